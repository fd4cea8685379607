"""Golden KV snapshots: turn a KV cache into a snapshot, compare it with a golden one, (re)write it.

This is the machinery behind :func:`kvsnap.testing.assert_kv_matches` (the pytest plugin only
finds the golden file and turns results into test failures); it is usable without pytest
through :func:`check_golden`.

Every input becomes a list of sequences with per-token KV (:class:`KVData`):

* a transformers ``DynamicCache``: layer ``i``'s keys/values ``(batch, heads, seq, head_dim)``;
  each batch row is one sequence ``seq-{row}`` of ``seq`` tokens (padding included: the cache
  does not say which positions are padding);
* a kvsnap :class:`~kvsnap.snapshot.Snapshot`, or the path of one: its sequences and tokens;
* a mapping ``{"layers.{i}.key": (tokens, heads, head_dim), "layers.{i}.value": ...}`` (or
  ``"layers.{i}.latent": (tokens, latent_dim)``) of torch tensors or numpy arrays: one
  sequence ``seq-0``.

Golden files are written with :func:`kvsnap.snapshot.capture` (``reproducible=True``, CPU
backend) from a flat paged cache holding the sequences back to back, so a golden file is an
ordinary snapshot whose bytes depend only on the KV, the token ids and the block size.
Comparison is :meth:`kvsnap.snapshot.Snapshot.compare` (token by token) after a structural check
that :meth:`~kvsnap.snapshot.Snapshot.compare` does not make: the same sequence ids, in the same
order, with the same token counts.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvsnap import format as fmt
from kvsnap._version import __version__
from kvsnap.errors import KVSnapError
from kvsnap.layout import (
    KEY,
    LATENT,
    VALUE,
    canonical_name,
    dtype_name,
    flat_paged_layout,
    mla_layout,
)
from kvsnap.snapshot import CaptureResult, SequenceBlocks, Snapshot, capture

#: Block size of golden files when neither the caller, an existing golden file nor the input says.
DEFAULT_GOLDEN_BLOCK_SIZE = 16
#: ``source.engine`` of golden snapshots written by this module.
GOLDEN_ENGINE = "kvsnap-golden"

_TENSOR_NAME = re.compile(r"^layers\.(\d+)\.(key|value|latent)$")


@dataclass(frozen=True)
class KVSequenceData:
    """One sequence's token ids and per-token KV: ``tensors[name]`` is ``(num_tokens, ...)``."""

    id: str
    token_ids: np.ndarray
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True)
class KVData:
    """Sequences of per-token KV, ready to be written as a snapshot.

    ``names`` lists the canonical tensor names (``layers.{i}.{part}``) in snapshot order,
    ``attention_types`` the per-layer attention (``None``: kvsnap's default),
    ``block_size`` the input's own block size when it has one (a snapshot).
    """

    sequences: list[KVSequenceData]
    names: list[str]
    attention_types: tuple[str, ...] | None = None
    block_size: int | None = None

    @property
    def is_mla(self) -> bool:
        return self.names[0].endswith(f".{LATENT}")

    @property
    def num_layers(self) -> int:
        return len(self.names) if self.is_mla else len(self.names) // 2

    @property
    def page_shape(self) -> tuple[int, ...]:
        """Per-token shape: ``(heads, head_dim)`` or ``(latent_dim,)``."""
        return tuple(self.sequences[0].tensors[self.names[0]].shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.sequences[0].tensors[self.names[0]].dtype


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


# --------------------------------------------------------------------------------------------
# Inputs


def _as_tensor(value: Any, name: str) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(np.ascontiguousarray(value))
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name}: expected a torch tensor or numpy array, got {type(value).__name__}"
        )
    return value.detach().to("cpu").contiguous()


