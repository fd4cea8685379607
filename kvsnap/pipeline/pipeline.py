"""The :class:`Pipeline`: capture and restore for one set of caches, kept warm between calls.

An engine calls kvsnap once per request from a long-lived process, so everything that does not
depend on the request is made once: the page table of the caches (per rank and tensor, the
addresses and fragment groups the fused copy needs), the pinned host slots and the device
staging buffer (process-wide, see :mod:`kvsnap.pipeline.staging`), and the compiled kernel.
``kvsnap.capture`` and ``Snapshot.restore`` use the same machinery through a process-wide
cache of page tables, so a second call is warm without the caller keeping anything.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvsnap import format as fmt
from kvsnap._version import __version__
from kvsnap.errors import RestoreIncompleteError
from kvsnap.format.fit import check_fits
from kvsnap.format.signing import KeyRing
from kvsnap.layout import CacheLayout, PageRef, part_layout
from kvsnap.pipeline.capture import capture_slots
from kvsnap.pipeline.fused import FusedMover, fused_unavailable
from kvsnap.pipeline.jobs import (
    CaptureResult,
    RestoreResult,
    SequenceBlocks,
    as_layouts,
    block_id_array,
    block_pairs,
    common_geometry,
    restore_pairs,
    validate_sequences,
)
from kvsnap.pipeline.movers import HandlerMover, SlotMover
from kvsnap.pipeline.options import StagingOptions, TransferOptions
from kvsnap.pipeline.restore import (
    FailedPages,
    RestoreSource,
    SnapshotPages,
    describe_failure,
    failed_target_blocks,
    lease_hot_files,
    restore_slots,
)
from kvsnap.pipeline.slots import plan_slots
from kvsnap.pipeline.staging import staging_ring
from kvsnap.store import SnapshotWriter, TraceHook, traced
from kvsnap.store.hot import HotFile, hot_tier
from kvsnap.transfer import TransferHandler
from kvsnap.transfer.page_table import PageTable
from kvsnap.transfer.plan import Direction

if TYPE_CHECKING:
    import torch

    from kvsnap.snapshot import Snapshot

ProgressCallback = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``, called as data moves."""

#: Page tables kept by the process-wide cache (each a few arrays of addresses, no tensors).
MAX_SHARED_TABLES = 32


