"""The ``Pipeline``: capture and restore for one set of caches, kept warm between calls.

An engine calls kvsnap once per request from a long-lived process, so everything that does not
depend on the request is made once: the page table of the caches (per rank and tensor, the
addresses and fragment groups the fused copy needs), the pinned host slots and the device
staging buffer (process-wide, see ``kvsnap.pipeline.staging``), and the compiled kernel.
``kvsnap.capture`` and ``Snapshot.restore`` use the same machinery through a process-wide
cache of page tables, so a second call is warm without the caller keeping anything.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsnap import format as fmt
from kvsnap.errors import UnsupportedVersionError
from kvsnap.format.signing import KeyRing
from kvsnap.layout import CacheLayout, part_layout
from kvsnap.pipeline.capture import capture_snapshot
from kvsnap.pipeline.fused import FusedMover
from kvsnap.pipeline.held_load import HeldLoader
from kvsnap.pipeline.jobs import (
    CaptureResult,
    RestoreResult,
    SequenceBlocks,
    as_layouts,
    block_pairs,
    common_geometry,
    restore_pairs,
)
from kvsnap.pipeline.movers import HandlerMover, SlotMover
from kvsnap.pipeline.options import (
    ProgressCallback,
    StagingOptions,
    TransferOptions,
)
from kvsnap.pipeline.part_jobs import (
    Item,
    RestorableSnapshot,
)
from kvsnap.pipeline.part_restores import PartRestores
from kvsnap.pipeline.path_restores import restore_refused_path
from kvsnap.pipeline.shared_tables import shared_page_table
from kvsnap.store import TraceHook
from kvsnap.store.read.head_parts import HeadPart, open_snapshot
from kvsnap.transfer import TransferHandler
from kvsnap.transfer.plan import Direction

if TYPE_CHECKING:
    import torch


class Pipeline(PartRestores):
    """Capture from and restore into the caches ``layout`` describes, warm across calls.

    Keep one per set of caches for as long as the caches live: what does not depend on the
    request (the caches' page table, the staging slots, the compiled kernel) is made once. The
    plain ``kvsnap.capture`` and ``kvsnap.Snapshot.restore`` make one per call over the same
    process-wide warm state.

    Args:
        layout: The engine cache's layout, or one layout per TP rank held by this process: a
            capture then takes from each rank the canonical fragments it is elected for, and
            a restore gives every rank its own heads.
        transfer: How pages move (``TransferOptions``: a named backend, an SM budget).
            Default ``None``: the fused page copy.

    Raises:
        ValueError: An empty list of layouts, or ``TransferOptions`` that contradict
            themselves.
        LayoutError: Layouts of TP ranks that do not describe one model's cache.

    Example:
        >>> import torch, kvsnap
        >>> target = [torch.zeros(8, 2, 16, 2, 64) for _ in range(2)]
        >>> pipeline = kvsnap.Pipeline(kvsnap.vllm_split_layout(target))
        >>> pipeline.geometry.num_kv_heads, pipeline.transfer.backend
        (2, 'auto')
        >>> pipeline.restore("prefix.safetensors", {"seq-0": [0, 1, 2]}).num_tokens
        40
    """

    def __init__(
        self,
        layout: CacheLayout | Sequence[CacheLayout],
        *,
        transfer: TransferOptions | None = None,
    ) -> None:
        self.layouts = as_layouts(layout)
        self.geometry = common_geometry(self.layouts)
        self.transfer = transfer or TransferOptions()
        self._fused: dict[Direction, FusedMover] = {}
        #: Per head range of a parted snapshot: the pipeline over the ranks' part layouts.
        self._part_pipelines: dict[tuple[int, int], Pipeline | None] = {}
        #: Restores of held files into a cache in host memory (:meth:`_held_loader`).
        self._held: HeldLoader | None = None

    def _mover(self, direction: Direction) -> SlotMover:
        if self.transfer.backend == "auto":
            mover = self._fused.get(direction)
            if mover is not None:
                return mover
            table = shared_page_table(self.layouts, direction)
            if table is not None:
                mover = FusedMover(table, direction, self.transfer.sm_budget)
                self._fused[direction] = mover
                return mover
        return HandlerMover(self.layouts, direction, self._handlers(direction))

    def _handlers(self, direction: Direction) -> list[TransferHandler]:
        backend, budget = self.transfer.backend, self.transfer.sm_budget
        if budget is None:
            return [TransferHandler(rank, direction, backend=backend) for rank in self.layouts]
        options = {"triton": {"max_programs": budget}}
        return [
            TransferHandler(rank, direction, backend="triton", backend_options=options)
            for rank in self.layouts
        ]

    def capture(
        self,
        sequences: Sequence[SequenceBlocks],
        path: str | Path,
        *,
        source: fmt.SourceInfo | None = None,
        part: fmt.PartInfo | None = None,
        staging: StagingOptions | None = None,
        reproducible: bool = False,
        max_shard_bytes: int | None = None,
        direct_io: bool | None = None,
        progress: ProgressCallback | None = None,
        trace: TraceHook | None = None,
        after: torch.cuda.Event | None = None,
        keys: KeyRing | None = None,
    ) -> CaptureResult:
        """Write the KV of ``sequences`` from the caches to a snapshot at ``path``.

        As ``kvsnap.capture``, on this pipeline's warm page table and kernel.

        Args:
            sequences: The sequences to capture: token ids and device blocks of each.
            path: Where the snapshot goes: a local path or an fsspec URL.
            source: Where the KV came from. Default ``None``: unknown.
            part: Write the file as this part of a parted snapshot, from part layouts (what
                ``kvsnap.parted.capture_part`` passes; not for callers). Default ``None``.
            staging: Host staging memory (``StagingOptions``). Default ``None``: kvsnap's
                process-wide slots.
            reproducible: Record nothing time- or host-dependent. Default ``False``.
            max_shard_bytes: Split into shard files of at most this many bytes. Default
                ``None``: one file.
            direct_io: ``True`` requires ``O_DIRECT``, ``False`` never uses it. Default
                ``None``: where the filesystem accepts it.
            progress: ``progress(done_bytes, total_bytes)``, called as data moves. Default
                ``None``.
            trace: ``trace(kind, started, finished, nbytes)`` per step. Default ``None``.
            after: A CUDA event the copies follow instead of the calling thread's stream (KV
                computed on another thread's stream). Default ``None``.
            keys: Sign every file with the first key of this ``KeyRing``. Default ``None``:
                unsigned.

        Returns:
            A ``CaptureResult``, as ``kvsnap.capture`` returns it.

        Raises:
            ValueError: Sequences that break the rules (see ``kvsnap.capture``).
            SnapshotIOError: Writing failed; the previous file at ``path`` is untouched.
            TransferFailedError: A copy out of the cache failed.

        Example:
            >>> import numpy as np, torch, kvsnap
            >>> kv_caches = [torch.randn(8, 2, 16, 2, 64) for _ in range(2)]
            >>> pipeline = kvsnap.Pipeline(kvsnap.vllm_split_layout(kv_caches))
            >>> for step in range(3):  # one snapshot per request, the pipeline kept warm
            ...     blocks = np.array([step, 7])
            ...     request = kvsnap.SequenceBlocks(f"req-{step}", np.arange(20), blocks)
            ...     result = pipeline.capture([request], f"req-{step}.safetensors")
            >>> result.path, result.num_blocks, result.num_tokens
            ('req-2.safetensors', 2, 20)
        """
        return capture_snapshot(
            self.layouts,
            lambda: self._mover(Direction.DEVICE_TO_HOST),
            sequences,
            path,
            source=source,
            part=part,
            staging=staging,
            reproducible=reproducible,
            max_shard_bytes=max_shard_bytes,
            direct_io=direct_io,
            progress=progress,
            trace=trace,
            after=after,
            keys=keys,
        )

    def restore(
        self,
        snapshot: RestorableSnapshot | str | Path,
        block_ids: Mapping[str, np.ndarray | Sequence[int]],
        *,
        staging: StagingOptions | None = None,
        model_fingerprint: str | None = None,
        force: bool = False,
        progress: ProgressCallback | None = None,
        trace: TraceHook | None = None,
        while_copying: Callable[[], None] | None = None,
    ) -> RestoreResult:
        """Write the KV of the sequences named in ``block_ids`` into the caches.

        As ``kvsnap.Snapshot.restore``: everything is checked before the first byte is written
        (the geometry, see ``kvsnap.format.fit.check_fits``, then the ids, counts and ranges
        of the blocks), and a page that fails its checksum is never written.

        Args:
            snapshot: An open ``Snapshot``, or a path (opened and closed here; a local
                encoded snapshot opens and restores as ``Snapshot.open(path).restore`` does).
            block_ids: Per sequence id, the target's device block ids, one per block of that
                sequence.
            staging: Host staging memory (``StagingOptions``). Default ``None``: kvsnap's
                process-wide slots.
            model_fingerprint: The target model's fingerprint, checked against the one
                recorded. Default ``None``: not checked.
            force: Skip the fingerprint check. Default ``False``.
            progress: ``progress(done_bytes, total_bytes)``, called as data moves. Default
                ``None``.
            trace: ``trace(kind, started, finished, nbytes)`` per step. Default ``None``.
            while_copying: The caller's host work, overlapped with the device's: called once,
                when every copy is enqueued and the restore would wait for the device (on
                CPU caches: after the copies). What it raises, the restore raises once the
                copies are complete; the caches are written then. For checks that may come
                after the write, of a target nobody else reads yet (``restore_dynamic_cache``
                checks its model so). Default ``None``.

        Returns:
            A ``RestoreResult``: sequences, tokens, blocks, bytes, seconds and backend.

        Raises:
            UnknownSequenceError: A sequence id the snapshot does not hold.
            IncompatibleSnapshotError: The snapshot does not fit the caches, or the block ids
                do not fit the sequences or the caches.
            ValueError: Block ids that are not integers, or no sequence at all.
            RestoreIncompleteError: Some pages failed their checksums and were not written;
                ``failed_block_ids`` lists the target blocks not (fully) restored.
            TransferFailedError: A copy into the cache failed.
            KVSnapError: ``snapshot`` is a path that does not open (see ``Snapshot.open``).

        Example:
            >>> import torch, kvsnap
            >>> target = [torch.zeros(8, 2, 16, 2, 64) for _ in range(2)]
            >>> pipeline = kvsnap.Pipeline(kvsnap.vllm_split_layout(target))
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     for blocks in ([0, 1, 2], [5, 6, 7]):  # twice: warm the second time
            ...         result = pipeline.restore(snap, {"seq-0": blocks})
            >>> result.num_sequences, result.num_tokens, result.num_blocks
            (1, 40, 3)
            >>> bool(torch.equal(target[0][[0, 1, 2]], target[0][[5, 6, 7]]))
            True
        """
        if isinstance(snapshot, (str, os.PathLike)):
            options: dict[str, Any] = {
                "staging": staging,
                "model_fingerprint": model_fingerprint,
                "force": force,
                "progress": progress,
                "trace": trace,
                "while_copying": while_copying,
            }
            try:
                opened = open_snapshot(snapshot)
            except UnsupportedVersionError as unsupported:
                # An encoded snapshot: its layer's restore, asked outside this handler so that
                # its own errors are not raised "during" this one.
                refused = unsupported
            else:
                with opened:
                    return self.restore(opened, block_ids, **options)
            return restore_refused_path(self, snapshot, block_ids, refused, options)
        started = time.perf_counter()
        capacity = self._checked_capacity(snapshot, model_fingerprint, force)
        snapshot_blocks, target_blocks, num_tokens = restore_pairs(
            snapshot.metadata.sequences, block_ids, capacity, snapshot.path
        )
        items = [(snapshot, (snapshot_blocks, target_blocks))]
        request = (len(block_ids), num_tokens)
        return self._restore_items(items, staging, progress, trace, started, request, while_copying)

    def restore_blocks(
        self,
        snapshot: RestorableSnapshot,
        snapshot_blocks: np.ndarray | Sequence[int],
        target_blocks: np.ndarray | Sequence[int],
        *,
        staging: StagingOptions | None = None,
        model_fingerprint: str | None = None,
        force: bool = False,
        progress: ProgressCallback | None = None,
        trace: TraceHook | None = None,
    ) -> RestoreResult:
        """Write snapshot block ``snapshot_blocks[i]`` into target block ``target_blocks[i]``.

        For part of a sequence, as an engine loading only the blocks its own prefix cache
        lacks does. Checked as ``restore`` checks.

        Args:
            snapshot: An open ``Snapshot``.
            snapshot_blocks: Snapshot block ids (``SequenceRecord.block_ids`` name them).
            target_blocks: The target's device block ids, one per snapshot block.
            staging: Host staging memory (``StagingOptions``). Default ``None``: kvsnap's
                process-wide slots.
            model_fingerprint: The target model's fingerprint, checked against the one
                recorded. Default ``None``: not checked.
            force: Skip the fingerprint check. Default ``False``.
            progress: ``progress(done_bytes, total_bytes)``, called as data moves. Default
                ``None``.
            trace: ``trace(kind, started, finished, nbytes)`` per step. Default ``None``.

        Returns:
            A ``RestoreResult`` whose ``num_sequences`` and ``num_tokens`` are 0 (no sequence
            is named).

        Raises:
            IncompatibleSnapshotError: The snapshot does not fit the caches, the two lists
                differ in length, an id is out of range, or a target block would receive two
                snapshot blocks.
            ValueError: Block ids that are not integers.
            RestoreIncompleteError: Some pages failed their checksums and were not written.
            TransferFailedError: A copy into the cache failed.

        Example:
            >>> import torch, kvsnap
            >>> target = [torch.zeros(8, 2, 16, 2, 64) for _ in range(2)]
            >>> pipeline = kvsnap.Pipeline(kvsnap.vllm_split_layout(target))
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as snap:
            ...     tail = snap.sequence("seq-0").block_ids[1:]  # the engine holds block 0
            ...     result = pipeline.restore_blocks(snap, tail, [6, 7])
            >>> result.num_blocks, result.num_sequences
            (2, 0)
        """
        started = time.perf_counter()
        capacity = self._checked_capacity(snapshot, model_fingerprint, force)
        num_blocks = snapshot.metadata.num_blocks
        pairs = block_pairs(snapshot_blocks, target_blocks, num_blocks, capacity)
        return self._restore_items([(snapshot, pairs)], staging, progress, trace, started)

    def restore_chunks(
        self,
        chunks: Sequence[
            tuple[RestorableSnapshot, np.ndarray | Sequence[int], np.ndarray | Sequence[int]]
        ],
        *,
        staging: StagingOptions | None = None,
        model_fingerprint: str | None = None,
        force: bool = False,
        trace: TraceHook | None = None,
    ) -> RestoreResult:
        """``restore_blocks`` of several snapshots as one job.

        Their pages stream through the staging slots back to back, so the reads of one
        overlap the moves of the one before (an engine loading a prompt's prefix stored as
        chunks). Every snapshot is checked before anything is written. Parted snapshots
        restore part by part, one job per head range.

        Args:
            chunks: ``(snapshot, snapshot_blocks, target_blocks)`` per snapshot, as
                ``restore_blocks`` takes them.
            staging: Host staging memory (``StagingOptions``). Default ``None``: kvsnap's
                process-wide slots.
            model_fingerprint: The target model's fingerprint, checked against every
                snapshot's. Default ``None``: not checked.
            force: Skip the fingerprint check. Default ``False``.
            trace: ``trace(kind, started, finished, nbytes)`` per step. Default ``None``.

        Returns:
            One ``RestoreResult`` for all chunks (``num_sequences`` and ``num_tokens`` 0).

        Raises:
            IncompatibleSnapshotError: A snapshot does not fit, or its block ids do not.
            ValueError: Block ids that are not integers.
            RestoreIncompleteError: Some pages failed their checksums and were not written;
                ``failed_block_ids`` lists the target blocks of every snapshot not (fully)
                restored, every other page was.
            TransferFailedError: A copy into the cache failed.

        Example:
            >>> import torch, kvsnap
            >>> target = [torch.zeros(8, 2, 16, 2, 64) for _ in range(2)]
            >>> pipeline = kvsnap.Pipeline(kvsnap.vllm_split_layout(target))
            >>> with kvsnap.Snapshot.open("prefix.safetensors") as first, kvsnap.Snapshot.open(
            ...     "prefix.safetensors"
            ... ) as second:
            ...     result = pipeline.restore_chunks([(first, [0], [3]), (second, [1, 2], [4, 5])])
            >>> result.num_blocks
            3
        """
        started = time.perf_counter()
        items: list[Item] = []
        for snapshot, snapshot_blocks, target_blocks in chunks:
            capacity = self._checked_capacity(snapshot, model_fingerprint, force)
            num_blocks = snapshot.metadata.num_blocks
            items.append(
                (snapshot, block_pairs(snapshot_blocks, target_blocks, num_blocks, capacity))
            )
        return self._restore_items(items, staging, None, trace, started)

    def _pipeline_for(self, part: HeadPart) -> Pipeline | None:
        """The pipeline moving ``part`` into every rank here holding some of its heads: this
        one for a part of every head; for a parted snapshot's part, the pipeline over the
        ranks' :func:`~kvsnap.layout.part_layout`, kept for the next call (``None`` when no
        rank here holds any of its heads)."""
        if part.first_head == 0 and part.num_heads == self.geometry.num_kv_heads:
            return self
        key = (part.first_head, part.num_heads)
        if key not in self._part_pipelines:
            layouts = [part_layout(layout, *key) for layout in self.layouts]
            held = [layout for layout in layouts if layout is not None]
            self._part_pipelines[key] = Pipeline(held, transfer=self.transfer) if held else None
        return self._part_pipelines[key]
