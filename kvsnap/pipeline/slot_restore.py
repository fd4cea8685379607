"""A restore job through the staging slots: the ring, the hot tier's leases, and the loop.

:meth:`Pipeline._move_in <kvsnap.pipeline.Pipeline._move_in>` hands here every part of a job
that is not a file held whole going into a cache in host memory (those are
:mod:`kvsnap.pipeline.held_load`'s): the slots are set up for the job, files the hot tier can
serve are leased (uploaded straight from their mappings), and :func:`~kvsnap.pipeline.restore.
restore_slots` reads, checks and moves every slot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvsnap.layout import KVGeometry
from kvsnap.pipeline.fused import FusedMover
from kvsnap.pipeline.movers import SlotMover
from kvsnap.pipeline.options import LARGE_SLOT_BYTES, StagingOptions
from kvsnap.pipeline.part_jobs import PartMove
from kvsnap.pipeline.restore import FailedPages, RestoreSource, restore_slots
from kvsnap.pipeline.slots import slot_loads
from kvsnap.pipeline.snapshot_pages import SnapshotPages, lease_hot_files
from kvsnap.pipeline.staging import staging_ring
from kvsnap.store import TraceHook, traced
from kvsnap.store.hot import HotFile, hot_tier
from kvsnap.store.reader import SnapshotReader


def restore_through_slots(
    mover: SlotMover,
    geometry: KVGeometry,
    moves: Sequence[PartMove],
    staging: StagingOptions | None,
    progress: Callable[[int], None],
    trace: TraceHook | None,
    while_copying: Callable[[], None] | None,
) -> list[FailedPages]:
    """The staging loop of ``moves`` (parts of ``geometry``), as one job: per move the pages
    that failed (:func:`restore_slots`)."""
    page_bytes = geometry.canonical_page_size_bytes
    names = geometry.tensor_names()
    total_bytes = page_bytes * sum(len(move.blocks[0]) for move in moves) * len(names)
    with traced(trace, "setup.staging"):
        ring = staging_ring(
            staging or StagingOptions(),
            page_bytes,
            total_bytes,
            restore=True,
            device_checked=mover.hashes_pages,
        )
    # Nothing is read into a slot of hot files: with kvsnap's own staging their loads are
    # as large as the device buffer, whatever the job's size (a 42 MB prefix of 80 layers
    # is one slot, not three of 16 MiB); a caller's own slot shape is kept.
    shaped = staging is not None and (staging.pool is not None or staging.private)
    hot_slot_bytes = ring.slot_bytes if shaped else max(ring.slot_bytes, LARGE_SLOT_BYTES)
    leases: list[HotFile] = []
    try:
        mover.begin()
        sources = []
        for move in moves:
            reader = move.part.reader
            hot = _hot_files(reader, mover, staging) if total_bytes else None
            leases += hot or []
            load_bytes = hot_slot_bytes if hot else ring.slot_bytes
            sources.append(
                RestoreSource(
                    SnapshotPages(reader, hot),
                    slot_loads(len(names), len(move.blocks[0]), page_bytes, load_bytes),
                    move.blocks,
                )
            )
        return restore_slots(mover, ring, sources, progress, trace, while_copying, hot_slot_bytes)
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


def _hot_files(
    reader: SnapshotReader, mover: SlotMover, staging: StagingOptions | None
) -> list[HotFile] | None:
    """``reader``'s files leased from the hot tier when this restore can copy straight out
    of them (a CUDA mover that takes uploads and checks pages on the device, against their
    signed BLAKE3 digests where the reader has them, or a reader that checks nothing), and the
    caller did not turn the tier off (``StagingOptions.hot``)."""
    wish = staging.hot if staging is not None else None
    bound = reader.page_digest_table is not None
    checks = mover.checks_page_digests if bound else mover.hashes_pages
    if wish is False or not mover.takes_uploads or not (checks or not reader.verifies):
        return None
    return lease_hot_files(reader, admit=wish is True)
