"""Several snapshots restored as one job: an engine loading a prompt's prefix stored as chunks.

Each chunk is its own snapshot file. Restored one after the other, every chunk paid the fixed
cost of a job and the last slot's move of one chunk waited before the next chunk's reads began;
here every chunk's slots go through one staging loop (:func:`~kvsnap.pipeline.restore.
restore_slots` over several sources), so the reads of a chunk overlap the moves of the one
before. :meth:`kvsnap.pipeline.Pipeline.restore_chunks` is the entry point.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvsnap.errors import RestoreIncompleteError
from kvsnap.pipeline.jobs import RestoreResult, block_pairs
from kvsnap.pipeline.options import StagingOptions
from kvsnap.pipeline.restore import FailedPages, describe_failure, failed_target_blocks
from kvsnap.store import TraceHook

if TYPE_CHECKING:
    from kvsnap.pipeline.pipeline import Pipeline
    from kvsnap.snapshot import Snapshot

#: A checked restore of one snapshot: the snapshot and ``(snapshot blocks, target blocks)``.
Item = tuple["Snapshot", tuple[np.ndarray, np.ndarray]]
#: One chunk as a caller names it: the snapshot, its blocks, and where they go.
Chunk = tuple["Snapshot", "np.ndarray | Sequence[int]", "np.ndarray | Sequence[int]"]


def restore_chunks(
    pipeline: Pipeline,
    chunks: Sequence[Chunk],
    staging: StagingOptions | None,
    model_fingerprint: str | None,
    force: bool,
    trace: TraceHook | None,
) -> RestoreResult:
    """What :meth:`~kvsnap.pipeline.Pipeline.restore_chunks` runs (see there)."""
    started = time.perf_counter()
    items: list[Item] = []
    for snapshot, snapshot_blocks, target_blocks in chunks:
        capacity = pipeline._checked_capacity(snapshot, model_fingerprint, force)
        pairs = block_pairs(snapshot_blocks, target_blocks, snapshot.num_blocks, capacity)
        items.append((snapshot, pairs))
    failures: list[tuple[FailedPages, Pipeline, np.ndarray, str]] = []
    moved_bytes, backend = 0, "none"
    for moving, group in jobs_by_pipeline(pipeline, items):
        failed, moved = moving._move_in(group, staging, None, trace)
        moved_bytes, backend = moved_bytes + moved.num_bytes, moved.backend
        for (snapshot, pairs), pages in zip(group, failed, strict=True):
            if len(pages.positions):
                failures.append((pages, moving, pairs[1], snapshot.path))
    num_blocks = sum(len(pairs[0]) for _, pairs in items)
    result = RestoreResult(0, 0, num_blocks, moved_bytes, time.perf_counter() - started, backend)
    if failures:
        pages, moving, targets, path = failures[0]
        raise RestoreIncompleteError(
            describe_failure(pages, moving.geometry.tensor_names(), targets),
            file=path,
            failed_block_ids=np.unique(
                np.concatenate([failed_target_blocks(f, t) for f, _, t, _ in failures])
            ),
            result=result,
        ) from pages.first_error
    return result


def jobs_by_pipeline(
    pipeline: Pipeline, items: Sequence[Item]
) -> list[tuple[Pipeline, list[Item]]]:
    """``items`` grouped by the pipeline that moves them: ``pipeline`` for single-file
    snapshots, its per-head-range pipelines for the parts of parted ones (a part no rank of
    ``pipeline`` holds is left out)."""
    from kvsnap.parted import PartedSnapshot

    groups: dict[int, tuple[Pipeline, list[Item]]] = {}
    for snapshot, pairs in items:
        if not isinstance(snapshot, PartedSnapshot):
            groups.setdefault(id(pipeline), (pipeline, []))[1].append((snapshot, pairs))
            continue
        for part, record in zip(snapshot.parts, snapshot.index.parts, strict=True):
            moving = pipeline._part_pipeline(record.first_head, record.num_heads)
            if moving is not None:
                groups.setdefault(id(moving), (moving, []))[1].append((part, pairs))
    return list(groups.values())
