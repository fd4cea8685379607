"""How a :class:`~kvsnap.pipeline.Pipeline` restores checked parts: a snapshot's fit checked,
every part moved by the pipeline over the ranks holding its heads, one job per such pipeline
(held files copied where they lie, the others through the staging loop), and the failures of
all of them reported as one. :class:`PartRestores` holds these methods; ``Pipeline`` inherits
them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvsnap.format.fit import check_fits
from kvsnap.layout import CacheLayout, KVGeometry
from kvsnap.pipeline.fused import FusedMover
from kvsnap.pipeline.held_load import HeldLoader
from kvsnap.pipeline.jobs import RestoreResult
from kvsnap.pipeline.movers import SlotMover
from kvsnap.pipeline.options import ProgressCallback, ProgressCounter, StagingOptions
from kvsnap.pipeline.part_jobs import (
    Item,
    PartMove,
    RestorableSnapshot,
    incomplete_restore,
    moves_by_pipeline,
)
from kvsnap.pipeline.restore_run import FailedPages
from kvsnap.pipeline.slot_restore import restore_through_slots
from kvsnap.store import TraceHook
from kvsnap.transfer.plan import Direction

if TYPE_CHECKING:
    from kvsnap.store.read.head_parts import HeadPart

__all__ = ["PartRestores"]


class PartRestores:
    """The restore of checked parts, for the pipeline that inherits it."""

    layouts: list[CacheLayout]
    geometry: KVGeometry
    _held: HeldLoader | None

    if TYPE_CHECKING:  # the pipeline's own

        def _mover(self, direction: Direction) -> SlotMover: ...

        def _pipeline_for(self, part: HeadPart) -> PartRestores | None: ...

    def _checked_capacity(
        self, snapshot: RestorableSnapshot, model_fingerprint: str | None, force: bool
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

    def _restore_items(
        self,
        items: Sequence[Item],
        staging: StagingOptions | None,
        progress: ProgressCallback | None,
        trace: TraceHook | None,
        started: float,
        request: tuple[int, int] = (0, 0),
        while_copying: Callable[[], None] | None = None,
    ) -> RestoreResult:
        """Move checked ``items``: every part of every snapshot by the pipeline over the ranks
        holding its heads, one staging loop per such pipeline. Raise
        :class:`~kvsnap.errors.RestoreIncompleteError` naming every target block whose pages
        failed their checksum, in any part. ``request``: the sequences and tokens named (the
        result's first two fields); ``while_copying``: run during the last loop's copies (or
        after, where there is no loop)."""
        jobs = moves_by_pipeline(items, self._pipeline_for)
        total = 0
        if progress is not None:  # reported from the first slot on: known before any job runs
            total = sum(
                moving.geometry.bytes_per_block * len(move.blocks[0])
                for moving, moves in jobs
                for move in moves
            )
        done = ProgressCounter(progress, total)
        failures: list[tuple[FailedPages, PartMove]] = []
        moved_bytes, backend = 0, "none"
        for position, (moving, moves) in enumerate(jobs):
            overlapped = while_copying if position == len(jobs) - 1 else None
            failed, num_bytes, backend = moving._move_in(
                moves, staging, done.add, trace, overlapped
            )
            moved_bytes += num_bytes
            failed_moves = zip(failed, moves, strict=True)
            failures += [(pages, move) for pages, move in failed_moves if len(pages.positions)]
        if while_copying is not None and not jobs:
            while_copying()
        num_blocks = sum(len(blocks[0]) for _, blocks in items)
        seconds = time.perf_counter() - started
        result = RestoreResult(*request, num_blocks, moved_bytes, seconds, backend)
        if failures:
            names = self.geometry.tensor_names()
            raise incomplete_restore(failures, names, result) from failures[0][0].first_error
        return result

    def _move_in(
        self,
        moves: Sequence[PartMove],
        staging: StagingOptions | None,
        progress: Callable[[int], None],
        trace: TraceHook | None,
        while_copying: Callable[[], None] | None = None,
    ) -> tuple[list[FailedPages], int, str]:
        """Checked restores of ``moves`` (parts whose heads are this pipeline's geometry), as
        one job: per move the pages that failed, the bytes of the job, and the backend.
        ``progress`` counts the bytes moved; ``while_copying`` runs while the device completes
        the job (:func:`restore_slots`). A part whose one file was read whole as it opened,
        going into a cache in host memory, is checked and copied where it lies
        (:class:`~kvsnap.pipeline.held_load.HeldLoader`); the others go through the staging
        loop."""
        total_bytes = self.geometry.bytes_per_block * sum(len(move.blocks[0]) for move in moves)
        mover = self._mover(Direction.HOST_TO_DEVICE)
        loader = self._held_loader(mover)
        failed: list[FailedPages | None] = [None] * len(moves)
        slotted = []
        for index, move in enumerate(moves):
            reader = move.part.reader
            if loader is not None and reader.verifies and reader.held_file() is not None:
                failed[index] = loader.restore(reader, move.blocks, progress, trace)
            else:
                slotted.append(index)
        if slotted:
            through_slots = restore_through_slots(
                mover,
                self.geometry,
                [moves[index] for index in slotted],
                staging,
                progress,
                trace,
                while_copying,
            )
            for index, pages in zip(slotted, through_slots, strict=True):
                failed[index] = pages
        elif while_copying is not None:
            while_copying()  # everything was copied on this thread: nothing left to overlap
        done = [pages for pages in failed if pages is not None]
        return done, total_bytes, mover.backend_name

    def _held_loader(self, mover: SlotMover) -> HeldLoader | None:
        """The loader of held files into this pipeline's cache, where its mover copies on the
        host (a cache in host memory), kept for the mover's page table."""
        if not (isinstance(mover, FusedMover) and mover.copies_on_host):
            return None
        if self._held is None or self._held.table is not mover.table:
            capacity = min(layout.num_blocks for layout in self.layouts)
            self._held = HeldLoader(mover.table, capacity)
        return self._held
