"""``kvsnap.capture``: one call that writes the KV of some sequences from an engine's cache to
a snapshot file, on a :class:`~kvsnap.pipeline.Pipeline` (or, per rank, as a parted snapshot:
:mod:`kvsnap.parted`). :mod:`kvsnap.snapshot` re-exports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvsnap import format as fmt
from kvsnap.format.signing import KeyRing
from kvsnap.store import TraceHook

if TYPE_CHECKING:
    from kvsnap.layout import CacheLayout
    from kvsnap.pipeline import (
        CaptureResult,
        ProgressCallback,
        SequenceBlocks,
        StagingOptions,
        TransferOptions,
    )
    from kvsnap.transfer.pinned import PinnedPool

__all__ = ["capture"]


def capture(
    layout: CacheLayout | Sequence[CacheLayout],
    sequences: Sequence[SequenceBlocks],
    path: str | Path,
    *,
    source: fmt.SourceInfo | None = None,
    transfer: TransferOptions | None = None,
    staging: StagingOptions | PinnedPool | None = None,
    reproducible: bool = False,
    max_shard_bytes: int | None = None,
    direct_io: bool | None = None,
    progress: ProgressCallback | None = None,
    trace: TraceHook | None = None,
    per_rank_parts: bool = False,
    keys: KeyRing | None = None,
    compression: str = "none",
) -> CaptureResult:
    """Write the KV of ``sequences`` from the cache ``layout`` describes to a snapshot file.

    With one layout per TP rank held by this process, each rank contributes the canonical
    fragments it is elected for, and the snapshot is the complete TP-free one. Blocks whose
    prefix hash chains coincide are stored once. The snapshot is published atomically: on any
    error the previous file at ``path`` is untouched. Repeated calls are warm; a caller
    capturing from the same caches many times may keep a ``Pipeline`` instead.

    Args:
        layout: The engine cache, described by a layout constructor such as
            ``vllm_split_layout``, or a list with one such layout per TP rank held here.
        sequences: The sequences to capture: each one's token ids and the device blocks
            holding their KV (``SequenceBlocks``).
        path: Where the snapshot goes: a local path or an fsspec URL.
        source: Where the KV came from (engine, model id, model fingerprint). Default
            ``None``: unknown, and restores then skip the fingerprint check.
        transfer: How pages move (``TransferOptions``: a named backend, an SM budget).
            Default ``None``: the fused page copy.
        staging: The host memory pages stage through: ``StagingOptions``, or a
            ``PinnedPool`` the caller keeps. Default ``None``: kvsnap's process-wide slots,
            pinned once.
        reproducible: Record nothing time- or host-dependent, so that the same KV always
            gives the same bytes. Default ``False``.
        max_shard_bytes: Split the snapshot into shard files of at most this many bytes.
            Default ``None``: one file.
        direct_io: ``True`` requires ``O_DIRECT`` writes of the KV, ``False`` never uses
            them. Default ``None``: ``O_DIRECT`` where the filesystem accepts it.
        progress: ``progress(done_bytes, total_bytes)``, called as data moves. Default
            ``None``.
        trace: ``trace(kind, started, finished, nbytes)``, called with a span for each step
            (setup, slot waits, transfers, checksums, writes, commit phases;
            ``benchmarks/e2e.py --timeline`` shows them). Default ``None``.
        per_rank_parts: With one layout per TP rank, write a parted snapshot
            (docs/format.md, "Parted snapshots"): one part file per distinct head range,
            each from the first rank holding it, then the index ``path + ".index.json"``.
            ``max_shard_bytes`` and ``progress`` do not apply. Default ``False``.
        keys: Sign every file with the first key of this ``KeyRing``
            (``kvsnap.store.files.keys.load_key_ring``): an HMAC-SHA256 over its header and every
            byte but its pages, the pages bound by their BLAKE3 digests, which
            ``Snapshot.open`` checks when given the keys (and every page read later against
            its digest). Default ``None``: unsigned.
        compression: ``"none"`` (the snapshot as captured), ``"lossless"`` (bit-exact,
            smaller) or ``"fp8"`` (e4m3 with per (block, head) scales, its error measured and
            recorded): an encoded snapshot (docs/format.md, "Encoded snapshots"), one local
            file, its pages encoded where the cache lies (fp8: quantized and measured on the
            device) and never written uncompressed. Default ``"none"``.

    Returns:
        A ``CaptureResult``: the path written (a parted snapshot's index), the numbers of
        sequences, tokens, blocks and bytes, the seconds taken and the copy backend used.

    Raises:
        ValueError: Sequences that break the rules (no tokens, duplicate ids, not exactly
            ``ceil(tokens / block_size)`` block ids, a block id outside the cache), or
            ``per_rank_parts`` with ``max_shard_bytes`` or ``progress``.
        LayoutError: Layouts of TP ranks that do not describe one model's cache.
        SnapshotIOError: Writing failed (disk full, permission denied, a lost connection).
        TransferFailedError: A copy out of the cache failed.

    Example:
        Two layers of a vLLM-style cache on the CPU, 8 blocks of 16 tokens, 2 KV heads of 64
        dimensions; a 40-token prompt in blocks 4, 1 and 6:

        >>> import numpy as np, torch, kvsnap
        >>> _ = torch.manual_seed(0)
        >>> kv_caches = [torch.randn(8, 2, 16, 2, 64) for _ in range(2)]
        >>> layout = kvsnap.vllm_split_layout(kv_caches)
        >>> prompt = kvsnap.SequenceBlocks("seq-0", np.arange(40), np.array([4, 1, 6]))
        >>> result = kvsnap.capture(layout, [prompt], "prefix.safetensors")
        >>> result.num_sequences, result.num_tokens, result.num_blocks
        (1, 40, 3)
    """
    from kvsnap.layout import CacheLayout
    from kvsnap.pipeline import Pipeline
    from kvsnap.pipeline.options import staging_options

    common: dict[str, Any] = {
        "source": source,
        "reproducible": reproducible,
        "direct_io": direct_io,
        "keys": keys,
    }
    if compression != "none":
        from kvsnap.encoded.capture import capture_compressed

        return capture_compressed(
            layout,
            sequences,
            path,
            compression,
            transfer=transfer,
            staging=staging_options(staging),
            progress=progress,
            trace=trace,
            refused=per_rank_parts or max_shard_bytes is not None,
            **common,
        )
    if per_rank_parts:
        from kvsnap.parted import capture_parts

        if max_shard_bytes is not None or progress is not None:
            raise ValueError(
                "per_rank_parts writes one file per head range: no shards, no progress"
            )
        layouts = [layout] if isinstance(layout, CacheLayout) else layout
        return capture_parts(
            layouts, sequences, path, transfer=transfer, staging=staging, trace=trace, **common
        )
    return Pipeline(layout, transfer=transfer).capture(
        sequences,
        path,
        staging=staging_options(staging),
        max_shard_bytes=max_shard_bytes,
        progress=progress,
        trace=trace,
        **common,
    )
