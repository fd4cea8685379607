"""A restore as jobs over head-range parts: which pipeline moves which part, and what failed.

A restore names one snapshot (``Pipeline.restore``, ``restore_blocks``) or several
(``restore_chunks``: an engine loading a prompt's prefix stored as chunk files, each its own
snapshot). Every snapshot is a list of head-range parts (:mod:`kvsnap.store.read.head_parts`): one
part of every head for a single-file or sharded snapshot, one per file for a parted one. Each
part goes to the pipeline over the target ranks holding its heads (a part no rank holds is
never read), and all the parts one pipeline moves go through one staging loop
(:func:`~kvsnap.pipeline.restore.restore_slots` over several sources): restored one after the
other, every chunk paid the fixed cost of a job, and the last move of one chunk waited before
the next chunk's reads began. The pages that failed their checksum, in any part, are gathered
into one :class:`~kvsnap.errors.RestoreIncompleteError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol, TypeVar

import numpy as np

from kvsnap import format as fmt
from kvsnap.errors import RestoreIncompleteError
from kvsnap.pipeline.jobs import RestoreResult
from kvsnap.pipeline.restore import describe_failure, failed_target_blocks
from kvsnap.pipeline.restore_run import FailedPages
from kvsnap.store.read.head_parts import HeadPart


class RestorableSnapshot(Protocol):
    """What a restore reads of an open snapshot (a :class:`kvsnap.Snapshot`, or the store's
    :class:`~kvsnap.store.read.head_parts.OpenedSnapshot`): where it is, the whole snapshot's
    metadata, and its head-range parts."""

    @property
    def path(self) -> str: ...

    @property
    def metadata(self) -> fmt.SnapshotMetadata: ...

    @property
    def parts(self) -> Sequence[HeadPart]: ...


#: A checked restore of one snapshot: the snapshot and ``(snapshot blocks, target blocks)``.
Item = tuple[RestorableSnapshot, tuple[np.ndarray, np.ndarray]]
#: What moves parts: a pipeline (a type variable, so that this module needs none).
Mover = TypeVar("Mover")


class PartMove(NamedTuple):
    """One part of a checked restore: the part, ``(snapshot blocks, target blocks)``, the path
    of the snapshot it belongs to, and the file a failure of its pages names (the snapshot's
    path when it is its only part)."""

    part: HeadPart
    blocks: tuple[np.ndarray, np.ndarray]
    snapshot_path: str
    file: str


def moves_by_pipeline(
    items: Sequence[Item], pipeline_for: Callable[[HeadPart], Mover | None]
) -> list[tuple[Mover, list[PartMove]]]:
    """Every part of ``items`` with the pipeline ``pipeline_for`` gives it, grouped by pipeline
    in order of first use (a part it gives none is left out)."""
    jobs: dict[Mover, list[PartMove]] = {}
    for snapshot, blocks in items:
        parts = snapshot.parts
        for part in parts:
            moving = pipeline_for(part)
            if moving is None:
                continue
            file = snapshot.path if len(parts) == 1 else part.path
            move = PartMove(part, blocks, snapshot.path, file)
            moves = jobs.get(moving)
            if moves is None:
                jobs[moving] = [move]
            else:
                moves.append(move)
    return list(jobs.items())


def incomplete_restore(
    failures: Sequence[tuple[FailedPages, PartMove]],
    names: Sequence[str],
    result: RestoreResult,
) -> RestoreIncompleteError:
    """The error of a restore some of whose parts' pages failed (``failures``: their pages, in
    tensors ``names``): it names the first failing snapshot, describes each failing part
    (prefixed by its file where that is another), and lists every target block not (fully)
    restored. Raise it from the first failure's error."""
    file = failures[0][1].snapshot_path
    described = [
        ("" if move.file == file else f"{move.file}: ")
        + describe_failure(pages, names, move.blocks[1])
        for pages, move in failures
    ]
    failed = [failed_target_blocks(pages, move.blocks[1]) for pages, move in failures]
    return RestoreIncompleteError(
        "; ".join(described),
        file=file,
        failed_block_ids=np.unique(np.concatenate(failed)),
        result=result,
    )
