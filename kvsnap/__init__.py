"""kvsnap: snapshot an LLM's paged KV cache to disk and restore it, bit-exact.

The public API, in pipeline order::

    layout = kvsnap.vllm_split_layout(kv_caches)          # what the engine's bytes mean
    kvsnap.capture(layout, sequences, "prefix.safetensors", source=...)
    with kvsnap.Snapshot.open("prefix.safetensors") as snap:
        snap.verify()
        snap.restore(other_layout, {"seq-0": target_block_ids})
    pipeline = kvsnap.Pipeline(layout)                     # an engine keeps one per cache set

Names are imported on first use, so ``import kvsnap`` stays cheap for the CLI and for engines
that only need one module.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvsnap._version import __version__

_EXPORTS = {
    "kvsnap.caches": ("clear_caches",),
    "kvsnap.errors": (
        "IncompatibleSnapshotError",
        "KVSnapError",
        "NotASnapshotError",
        "RestoreIncompleteError",
        "SnapshotCorruptError",
        "SnapshotIOError",
        "TransferFailedError",
        "UnsupportedVersionError",
    ),
    "kvsnap.foreign": ("open_foreign",),
    "kvsnap.format": ("SequenceRecord", "SnapshotMetadata", "SourceInfo"),
    "kvsnap.layout": (
        "CacheLayout",
        "KVGeometry",
        "LayoutError",
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

__all__ = ["__version__", *sorted(_MODULE_OF)]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'kvsnap' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
