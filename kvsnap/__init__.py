"""kvsnap: snapshot an LLM's paged KV cache to disk and restore it, bit-exact.

The public API, in pipeline order::

    layout = kvsnap.vllm_split_layout(kv_caches)          # what the engine's bytes mean
    kvsnap.capture(layout, sequences, "prefix.safetensors", source=...)
    with kvsnap.Snapshot.open("prefix.safetensors") as snap:
        snap.verify()
        snap.restore(other_layout, {"seq-0": target_block_ids})
    pipeline = kvsnap.Pipeline(layout)                     # an engine keeps one per cache set

Names are imported on first use, so ``import kvsnap`` stays cheap for the CLI and for engines
that only need one module; type checkers see them through the ``TYPE_CHECKING`` imports below.
Every error class kvsnap raises on purpose is importable from here (their rule:
``kvsnap.errors``). The other public modules are ``kvsnap.distributed``,
``kvsnap.engines.transformers``, ``kvsnap.engines.vllm`` and ``kvsnap.testing``; everything
else is internal (README.md, "Public API").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvsnap._version import __version__

if TYPE_CHECKING:  # what type checkers see of the names below, imported on first use
    from kvsnap.caches import clear_caches
    from kvsnap.errors import (
        BackendUnavailableError,
        BadSignatureError,
        CacheCapacityError,
        IncompatibleSnapshotError,
        KVSnapError,
        LayoutError,
        ModelLoadError,
        NotASnapshotError,
        RankFailedError,
        RestoreIncompleteError,
        SaveAbandonedError,
        SignatureError,
        SnapshotCorruptError,
        SnapshotIOError,
        TransferFailedError,
        UnknownSequenceError,
        UnsignedSnapshotError,
        UnsupportedVersionError,
    )
    from kvsnap.foreign import open_foreign
    from kvsnap.format import SequenceRecord, SnapshotMetadata, SourceInfo
    from kvsnap.layout import (
        CacheLayout,
        KVGeometry,
        check_tiling,
        contiguous_layout,
        cross_layer_layout,
        flat_paged_layout,
        mla_layout,
        packed_layout,
        vllm_legacy_layout,
        vllm_split_layout,
    )
    from kvsnap.pipeline import Pipeline, StagingOptions, TransferOptions
    from kvsnap.snapshot import CaptureResult, RestoreResult, SequenceBlocks, Snapshot, capture

#: Where each public name lives; tests/project/test_public_api.py checks the block above agrees.
_EXPORTS = {
    "kvsnap.caches": ("clear_caches",),
    "kvsnap.errors": (
        "BackendUnavailableError",
        "BadSignatureError",
        "CacheCapacityError",
        "IncompatibleSnapshotError",
        "KVSnapError",
        "LayoutError",
        "ModelLoadError",
        "NotASnapshotError",
        "RankFailedError",
        "RestoreIncompleteError",
        "SaveAbandonedError",
        "SignatureError",
        "SnapshotCorruptError",
        "SnapshotIOError",
        "TransferFailedError",
        "UnknownSequenceError",
        "UnsignedSnapshotError",
        "UnsupportedVersionError",
    ),
    "kvsnap.foreign": ("open_foreign",),
    "kvsnap.format": ("SequenceRecord", "SnapshotMetadata", "SourceInfo"),
    "kvsnap.layout": (
        "CacheLayout",
        "KVGeometry",
        "check_tiling",
        "contiguous_layout",
        "cross_layer_layout",
        "flat_paged_layout",
        "mla_layout",
        "packed_layout",
        "vllm_legacy_layout",
        "vllm_split_layout",
    ),
    "kvsnap.pipeline": ("Pipeline", "StagingOptions", "TransferOptions"),
    "kvsnap.snapshot": ("CaptureResult", "RestoreResult", "SequenceBlocks", "Snapshot", "capture"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
#: Modules imported with a module of exports, for what they register with it: the restore of
#: an encoded snapshot's path, which ``Pipeline.restore`` asks (the pipeline cannot import the
#: layer that reads encoded files; kvsnap/pipeline/path_restores.py).
_IMPORTED_WITH = {"kvsnap.pipeline": "kvsnap.encoded.path_restore"}

#: Spelled out, since type checkers read a literal list only.
__all__ = [
    "BackendUnavailableError",
    "BadSignatureError",
    "CacheCapacityError",
    "CacheLayout",
    "CaptureResult",
    "IncompatibleSnapshotError",
    "KVGeometry",
    "KVSnapError",
    "LayoutError",
    "ModelLoadError",
    "NotASnapshotError",
    "Pipeline",
    "RankFailedError",
    "RestoreIncompleteError",
    "RestoreResult",
    "SaveAbandonedError",
    "SequenceBlocks",
    "SequenceRecord",
    "SignatureError",
    "Snapshot",
    "SnapshotCorruptError",
    "SnapshotIOError",
    "SnapshotMetadata",
    "SourceInfo",
    "StagingOptions",
    "TransferFailedError",
    "TransferOptions",
    "UnknownSequenceError",
    "UnsignedSnapshotError",
    "UnsupportedVersionError",
    "__version__",
    "capture",
    "check_tiling",
    "clear_caches",
    "contiguous_layout",
    "cross_layer_layout",
    "flat_paged_layout",
    "mla_layout",
    "open_foreign",
    "packed_layout",
    "vllm_legacy_layout",
    "vllm_split_layout",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'kvsnap' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    if module in _IMPORTED_WITH:
        importlib.import_module(_IMPORTED_WITH[module])
    return value


def __dir__() -> list[str]:
    return __all__
