"""One restore's reads and moves, and the pages that failed: :class:`RestoreRun`, which the
restore loop (:mod:`kvsnap.pipeline.restore`) and the packing of hot files' loads
(:mod:`kvsnap.pipeline.packed_slots`) both drive, and :class:`FailedPages`, what it reports."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsnap.errors import SnapshotCorruptError
from kvsnap.pipeline.movers import SlotMover
from kvsnap.pipeline.slots import SlotLoad
from kvsnap.pipeline.snapshot_pages import SnapshotPages
from kvsnap.pipeline.staging import StagingRing
from kvsnap.store import TraceHook, traced
from kvsnap.transfer.pinned import Slot

#: One slot's work: the loads it carries, each with its restore (several only when packed).
Group = list[tuple["RestoreRun", SlotLoad]]
#: A slot the device checks: its ticket, and per load carried its restore, the load and the
#: load's first page in the slot.
Checked = tuple[Any, list[tuple["RestoreRun", SlotLoad, int]]]

_XXH3_MISMATCH = "xxh3-64 does not match the stored checksum"
_BLAKE3_MISMATCH = "BLAKE3 digest does not match the signed page digest (changed after signing)"


@dataclass(frozen=True)
class FailedPages:
    """Pages a restore did not write: their tensors, positions in the block list, and the first
    error met."""

    tensors: np.ndarray
    positions: np.ndarray
    first_error: SnapshotCorruptError | None


def nothing_to_read() -> Future[np.ndarray]:
    """A read that is already complete, with no page failed."""
    nothing: Future[np.ndarray] = Future()
    nothing.set_result(np.empty(0, dtype=np.int64))
    return nothing


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
            return nothing_to_read()
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
