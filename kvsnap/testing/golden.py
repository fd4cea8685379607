"""Golden KV snapshots: turn a KV cache into a snapshot, compare it with a golden one, (re)write it.

This is the machinery behind :func:`kvsnap.testing.assert_kv_matches` (the pytest plugin only
finds the golden file and turns results into test failures); it is usable without pytest
through :func:`check_golden`.

Every input (a transformers ``DynamicCache``, a kvsnap snapshot or its path, a mapping of
tensors) becomes a list of sequences with per-token KV (:class:`~kvsnap.testing.kv_inputs.KVData`,
made by :func:`~kvsnap.testing.kv_inputs.kv_data`).

Golden files are written with :func:`kvsnap.snapshot.capture` (``reproducible=True``, CPU
backend) from a flat paged cache holding the sequences back to back, so a golden file is a
snapshot whose bytes depend only on the KV, the token ids, the block size and how it is stored:
``compression="none"`` (an ordinary snapshot) or ``"lossless"`` (an encoded snapshot,
docs/format.md "Encoded snapshots": smaller, and decoded bit for bit before any comparison, so
the comparison stays exact). Comparison is :meth:`kvsnap.snapshot.Snapshot.compare` (token by
token) after a structural check that :meth:`~kvsnap.snapshot.Snapshot.compare` does not make:
the same sequence ids, in the same order, with the same token counts.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvsnap import format as fmt
from kvsnap._version import __version__
from kvsnap.encoded.summary import file_encoding
from kvsnap.errors import KVSnapError
from kvsnap.layout import KEY, VALUE, canonical_name, flat_paged_layout, mla_layout
from kvsnap.snapshot import CaptureResult, SequenceBlocks, Snapshot, capture
from kvsnap.testing.kv_inputs import KVData, KVSequenceData, kv_data

#: Block size of golden files when neither the caller, an existing golden file nor the input says.
DEFAULT_GOLDEN_BLOCK_SIZE = 16
#: ``source.engine`` of golden snapshots written by this module.
GOLDEN_ENGINE = "kvsnap-golden"

#: How golden files may be stored: exact encodings only (an fp8 golden file would compare the
#: KV with its own rounding).
GOLDEN_COMPRESSIONS = ("none", "lossless")

#: The public names (``KVData``, ``KVSequenceData`` and ``kv_data`` from ``kv_inputs``).
__all__ = [
    "DEFAULT_GOLDEN_BLOCK_SIZE",
    "GOLDEN_COMPRESSIONS",
    "GOLDEN_ENGINE",
    "GoldenResult",
    "KVData",
    "KVSequenceData",
    "check_compression",
    "check_golden",
    "compare_files",
    "kv_data",
    "stored_compression",
    "write_kv_snapshot",
]


@dataclass(frozen=True)
class GoldenResult:
    """What :func:`check_golden` did.

    ``status`` is ``"matched"`` (golden present and equal within tolerance), ``"mismatch"``
    (golden present and different; ``report`` says how), ``"missing"`` (golden absent and
    written now, no update requested), ``"created"`` or ``"updated"`` (written on request).
    """

    status: str
    path: Path
    report: str = ""

    @property
    def written(self) -> bool:
        return self.status in ("missing", "created", "updated")

    @property
    def passed(self) -> bool:
        return self.status in ("matched", "created", "updated")


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def _check_shared_blocks(data: KVData, block_size: int) -> None:
    """Refuse KV that the snapshot's prefix dedupe would silently merge.

    A snapshot stores blocks with the same token prefix once; if two sequences share a block's
    token prefix but hold different KV for it, the golden file would keep only the first one's.
    """
    owners: dict[str, tuple[int, int]] = {}
    for index, sequence in enumerate(data.sequences):
        for position, digest in enumerate(fmt.prefix_hash_chain(sequence.token_ids, block_size)):
            if digest not in owners:
                owners[digest] = (index, position)
                continue
            other_index, other_position = owners[digest]
            other = data.sequences[other_index]
            tokens = slice(position * block_size, (position + 1) * block_size)
            other_tokens = slice(other_position * block_size, (other_position + 1) * block_size)
            for name in data.names:
                if not _bytes_equal(
                    sequence.tensors[name][tokens], other.tensors[name][other_tokens]
                ):
                    raise ValueError(
                        f"sequences {other.id} and {sequence.id} have the same token ids up to "
                        f"token {tokens.stop} but different KV there ({name}): a snapshot stores "
                        "that block once, so pass distinct token_ids or compare them separately"
                    )


# --------------------------------------------------------------------------------------------
# Writing and comparing


def check_compression(compression: str | None) -> None:
    """Refuse (``ValueError``) a golden file's ``compression`` that is not one of
    :data:`GOLDEN_COMPRESSIONS` (or ``None``, where that means "as the golden file is")."""
    if compression is not None and compression not in GOLDEN_COMPRESSIONS:
        raise ValueError(
            f"golden compression {compression!r}: one of {', '.join(GOLDEN_COMPRESSIONS)} "
            "(a golden comparison is exact, so its file is stored bit-exactly)"
        )


def write_kv_snapshot(
    data: KVData,
    path: str | Path,
    *,
    block_size: int,
    name: str = "golden",
    compression: str = "none",
) -> CaptureResult:
    """Write ``data`` as a reproducible snapshot at ``path`` (atomically), ``block_size`` per block,
    stored as ``compression`` (``"none"`` or ``"lossless"``).

    The sequences are laid out back to back in a flat paged cache (MLA: an MLA cache) and
    captured with the CPU backend; the last block of each sequence is zero-padded.
    """
    check_compression(compression)
    _check_shared_blocks(data, block_size)
    blocks_per_sequence = [-(-len(sequence.token_ids) // block_size) for sequence in data.sequences]
    num_blocks = sum(blocks_per_sequence)
    starts = np.cumsum([0, *blocks_per_sequence[:-1]])
    rows = num_blocks * block_size
    storage = {
        tensor: torch.zeros((rows, *data.page_shape), dtype=data.dtype) for tensor in data.names
    }
    for sequence, start in zip(data.sequences, starts, strict=True):
        first_row = int(start) * block_size
        rows_of_sequence = slice(first_row, first_row + len(sequence.token_ids))
        for tensor in data.names:
            storage[tensor][rows_of_sequence] = sequence.tensors[tensor]
    if data.is_mla:
        caches = [storage[tensor].view(num_blocks, block_size, -1) for tensor in data.names]
        layout = mla_layout(caches, attention_types=data.attention_types)
    else:
        keys = [storage[canonical_name(layer, KEY)] for layer in range(data.num_layers)]
        values = [storage[canonical_name(layer, VALUE)] for layer in range(data.num_layers)]
        layout = flat_paged_layout(
            keys, values, block_size=block_size, attention_types=data.attention_types
        )
    sequences = [
        SequenceBlocks(
            id=sequence.id,
            token_ids=sequence.token_ids,
            block_ids=np.arange(start, start + count, dtype=np.int64),
        )
        for sequence, start, count in zip(data.sequences, starts, blocks_per_sequence, strict=True)
    ]
    source = fmt.SourceInfo(
        engine=GOLDEN_ENGINE,
        engine_version=".".join(__version__.split(".")[:2]),
        model_id=name,
        model_revision=None,
        model_fingerprint="",
    )
    return capture(
        layout,
        sequences,
        path,
        source=source,
        reproducible=True,
        compression=compression,
    )


def _structure_problems(actual: Snapshot, golden: Snapshot) -> list[str]:
    mine = [(record.id, record.num_tokens) for record in actual.sequences]
    theirs = [(record.id, record.num_tokens) for record in golden.sequences]
    if mine == theirs:
        return []
    return [
        "sequences differ: actual "
        + ", ".join(f"{sid} ({count} tokens)" for sid, count in mine)
        + "; golden "
        + ", ".join(f"{sid} ({count} tokens)" for sid, count in theirs)
    ]


def compare_files(
    actual_path: str | Path, golden_path: str | Path, *, atol: float, rtol: float
) -> tuple[bool, str]:
    """Compare two snapshots as ``kvsnap verify ACTUAL --against GOLDEN`` does, plus the structure.

    Returns ``(ok, report)``; ``report`` is :meth:`~kvsnap.snapshot.Comparison.report` preceded
    by any difference in sequence ids, order or token counts (which ``compare`` alone ignores),
    and followed, with no tolerance, by the first element whose bits differ where the values
    compare equal (:func:`_first_bit_difference`).
    """
    with Snapshot.open(actual_path) as actual, Snapshot.open(golden_path) as golden:
        problems = [f"{golden_path}: {problem.message}" for problem in golden.verify()]
        if problems:
            return False, "\n".join(problems)
        comparison = actual.compare(golden, atol=atol, rtol=rtol)
        # compare() names differing ids, counts and lengths itself; the order is ours to check.
        structure = [] if comparison.problems else _structure_problems(actual, golden)
        exact = comparison.ok and not structure and atol == 0 and rtol == 0
        bits = _first_bit_difference(actual, golden) if exact else None
    report = "\n".join([*structure, comparison.report(), *([bits] if bits else [])])
    return comparison.ok and not structure and bits is None, report


#: Integer views of each element size, to compare bits.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _first_bit_difference(actual: Snapshot, golden: Snapshot) -> str | None:
    """Where two snapshots of one dtype whose values compare equal still differ in their
    bits, which a comparison of values cannot see: a zero's sign (``-0.0 == 0.0``) or a NaN's
    payload. ``None`` when they are bit-identical (or of different dtypes: then values are
    what can be compared)."""
    if actual.geometry.dtype != golden.geometry.dtype:
        return None
    for record in actual.sequences:
        for name in actual.geometry.tensor_names():
            mine = actual.sequence_kv(record.id, name).contiguous()
            theirs = golden.sequence_kv(record.id, name).contiguous()
            width = _BITS[mine.element_size()]
            differ = (mine.view(width) != theirs.view(width)).nonzero()
            if len(differ):
                where = differ[0].tolist()
                # (token, head, channel); an MLA latent (token, channel)
                axes = ("token", "head", "channel") if len(where) == 3 else ("token", "channel")
                place = ", ".join(f"{axis} {at}" for axis, at in zip(axes, where, strict=True))
                got, want = (int(t.view(width)[tuple(where)]) for t in (mine, theirs))
                mask = (1 << (8 * mine.element_size())) - 1
                return (
                    f"bits differ where the values compare equal (a zero's sign or a NaN's "
                    f"payload): {name}, sequence {record.id}, {place}: "
                    f"{got & mask:#x} vs {want & mask:#x}"
                )
    return None


def stored_compression(path: str | Path) -> str:
    """How the golden file at ``path`` is stored: ``"lossless"`` for a lossless encoded
    snapshot, else ``"none"`` (an ordinary snapshot, or a file that is neither)."""
    encoding, _ = file_encoding(str(path))
    return "lossless" if encoding == "lossless" else "none"


def check_golden(
    cache_or_tensors: object,
    path: str | Path,
    *,
    update: bool = False,
    atol: float = 0.0,
    rtol: float = 0.0,
    block_size: int | None = None,
    token_ids: Any = None,
    compression: str | None = None,
) -> GoldenResult:
    """Compare KV with the golden snapshot at ``path``; write it when missing or when ``update``.

    Without ``update``: a present golden file is compared (``"matched"`` or ``"mismatch"``
    with the report); a missing one is written and reported as ``"missing"``. With ``update``:
    a missing golden file is written (``"created"``), a different one rewritten
    (``"updated"``), an equal one left untouched (``"matched"``) unless ``compression`` names
    another way to store it than it has (then it is rewritten so: ``"updated"``).
    ``block_size`` defaults to the existing golden file's, else the input snapshot's, else
    :data:`DEFAULT_GOLDEN_BLOCK_SIZE`. ``compression`` (one of :data:`GOLDEN_COMPRESSIONS`)
    is how a golden file written now is stored; it defaults to the existing golden file's,
    else ``"none"``. The comparison is the same either way: a lossless golden file is decoded
    bit for bit first.
    """
    check_compression(compression)
    path = Path(path)
    data = kv_data(cache_or_tensors, token_ids=token_ids)
    exists = path.exists()
    if block_size is None and exists:
        # An unreadable golden file is reported (or replaced) below.
        with contextlib.suppress(KVSnapError), Snapshot.open(path, verify=False) as golden:
            block_size = golden.geometry.block_size
    block_size = block_size or data.block_size or DEFAULT_GOLDEN_BLOCK_SIZE
    stored = stored_compression(path) if exists else None
    write_as = compression or stored or "none"
    if not exists:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_kv_snapshot(data, path, block_size=block_size, name=path.stem, compression=write_as)
        return GoldenResult("created" if update else "missing", path)
    with tempfile.TemporaryDirectory(prefix="kvsnap-golden-") as scratch:
        actual_path = Path(scratch) / path.name
        write_kv_snapshot(data, actual_path, block_size=block_size, name=path.stem)
        try:
            ok, report = compare_files(actual_path, path, atol=atol, rtol=rtol)
        except KVSnapError as error:
            ok, report = False, f"the golden snapshot cannot be read: {error}"
        # This run's snapshot is a temporary file, gone once the report is read: name it so.
        report = report.replace(str(actual_path), "this run's KV")
    if ok and not (update and write_as != stored):
        return GoldenResult("matched", path, report)
    if not update:
        return GoldenResult("mismatch", path, report)
    if ok:
        report = f"{report}\nstored as {stored}, rewritten as {write_as}"
    # capture publishes atomically in the golden file's own directory.
    write_kv_snapshot(data, path, block_size=block_size, name=path.stem, compression=write_as)
    return GoldenResult("updated", path, report)
