"""The restore loop: snapshot file -> staging slots (checksums verified) -> the engine cache.

A read (and its verification, on the reader's threads) is queued in every free slot; slots are
moved into the cache in order as their reads complete, and given back with the event of their
copy, so the disk and the page cache never wait for the device. A page that fails its checksum
never reaches the cache: its slot's other pages are moved, and the failed pages are reported.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import numpy as np

from kvsnap.errors import SnapshotCorruptError
from kvsnap.pinned import Slot
from kvsnap.pipeline.movers import SlotMover
from kvsnap.pipeline.slots import SlotPlan
from kvsnap.pipeline.staging import StagingRing
from kvsnap.store import SnapshotReader, TraceHook, traced


class SnapshotPages:
    """The pages of one open snapshot as a restore reads them: a slot's pages in one call."""

    def __init__(self, reader: SnapshotReader) -> None:
        self.reader = reader
        self.names = reader.tensor_names()
        self.page_size_bytes = reader.metadata.geometry.canonical_page_size_bytes

    def read_async(
        self, plan: SlotPlan, snapshot_blocks: np.ndarray, out: np.ndarray, trace: TraceHook | None
    ) -> Future[np.ndarray]:
        """Read (and verify) ``plan``'s pages into ``out``; the future gives the pages that
        failed their checksum."""
        return self.reader.read_slot_async(
            plan.page_tensors,
            snapshot_blocks[plan.page_positions],
            plan.page_offsets,
            out,
            trace=trace,
        )


@dataclass
class _Read:
    plan: SlotPlan
    slot: Slot
    future: Future[np.ndarray]


@dataclass(frozen=True)
class FailedPages:
    """Pages a restore did not write: their tensors, positions in the block list, and the first
    error met."""

    tensors: np.ndarray
    positions: np.ndarray
    first_error: SnapshotCorruptError | None


def restore_slots(
    mover: SlotMover,
    ring: StagingRing,
    pages: SnapshotPages,
    plans: Iterable[SlotPlan],
    blocks: tuple[np.ndarray, np.ndarray],
    progress: Callable[[int], None],
    trace: TraceHook | None,
) -> FailedPages:
    """Read every slot of ``plans`` and move it into the cache.

    ``blocks`` is ``(snapshot_blocks, target_blocks)``: page ``i`` of a plan is snapshot block
    ``snapshot_blocks[p]`` going to device block ``target_blocks[p]``, ``p`` its position.
    Returns the pages that failed their checksum (nothing of them was written).
    """
    page_bytes = pages.page_size_bytes
    work = deque(plans)
    reads: deque[_Read] = deque()
    failed_tensors: list[np.ndarray] = []
    failed_positions: list[np.ndarray] = []
    first_error: list[SnapshotCorruptError] = []
    try:
        while work or reads:
            while work:
                # Wait for a slot only with no read of ours queued: a pool shared with another
                # restore must not leave both waiting for each other's slots.
                slot = ring.try_acquire() if reads else _acquire(ring, trace)
                if slot is None:
                    break
                try:
                    reads.append(_start_read(pages, work.popleft(), slot, blocks[0], trace))
                except BaseException:
                    ring.release(slot)
                    raise
            read = reads.popleft()
            plan = _verified_part(pages, read, blocks[0], trace, first_error)
            if plan.num_pages < read.plan.num_pages:
                keep = np.isin(read.plan.page_offsets, plan.page_offsets)
                failed_tensors.append(read.plan.page_tensors[~keep])
                failed_positions.append(read.plan.page_positions[~keep])
            try:
                with traced(trace, "transfer.submit", plan.num_bytes(page_bytes)):
                    positions = plan.page_positions
                    ticket = mover.submit(
                        plan, read.slot, blocks[1][positions], blocks[0][positions]
                    )
            except BaseException:
                ring.release(read.slot)
                raise
            event = mover.event(ticket)
            if event is None:
                with traced(trace, "transfer.wait", plan.num_bytes(page_bytes)):
                    try:
                        mover.wait(ticket)
                    finally:
                        ring.release(read.slot)
            else:
                ring.release(read.slot, after=event)
            progress(read.plan.num_bytes(page_bytes))
    finally:
        for read in reads:
            # A read still in flight must finish before its slot is reused.
            wait_futures([read.future])
            ring.release(read.slot)
    empty = np.empty(0, dtype=np.int64)
    return FailedPages(
        np.concatenate(failed_tensors) if failed_tensors else empty,
        np.concatenate(failed_positions) if failed_positions else empty,
        first_error[0] if first_error else None,
    )


def _acquire(ring: StagingRing, trace: TraceHook | None) -> Slot:
    with traced(trace, "staging.wait"):
        return ring.acquire()


def _start_read(
    pages: SnapshotPages,
    plan: SlotPlan,
    slot: Slot,
    snapshot_blocks: np.ndarray,
    trace: TraceHook | None,
) -> _Read:
    return _Read(plan, slot, pages.read_async(plan, snapshot_blocks, slot.as_numpy(), trace))


def _verified_part(
    pages: SnapshotPages,
    read: _Read,
    snapshot_blocks: np.ndarray,
    trace: TraceHook | None,
    first_error: list[SnapshotCorruptError],
) -> SlotPlan:
    """``read.plan`` without the pages that failed their checksum (waits for the read).

    Errors other than a checksum mismatch (the file vanished, the disk failed) propagate.
    """
    with traced(trace, "read.wait"):
        bad = read.future.result()
    if not len(bad):
        return read.plan
    if not first_error:
        page = int(bad[0])
        first_error.append(
            SnapshotCorruptError(
                "xxh3-64 does not match the stored checksum",
                file=pages.reader.url,
                tensor=pages.names[int(read.plan.page_tensors[page])],
                block=int(snapshot_blocks[read.plan.page_positions[page]]),
            )
        )
    keep = np.ones(read.plan.num_pages, dtype=bool)
    keep[bad] = False
    return read.plan.subset(keep)


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
