"""Read-only analysis of snapshots: compare two, per-tensor statistics, per-token norms.

Nothing here writes or restores anything; every function reads through the
:class:`~kvsnap.snapshot.Snapshot` it is given (checksums verified by the reader), and the
``Snapshot`` methods of the same names delegate here. What they read of it is
:class:`ReadableSnapshot`, so this module needs nothing of the facade.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from kvsnap import format as fmt
from kvsnap.layout import KVGeometry


class ReadableSnapshot(Protocol):
    """What the analysis reads of a snapshot (a :class:`~kvsnap.snapshot.Snapshot` is one):
    its path, geometry and sequences, and its KV, whole or per sequence."""

    @property
    def path(self) -> str: ...

    @property
    def geometry(self) -> KVGeometry: ...

    @property
    def sequences(self) -> list[fmt.SequenceRecord]: ...

    @property
    def num_blocks(self) -> int: ...

    def sequence(self, sequence_id: str) -> fmt.SequenceRecord: ...

    def read_tensor(self, name: str) -> torch.Tensor: ...

    def sequence_kv(self, sequence_id: str, name: str) -> torch.Tensor: ...


#: The KV geometry fields two snapshots must share to be compared element by element; the
#: dtype and the block size may differ (values are compared token by token, in a dtype that
#: holds both exactly).
_GEOMETRY_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "latent_dim")


@dataclass(frozen=True)
class LayerDifference:
    """One tensor's comparison between two snapshots, over the tokens both hold."""

    tensor: str
    max_abs_diff: float
    num_mismatches: int
    first_mismatch: dict[str, object] | None  # {"sequence", "token", "head"} of the first one


@dataclass(frozen=True)
class Comparison:
    """The result of :func:`compare`: ``ok`` when the snapshots hold the same sequences (ids,
    token ids, lengths) and every compared element is close.

    ``problems`` are the structural differences, each stated once; ``layers`` the numerical
    comparison per tensor; ``notes`` what is worth knowing without being a difference.
    """

    ok: bool
    layers: list[LayerDifference]
    problems: list[fmt.Problem] = field(default_factory=list)
    #: What the reader should know that is not a difference (sequences paired by position).
    notes: list[str] = field(default_factory=list)

    def first_mismatch(self) -> LayerDifference | None:
        """The first tensor (in snapshot order) with a mismatching element, or ``None``."""
        return next((layer for layer in self.layers if layer.num_mismatches), None)

    def layer_lines(self) -> list[str]:
        """Per tensor the largest difference and the mismatch count, then the first mismatch."""
        lines = []
        for layer in self.layers:
            flag = "MISMATCH" if layer.num_mismatches else "ok"
            lines.append(
                f"{layer.tensor:<24} max |diff| {layer.max_abs_diff:.6g}  "
                f"mismatches {layer.num_mismatches}  {flag}"
            )
        first = self.first_mismatch()
        if first is not None and first.first_mismatch is not None:
            where = first.first_mismatch
            lines.append(
                f"first mismatch: {first.tensor}, sequence {where['sequence']}, "
                f"token {where['token']}, head {where['head']}"
            )
        return lines

    def report(self) -> str:
        """A readable summary: the notes, the structural problems, then :meth:`layer_lines`."""
        problems = [problem.message for problem in self.problems]
        return "\n".join([*self.notes, *problems, *self.layer_lines()])


def compare(
    a: ReadableSnapshot, b: ReadableSnapshot, *, atol: float = 0.0, rtol: float = 0.0
) -> Comparison:
    """Compare snapshot ``a``'s KV with reference ``b``.

    The layers, KV heads and head size (or MLA latent width) must match (otherwise the only
    problem names the differing fields and how to fix it, and nothing is read); the dtype and
    the block size may differ. Sequences are paired by id; when no id matches (two engines
    name their requests differently) they are paired by position, which a note says. Every
    sequence only in one snapshot, a different count, length or token ids is one problem.
    Paired sequences are compared token by token over the tokens both hold, whatever the
    block sizes, in :func:`comparison_dtype` of the two dtypes (a note names the dtypes when
    they differ): an element mismatches when ``|a - b| > atol + rtol * |b|`` or exactly one of
    them is NaN.
    """
    geometry_problem = _geometry_problem(a, b)
    if geometry_problem is not None:
        return Comparison(False, [], [geometry_problem])
    pairs, problems, notes = _pair_sequences(a, b)
    notes = _layout_notes(a, b, atol, rtol) + notes
    if not pairs:
        problems.append(fmt.Problem(None, None, "the snapshots share no sequence"))
        return Comparison(False, [], problems, notes)
    dtype = comparison_dtype(a.geometry.dtype, b.geometry.dtype)
    layers = [
        _compare_tensor(a, b, name, pairs, atol, rtol, dtype) for name in a.geometry.tensor_names()
    ]
    ok = not problems and all(layer.num_mismatches == 0 for layer in layers)
    return Comparison(ok, layers, problems, notes)


