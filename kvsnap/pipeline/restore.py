"""The restore loop: snapshot file -> staging slots (checksums verified) -> the engine cache.

A read is queued in every free slot; the read thread that completes a slot moves it into the
cache at once and gives the slot back with the event of its copy, so neither the disk nor the
device waits for the calling thread. A page that fails its checksum (on the device where the
pages are hashed there, on the read threads otherwise) never reaches the cache: its slot's
other pages are moved, and the failed pages are reported.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

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
        self,
        plan: SlotPlan,
        snapshot_blocks: np.ndarray,
        out: np.ndarray,
        trace: TraceHook | None,
        *,
        verify: bool = True,
    ) -> Future[np.ndarray]:
        """Read (and, with ``verify``, check) ``plan``'s pages into ``out``; the future gives
        the pages that failed their checksum."""
        return self.reader.read_slot_async(
            plan.page_tensors,
            snapshot_blocks[plan.page_positions],
            plan.page_offsets,
            out,
            verify=verify,
            trace=trace,
        )

    def stored(self, plan: SlotPlan, snapshot_blocks: np.ndarray) -> np.ndarray:
        """The stored xxh3-64 of ``plan``'s pages."""
        return self.reader.stored_checksums(plan.page_tensors, snapshot_blocks[plan.page_positions])


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
    A read is queued in every free slot; the read thread that completes a slot's read moves
    it at once, so no slot waits for this thread (which only hands out slots). Pages are
    verified on the device where the mover hashes pages (the reads then skip the host's
    checksums), on the read threads otherwise. Returns the pages that failed their checksum:
    nothing of them was written.
    """
    run = _RestoreRun(mover, ring, pages, blocks, progress, trace)
    try:
        for plan in plans:
            with traced(trace, "staging.wait"):
                slot = ring.acquire()
            if not run.start(plan, slot):
                break
    finally:
        run.wait_for_moves()
    run.raise_error()
    run.collect_device_checks()
    return run.failed()


class _RestoreRun:
    """One restore's slots in flight, its moves and the pages that failed."""

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
        self.checked: list[tuple[SlotPlan, Any]] = []
        self.failed_tensors: list[np.ndarray] = []
        self.failed_positions: list[np.ndarray] = []
        self.first_error: list[SnapshotCorruptError] = []
        self.error: BaseException | None = None
        self.pending = 0
        self.lock = threading.Condition()

    def start(self, plan: SlotPlan, slot: Slot) -> bool:
        """Queue ``plan``'s read into ``slot``; its completion moves it. False (and the slot
        given back) once an earlier slot failed."""
        with self.lock:
            if self.error is not None:
                self.ring.release(slot)
                return False
            self.pending += 1
        try:
            future = self.pages.read_async(
                plan, self.snapshot_blocks, slot.as_numpy(), self.trace, verify=not self.on_device
            )
        except BaseException as error:
            self._finish(slot, error)
            raise
        future.add_done_callback(lambda done: self._moved(plan, slot, done))
        return True

    def _moved(self, plan: SlotPlan, slot: Slot, read: Future[np.ndarray]) -> None:
        """On the read thread that completed ``plan``'s read: move the slot, give it back."""
        error: BaseException | None = None
        event = None
        try:
            with self.lock:
                failed_before = self.error is not None
            if not failed_before:
                event = self._move(plan, slot, read)
                self.progress(plan.num_bytes(self.pages.page_size_bytes))
        except BaseException as caught:
            error = caught
        self._finish(slot, error, event)

    def _move(self, plan: SlotPlan, slot: Slot, read: Future[np.ndarray]) -> Any:
        """Move ``plan``'s verified pages out of ``slot``: the copy's event, or ``None`` when
        the copy is already done."""
        moving = self._verified(plan, read)
        positions = moving.page_positions
        expected = self.pages.stored(moving, self.snapshot_blocks) if self.on_device else None
        nbytes = moving.num_bytes(self.pages.page_size_bytes)
        with traced(self.trace, "transfer.submit", nbytes):
            ticket = self.mover.submit(
                moving,
                slot,
                self.target_blocks[positions],
                self.snapshot_blocks[positions],
                expected,
            )
        if expected is not None:
            with self.lock:
                self.checked.append((moving, ticket))
        event = self.mover.event(ticket)
        if event is None:
            with traced(self.trace, "transfer.wait", nbytes):
                self.mover.wait(ticket)
        return event

    def _verified(self, plan: SlotPlan, read: Future[np.ndarray]) -> SlotPlan:
        """``plan`` without the pages its read found corrupt (noted as failed); errors other
        than a checksum mismatch (the file vanished, the disk failed) propagate."""
        bad = read.result()
        if not len(bad):
            return plan
        with self.lock:
            self._fail(plan, bad, "xxh3-64 does not match the stored checksum")
        keep = np.ones(plan.num_pages, dtype=bool)
        keep[bad] = False
        return plan.subset(keep)

    def _finish(self, slot: Slot, error: BaseException | None, event: Any = None) -> None:
        self.ring.release(slot, after=event)
        with self.lock:
            if error is not None and self.error is None:
                self.error = error
            self.pending -= 1
            self.lock.notify_all()

    def wait_for_moves(self) -> None:
        with self.lock:
            self.lock.wait_for(lambda: self.pending == 0)

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def collect_device_checks(self) -> None:
        """Wait for the device-verified slots and note the pages their kernels refused."""
        for plan, ticket in self.checked:
            self.mover.wait(ticket)
            bad = self.mover.failed_pages(ticket)
            if len(bad):
                self._fail(plan, bad, "xxh3-64 does not match the stored checksum (device)")
        self.checked = []

    def _fail(self, plan: SlotPlan, bad: np.ndarray, message: str) -> None:
        self.failed_tensors.append(plan.page_tensors[bad])
        self.failed_positions.append(plan.page_positions[bad])
        if not self.first_error:
            page = int(bad[0])
            self.first_error.append(
                SnapshotCorruptError(
                    message,
                    file=self.pages.reader.url,
                    tensor=self.pages.names[int(plan.page_tensors[page])],
                    block=int(self.snapshot_blocks[plan.page_positions[page]]),
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