class Pipeline:
    """Capture from and restore into the caches ``layout`` describes, warm across calls.

    ``layout`` may list one layout per TP rank held by this process: a capture then takes from
    each rank the canonical fragments it is elected for, and a restore gives every rank its
    own heads. ``transfer`` picks how pages move (:class:`TransferOptions`). Keep one per set of
    caches for as long as the caches live; the plain :func:`kvsnap.capture` and
    :meth:`kvsnap.Snapshot.restore` make one per call over the same warm state.
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
        """Write the KV of ``sequences`` to a snapshot at ``path``; see :func:`kvsnap.capture`.
        ``part``: the file is that part of a parted snapshot, from part layouts (what
        :func:`kvsnap.parted.capture_part` passes). ``after``: the copies follow this CUDA event,
        not the calling thread's stream (KV computed on another thread's stream)."""
        started = time.perf_counter()
        validate_sequences(self.geometry.block_size, sequences)
        metadata, device_blocks = _capture_metadata(
            self.layouts, sequences, source or fmt.SourceInfo(), reproducible, part
        )
        page_bytes = self.geometry.canonical_page_size_bytes
        names = self.geometry.tensor_names()
        total_bytes = page_bytes * len(device_blocks) * len(names)
        with traced(trace, "setup.staging"):
            ring = staging_ring(staging or StagingOptions(), page_bytes, total_bytes)
        mover = self._mover(Direction.DEVICE_TO_HOST)
        done = _Progress(progress, total_bytes)
        options = {"direct_io": direct_io, "max_shard_bytes": max_shard_bytes, "trace": trace}
        options["keys"] = keys
        try:
            with traced(trace, "setup.writer"):
                writer = SnapshotWriter(path, metadata, **options)
            try:
                mover.begin(after)
                plans = plan_slots(len(names), len(device_blocks), page_bytes, ring.slot_bytes)
                capture_slots(mover, ring, writer, plans, device_blocks, done.add, trace)
                info = writer.commit()
            except BaseException:
                writer.abort()
                raise
        finally:
            with traced(trace, "teardown"):
                try:
                    mover.end()
                finally:
                    ring.finish()
        return CaptureResult(
            path=str(info.path),
            num_sequences=len(sequences),
            num_tokens=sum(len(sequence.token_ids) for sequence in sequences),
            num_blocks=len(device_blocks),
            num_bytes=info.num_bytes,
            seconds=time.perf_counter() - started,
            backend=mover.backend_name,
            direct_io_fallback=writer.fallback_reason,
            trailer_digest=info.trailers[0] if len(info.trailers) == 1 else None,
        )

    def restore(
        self,
        snapshot: Snapshot | str | Path,
        block_ids: Mapping[str, np.ndarray | Sequence[int]],
        *,
        staging: StagingOptions | None = None,
        model_fingerprint: str | None = None,
        force: bool = False,
        progress: ProgressCallback | None = None,
        trace: TraceHook | None = None,
    ) -> RestoreResult:
        """Write the KV of the sequences named in ``block_ids`` into the caches.

        ``snapshot`` is an open :class:`~kvsnap.Snapshot` or a path (opened and closed here).
        ``block_ids`` maps a sequence id to the target's device block ids, one per block of
        that sequence. Everything is checked before the first byte is written (see
        :func:`kvsnap.format.fit.check_fits`, and the ids, counts and ranges of the blocks). A page
        that fails its checksum is never written: the others are, and
        :class:`~kvsnap.errors.RestoreIncompleteError` then lists the target blocks not
        (fully) restored.
        """
        from kvsnap.snapshot import Snapshot

        if not isinstance(snapshot, Snapshot):
            with Snapshot.open(snapshot) as opened:
                return self.restore(
                    opened,
                    block_ids,
                    staging=staging,
                    model_fingerprint=model_fingerprint,
                    force=force,
                    progress=progress,
                    trace=trace,
                )
        started = time.perf_counter()
        capacity = self._checked_capacity(snapshot, model_fingerprint, force)
        snapshot_blocks, target_blocks, num_tokens = restore_pairs(
            snapshot.sequences, block_ids, capacity, snapshot.path
        )
        result = self._restore_pairs(
            snapshot, (snapshot_blocks, target_blocks), staging, progress, trace
        )
        return RestoreResult(
            num_sequences=len(block_ids),
            num_tokens=num_tokens,
            num_blocks=result.num_blocks,
            num_bytes=result.num_bytes,
            seconds=time.perf_counter() - started,
            backend=result.backend,
        )

    def restore_blocks(
        self,
        snapshot: Snapshot,
        snapshot_blocks: np.ndarray | Sequence[int],
        target_blocks: np.ndarray | Sequence[int],
        *,
        staging: StagingOptions | None = None,
        model_fingerprint: str | None = None,
        force: bool = False,
        progress: ProgressCallback | None = None,
        trace: TraceHook | None = None,
    ) -> RestoreResult:
        """Write snapshot block ``snapshot_blocks[i]`` into target block ``target_blocks[i]``
        for every ``i``: part of a sequence, as an engine loading only the blocks its own
        prefix cache lacks does. Checked as :meth:`restore` checks (``num_sequences`` and
        ``num_tokens`` of the result are 0: no sequence is named)."""
        started = time.perf_counter()
        capacity = self._checked_capacity(snapshot, model_fingerprint, force)
        pairs = block_pairs(snapshot_blocks, target_blocks, snapshot.num_blocks, capacity)
        result = self._restore_pairs(snapshot, pairs, staging, progress, trace)
        return dataclasses.replace(result, seconds=time.perf_counter() - started)

    def restore_chunks(
        self,
        chunks: Sequence[tuple[Snapshot, np.ndarray | Sequence[int], np.ndarray | Sequence[int]]],
        *,
        staging: StagingOptions | None = None,
        model_fingerprint: str | None = None,
        force: bool = False,
        trace: TraceHook | None = None,
    ) -> RestoreResult:
        """:meth:`restore_blocks` of several snapshots, ``(snapshot, snapshot_blocks,
        target_blocks)`` each, as one job: their pages stream through the staging slots back
        to back, so the reads of one overlap the moves of the one before (an engine loading a
        prompt's prefix stored as chunks). Every snapshot is checked before anything is
        written. A page failing its checksum is never written; the others are, and
        :class:`~kvsnap.errors.RestoreIncompleteError` lists the target blocks of every
        snapshot not (fully) restored. Parted snapshots restore part by part, one job per head
        range."""
        from kvsnap.pipeline.chunked import restore_chunks

        return restore_chunks(self, chunks, staging, model_fingerprint, force, trace)

    def _checked_capacity(
        self, snapshot: Snapshot, model_fingerprint: str | None, force: bool
    ) -> int:
        """Refuse a snapshot that does not fit (:func:`kvsnap.format.fit.check_fits`); the number of
        blocks every rank's cache has."""
        check_fits(
            snapshot.metadata,
            self.geometry,
            path=snapshot.path,
            model_fingerprint=model_fingerprint,
            force=force,
        )
        return min(layout.num_blocks for layout in self.layouts)

    def _restore_pairs(
        self,
        snapshot: Snapshot,
        pairs: tuple[np.ndarray, np.ndarray],
        staging: StagingOptions | None,
        progress: ProgressCallback | None,
        trace: TraceHook | None,
    ) -> RestoreResult:
        """Move checked ``(snapshot blocks, target blocks)``; raise
        :class:`~kvsnap.errors.RestoreIncompleteError` if any page failed its checksum."""
        from kvsnap.parted import PartedSnapshot, restore_parted

        if isinstance(snapshot, PartedSnapshot):
            return restore_parted(self, snapshot, pairs, staging, progress, trace)
        (failed,), moved = self._move_in([(snapshot, pairs)], staging, progress, trace)
        result = dataclasses.replace(moved, num_blocks=len(pairs[0]))
        if len(failed.positions):
            raise RestoreIncompleteError(
                describe_failure(failed, self.geometry.tensor_names(), pairs[1]),
                file=snapshot.path,
                failed_block_ids=failed_target_blocks(failed, pairs[1]),
                result=result,
            ) from failed.first_error
        return result

    def _part_pipeline(self, first_head: int, num_heads: int) -> Pipeline | None:
        """The pipeline moving heads ``[first_head, +num_heads)`` into every rank holding some
        of them (their :func:`~kvsnap.layout.part_layout`), kept for the next call; ``None``
        when no rank here holds any."""
        key = (first_head, num_heads)
        if key not in self._part_pipelines:
            layouts = [part_layout(layout, first_head, num_heads) for layout in self.layouts]
            held = [layout for layout in layouts if layout is not None]
            self._part_pipelines[key] = Pipeline(held, transfer=self.transfer) if held else None
        return self._part_pipelines[key]

    def _move_in(
        self,
        items: Sequence[tuple[Snapshot, tuple[np.ndarray, np.ndarray]]],
        staging: StagingOptions | None,
        progress: ProgressCallback | None,
        trace: TraceHook | None,
    ) -> tuple[list[FailedPages], RestoreResult]:
        """The staging loop of checked restores of ``items`` (single-file snapshots and their
        ``(snapshot blocks, target blocks)``), as one job: per item the pages that failed, and
        the bytes and backend (the rest of the result is the caller's)."""
        page_bytes = self.geometry.canonical_page_size_bytes
        names = self.geometry.tensor_names()
        pages_total = sum(len(blocks[0]) for _, blocks in items) * len(names)
        total_bytes = page_bytes * pages_total
        with traced(trace, "setup.staging"):
            ring = staging_ring(staging or StagingOptions(), page_bytes, total_bytes, restore=True)
        mover = self._mover(Direction.HOST_TO_DEVICE)
        done = _Progress(progress, total_bytes)
        leases: list[HotFile] = []
        try:
            mover.begin()
            sources = []
            for snapshot, blocks in items:
                hot = _hot_files(snapshot, mover, staging) if total_bytes else None
                leases += hot or []
                sources.append(
                    RestoreSource(
                        SnapshotPages(snapshot.reader, hot),
                        plan_slots(len(names), len(blocks[0]), page_bytes, ring.slot_bytes),
                        blocks,
                    )
                )
            failed = restore_slots(mover, ring, sources, done.add, trace)
        finally:
            with traced(trace, "teardown"):
                try:
                    if leases and isinstance(mover, FusedMover):
                        # The mappings stay registered until the copies that read them ran.
                        last_use = mover.fence()
                        for entry in leases:
                            hot_tier().release(entry, last_use)
                    mover.end()
                finally:
                    ring.finish()
        return failed, RestoreResult(0, 0, 0, total_bytes, 0.0, mover.backend_name)


def _hot_files(
    snapshot: Snapshot, mover: SlotMover, staging: StagingOptions | None
) -> list[HotFile] | None:
    """``snapshot``'s files leased from the hot tier when this restore can copy straight out
    of them (a CUDA mover that takes uploads and checks pages on the device, or a reader that
    checks nothing), and the caller did not turn the tier off (``StagingOptions.hot``)."""
    wish = staging.hot if staging is not None else None
    reader = snapshot.reader
    if wish is False or not mover.takes_uploads or not (mover.hashes_pages or not reader.verifies):
        return None
    return lease_hot_files(reader, admit=wish is True)


class _Progress:
    """Counts the bytes moved and reports them to an optional :data:`ProgressCallback`."""

    def __init__(self, callback: ProgressCallback | None, total_bytes: int) -> None:
        self.callback = callback
        self.total_bytes = total_bytes
        self.done_bytes = 0
        self._lock = threading.Lock()

    def add(self, num_bytes: int) -> None:
        """Count ``num_bytes`` more; reports are serialized (restores move slots on several
        threads) and never decrease."""
        with self._lock:
            self.done_bytes += num_bytes
            if self.callback is not None:
                self.callback(self.done_bytes, self.total_bytes)


def _capture_metadata(
    layouts: Sequence[CacheLayout],
    sequences: Sequence[SequenceBlocks],
    source: fmt.SourceInfo,
    reproducible: bool,
    part: fmt.PartInfo | None = None,
) -> tuple[fmt.SnapshotMetadata, np.ndarray]:
    """The snapshot's metadata (of part ``part`` of a parted snapshot, if given), and the
    device block holding each unique snapshot block.

    Blocks whose prefix hash chains coincide are stored once (their first owner's block).
    """
    geometry = layouts[0].geometry
    token_lists = [np.asarray(sequence.token_ids, dtype=np.int64) for sequence in sequences]
    block_lists = [block_id_array(sequence.block_ids, "block ids") for sequence in sequences]
    chains = [fmt.prefix_hash_chain(tokens, geometry.block_size) for tokens in token_lists]
    dedupe = fmt.dedupe_blocks(chains)
    device_blocks = np.array(
        [int(block_lists[index][position]) for index, position in dedupe.owners], dtype=np.int64
    )
    records = [
        fmt.SequenceRecord(
            id=sequence.id,
            token_ids=tokens,
            block_ids=np.asarray(block_ids, dtype=np.int64),
            prefix_hashes=tuple(chain),
        )
        for sequence, tokens, chain, block_ids in zip(
            sequences, token_lists, chains, dedupe.sequence_block_ids, strict=True
        )
    ]
    metadata = fmt.SnapshotMetadata(
        geometry=geometry,
        source=source,
        sequences=records,
        num_blocks=len(device_blocks),
        capture_encoding=layouts[0].encoding,
        tp_size=layouts[0].tp_size,
        # A reproducible snapshot must not change bytes with each patch release.
        kvsnap_version=".".join(__version__.split(".")[:2]) if reproducible else __version__,
        created=None if reproducible else fmt.utc_now(),
        part=part,
    )
    return metadata, device_blocks


_TABLES: OrderedDict[tuple[object, ...], _SharedEntry] = OrderedDict()
_TABLES_LOCK = threading.Lock()
#: Per set of layout objects, their table key (see :func:`_tables_key`); per list of page
#: references, its part of the key. Both bounded like ``_SPLITS`` in the page table.
_LAYOUT_KEYS: dict[tuple[int, ...], tuple[list[weakref.ref], tuple[object, ...], int]] = {}
_REFS_KEYS: dict[int, tuple[list[PageRef], tuple[object, ...]]] = {}
_MAX_KEYS = 256


def layout_key(layout: CacheLayout, base: int = 0) -> tuple[object, ...]:
    """Everything a page table depends on: addresses (as offsets from ``base``), strides, block
    counts and copy runs."""
    return (
        layout.encoding,
        layout.tp_rank,
        layout.tp_size,
        layout.geometry,
        str(layout.device),
        tuple((t.data_ptr - base, t.num_blocks, t.block_stride_bytes) for t in layout.tensors),
        _refs_key(layout.refs),
    )


def _refs_key(refs: list[PageRef]) -> tuple[object, ...]:
    """The copy runs part of :func:`layout_key`, worked out once per list: layouts rebased onto
    a new cache (:class:`~kvsnap.layout.cache.LayoutTemplate`) share their template's list."""
    known = _REFS_KEYS.get(id(refs))
    if known is not None and known[0] is refs:
        return known[1]
    key = tuple((ref.tensor_index, ref.layer, ref.part, ref.mapping.digest) for ref in refs)
    if len(_REFS_KEYS) >= _MAX_KEYS:
        _REFS_KEYS.clear()
    _REFS_KEYS[id(refs)] = (refs, key)
    return key


def _tables_key(layouts: Sequence[CacheLayout]) -> tuple[tuple[object, ...], int]:
    """The key of ``layouts``' page table with every address relative to the first tensor's,
    and that tensor's address. Caches that differ only by where they lie as a whole (a
    ``DynamicCache`` allocated anew per restore) share one key, so one table, rebased. Kept
    per set of layout objects: an engine passes the same layouts on every call."""
    ids = tuple(map(id, layouts))
    known = _LAYOUT_KEYS.get(ids)
    if known is not None and all(map(_refers_to, known[0], layouts)):
        return known[1], known[2]
    base = layouts[0].tensors[0].data_ptr
    key = tuple(layout_key(layout, base) for layout in layouts)
    if len(_LAYOUT_KEYS) >= _MAX_KEYS:
        _LAYOUT_KEYS.clear()
    _LAYOUT_KEYS[ids] = ([weakref.ref(layout) for layout in layouts], key, base)
    return key, base


def _refers_to(reference: weakref.ref, layout: CacheLayout) -> bool:
    return reference() is layout


def shared_page_table(layouts: Sequence[CacheLayout], direction: Direction) -> PageTable | None:
    """The process-wide page table of ``layouts``, or ``None`` where the fused copy cannot
    serve them in ``direction`` (:func:`~kvsnap.pipeline.movers.fused_unavailable`). Both are
    worked out once per layout shape (the tiling check of many ranks takes milliseconds);
    caches moved as a whole get the table rebased onto their address. The least recently
    used shapes past ``MAX_SHARED_TABLES`` are dropped."""
    key, base = _tables_key(layouts)
    with _TABLES_LOCK:
        entry = _TABLES.get(key)
        if entry is not None:
            _TABLES.move_to_end(key)
    if entry is None:
        entry = _SharedEntry(layouts, base)
        with _TABLES_LOCK:
            _TABLES[key] = entry
            while len(_TABLES) > MAX_SHARED_TABLES:
                _TABLES.popitem(last=False)
    return entry.table_for(direction, base)


class _SharedEntry:
    """One layout shape's page table (built at ``base``) and, per direction, whether the fused
    copy serves it.

    Everything is worked out at once, so the cache never holds the caches' tensors.
    """

    def __init__(self, layouts: Sequence[CacheLayout], base: int) -> None:
        self._usable = {
            direction: fused_unavailable(layouts, direction) is None for direction in Direction
        }
        self._table = PageTable(layouts) if any(self._usable.values()) else None
        self._base = base
        #: The last rebased table and its base: a caller alternating between two caches
        #: rebases each time, one reusing a cache rebases once.
        self._last: tuple[int, PageTable | None] = (base, self._table)

    def table_for(self, direction: Direction, base: int) -> PageTable | None:
        if not self._usable[direction] or self._table is None:
            return None
        last_base, table = self._last
        if last_base != base:
            table = self._table.rebased(base - self._base)
            self._last = (base, table)
        return table