def _geometry_problem(a: ReadableSnapshot, b: ReadableSnapshot) -> fmt.Problem | None:
    differences = [
        f"{name}: {getattr(a.geometry, name)!r} vs {getattr(b.geometry, name)!r}"
        for name in _GEOMETRY_FIELDS
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


def comparison_dtype(first: str, second: str) -> torch.dtype:
    """The dtype two snapshots' KV is compared in: float64 when either is float64, else
    float32, which holds every other KV dtype (bfloat16, float16, float8) exactly."""
    return torch.float64 if "float64" in (first, second) else torch.float32


def _layout_notes(a: ReadableSnapshot, b: ReadableSnapshot, atol: float, rtol: float) -> list[str]:
    """What differs between the two snapshots without preventing the comparison."""
    notes = []
    first, second = a.geometry.dtype, b.geometry.dtype
    if first != second:
        common = str(comparison_dtype(first, second)).removeprefix("torch.")
        tolerance = (
            f"within atol {atol:g}, rtol {rtol:g}"
            if atol or rtol
            else "exactly (give a tolerance, atol or rtol, to allow the narrower dtype's rounding)"
        )
        notes.append(
            f"dtypes differ ({a.path}: {first}, {b.path}: {second}): values compared in "
            f"{common}, {tolerance}"
        )
    if a.geometry.block_size != b.geometry.block_size:
        notes.append(
            f"block sizes differ ({a.geometry.block_size} vs {b.geometry.block_size} tokens): "
            "values compared token by token"
        )
    return notes


SequencePair = tuple[fmt.SequenceRecord, fmt.SequenceRecord]


def _pair_sequences(
    a: ReadableSnapshot, b: ReadableSnapshot
) -> tuple[list[SequencePair], list[fmt.Problem], list[str]]:
    """Pair ``a``'s sequences with ``b``'s; list every structural difference once, and notes."""
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


def _compare_tensor(
    a: ReadableSnapshot,
    b: ReadableSnapshot,
    name: str,
    pairs: Sequence[SequencePair],
    atol: float,
    rtol: float,
    dtype: torch.dtype,
) -> LayerDifference:
    max_diff = 0.0
    mismatches = 0
    first: dict[str, object] | None = None
    for mine, theirs in pairs:
        count = min(len(mine.token_ids), len(theirs.token_ids))
        if count == 0:
            continue
        left = a.sequence_kv(mine.id, name)[:count].to(dtype)
        right = b.sequence_kv(theirs.id, name)[:count].to(dtype)
        finite = torch.nan_to_num((left - right).abs(), nan=0.0, posinf=0.0)
        max_diff = max(max_diff, float(finite.max()))
        bad = ~torch.isclose(left, right, atol=atol, rtol=rtol, equal_nan=True)
        mismatches += int(bad.sum())
        if first is None and bad.any():
            index = torch.nonzero(bad)[0].tolist()
            head = index[1] if bad.dim() == 3 else 0
            first = {"sequence": mine.id, "token": index[0], "head": head}
    return LayerDifference(name, max_diff, mismatches, first)


def valid_tokens_per_block(snapshot: ReadableSnapshot) -> np.ndarray:
    """How many leading tokens of each snapshot block hold real KV (partial last blocks; a
    block no sequence references counts 0)."""
    valid = np.zeros(snapshot.num_blocks, dtype=np.int64)
    block_size = snapshot.geometry.block_size
    for record in snapshot.sequences:
        if len(record.block_ids) == 0:  # a sequence without tokens holds no block
            continue
        counts = np.full(len(record.block_ids), block_size, dtype=np.int64)
        counts[-1] = len(record.token_ids) - block_size * (len(record.block_ids) - 1)
        np.maximum.at(valid, np.asarray(record.block_ids, dtype=np.int64), counts)
    return valid


def tensor_stats(snapshot: ReadableSnapshot, name: str) -> dict[str, float | int]:
    """absmax, mean, std (population), NaN and Inf counts of tensor ``name`` over the tokens
    that hold real KV; all zero when there is no such token."""
    valid = valid_tokens_per_block(snapshot)
    if not valid.any():
        return {"absmax": 0.0, "mean": 0.0, "std": 0.0, "nan": 0, "inf": 0}
    tensor = snapshot.read_tensor(name)
    block_size = snapshot.geometry.block_size
    mask = torch.from_numpy(np.arange(block_size)[None, :] < valid[:, None])
    values = tensor[mask].double()
    finite = values[torch.isfinite(values)]
    return {
        "absmax": float(finite.abs().max()) if finite.numel() else 0.0,
        "mean": float(finite.mean()) if finite.numel() else 0.0,
        "std": float(finite.std(unbiased=False)) if finite.numel() else 0.0,
        "nan": int(torch.isnan(values).sum()),
        "inf": int(torch.isinf(values).sum()),
    }


def token_norms(snapshot: ReadableSnapshot, sequence_id: str) -> dict[str, np.ndarray]:
    """Per part (``key``/``value`` or ``latent``), a float32 ``(num_layers, num_tokens)`` array
    of the L2 norm of each token's KV in each layer (``num_tokens`` may be 0)."""
    geometry = snapshot.geometry
    record = snapshot.sequence(sequence_id)
    if len(record.token_ids) == 0:
        empty = np.zeros((geometry.num_layers, 0), dtype=np.float32)
        return {part: empty.copy() for part in geometry.parts}
    norms: dict[str, list[np.ndarray]] = {part: [] for part in geometry.parts}
    for layer in range(geometry.num_layers):
        for part in geometry.parts:
            kv = snapshot.sequence_kv(sequence_id, f"layers.{layer}.{part}").float()
            norms[part].append(kv.reshape(kv.shape[0], -1).norm(dim=1).numpy())
    return {part: np.stack(rows) for part, rows in norms.items()}