def _layer_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """``(keys, values, is_sliding)`` per layer of a transformers cache, duck-typed (no import)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        result = []
        for index, layer in enumerate(layers):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
                raise ValueError(
                    f"cache layer {index} holds no keys/values yet (run the model first)"
                )
            result.append((keys, values, bool(getattr(layer, "is_sliding", False))))
        return result
    key_cache, value_cache = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
    if key_cache is not None and value_cache is not None:
        return [(keys, values, False) for keys, values in zip(key_cache, value_cache, strict=True)]
    raise TypeError(
        f"{type(cache).__name__} is not a transformers cache (no .layers or .key_cache)"
    )


def _placeholder_token_ids(lengths: Sequence[int]) -> list[np.ndarray]:
    # Distinct across all sequences, so no two sequences share a prefix hash and nothing is
    # deduplicated: each sequence's KV is kept as given.
    starts = np.cumsum([0, *lengths[:-1]])
    return [
        np.arange(start, start + length, dtype=np.int64)
        for start, length in zip(starts, lengths, strict=True)
    ]


def _token_rows(token_ids: Any, lengths: Sequence[int]) -> list[np.ndarray]:
    if token_ids is None:
        return _placeholder_token_ids(lengths)
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    if isinstance(token_ids, np.ndarray) and token_ids.ndim == 1 and len(lengths) == 1:
        rows = [token_ids]
    elif (
        isinstance(token_ids, Sequence)
        and token_ids
        and np.ndim(token_ids[0]) == 0
        and len(lengths) == 1
    ):
        rows = [np.asarray(token_ids)]
    else:
        rows = [
            np.asarray(row.detach().cpu() if isinstance(row, torch.Tensor) else row)
            for row in token_ids
        ]
    if len(rows) != len(lengths):
        raise ValueError(f"token_ids has {len(rows)} rows for {len(lengths)} sequences")
    for index, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        if row.ndim != 1 or len(row) != length:
            raise ValueError(
                f"token_ids row {index} has shape {row.shape}, the sequence has {length} tokens"
            )
    return [row.astype(np.int64) for row in rows]


def _from_cache(cache: Any, token_ids: Any) -> KVData:
    layers = _layer_tensors(cache)
    if not layers:
        raise ValueError("the cache has no layers")
    batch, _, seq_len, _ = layers[0][0].shape
    for index, (keys, values, _) in enumerate(layers):
        if keys.dim() != 4 or keys.shape != values.shape:
            raise ValueError(
                f"cache layer {index}: expected keys and values (batch, heads, seq, head_dim), "
                f"got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if keys.shape[0] != batch or keys.shape[2] != seq_len:
            raise ValueError(
                f"cache layer {index} holds {keys.shape[0]} rows of {keys.shape[2]} tokens, "
                f"layer 0 holds {batch} of {seq_len} (sliding-window layers keep only their "
                "window): pass a mapping of the layers to compare instead"
            )
    rows = _token_rows(token_ids, [seq_len] * batch)
    sequences = []
    for row in range(batch):
        tensors = {}
        for layer, (keys, values, _) in enumerate(layers):
            tensors[canonical_name(layer, KEY)] = _as_tensor(
                keys[row].transpose(0, 1), f"layer {layer} keys"
            )
            tensors[canonical_name(layer, VALUE)] = _as_tensor(
                values[row].transpose(0, 1), f"layer {layer} values"
            )
        sequences.append(KVSequenceData(f"seq-{row}", rows[row], tensors))
    attention = tuple("sliding" if sliding else "full" for _, _, sliding in layers)
    names = [canonical_name(layer, part) for layer in range(len(layers)) for part in (KEY, VALUE)]
    return KVData(sequences, names, attention_types=attention)


def _from_snapshot(snapshot: Snapshot) -> KVData:
    names = snapshot.geometry.tensor_names()
    sequences = [
        KVSequenceData(
            record.id,
            np.asarray(record.token_ids, dtype=np.int64),
            {name: snapshot.sequence_kv(record.id, name).clone() for name in names},
        )
        for record in snapshot.sequences
    ]
    return KVData(
        sequences,
        names,
        attention_types=tuple(snapshot.geometry.attention_types),
        block_size=snapshot.geometry.block_size,
    )


def _from_mapping(tensors: Mapping[str, Any], token_ids: Any) -> KVData:
    parsed: dict[tuple[int, str], torch.Tensor] = {}
    for name, value in tensors.items():
        match = _TENSOR_NAME.match(str(name))
        if match is None:
            raise ValueError(f"tensor name {name!r} is not layers.{{i}}.key|value|latent")
        parsed[(int(match.group(1)), match.group(2))] = _as_tensor(value, str(name))
    if not parsed:
        raise ValueError("the mapping holds no tensors")
    num_layers = max(layer for layer, _ in parsed) + 1
    parts = (LATENT,) if any(part == LATENT for _, part in parsed) else (KEY, VALUE)
    names = [canonical_name(layer, part) for layer in range(num_layers) for part in parts]
    expected = {(layer, part) for layer in range(num_layers) for part in parts}
    if set(parsed) != expected:
        missing = sorted(canonical_name(*key) for key in expected - set(parsed))
        extra = sorted(canonical_name(*key) for key in set(parsed) - expected)
        raise ValueError(f"incomplete KV mapping: missing {missing[:4]}, unexpected {extra[:4]}")
    rows = _token_rows(token_ids, [parsed[(0, parts[0])].shape[0]])
    data = {canonical_name(layer, part): tensor for (layer, part), tensor in parsed.items()}
    return KVData([KVSequenceData("seq-0", rows[0], data)], names)


def kv_data(cache_or_tensors: object, *, token_ids: Any = None) -> KVData:
    """Per-sequence, per-token KV of a ``DynamicCache``, a :class:`Snapshot` (or path) or a mapping.

    ``token_ids`` (one row per sequence, or one array for a single sequence) are recorded with
    the KV; without them, the sequences get consecutive placeholder ids (distinct across
    sequences). Snapshots carry their own token ids. Raises ``ValueError``/``TypeError`` for
    inputs that are not complete, consistent KV.
    """
    obj = cache_or_tensors
    if isinstance(obj, str | os.PathLike):
        with Snapshot.open(obj) as snapshot:
            return _check(_from_snapshot(snapshot))
    if isinstance(obj, Snapshot):
        return _check(_from_snapshot(obj))
    if isinstance(obj, Mapping):
        return _check(_from_mapping(obj, token_ids))
    return _check(_from_cache(obj, token_ids))


def _check(data: KVData) -> KVData:
    """Consistent shapes and dtype across tensors; sequences sharing token blocks share their KV."""
    first = data.sequences[0].tensors[data.names[0]]
    if first.dim() not in (2, 3) or (first.dim() == 2) != data.is_mla:
        raise ValueError(
            f"{data.names[0]}: expected (tokens, heads, head_dim) or (tokens, latent_dim), "
            f"got {tuple(first.shape)}"
        )
    dtype_name(first.dtype)  # raises for dtypes a snapshot cannot hold
    for sequence in data.sequences:
        count = len(sequence.token_ids)
        for name in data.names:
            tensor = sequence.tensors[name]
            if tensor.dtype != first.dtype or tuple(tensor.shape) != (count, *first.shape[1:]):
                raise ValueError(
                    f"sequence {sequence.id}, {name}: {tuple(tensor.shape)} {tensor.dtype}, "
                    f"expected {(count, *first.shape[1:])} {first.dtype} like {data.names[0]}"
                )
    return data


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


def write_kv_snapshot(
    data: KVData, path: str | Path, *, block_size: int, name: str = "golden"
) -> CaptureResult:
    """Write ``data`` as a reproducible snapshot at ``path`` (atomically), ``block_size`` per block.

    The sequences are laid out back to back in a flat paged cache (MLA: an MLA cache) and
    captured with the CPU backend; the last block of each sequence is zero-padded.
    """
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
    by any difference in sequence ids, order or token counts (which ``compare`` alone ignores).
    """
    with Snapshot.open(actual_path) as actual, Snapshot.open(golden_path) as golden:
        problems = [f"{golden_path}: {problem.message}" for problem in golden.verify()]
        if problems:
            return False, "\n".join(problems)
        comparison = actual.compare(golden, atol=atol, rtol=rtol)
        # compare() names differing ids, counts and lengths itself; the order is ours to check.
        structure = [] if comparison.problems else _structure_problems(actual, golden)
    report = "\n".join([*structure, comparison.report()])
    return comparison.ok and not structure, report


