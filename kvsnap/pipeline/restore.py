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


#: One slot's work: the loads it carries, each with its restore (several only when packed).
_Group = list[tuple["_RestoreRun", SlotLoad]]
#: A read in flight: the slot's loads, the slot it reads into, and its future.
_Reading = tuple[_Group, Slot, Future[np.ndarray]]
#: A slot the device checks: its ticket, and per load carried its restore, the load and the
#: load's first page in the slot.
_Checked = tuple[Any, list[tuple["_RestoreRun", SlotLoad, int]]]


def restore_slots(
    mover: SlotMover,
    ring: StagingRing,
    sources: Sequence[RestoreSource],
    progress: Callable[[int], None],
    trace: TraceHook | None,
    while_copying: Callable[[], None] | None = None,
    hot_slot_bytes: int | None = None,
) -> list[FailedPages]:
    """Read every slot of every source and move it into the cache, as one job.

    A read is queued in every free slot (the next source's reads as soon as the previous
    source's are all queued, so that several snapshots read as one stream), and slots are moved
    in the order their reads complete, all on this thread (CUDA calls from many read threads
    would contend). Pages are verified on the device where the mover hashes pages (the reads
    then skip the host's checksums), on the read threads otherwise. Loads of hot files, which
    are never read, are packed several to a slot where they fit (:func:`_packed`): an engine's
    prefix of small chunks then costs a slot's host work per slot, not per chunk. Returns, per
    source, the pages that failed their checksum: nothing of them was written.

    ``while_copying`` is called once every slot is moved (enqueued, on a device) and before
    waiting for the device's checks: the host is idle there while the device works through
    the last slots. What it raises is raised once the copies it overlapped are complete.
    ``hot_slot_bytes``: the most bytes a slot of hot files carries (default: the ring's slot
    size; nothing is read into such a slot, only the device buffer bounds it).
    """
    runs = [_RestoreRun(mover, ring, s.pages, s.blocks, progress, trace) for s in sources]
    completed: queue.SimpleQueue[_Reading] = queue.SimpleQueue()
    pairs = ((run, load) for run, s in zip(runs, sources, strict=True) for load in s.loads)
    remaining = _PendingLoads(_packed(pairs, hot_slot_bytes or ring.slot_bytes))
    checked: list[_Checked] = []
    reading = 0
    try:
        while True:
            reading += _fill_free_slots(ring, runs, remaining, completed, blocking=reading == 0)
            if reading == 0:
                break
            with traced(runs[0].trace, "read.wait"):
                group, slot, read = completed.get()
            reading -= 1
            if len(group) == 1:
                run, load = group[0]
                run.move(load, slot, read, checked)
            else:
                _move_packed(group, slot, checked)
    finally:
        while reading:
            # A read still in flight must finish before its slot is reused.
            _, slot, read = completed.get()
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
    _collect_device_checks(mover, checked)
    if overlapped_error is not None:
        raise overlapped_error
    return [run.failed() for run in runs]


def _packed(pairs: Iterator[tuple[_RestoreRun, SlotLoad]], slot_bytes: int) -> Iterator[_Group]:
    """The loads in order, one slot's worth each: consecutive loads of hot files checked on the
    device share a slot while their bytes fit in it (nothing is read into it: the slot only
    orders the device's work); every other load has a slot of its own."""
    group: _Group = []
    group_bytes = 0
    for run, load in pairs:
        load_bytes = load.num_bytes(run.pages.page_size_bytes)
        if group and (not run.packs or group_bytes + load_bytes > slot_bytes):
            yield group
            group, group_bytes = [], 0
        group.append((run, load))
        group_bytes += load_bytes
        if not run.packs:
            yield group
            group, group_bytes = [], 0
    if group:
        yield group


def _move_packed(group: _Group, slot: Slot, checked: list[_Checked]) -> None:
    """Move the loads of ``group`` (hot files, checked on the device; one run of pages each,
    back to back) out of one slot with one submit, and give the slot back with its event."""
    first_run = group[0][0]
    event = None
    try:
        if all(run.error is None for run, _ in group):
            event = _submit_packed(group, slot, checked)
    except BaseException as error:
        first_run.error = error
    first_run.ring.release(slot, after=event)


def _submit_packed(group: _Group, slot: Slot, checked: list[_Checked]) -> Any:
    """The one submit of a packed slot: each load's pages follow the previous load's, with its
    files' bytes, blocks and stored digests; returns the copy's event."""
    tensors, offsets, targets, blocks, expected = [], [], [], [], []
    uploads: list[tuple[Any, int]] = []
    parts: list[tuple[_RestoreRun, SlotLoad, int]] = []
    first_page = first_byte = 0
    trace = group[0][0].trace
    with traced(trace, "transfer.prepare"):
        for run, load in group:
            page_bytes = run.pages.page_size_bytes
            page_blocks = run.snapshot_blocks[load.page_positions]
            tensors.append(load.page_tensors)
            offsets.append(load.page_offsets + first_byte)
            targets.append(run.target_blocks[load.page_positions])
            blocks.append(page_blocks)
            expected.append(run.pages.stored(load, page_blocks))
            uploads.extend(
                (host, at + first_byte) for host, at in run.pages.uploads(load, page_blocks)
            )
            parts.append((run, load, first_page))
            first_page += load.num_pages
            first_byte += load.num_bytes(page_bytes)
        positions = np.arange(first_page, dtype=np.int64)  # not read: the mover needs none
        packed = SlotLoad(np.concatenate(tensors), positions, np.concatenate(offsets))
    mover = group[0][0].mover
    with traced(trace, "transfer.submit", first_byte):
        ticket = mover.submit(
            packed,
            slot,
            np.concatenate(targets),
            np.concatenate(blocks),
            np.concatenate(expected),
            uploads=uploads,
        )
    checked.append((ticket, parts))
    for run, load, _ in parts:
        run.progress(load.num_bytes(run.pages.page_size_bytes))
    return mover.event(ticket)


