"""The restore loop: snapshot file -> staging slots (checksums verified) -> the engine cache.

What a slot carries comes from ``snapshot_pages`` (reads, or hot files' spans) and, for hot
files, ``packed_slots`` (several loads to a slot); each snapshot's reads and moves are a
``restore_run``.

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

import numpy as np

from kvsnap.pipeline.movers import SlotMover
from kvsnap.pipeline.packed_slots import (
    collect_device_checks,
    move_packed,
    packed_groups,
)
from kvsnap.pipeline.restore_run import Checked, FailedPages, Group, RestoreRun, nothing_to_read
from kvsnap.pipeline.slots import SlotLoad
from kvsnap.pipeline.snapshot_pages import SnapshotPages
from kvsnap.pipeline.staging import StagingRing
from kvsnap.store import TraceHook, traced
from kvsnap.transfer.pinned import Slot


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
                read = run.read(load, slot) if len(group) == 1 else nothing_to_read()
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