def check_golden(
    cache_or_tensors: object,
    path: str | Path,
    *,
    update: bool = False,
    atol: float = 0.0,
    rtol: float = 0.0,
    block_size: int | None = None,
    token_ids: Any = None,
) -> GoldenResult:
    """Compare KV with the golden snapshot at ``path``; write it when missing or when ``update``.

    Without ``update``: a present golden file is compared (``"matched"`` or ``"mismatch"``
    with the report); a missing one is written and reported as ``"missing"``. With ``update``:
    a missing golden file is written (``"created"``), a different one rewritten
    (``"updated"``), an equal one left untouched (``"matched"``). ``block_size`` defaults to
    the existing golden file's, else the input snapshot's, else
    :data:`DEFAULT_GOLDEN_BLOCK_SIZE`.
    """
    path = Path(path)
    data = kv_data(cache_or_tensors, token_ids=token_ids)
    exists = path.exists()
    if block_size is None and exists:
        # An unreadable golden file is reported (or replaced) below.
        with contextlib.suppress(KVSnapError), Snapshot.open(path, verify=False) as golden:
            block_size = golden.geometry.block_size
    block_size = block_size or data.block_size or DEFAULT_GOLDEN_BLOCK_SIZE
    if not exists:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_kv_snapshot(data, path, block_size=block_size, name=path.stem)
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
    if ok:
        return GoldenResult("matched", path, report)
    if not update:
        return GoldenResult("mismatch", path, report)
    # capture publishes atomically in the golden file's own directory.
    write_kv_snapshot(data, path, block_size=block_size, name=path.stem)
    return GoldenResult("updated", path, report)
