"""The restore loop: snapshot file -> staging slots (checksums verified) -> the engine cache.

A read is queued in every free slot; slots are moved into the cache in the order their reads
complete and given back with the event of their copy, so the disk and the page cache never
wait for the device. A page that fails its checksum (on the device where the
pages are hashed there, on the read threads otherwise) never reaches the cache: its slot's
other pages are moved, and the failed pages are reported. A snapshot file read whole as it
opened (``read_whole_max_bytes``: the vLLM connector's checked chunks) going into a cache in
host memory takes no slot: its pages are checked and copied into the cache where they lie.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvsnap.errors import SnapshotCorruptError
from kvsnap.pipeline.movers import SlotMover
from kvsnap.pipeline.slots import SlotLoad
from kvsnap.pipeline.staging import StagingRing
from kvsnap.store import SnapshotReader, TraceHook, traced
from kvsnap.store.hot import HotFile, hot_tier
from kvsnap.store.slot_reads import held_page_failures
from kvsnap.transfer.pinned import Slot


class SnapshotPages:
    """The pages of one open snapshot as a restore reads them: a slot's pages in one call.

    ``hot``: the snapshot's files held by the hot tier (one per file, leased by the caller):
    then nothing is read, and each slot's pages go to the device straight from the files'
    registered mappings (:meth:`uploads`).
    """

    def __init__(self, reader: SnapshotReader, hot: Sequence[HotFile] | None = None) -> None:
        self.reader = reader
        self.names = reader.tensor_names()
        self.page_size_bytes = reader.metadata.geometry.canonical_page_size_bytes
        self.hot = hot

    def uploads(self, load: SlotLoad, page_blocks: np.ndarray) -> list[tuple[Any, int]]:
        """``load``'s pages (page ``i`` is snapshot block ``page_blocks[i]``) as host→device
        copies out of the hot files' mappings: per run of pages consecutive in a file and in
        the slot, the mapped bytes and their offset in the slot (one run per slot when the
        slot's pages follow each other in the file)."""
        assert self.hot is not None
        runs = self.reader.page_runs(load.page_tensors, page_blocks, load.page_offsets)
        lengths = (runs.stops - runs.starts) * self.page_size_bytes
        uploads = []
        for file, begin, length, slot_offset in zip(
            runs.files.tolist(),
            runs.file_offsets.tolist(),
            lengths.tolist(),
            runs.slot_offsets.tolist(),
            strict=True,
        ):
            host = self.hot[file].host
            assert host is not None  # leased entries stay mapped
            uploads.append((host[begin : begin + length], slot_offset))
        return uploads

    def read_async(
        self,
        load: SlotLoad,
        snapshot_blocks: np.ndarray,
        out: np.ndarray,
        trace: TraceHook | None,
        *,
        verify: bool = True,
        inline: bool = False,
    ) -> Future[np.ndarray]:
        """Read (and, with ``verify``, check) ``load``'s pages into ``out``; the future gives
        the pages that failed their checksum. ``inline``: a small slot may be read on this
        thread (:meth:`SnapshotReader.read_slot_async`)."""
        return self.reader.read_slot_async(
            load.page_tensors,
            snapshot_blocks[load.page_positions],
            load.page_offsets,
            out,
            verify=verify,
            trace=trace,
            inline=inline,
        )

    def stored(self, load: SlotLoad, page_blocks: np.ndarray) -> np.ndarray:
        """The stored xxh3-64 of ``load``'s pages (page ``i`` is snapshot block
        ``page_blocks[i]``)."""
        return self.reader.stored_checksums(load.page_tensors, page_blocks)


def lease_hot_files(reader: SnapshotReader, *, admit: bool) -> list[HotFile] | None:
    """Every file of ``reader``'s snapshot from the process-wide hot tier, leased (give each
    back with :meth:`~kvsnap.store.hot.HotTier.release`), or ``None``: a file is not local or
    not (yet) held (all or nothing; each lookup counts a hit). ``admit``: register the files
    now (the caller's word) rather than on the tier's ``register_after``-th hit."""
    tier = hot_tier()
    files = reader.local_files() if tier.enabled else None
    if files is None:
        return None
    leases: list[HotFile] = []
    for path, fd, status in files:
        entry = tier.lookup(path, fd, status, admit=admit)
        if entry is None:
            for leased in leases:
                tier.release(leased)
            return None
        leases.append(entry)
    return leases


@dataclass(frozen=True)
class FailedPages:
    """Pages a restore did not write: their tensors, positions in the block list, and the first
    error met."""

    tensors: np.ndarray
    positions: np.ndarray
    first_error: SnapshotCorruptError | None


@dataclass(frozen=True)
class RestoreSource:
    """One snapshot of a restore job: its pages, the slots they fill, and ``blocks`` =
    ``(snapshot_blocks, target_blocks)``: page ``i`` of a load is snapshot block
    ``snapshot_blocks[p]`` going to device block ``target_blocks[p]``, ``p`` its position."""

    pages: SnapshotPages
    loads: Iterable[SlotLoad]
    blocks: tuple[np.ndarray, np.ndarray]


#: A read in flight: whose it is, what it reads, the slot it reads into, and its future.
_Reading = tuple["_RestoreRun", SlotLoad, Slot, Future[np.ndarray]]


def restore_slots(
    mover: SlotMover,
    ring: StagingRing,
    sources: Sequence[RestoreSource],
    progress: Callable[[int], None],
    trace: TraceHook | None,
    while_copying: Callable[[], None] | None = None,
) -> list[FailedPages]:
    """Read every slot of every source and move it into the cache, as one job.

    A read is queued in every free slot (the next source's reads as soon as the previous
    source's are all queued, so that several snapshots read as one stream), and slots are moved
    in the order their reads complete, all on this thread (CUDA calls from many read threads
    would contend). Pages are verified on the device where the mover hashes pages (the reads
    then skip the host's checksums), on the read threads otherwise. Returns, per source, the
    pages that failed their checksum: nothing of them was written.

    ``while_copying`` is called once every slot is moved (enqueued, on a device) and before
    waiting for the device's checks: the host is idle there while the device works through
    the last slots. What it raises is raised once the copies it overlapped are complete.
    """
    runs = [_RestoreRun(mover, ring, s.pages, s.blocks, progress, trace) for s in sources]
    completed: queue.SimpleQueue[_Reading] = queue.SimpleQueue()
    remaining = _PendingLoads(
        (run, load) for run, s in zip(runs, sources, strict=True) for load in s.loads
    )
    reading = 0
    try:
        while True:
            reading += _fill_free_slots(ring, runs, remaining, completed, blocking=reading == 0)
            if reading == 0:
                break
            with traced(runs[0].trace, "read.wait"):
                run, load, slot, read = completed.get()
            reading -= 1
            run.move(load, slot, read)
    finally:
        while reading:
            # A read still in flight must finish before its slot is reused.
            _, _, slot, read = completed.get()
            reading -= 1
            ring.release(slot)
    for run in runs:
        run.raise_error()
    overlapped_error: BaseException | None = None
    if while_copying is not None:
        try:
            while_copying()
        except BaseException as error:  # raised below: the device still uses the slots
            overlapped_error = error
    for run in runs:
        run.collect_device_checks()
    if overlapped_error is not None:
        raise overlapped_error
    return [run.failed() for run in runs]


def _fill_free_slots(
    ring: StagingRing,
    runs: Sequence[_RestoreRun],
    remaining: _PendingLoads,
    completed: queue.SimpleQueue[_Reading],
    *,
    blocking: bool,
) -> int:
    """Queue the next loads' reads in every free slot: how many were started. Waits for a
    slot only when ``blocking`` (nothing of ours in flight): a pool shared with another
    restore must not leave both waiting for each other's slots. No slot is taken once every
    load is started: taking one waits for its last copy, often the one just enqueued. The
    loads of a file read whole into a cache in host memory take no slot: they are checked
    and moved here, where they lie (:meth:`_RestoreRun.move_held`)."""
    started = 0
    while not any(run.error is not None for run in runs):
        upcoming = remaining.peek()
        if upcoming is None:
            break
        if upcoming[0].held and upcoming[0].move_held(upcoming[1]):
            remaining.take()  # moved straight out of the file's bytes: no slot, no read
            continue
        if blocking and not started:
            with traced(runs[0].trace, "staging.wait"):
                slot = ring.acquire()
        else:
            slot = ring.try_acquire()
        if slot is None:
            break
        run, load = remaining.take()
        try:
            with traced(run.trace, "read.enqueue"):
                read = run.read(load, slot)
        except BaseException:
            ring.release(slot)
            raise
        # The read thread that completes it only queues it: this thread moves every slot.
        read.add_done_callback(lambda done, r=run, p=load, s=slot: completed.put((r, p, s, done)))
        started += 1
    return started


class _PendingLoads:
    """The loads of a restore in order, the next one visible before it is taken."""

    def __init__(self, loads: Iterator[tuple[_RestoreRun, SlotLoad]]) -> None:
        self._loads = loads
        self._next: tuple[_RestoreRun, SlotLoad] | None = None

    def peek(self) -> tuple[_RestoreRun, SlotLoad] | None:
        if self._next is None:
            self._next = next(self._loads, None)
        return self._next

    def take(self) -> tuple[_RestoreRun, SlotLoad]:
        item = self.peek()
        assert item is not None
        self._next = None
        return item


class _RestoreRun:
    """One restore's reads and moves, and the pages that failed."""

    def __init__(
        self,
        mover: SlotMover,
        ring: StagingRing,
        pages: SnapshotPages,
        blocks: tuple[np.ndarray, np.ndarray],
        progress: Callable[[int], None],
        trace: TraceHook | None,
    ) -> None:
        self.mover, self.ring, self.pages, self.trace = mover, ring, pages, trace
        self.snapshot_blocks, self.target_blocks = blocks
        self.progress = progress
        self.on_device = mover.hashes_pages and pages.reader.verifies
        # Hot files are only ever read by the device: never through a host read or host check.
        self.hot = (
            pages.hot is not None
            and mover.takes_uploads
            and (self.on_device or not pages.reader.verifies)
        )
        # A file read whole as it opened, into a cache in host memory: its pages are checked
        # and copied where they lie (move_held), not copied into a staging slot first.
        self.held = not self.hot and mover.copies_on_host and pages.reader.verifies
        self.checked: list[tuple[SlotLoad, Any]] = []
        self.failed_tensors: list[np.ndarray] = []
        self.failed_positions: list[np.ndarray] = []
        self.first_error: list[SnapshotCorruptError] = []
        self.error: BaseException | None = None

    def read(self, load: SlotLoad, slot: Slot) -> Future[np.ndarray]:
        """Queue ``load``'s read into ``slot`` (checksums on the read threads unless the
        device checks them; a small slot of a cache in host memory is read on this thread).
        From hot files nothing is read: the slot only orders the move."""
        if self.hot:
            nothing: Future[np.ndarray] = Future()
            nothing.set_result(np.empty(0, dtype=np.int64))
            return nothing
        return self.pages.read_async(
            load,
            self.snapshot_blocks,
            slot.as_numpy(),
            self.trace,
            verify=not self.on_device,
            inline=self.mover.copies_on_host,
        )

    def move_held(self, load: SlotLoad) -> bool:
        """Check ``load``'s pages against their stored xxh3-64 where they lie in the bytes
        the snapshot's one file was read into as it opened, and have the mover copy the pages
        that match straight from there into the cache (a cache in host memory: the copy is
        done when this returns); failed pages are noted as a slot's are. ``False``, doing
        nothing, when the file was not read whole."""
        page_blocks = self.snapshot_blocks[load.page_positions]
        held = self.pages.reader.held_pages(load.page_tensors, page_blocks)
        if held is None:
            return False
        whole, offsets = held
        page = self.pages.page_size_bytes
        try:
            if self.error is None:
                with traced(self.trace, "verify", load.num_bytes(page)):
                    stored = self.pages.stored(load, page_blocks)
                    bad = held_page_failures(whole, offsets, page, stored)
                keep = np.ones(load.num_pages, dtype=bool)
                if len(bad):
                    self._fail(load, bad, "xxh3-64 does not match the stored checksum")
                    keep[bad] = False
                # The pages' offsets in the file's bytes stand in for offsets in a slot that
                # spans those bytes: the mover copies from slot address + page offset.
                moving = SlotLoad(load.page_tensors[keep], load.page_positions[keep], offsets[keep])
                over = Slot(-1, whole.ctypes.data, whole.nbytes, torch.from_numpy(whole))
                with traced(self.trace, "transfer.submit", moving.num_bytes(page)):
                    positions = moving.page_positions
                    ticket = self.mover.submit(
                        moving, over, self.target_blocks[positions], page_blocks[keep]
                    )
                    self.mover.wait(ticket)
                self.progress(load.num_bytes(page))
        except BaseException as error:
            self.error = error
        return True

    def move(self, load: SlotLoad, slot: Slot, read: Future[np.ndarray]) -> None:
        """Move the slot's pages (unless an earlier slot failed) and give it back, with the
        copy's event where the copy may still run."""
        event = None
        try:
            if self.error is None:
                event = self._move(load, slot, read)
                self.progress(load.num_bytes(self.pages.page_size_bytes))
        except BaseException as error:
            self.error = error
        self.ring.release(slot, after=event)

    def _move(self, load: SlotLoad, slot: Slot, read: Future[np.ndarray]) -> Any:
        """Move ``load``'s verified pages out of ``slot``: the copy's event, or ``None`` when
        the copy is already done."""
        moving = self._verified(load, read)
        positions = moving.page_positions
        with traced(self.trace, "transfer.prepare"):
            page_blocks = self.snapshot_blocks[positions]
            expected = self.pages.stored(moving, page_blocks) if self.on_device else None
            uploads = self.pages.uploads(moving, page_blocks) if self.hot else None
        nbytes = moving.num_bytes(self.pages.page_size_bytes)
        with traced(self.trace, "transfer.submit", nbytes):
            ticket = self.mover.submit(
                moving, slot, self.target_blocks[positions], page_blocks, expected, uploads=uploads
            )
        if expected is not None:
            self.checked.append((moving, ticket))
        event = self.mover.event(ticket)
        if event is None:
            with traced(self.trace, "transfer.wait", nbytes):
                self.mover.wait(ticket)
        return event

    def _verified(self, load: SlotLoad, read: Future[np.ndarray]) -> SlotLoad:
        """``load`` without the pages its read found corrupt (noted as failed); errors other
        than a checksum mismatch (the file vanished, the disk failed) propagate."""
        bad = read.result()
        if not len(bad):
            return load
        self._fail(load, bad, "xxh3-64 does not match the stored checksum")
        keep = np.ones(load.num_pages, dtype=bool)
        keep[bad] = False
        return load.subset(keep)

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def collect_device_checks(self) -> None:
        """Wait for the device-verified slots and note the pages their kernels refused."""
        failed = self.mover.failed_pages_of([ticket for _, ticket in self.checked])
        for (load, _), bad in zip(self.checked, failed, strict=True):
            if len(bad):
                self._fail(load, bad, "xxh3-64 does not match the stored checksum (device)")
        self.checked = []

    def _fail(self, load: SlotLoad, bad: np.ndarray, message: str) -> None:
        self.failed_tensors.append(load.page_tensors[bad])
        self.failed_positions.append(load.page_positions[bad])
        if not self.first_error:
            page = int(bad[0])
            self.first_error.append(
                SnapshotCorruptError(
                    message,
                    file=self.pages.reader.url,
                    tensor=self.pages.names[int(load.page_tensors[page])],
                    block=int(self.snapshot_blocks[load.page_positions[page]]),
                )
            )

    def failed(self) -> FailedPages:
        empty = np.empty(0, dtype=np.int64)
        return FailedPages(
            np.concatenate(self.failed_tensors) if self.failed_tensors else empty,
            np.concatenate(self.failed_positions) if self.failed_positions else empty,
            self.first_error[0] if self.first_error else None,
        )


def failed_target_blocks(failed: FailedPages, target_blocks: np.ndarray) -> np.ndarray:
    """The target blocks with at least one page not restored, sorted."""
    return np.unique(target_blocks[failed.positions])


def describe_failure(failed: FailedPages, names: Sequence[str], target_blocks: np.ndarray) -> str:
    """One line: how many pages failed, and the first one."""
    first = int(np.argmin(failed.positions)) if len(failed.positions) else 0
    tensor = names[int(failed.tensors[first])]
    where = f"{tensor}, target block {int(target_blocks[failed.positions[first]])}"
    blocks = failed_target_blocks(failed, target_blocks)
    return (
        f"{len(failed.positions)} page(s) failed their checksum and were not restored "
        f"({len(blocks)} target block(s), first: {where})"
    )
