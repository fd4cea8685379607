"""What a capture or restore is asked to do, checked; and what it did."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvsnap.errors import IncompatibleSnapshotError, LayoutError, UnknownSequenceError
from kvsnap.format import SequenceRecord
from kvsnap.layout import CacheLayout, KVGeometry


@dataclass(frozen=True)
class SequenceBlocks:
    """One sequence in an engine cache: its tokens and the device blocks holding their KV.

    ``block_ids[i]`` holds tokens ``i*block_size .. (i+1)*block_size``; the last block may be
    partial. The ids are the same on every TP rank (engines share one block table).
    """

    id: str
    token_ids: np.ndarray
    block_ids: np.ndarray


@dataclass(frozen=True)
class CaptureResult:
    """What a capture wrote."""

    path: str
    num_sequences: int
    num_tokens: int
    num_blocks: int
    num_bytes: int
    seconds: float
    backend: str
    direct_io_fallback: str | None
    #: xxh3-128 (hex) of the file's checksum trailer when the capture wrote one file (a plain
    #: snapshot or one part of a parted snapshot: what the parted index records), else None.
    trailer_digest: str | None = None
    #: How the pages reached the file: ``"dma"``, copied by the device straight into the
    #: file's registered mapping (a CUDA cache captured to a memory-backed file), or
    #: ``"write"``, through pinned staging and ``pwrite``.
    data_path: str = "write"
    #: Why the pages were not copied straight into the file (``None`` when they were).
    dma_refused: str | None = None


@dataclass(frozen=True)
class RestoreResult:
    """What a restore wrote into the target cache."""

    num_sequences: int
    num_tokens: int
    num_blocks: int
    num_bytes: int
    seconds: float
    backend: str


def as_layouts(layout: CacheLayout | Sequence[CacheLayout]) -> list[CacheLayout]:
    """One layout, or one per TP rank held by this process, as a list (at least one)."""
    layouts = [layout] if isinstance(layout, CacheLayout) else list(layout)
    if not layouts:
        raise ValueError("need at least one cache layout")
    return layouts


def common_geometry(layouts: Sequence[CacheLayout]) -> KVGeometry:
    """The geometry every rank's layout shares; ``LayoutError`` (the caller's layouts do not
    describe one model's cache) otherwise."""
    geometry = layouts[0].geometry
    for layout in layouts[1:]:
        if layout.geometry != geometry:
            raise LayoutError(
                f"TP ranks disagree on the KV geometry: {geometry.describe()} vs "
                f"{layout.geometry.describe()}"
            )
    return geometry


def block_id_array(values: np.ndarray | Sequence[int], what: str) -> np.ndarray:
    """``values`` as a one-dimensional int64 array; ``ValueError`` for anything but integers
    (a float id is refused, never silently truncated)."""
    array = np.asarray(values)
    if array.size == 0:
        return np.empty(0, dtype=np.int64)
    # numpy's integer kinds ("m": timedelta64 counts as a signed integer in its hierarchy),
    # bool excluded: the verdict of np.issubdtype(dtype, np.integer), without its calls.
    if array.ndim != 1 or array.dtype.kind not in "ium":
        raise ValueError(
            f"{what} must be a one-dimensional sequence of integers, got {array.dtype}"
        )
    return array.astype(np.int64, copy=False)


def validate_sequences(block_size: int, sequences: Sequence[SequenceBlocks], capacity: int) -> None:
    """The rule every sequence list obeys: unique ids, at least one token, and exactly
    ``ceil(tokens / block_size)`` integer block ids, each a block of the cache (``capacity``
    blocks: a copy reads where an id points). ``ValueError`` naming the first breach."""
    if not sequences:
        raise ValueError("capture needs at least one sequence")
    seen: set[str] = set()
    for sequence in sequences:
        if sequence.id in seen:
            raise ValueError(f"sequence id {sequence.id!r} appears twice")
        seen.add(sequence.id)
        if len(sequence.token_ids) == 0:
            raise ValueError(f"sequence {sequence.id!r} has no tokens")
        needed = math.ceil(len(sequence.token_ids) / block_size)
        block_ids = block_id_array(sequence.block_ids, f"sequence {sequence.id!r}: block ids")
        if len(block_ids) != needed:
            raise ValueError(
                f"sequence {sequence.id!r}: {len(sequence.token_ids)} tokens need {needed} blocks "
                f"of {block_size}, got {len(block_ids)} block ids"
            )
        outside = np.flatnonzero((block_ids < 0) | (block_ids >= capacity))
        if len(outside):
            raise ValueError(
                f"sequence {sequence.id!r}: block id {int(block_ids[outside[0]])} is outside "
                f"the cache's {capacity} blocks"
            )


