"""The restore loop: snapshot file -> staging slots (checksums verified) -> the engine cache.

What a slot carries comes from ``snapshot_pages`` (reads, or hot files' spans) and, for hot
files, ``packed_slots`` (several loads to a slot).

A read is queued in every free slot; slots are moved into the cache in the order their reads
complete and given back with the event of their copy, so the disk and the page cache never
wait for the device. A page that fails its checksum (on the device where the
pages are hashed there, on the read threads otherwise) never reaches the cache: its slot's
other pages are moved, and the failed pages are reported. A snapshot file read whole as it
opened (``read_whole_max_bytes``: the vLLM connector's checked chunks) going into a cache in
host memory never comes here: :mod:`kvsnap.pipeline.held_load` checks and copies its pages
where they lie.
"""

from __future__ import annotations

import functools
import queue
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsnap.errors import SnapshotCorruptError
from kvsnap.pipeline.movers import SlotMover
from kvsnap.pipeline.packed_slots import (
    Checked,
    Group,
    collect_device_checks,
    move_packed,
    packed_groups,
)
from kvsnap.pipeline.slots import SlotLoad
from kvsnap.pipeline.snapshot_pages import SnapshotPages
from kvsnap.pipeline.staging import StagingRing
from kvsnap.store import TraceHook, traced
from kvsnap.transfer.pinned import Slot

_XXH3_MISMATCH = "xxh3-64 does not match the stored checksum"
_BLAKE3_MISMATCH = "BLAKE3 digest does not match the signed page digest (changed after signing)"


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


#: A read in flight: the slot's loads, the slot it reads into, and its future.
_Reading = tuple[Group, Slot, Future[np.ndarray]]


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
    are never read, are packed several to a slot where they fit (``packed_slots``): an
    engine's prefix of small chunks then costs a slot's host work per slot, not per chunk.
    Returns, per source, the pages that failed their checksum: nothing of them was written.

    ``while_copying`` is called once every slot is moved (enqueued, on a device) and before
    waiting for the device's checks: the host is idle there while the device works through
    the last slots. What it raises is raised once the copies it overlapped are complete.
    ``hot_slot_bytes``: the most bytes a slot of hot files carries (default: the ring's slot
    size; nothing is read into such a slot, only the device buffer bounds it).
    """
    hot_slot_bytes = hot_slot_bytes or ring.slot_bytes
    runs = [
        RestoreRun(mover, ring, s.pages, s.blocks, progress, trace, hot_slot_bytes) for s in sources
    ]
    completed: queue.SimpleQueue[_Reading] = queue.SimpleQueue()
    pairs = ((run, load) for run, s in zip(runs, sources, strict=True) for load in s.loads)
    remaining = _PendingLoads(packed_groups(pairs, hot_slot_bytes))
    checked: list[Checked] = []
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
                move_packed(group, slot, checked)
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
    collect_device_checks(mover, checked)
    if overlapped_error is not None:
        raise overlapped_error
    return [run.failed() for run in runs]


def _fill_free_slots(
    ring: StagingRing,
    runs: Sequence[RestoreRun],
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
    the host has taken every free slot."""
    started = 0
    while not any(run.error is not None for run in runs):
        upcoming = remaining.peek()
        if upcoming is None:
            break
        slot: Slot | None
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
        read.add_done_callback(functools.partial(_queue_done, completed, group, slot))
        started += 1
        if run.hot:
            break
    return started


def _queue_done(
    completed: queue.SimpleQueue[_Reading], group: Group, slot: Slot, read: Future[np.ndarray]
) -> None:
    completed.put((group, slot, read))


def _nothing_to_read() -> Future[np.ndarray]:
    """A read that is already complete, with no page failed."""
    nothing: Future[np.ndarray] = Future()
    nothing.set_result(np.empty(0, dtype=np.int64))
    return nothing


class _PendingLoads:
    """A restore's slots of loads in order, the next one visible before it is taken."""

    def __init__(self, groups: Iterator[Group]) -> None:
        self._groups = groups
        self._next: Group | None = None

    def peek(self) -> Group | None:
        if self._next is None:
            self._next = next(self._groups, None)
        return self._next

    def take(self) -> Group:
        item = self.peek()
        assert item is not None
        self._next = None
        return item


class RestoreRun:
    """One restore's reads and moves, and the pages that failed."""

    def __init__(
        self,
        mover: SlotMover,
        ring: StagingRing,
        pages: SnapshotPages,
        blocks: tuple[np.ndarray, np.ndarray],
        progress: Callable[[int], None],
        trace: TraceHook | None,
        hot_slot_bytes: int,
    ) -> None:
        self.mover, self.ring, self.pages, self.trace = mover, ring, pages, trace
        self.hot_slot_bytes = hot_slot_bytes
        self.snapshot_blocks, self.target_blocks = blocks
        self.progress = progress
        # Opened with keys, a file signed with BLAKE3 page digests has every page checked
        # against those, where it lands: on the device where the mover computes BLAKE3 there,
        # else on the read threads (never against its xxh3-64 alone).
        self.bound = pages.reader.page_digest_table is not None
        device_checks = mover.checks_page_digests if self.bound else mover.hashes_pages
        self.on_device = device_checks and pages.reader.verifies
        self.mismatch = _BLAKE3_MISMATCH if self.bound else _XXH3_MISMATCH
        # Hot files are only ever read by the device: never through a host read or host check.
        self.hot = (
            pages.hot is not None
            and mover.takes_uploads
            and (self.on_device or not pages.reader.verifies)
        )
        # Hot files checked on the device share slots (restore_slots packs their loads).
        self.packs = self.hot and self.on_device
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

    def move(
        self, load: SlotLoad, slot: Slot, read: Future[np.ndarray], checked: list[Checked]
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
        self, load: SlotLoad, slot: Slot, read: Future[np.ndarray], checked: list[Checked]
    ) -> Any:
        """Move ``load``'s verified pages out of ``slot``: the copy's event, or ``None`` when
        the copy is already done."""
        moving = self._verified(load, read)
        positions = moving.page_positions
        with traced(self.trace, "transfer.prepare"):
            page_blocks = self.snapshot_blocks[positions]
            expected = self.pages.stored(moving, page_blocks) if self.on_device else None
            uploads = None
            if self.hot:
                moving, uploads = self.pages.uploads(moving, page_blocks, self.hot_slot_bytes)
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
        self.fail(load, bad, self.mismatch)
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
    """One line: how many pages failed, the first one, and what the first failure met (a
    page's xxh3-64, or its signed BLAKE3 digest)."""
    first = int(np.argmin(failed.positions)) if len(failed.positions) else 0
    tensor = names[int(failed.tensors[first])]
    where = f"{tensor}, target block {int(target_blocks[failed.positions[first]])}"
    blocks = failed_target_blocks(failed, target_blocks)
    why = "" if failed.first_error is None else f": {failed.first_error.detail}"
    return (
        f"{len(failed.positions)} page(s) failed their checksum and were not restored "
        f"({len(blocks)} target block(s), first: {where}{why})"
    )
