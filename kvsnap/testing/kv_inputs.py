"""Golden KV inputs: a transformers ``DynamicCache``, a kvsnap snapshot (or its path) or a mapping
of tensors, turned into sequences of per-token KV (:class:`KVData`) that
:mod:`kvsnap.testing.golden` writes as a golden snapshot.

* a transformers ``DynamicCache``: layer ``i``'s keys/values ``(batch, heads, seq, head_dim)``;
  each batch row is one sequence ``seq-{row}`` of ``seq`` tokens (padding included: the cache
  does not say which positions are padding);
* a kvsnap :class:`~kvsnap.snapshot.Snapshot`, or the path of one: its sequences and tokens;
* a mapping ``{"layers.{i}.key": (tokens, heads, head_dim), "layers.{i}.value": ...}`` (or
  ``"layers.{i}.latent": (tokens, latent_dim)``) of torch tensors or numpy arrays: one
  sequence ``seq-0``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvsnap.layout import KEY, LATENT, VALUE, canonical_name, dtype_name
from kvsnap.snapshot import Snapshot

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