def restore_pairs(
    records: Sequence[SequenceRecord],
    block_ids: Mapping[str, np.ndarray | Sequence[int]],
    capacity: int,
    path: str,
) -> tuple[np.ndarray, np.ndarray, int]:
    """(snapshot block, target block) pairs sorted by snapshot block, and the token count, for
    restoring the sequences named in ``block_ids`` into a cache of ``capacity`` blocks.

    Raises ``UnknownSequenceError`` for an unknown sequence id, and
    ``IncompatibleSnapshotError`` for a wrong number of block ids, ids outside the cache, or
    one target block receiving two snapshot blocks.
    """
    if not block_ids:
        raise ValueError("restore needs at least one sequence")
    by_id = {record.id: record for record in records}
    sources, targets = [], []
    num_tokens = 0
    for sequence_id, targets_of_sequence in block_ids.items():
        record = by_id.get(sequence_id)
        if record is None:
            raise UnknownSequenceError(sequence_id, by_id, file=path)
        target = block_id_array(targets_of_sequence, f"sequence {sequence_id!r}: target block ids")
        if len(target) != len(record.block_ids):
            raise IncompatibleSnapshotError(
                f"sequence {sequence_id!r} has {len(record.block_ids)} blocks in {path}, "
                f"the target gave {len(target)} block ids"
            )
        if len(target) and (target.min() < 0 or target.max() >= capacity):
            raise IncompatibleSnapshotError(
                f"sequence {sequence_id!r}: target block ids {target.min()}..{target.max()} "
                f"do not fit a cache of {capacity} blocks"
            )
        sources.append(record.block_ids)
        targets.append(target)
        num_tokens += len(record.token_ids)
    source_blocks, target_blocks = block_pairs(
        np.concatenate(sources), np.concatenate(targets), np.iinfo(np.int64).max, capacity
    )
    return source_blocks, target_blocks, num_tokens


def block_pairs(
    snapshot_blocks: np.ndarray | Sequence[int],
    target_blocks: np.ndarray | Sequence[int],
    num_snapshot_blocks: int,
    capacity: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Snapshot blocks and their target blocks, checked (``ValueError`` for non-integers,
    :class:`IncompatibleSnapshotError` for unequal counts, ids out of range, or one target
    block receiving two snapshot blocks) and sorted by snapshot block."""
    sources = block_id_array(snapshot_blocks, "snapshot block ids")
    targets = block_id_array(target_blocks, "target block ids")
    if len(sources) != len(targets):
        raise IncompatibleSnapshotError(
            f"{len(sources)} snapshot blocks but {len(targets)} target block ids"
        )
    if len(sources) and (sources.min() < 0 or sources.max() >= num_snapshot_blocks):
        raise IncompatibleSnapshotError(
            f"snapshot block ids {sources.min()}..{sources.max()} are outside the snapshot's "
            f"{num_snapshot_blocks} blocks"
        )
    if len(targets) and (targets.min() < 0 or targets.max() >= capacity):
        raise IncompatibleSnapshotError(
            f"target block ids {targets.min()}..{targets.max()} do not fit a cache of "
            f"{capacity} blocks"
        )
    sources, targets = _sorted_distinct_pairs(sources, targets)
    if len(targets) > 1:
        ordered = np.sort(targets)
        repeated = ordered[1:] == ordered[:-1]
        if repeated.any():
            block = int(ordered[1:][repeated][0])
            raise IncompatibleSnapshotError(
                f"target block {block} would receive two different snapshot blocks"
            )
    return sources, targets


def _sorted_distinct_pairs(sources: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, ...]:
    """The distinct ``(source, target)`` pairs sorted by source, then target, as two new
    arrays. Pairs already in strictly ascending source order (a sequence's blocks, as every
    restore passes them) are only copied: ``np.unique(..., axis=0)`` took ~0.2 ms for one pair."""
    if len(sources) < 2 or bool((sources[1:] > sources[:-1]).all()):
        return sources.copy(), targets.copy()
    order = np.lexsort((targets, sources))
    sources, targets = sources[order], targets[order]
    distinct = np.ones(len(sources), dtype=bool)
    np.logical_or(sources[1:] != sources[:-1], targets[1:] != targets[:-1], out=distinct[1:])
    return sources[distinct], targets[distinct]
