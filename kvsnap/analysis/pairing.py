"""Before any KV is read: whether two snapshots compare at all (their KV geometry), how their
origins differ (model fingerprint, engine, dtype, block size), and which sequence of one is
compared with which of the other, every structural difference stated once."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvsnap import format as fmt
from kvsnap.analysis.comparison import SourceDifference
from kvsnap.analysis.readable import ReadableSnapshot
from kvsnap.analysis.values import compute_dtype

#: The KV geometry fields two snapshots must share to be compared element by element; the
#: dtype and the block size may differ (values are compared token by token, in a dtype that
#: holds both exactly).
GEOMETRY_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "latent_dim")

SequencePair = tuple[fmt.SequenceRecord, fmt.SequenceRecord]


def geometry_problem(a: ReadableSnapshot, b: ReadableSnapshot) -> fmt.Problem | None:
    """The one problem of two snapshots whose KV shapes differ (nothing can be compared)."""
    differences = [
        f"{name}: {getattr(a.geometry, name)!r} vs {getattr(b.geometry, name)!r}"
        for name in GEOMETRY_FIELDS
        if getattr(a.geometry, name) != getattr(b.geometry, name)
    ]
    if not differences:
        return None
    return fmt.Problem(
        None,
        None,
        f"the snapshots differ in KV geometry ({'; '.join(differences)}): "
        f"{a.path} is {a.geometry.describe()}, {b.path} is {b.geometry.describe()}; only KV of "
        "the same shape compares (capture both from the same model: the dtype and the block "
        "size may differ, the layers, KV heads and head size may not)",
    )


def source_differences(a: ReadableSnapshot, b: ReadableSnapshot) -> list[SourceDifference]:
    """How the two snapshots' origins differ: model id and fingerprint, engine and its
    version, KV dtype and block size (an empty fingerprint reads "not recorded")."""
    first, second = a.metadata.source, b.metadata.source
    fields = [
        ("model", first.model_id, second.model_id),
        (
            "model fingerprint",
            first.model_fingerprint or "not recorded",
            second.model_fingerprint or "not recorded",
        ),
        (
            "engine",
            f"{first.engine} {first.engine_version}",
            f"{second.engine} {second.engine_version}",
        ),
        ("dtype", a.geometry.dtype, b.geometry.dtype),
        ("block size", str(a.geometry.block_size), str(b.geometry.block_size)),
    ]
    return [SourceDifference(name, mine, theirs) for name, mine, theirs in fields if mine != theirs]


def layout_notes(a: ReadableSnapshot, b: ReadableSnapshot, atol: float, rtol: float) -> list[str]:
    """How values are compared where the two snapshots' layouts differ without preventing the
    comparison. The difference itself is one of :func:`source_differences` (stated once)."""
    notes = []
    first, second = a.geometry.dtype, b.geometry.dtype
    if first != second:
        common = compute_dtype(first, second).name
        tolerance = (
            f"within atol {atol:g}, rtol {rtol:g}"
            if atol or rtol
            else "exactly (give a tolerance, atol or rtol, to allow the narrower dtype's rounding)"
        )
        notes.append(f"values of the two dtypes compared in {common}, {tolerance}")
    if a.geometry.block_size != b.geometry.block_size:
        notes.append("values of the two block sizes compared token by token")
    return notes


def pair_sequences(
    a: ReadableSnapshot, b: ReadableSnapshot
) -> tuple[list[SequencePair], list[fmt.Problem], list[str]]:
    """Pair ``a``'s sequences with ``b``'s (by id; by position when no id is in both); list
    every structural difference once, and notes."""
    mine, theirs = a.sequences, b.sequences
    problems: list[fmt.Problem] = []
    notes: list[str] = []

    def problem(message: str) -> None:
        problems.append(fmt.Problem(None, None, message))

    if len(mine) != len(theirs):
        problem(f"{a.path} holds {len(mine)} sequence(s), {b.path} holds {len(theirs)}")
    by_id = {record.id: record for record in theirs}
    pairs = [(record, by_id[record.id]) for record in mine if record.id in by_id]
    if pairs:
        mine_ids = {record.id for record in mine}
        for record in mine:
            if record.id not in by_id:
                problem(f"sequence {record.id!r} is only in {a.path}")
        for record in theirs:
            if record.id not in mine_ids:
                problem(f"sequence {record.id!r} is only in {b.path}")
    else:
        pairs = list(zip(mine, theirs, strict=False))
        if pairs:
            notes.append(
                f"no sequence id is in both snapshots ({_ids(mine)} vs {_ids(theirs)}): "
                "sequences compared by position"
            )
    for one, other in pairs:
        problems += _sequence_problems(a, one, b, other)
    return pairs, problems, notes


def pair_name(pair: SequencePair) -> str:
    """How a pair is named: the shared id, or ``a-id/b-id`` when paired by position."""
    one, other = pair
    return one.id if one.id == other.id else f"{one.id}/{other.id}"


def _ids(records: Sequence[fmt.SequenceRecord]) -> str:
    shown = ", ".join(repr(record.id) for record in records[:4])
    return shown + (f" and {len(records) - 4} more" if len(records) > 4 else "")


def _sequence_problems(
    a: ReadableSnapshot, one: fmt.SequenceRecord, b: ReadableSnapshot, other: fmt.SequenceRecord
) -> list[fmt.Problem]:
    name = repr(one.id) if one.id == other.id else f"{one.id!r} / {other.id!r}"
    problems = []
    count = min(len(one.token_ids), len(other.token_ids))
    if len(one.token_ids) != len(other.token_ids):
        problems.append(
            fmt.Problem(
                None,
                None,
                f"sequence {name}: {len(one.token_ids)} tokens in {a.path}, "
                f"{len(other.token_ids)} in {b.path} (only the first {count} compared)",
            )
        )
    if not np.array_equal(one.token_ids[:count], other.token_ids[:count]):
        first = int(np.flatnonzero(one.token_ids[:count] != other.token_ids[:count])[0])
        problems.append(
            fmt.Problem(None, None, f"sequence {name}: token ids differ from token {first}")
        )
    return problems