def _collect_device_checks(mover: SlotMover, checked: list[_Checked]) -> None:
    """Wait for the device-checked slots (their flags in one copy) and note, per restore, the
    pages their kernels refused."""
    failed = mover.failed_pages_of([ticket for ticket, _ in checked])
    for (_, parts), bad in zip(checked, failed, strict=True):
        for run, load, first_page in parts:
            mine = bad[(bad >= first_page) & (bad < first_page + load.num_pages)] - first_page
            if len(mine):
                run.fail(load, mine, "xxh3-64 does not match the stored checksum (device)")


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
    load is started: taking one waits for its last copy, often the one just enqueued. Stops
    after a slot of hot files, which are not read: the device gets that slot now, not after
    the host has taken every free slot. The loads of a file read whole into a cache in host
    memory take no slot: they are checked and moved here, where they lie
    (:meth:`_RestoreRun.move_held`)."""
    started = 0
    while not any(run.error is not None for run in runs):
        upcoming = remaining.peek()
        if upcoming is None:
            break
        first_run, first_load = upcoming[0]  # a held file's loads are never packed
        if first_run.held and first_run.move_held(first_load):
            remaining.take()  # moved straight out of the file's bytes: no slot, no read
            continue
        if blocking and not started:
            with traced(runs[0].trace, "staging.wait"):
                slot = ring.acquire()
        else:
            slot = ring.try_acquire()
        if slot is None:
            break
        group = remaining.take()
        run, load = group[0]
        try:
            with traced(run.trace, "read.enqueue"):
                # A packed slot holds hot files' pages only: nothing to read.
                read = run.read(load, slot) if len(group) == 1 else _nothing_to_read()
        except BaseException:
            ring.release(slot)
            raise
        # The read thread that completes it only queues it: this thread moves every slot.
        read.add_done_callback(lambda done, g=group, s=slot: completed.put((g, s, done)))
        started += 1
        if run.hot:
            break
    return started


def _nothing_to_read() -> Future[np.ndarray]:
    """A read that is already complete, with no page failed."""
    nothing: Future[np.ndarray] = Future()
    nothing.set_result(np.empty(0, dtype=np.int64))
    return nothing


class _PendingLoads:
    """A restore's slots of loads in order, the next one visible before it is taken."""

    def __init__(self, groups: Iterator[_Group]) -> None:
        self._groups = groups
        self._next: _Group | None = None

    def peek(self) -> _Group | None:
        if self._next is None:
            self._next = next(self._groups, None)
        return self._next

    def take(self) -> _Group:
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
        # Hot files checked on the device share slots (restore_slots packs their loads).
        self.packs = self.hot and self.on_device
        # A file read whole as it opened, into a cache in host memory: its pages are checked
        # and copied where they lie (move_held), not copied into a staging slot first.
        self.held = not self.hot and mover.copies_on_host and pages.reader.verifies
        self.failed_tensors: list[np.ndarray] = []
        self.failed_positions: list[np.ndarray] = []
        self.first_error: list[SnapshotCorruptError] = []
        self.error: BaseException | None = None

    def read(self, load: SlotLoad, slot: Slot) -> Future[np.ndarray]:
        """Queue ``load``'s read into ``slot`` (checksums on the read threads unless the
        device checks them; a small slot of a cache in host memory is read on this thread).
        From hot files nothing is read: the slot only orders the move."""
        if self.hot:
            return _nothing_to_read()
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
                # The pages' offsets in the file's bytes stand in for offsets in a slot that
                # spans those bytes: the mover copies from slot address + page offset.
                moving = SlotLoad(load.page_tensors, load.page_positions, offsets)
                if len(bad):
                    self.fail(load, bad, "xxh3-64 does not match the stored checksum")
                    keep = np.ones(load.num_pages, dtype=bool)
                    keep[bad] = False
                    moving = SlotLoad(
                        load.page_tensors[keep], load.page_positions[keep], offsets[keep]
                    )
                    page_blocks = page_blocks[keep]
                over = Slot(-1, whole.ctypes.data, whole.nbytes, torch.from_numpy(whole))
                with traced(self.trace, "transfer.submit", moving.num_bytes(page)):
                    positions = moving.page_positions
                    ticket = self.mover.submit(
                        moving, over, self.target_blocks[positions], page_blocks
                    )
                    self.mover.wait(ticket)
                self.progress(load.num_bytes(page))
        except BaseException as error:
            self.error = error
        return True

    def move(
        self, load: SlotLoad, slot: Slot, read: Future[np.ndarray], checked: list[_Checked]
    ) -> None:
        """Move the slot's pages (unless an earlier slot failed) and give it back, with the
        copy's event where the copy may still run; a slot the device checks goes on
        ``checked``."""
        event = None
        try:
            if self.error is None:
                event = self._move(load, slot, read, checked)
                self.progress(load.num_bytes(self.pages.page_size_bytes))
        except BaseException as error:
            self.error = error
        self.ring.release(slot, after=event)

    def _move(
        self, load: SlotLoad, slot: Slot, read: Future[np.ndarray], checked: list[_Checked]
    ) -> Any:
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
            checked.append((ticket, [(self, moving, 0)]))
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
        self.fail(load, bad, "xxh3-64 does not match the stored checksum")
        keep = np.ones(load.num_pages, dtype=bool)
        keep[bad] = False
        return load.subset(keep)

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def fail(self, load: SlotLoad, bad: np.ndarray, message: str) -> None:
        """Note pages ``bad`` of ``load`` as failed (not written), and the first error."""
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
