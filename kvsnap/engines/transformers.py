"""kvsnap for Hugging Face transformers: ``DynamicCache``, continuous batching, and a dump hook.

Three ways transformers holds KV, and what this module does with each:

* **``DynamicCache``** (``model(...)``, ``model.generate(...)``): per layer a contiguous
  ``(batch, kv_heads, seq, head_dim)`` tensor. :func:`capture_dynamic_cache` copies the rows
  once into a zero-padded, block-aligned buffer (a snapshot stores whole blocks) and captures it
  through :func:`~kvsnap.layout.contiguous_layout`; :func:`restore_dynamic_cache` restores into
  such a buffer and hands back a ``DynamicCache`` exactly ``num_tokens`` long.
* **``PagedAttentionCache``** (continuous batching, ``model.generate_batch`` and
  ``ContinuousBatchingManager``): blocks of ``page_size`` tokens, addressed through per-request
  block tables. :func:`capture_paged_cache` captures live requests by their block tables,
  :func:`capture_paged_prefix` captures the complete blocks the cache keeps for prefix sharing,
  and :func:`restore_paged_cache` allocates blocks through the cache's own allocator, restores
  into them and (by default) registers them as cached prefix blocks, so that the next request
  whose prompt starts with those tokens skips their prefill — exactly how continuous batching
  resumes from its own prefix cache.
* **inside ``generate``**: :class:`KVDumpHook` is a logits processor that snapshots the cache at
  one generation step and returns the scores untouched, so the output does not change.

transformers 5.17 to 5.24 are supported. The continuous-batching cache changed shape in that
range, and both are handled (:func:`paged_cache_layout`):

* 5.17 keeps one ``(num_blocks * page_size, kv_heads, head_dim)`` tensor per layer for K and V
  (:func:`~kvsnap.layout.flat_paged_layout`), block ids counting from 0, two trash blocks last;
* 5.24 keeps one flat byte tensor cut into sectors; a full-attention block holds every layer's
  K page then V page, i.e. ``(num_blocks, layers, 2, page_size, kv_heads, head_dim)``
  (:func:`~kvsnap.layout.cross_layer_layout`), block ids counting the two trash sectors first.

Caches with sliding-window layer groups, and continuous batching with tensor-parallel KV heads,
are refused with a :class:`~kvsnap.layout.LayoutError` naming the reason: a sliding group keeps
only the last window of tokens, so a snapshot of it would not describe the sequence.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import Cache

from kvsnap.engines.default_model import LoadedModel
from kvsnap.errors import CacheCapacityError, KVSnapError
from kvsnap.format import SourceInfo
from kvsnap.layout import (
    CacheLayout,
    KVGeometry,
    LayoutError,
    contiguous_layout,
    cross_layer_layout,
    dtype_name,
    flat_paged_layout,
    torch_dtype,
)
from kvsnap.pipeline import TransferOptions
from kvsnap.snapshot import CaptureResult, SequenceBlocks, Snapshot, capture

#: transformers' layer type names, as snapshot attention types.
_ATTENTION_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}

ModelLike = LoadedModel | torch.nn.Module


# ---------------------------------------------------------------------------------------------
# Model geometry


def _module(model: ModelLike) -> torch.nn.Module:
    return model.model if isinstance(model, LoadedModel) else model


def _text_config(model: ModelLike | Any) -> Any:
    """The decoder config of a LoadedModel, a transformers model, or a config."""
    config = _module(model).config if isinstance(model, (LoadedModel, torch.nn.Module)) else model
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_types(model: ModelLike | Any) -> tuple[str, ...]:
    """Per layer, ``"full"`` or ``"sliding"``; other transformers layer types keep their name."""
    config = _text_config(model)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        kind = "sliding" if getattr(config, "sliding_window", None) is not None else "full"
        return (kind,) * config.num_hidden_layers
    return tuple(_ATTENTION_TYPES.get(layer_type, layer_type) for layer_type in layer_types)


def geometry_for_model(
    model: ModelLike | Any, block_size: int, dtype: torch.dtype | str | None = None
) -> KVGeometry:
    """The KV geometry of ``model``'s cache: what a snapshot must match to restore into it.

    ``model`` is a :class:`LoadedModel`, a transformers model or its config. ``dtype`` defaults
    to the model's parameter dtype (required when a bare config is given).
    """
    config = _text_config(model)
    if dtype is None:
        if isinstance(model, (LoadedModel, torch.nn.Module)):
            dtype = next(_module(model).parameters()).dtype
        else:
            raise ValueError("geometry_for_model needs a dtype when given a config")
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return KVGeometry(
        num_layers=config.num_hidden_layers,
        block_size=block_size,
        dtype=name,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        attention_types=attention_types(config),
    )


def source_info(model: LoadedModel | None) -> SourceInfo:
    """What a snapshot records about its origin: transformers, its version, the model."""
    if model is None:
        # Empty model id and fingerprint mean "unknown": restores then skip the fingerprint check.
        return SourceInfo(
            engine="transformers",
            engine_version=transformers.__version__,
            model_id="",
            model_revision=None,
            model_fingerprint="",
        )
    return SourceInfo(
        engine="transformers",
        engine_version=transformers.__version__,
        model_id=model.model_id,
        model_revision=model.model_revision,
        model_fingerprint=model.fingerprint,
    )


def check_snapshot_fits(
    snapshot: Snapshot, model: LoadedModel, *, dtype: torch.dtype | None = None, force: bool = False
) -> None:
    """Raise :class:`~kvsnap.errors.IncompatibleSnapshotError` unless ``snapshot`` fits ``model``.

    The KV geometry must match (layers, KV heads, head dim, dtype — ``dtype`` defaults to the
    model's); the model fingerprint must match too unless ``force``.
    """
    geometry = geometry_for_model(model, snapshot.geometry.block_size, dtype)
    snapshot.check_compatible(geometry, model_fingerprint=model.fingerprint, force=force)


# ---------------------------------------------------------------------------------------------
# Running the model: forward with a cache, prefill, greedy continuation


def _cache_keyword(module: torch.nn.Module) -> str:
    """The forward keyword of the cache: ``cache`` in 5.2x, ``past_key_values`` in 5.17."""
    parameters = inspect.signature(module.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def new_dynamic_cache(model: ModelLike | None = None) -> DynamicCache:
    """An empty ``DynamicCache``, built from the model's config when one is given."""
    if model is None:
        return DynamicCache()
    return DynamicCache(config=_module(model).config)


@torch.no_grad()
def forward_with_cache(model: ModelLike, input_ids: Sequence[int], cache: Cache) -> torch.Tensor:
    """Run ``input_ids`` (one sequence) through the model, appending their KV to ``cache``.

    Positions continue from the cache's length. Returns the logits of the last token, ``(vocab,)``.
    """
    module = _module(model)
    device = next(module.parameters()).device
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=device)
    outputs = module(input_ids=ids, use_cache=True, **{_cache_keyword(module): cache})
    return outputs.logits[0, -1]


def prefill(model: LoadedModel, prompts: Sequence[str]) -> list[tuple[DynamicCache, list[int]]]:
    """Encode and run each prompt on its own, returning its ``DynamicCache`` and token ids.

    Each cache holds the KV of every token of its prompt (batch 1), ready for
    :func:`capture_dynamic_caches` and, after a restore, :func:`continue_generation`.
    """
    token_id_lists = []
    for prompt in prompts:
        token_ids = model.encode(prompt)
        if not token_ids:
            raise ValueError(f"prompt {prompt!r} encodes to no tokens")
        token_id_lists.append(token_ids)
    return prefill_token_ids(model, token_id_lists)


def prefill_token_ids(
    model: LoadedModel, token_id_lists: Sequence[Sequence[int]]
) -> list[tuple[DynamicCache, list[int]]]:
    """Run each token id list on its own (batch 1) and return its ``DynamicCache`` and the ids."""
    results = []
    for token_ids in token_id_lists:
        ids = [int(token) for token in token_ids]
        cache = new_dynamic_cache(model)
        forward_with_cache(model, ids, cache)
        results.append((cache, ids))
    return results


def generate_greedy(model: LoadedModel, token_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens after ``token_ids``, computed from scratch: what a restore must match."""
    return continue_generation(model, new_dynamic_cache(model), token_ids, max_new_tokens)


@torch.no_grad()
def continue_generation(
    model: ModelLike,
    cache: Cache,
    token_ids: Sequence[int],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
) -> list[int]:
    """Greedy-decode ``max_new_tokens`` tokens after ``token_ids``, from a cache holding a prefix.

    ``cache`` (batch 1) holds the KV of ``token_ids[:k]`` for some ``k`` (its length). The tokens
    it lacks, ``token_ids[k:]``, are run in one forward pass; when it already holds all of them,
    the last token's KV is dropped and recomputed, because a snapshot stores KV and not the
    logits that pick the next token. Decoding then proceeds one token at a time; it stops early
    after ``eos_token_id`` when one is given. Returns the new tokens only. The cache is extended
    in place.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    cached = cache.get_seq_length()
    if cached > len(token_ids):
        raise ValueError(
            f"the cache holds {cached} tokens, more than the {len(token_ids)} token ids given"
        )
    if not token_ids:
        raise ValueError("continue_generation needs at least one token id")
    if max_new_tokens == 0:
        return []
    if cached == len(token_ids):
        cache.crop(-1)
        cached -= 1
    generated: list[int] = []
    pending = list(token_ids[cached:])
    while len(generated) < max_new_tokens:
        logits = forward_with_cache(model, pending, cache)
        token = int(torch.argmax(logits))
        generated.append(token)
        if eos_token_id is not None and token == eos_token_id:
            break
        pending = [token]
    return generated


# ---------------------------------------------------------------------------------------------
# DynamicCache


def dynamic_cache_states(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(keys, values)``, each ``(batch, kv_heads, seq, head_dim)``.

    Raises :class:`~kvsnap.layout.LayoutError` for an empty cache, or when a layer holds fewer
    tokens than the cache has seen (a sliding-window layer past its window).
    """
    layers = getattr(cache, "layers", None)
    if not layers:
        raise LayoutError("the cache is empty: run the model with it first")
    seen = cache.get_seq_length()
    states = []
    for index, layer in enumerate(layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None or keys.dim() != 4:
            raise LayoutError(
                f"cache layer {index} ({type(layer).__name__}) holds no (batch, heads, seq, dim) KV"
            )
        if keys.shape[-2] != seen:
            raise LayoutError(
                f"cache layer {index} ({type(layer).__name__}) holds {keys.shape[-2]} of the "
                f"{seen} tokens (a sliding window): kvsnap snapshots whole sequences only"
            )
        states.append((keys, values))
    return states


def _token_rows(token_ids: Sequence[Sequence[int]] | torch.Tensor | np.ndarray) -> list[np.ndarray]:
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    rows = [np.asarray(row, dtype=np.int64).reshape(-1) for row in token_ids]
    if not rows:
        raise ValueError("no token ids given")
    return rows


def capture_dynamic_cache(
    cache: Cache,
    token_ids: Sequence[Sequence[int]] | torch.Tensor,
    path: str | Path,
    *,
    model: LoadedModel | None,
    block_size: int = 16,
    sequence_ids: Sequence[str] | None = None,
    **capture_kwargs: Any,
) -> CaptureResult:
    """Snapshot a ``DynamicCache``: one sequence per batch row, to ``path``.

    ``token_ids[i]`` are the tokens of row ``i``; their KV is the row's last ``len(token_ids[i])``
    positions (shorter rows are left-padded, as ``generate`` pads a batch). ``sequence_ids`` name
    the sequences (default ``"seq-0"``, ``"seq-1"``, ...). The rows are copied once into a
    zero-padded buffer ``ceil(tokens / block_size)`` blocks long, which is what is captured; the
    cache itself is not modified. ``model`` fills the snapshot's source (model id, fingerprint).
    Remaining keyword arguments go to :func:`kvsnap.snapshot.capture`.
    """
    states = dynamic_cache_states(cache)
    rows = _token_rows(token_ids)
    batch = states[0][0].shape[0]
    if len(rows) != batch:
        raise ValueError(f"the cache has {batch} rows, {len(rows)} token id rows were given")
    return _capture_rows(
        [(states, row, tokens) for row, tokens in enumerate(rows)],
        path,
        model=model,
        block_size=block_size,
        sequence_ids=sequence_ids,
        **capture_kwargs,
    )


def capture_dynamic_caches(
    items: Sequence[tuple[Cache, Sequence[int]]],
    path: str | Path,
    *,
    model: LoadedModel | None,
    block_size: int = 16,
    sequence_ids: Sequence[str] | None = None,
    **capture_kwargs: Any,
) -> CaptureResult:
    """Snapshot several batch-1 caches, e.g. what :func:`prefill` returns, as one snapshot.

    ``items`` pairs each cache with the token ids its KV holds; sequence ``i`` is named
    ``sequence_ids[i]`` (default ``"seq-i"``). Otherwise as :func:`capture_dynamic_cache`.
    """
    rows = []
    for cache, tokens in items:
        states = dynamic_cache_states(cache)
        if states[0][0].shape[0] != 1:
            raise ValueError(
                "capture_dynamic_caches takes batch-1 caches; use capture_dynamic_cache"
            )
        rows.append((states, 0, np.asarray(tokens, dtype=np.int64)))
    return _capture_rows(
        rows, path, model=model, block_size=block_size, sequence_ids=sequence_ids, **capture_kwargs
    )


def _capture_rows(
    rows: Sequence[tuple[list[tuple[torch.Tensor, torch.Tensor]], int, np.ndarray]],
    path: str | Path,
    *,
    model: LoadedModel | None,
    block_size: int,
    sequence_ids: Sequence[str] | None,
    **capture_kwargs: Any,
) -> CaptureResult:
    """Capture ``(per-layer states, batch row, token ids)`` rows as one sequence each."""
    if not rows:
        raise ValueError("nothing to capture: no sequences")
    ids = list(sequence_ids) if sequence_ids is not None else [f"seq-{i}" for i in range(len(rows))]
    if len(ids) != len(rows):
        raise ValueError(f"{len(ids)} sequence ids for {len(rows)} sequences")
    first_keys = rows[0][0][0][0]
    _, num_heads, _, head_dim = first_keys.shape
    for index, (states, _row, tokens) in enumerate(rows):
        seq_len = states[0][0].shape[2]
        if not 0 < len(tokens) <= seq_len:
            raise ValueError(
                f"sequence {index} has {len(tokens)} token ids, the cache holds {seq_len} positions"
            )
    blocks_per_row = [math.ceil(len(tokens) / block_size) for _, _, tokens in rows]
    first_block = np.concatenate(([0], np.cumsum(blocks_per_row)[:-1])).astype(np.int64)
    total_tokens = int(sum(blocks_per_row)) * block_size
    key_buffers, value_buffers = [], []
    for layer in range(len(rows[0][0])):
        for part, buffers in ((0, key_buffers), (1, value_buffers)):
            # All sequences back to back in one row, block-aligned: the layout needs whole blocks.
            buffer = first_keys.new_zeros((1, num_heads, total_tokens, head_dim))
            for (states, row, tokens), first in zip(rows, first_block, strict=True):
                source = states[layer][part]
                start = int(first) * block_size
                buffer[0, :, start : start + len(tokens)] = source[
                    row, :, source.shape[2] - len(tokens) :
                ]
            buffers.append(buffer)
    types = attention_types(model) if model is not None else None
    layout = contiguous_layout(
        key_buffers, value_buffers, block_size=block_size, attention_types=types
    )
    sequences = [
        SequenceBlocks(
            id=sequence_id,
            token_ids=np.asarray(tokens, dtype=np.int64),
            block_ids=np.arange(first, first + count, dtype=np.int64),
        )
        for sequence_id, (_, _, tokens), first, count in zip(
            ids, rows, first_block, blocks_per_row, strict=True
        )
    ]
    return capture(layout, sequences, path, source=source_info(model), **capture_kwargs)


def _pick_sequence(snapshot: Snapshot, sequence_id: str | None) -> Any:
    if sequence_id is not None:
        return snapshot.sequence(sequence_id)
    if len(snapshot.sequences) != 1:
        known = ", ".join(record.id for record in snapshot.sequences)
        raise ValueError(
            f"{snapshot.path} holds {len(snapshot.sequences)} sequences ({known}): name one"
        )
    return snapshot.sequences[0]


@contextmanager
def _opened(snapshot: Snapshot | str | Path) -> Iterator[Snapshot]:
    if isinstance(snapshot, Snapshot):
        yield snapshot
    else:
        with Snapshot.open(snapshot) as opened:
            yield opened


def restore_dynamic_cache(
    snapshot: Snapshot | str | Path,
    *,
    sequence_id: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    model: LoadedModel | None = None,
    force: bool = False,
    backend: str = "auto",
    progress: Callable[[int, int], None] | None = None,
) -> tuple[DynamicCache, list[int]]:
    """Restore one sequence of a snapshot into a new ``DynamicCache`` (batch 1) on ``device``.

    Returns the cache, holding exactly the sequence's ``num_tokens`` tokens of KV, bit-identical
    to what was captured, and the sequence's token ids. ``sequence_id`` may be omitted when the
    snapshot holds one sequence. With ``model``, the snapshot is first checked against it
    (geometry, and fingerprint unless ``force``) and the cache is built from its config.
    ``dtype`` casts the restored KV afterwards (lossy when narrower); by default it stays in the
    snapshot's dtype. ``progress(done_bytes, total_bytes)`` follows the copy.
    """
    with _opened(snapshot) as opened:
        record = _pick_sequence(opened, sequence_id)
        geometry = opened.geometry
        if model is not None:
            # An explicit dtype casts the KV after the restore: only the model's layout must match.
            check_dtype = torch_dtype(geometry.dtype) if dtype is not None else None
            check_snapshot_fits(opened, model, dtype=check_dtype, force=force)
        num_blocks = len(record.block_ids)
        num_tokens = len(record.token_ids)
        shape = (1, geometry.num_kv_heads, num_blocks * geometry.block_size, geometry.head_dim)
        kv_dtype = torch_dtype(geometry.dtype)
        keys = [
            torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(geometry.num_layers)
        ]
        values = [
            torch.zeros(shape, dtype=kv_dtype, device=device) for _ in range(geometry.num_layers)
        ]
        layout = contiguous_layout(
            keys, values, block_size=geometry.block_size, attention_types=geometry.attention_types
        )
        opened.restore(
            layout,
            {record.id: np.arange(num_blocks, dtype=np.int64)},
            transfer=TransferOptions(backend=backend),
            progress=progress,
        )
        token_ids = [int(token) for token in record.token_ids]
    cache = new_dynamic_cache(model)
    for layer, (layer_keys, layer_values) in enumerate(zip(keys, values, strict=True)):
        layer_keys, layer_values = layer_keys[:, :, :num_tokens], layer_values[:, :, :num_tokens]
        if dtype is not None:
            layer_keys, layer_values = layer_keys.to(dtype), layer_values.to(dtype)
        cache.update(layer_keys, layer_values, layer)
    return cache, token_ids


# ---------------------------------------------------------------------------------------------
# Continuous batching: PagedAttentionCache


class _PendingRequest:
    """The two things 5.24's allocator asks of a request state: its id and its cached length."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def current_len(self) -> int:
        return 0


class PagedCacheAdapter(ABC):
    """One interface over the continuous-batching cache of transformers 5.17 and 5.24.

    Use :func:`paged_cache_adapter` to get one. Only caches whose layers are all full attention
    in one group are accepted; everything kvsnap does with a paged cache goes through here.
    """

    block_size: int
    cache: Any

    @abstractmethod
    def layout(self) -> CacheLayout:
        """The cache's memory as a :class:`CacheLayout` (the real tensors, no copy)."""

    @abstractmethod
    def block_table(self, request_id: str) -> list[int]:
        """The block ids currently held by a live request."""

    @abstractmethod
    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Allocate blocks for ``num_tokens`` tokens to a new request id; return its block ids."""

    @abstractmethod
    def register_complete_blocks(self, request_id: str, token_ids: Sequence[int]) -> list[int]:
        """Hash the request's complete blocks for prefix sharing; return its block ids."""

    @abstractmethod
    def cached_prefix_blocks(self, token_ids: Sequence[int]) -> list[int]:
        """Blocks of the longest chain of complete blocks cached for these tokens (read-only)."""

    def free(self, request_id: str) -> None:
        """Release a request's blocks; complete hashed blocks stay cached for prefix sharing."""
        self.cache.free_blocks(request_id)

    @property
    def uses_prefix_sharing(self) -> bool:
        return bool(self.cache.use_prefix_sharing)

    def _known(self, table: Mapping[str, Any], request_id: str) -> list[int]:
        if request_id not in table:
            known = ", ".join(sorted(table)) or "none"
            raise KeyError(
                f"request {request_id!r} holds no blocks in this cache (live requests: {known})"
            )
        return [int(block) for block in table[request_id]]


class _SectorCacheAdapter(PagedCacheAdapter):
    """transformers 5.24: one flat byte tensor, sectors, per-attention-type allocators."""

    def __init__(self, cache: Any, num_kv_heads: int) -> None:
        groups = list(cache.cache_allocators)
        if groups != ["full_attention"]:
            raise LayoutError(
                f"the cache has layer groups {groups}: kvsnap supports caches whose layers are all "
                "full attention (a sliding-window group keeps only its last window of tokens)"
            )
        self.cache = cache
        self.allocator = cache.cache_allocators["full_attention"]
        num_layers = cache.config.num_hidden_layers
        if list(self.allocator.layer_indices) != list(range(num_layers)):
            raise LayoutError(
                f"the full-attention group covers layers {self.allocator.layer_indices}, "
                f"not all {num_layers}"
            )
        if self.allocator.num_key_value_heads != num_kv_heads:
            raise LayoutError(
                f"the cache holds {self.allocator.num_key_value_heads} of {num_kv_heads} KV heads "
                "(tensor parallel): continuous batching with tensor parallelism is not supported"
            )
        self.block_size = int(self.allocator.tokens_per_page)

    def layout(self) -> CacheLayout:
        allocator = self.allocator
        raw = self.cache.cache_tensor
        num_blocks = raw.numel() // allocator.bytes_per_block
        # A block is every layer's K page then V page: (layers, 2, page_size, kv_heads, head_dim).
        blocks = raw[: num_blocks * allocator.bytes_per_block].view(allocator.cache_dtype)
        blocks = blocks.view(
            num_blocks,
            allocator.pages_per_block,
            2,
            self.block_size,
            allocator.num_key_value_heads,
            allocator.head_dim,
        )
        return cross_layer_layout(blocks, attention_types=attention_types(self.cache.config))

    def block_table(self, request_id: str) -> list[int]:
        return self._known(self.allocator.block_table, request_id)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        if request_id in self.allocator.block_table:
            raise ValueError(f"request {request_id!r} already holds blocks in this cache")
        if not self.cache.can_store_request_tokens(_PendingRequest(request_id), num_tokens):
            free = self.cache.pool.num_free_sectors * self.allocator.blocks_per_sector
            free += self.cache.pool.count_free_blocks(self.allocator.index)
            raise CacheCapacityError(
                f"the cache cannot hold {num_tokens} more tokens "
                f"({math.ceil(num_tokens / self.block_size)} blocks; about {free} free)"
            )
        return self.block_table(request_id)

    def register_complete_blocks(self, request_id: str, token_ids: Sequence[int]) -> list[int]:
        complete = len(token_ids) // self.block_size
        if complete:
            self.allocator.mark_complete_blocks(request_id, [int(t) for t in token_ids], complete)
        return self.block_table(request_id)

    def cached_prefix_blocks(self, token_ids: Sequence[int]) -> list[int]:
        from transformers.generation.continuous_batching.cache_allocators.cache_allocator import (
            compute_block_hash,
        )

        found: list[int] = []
        parent = None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = compute_block_hash(
                parent, [int(t) for t in token_ids[start : start + self.block_size]]
            )
            block = self.allocator.ledger.hash_to_block.get(parent)
            if block is None:
                break
            found.append(int(block))
        return found


class _GroupCacheAdapter(PagedCacheAdapter):
    """transformers 5.17: per-layer K and V tensors, one block manager for all layer groups."""

    def __init__(self, cache: Any, num_kv_heads: int) -> None:
        if cache.num_groups != 1 or cache.num_sliding_attention_groups:
            raise LayoutError(
                f"the cache has {cache.num_groups} layer groups "
                f"({cache.num_sliding_attention_groups} sliding-window): kvsnap supports caches "
                "whose layers are all full attention in one group"
            )
        num_layers = cache.config.num_hidden_layers
        mapping = cache.layer_index_to_group_indices
        if any(mapping[layer] != (0, layer) for layer in range(num_layers)):
            raise LayoutError("the cache's layer group does not hold the layers in order")
        if cache.num_key_value_heads != num_kv_heads:
            raise LayoutError(
                f"the cache holds {cache.num_key_value_heads} of {num_kv_heads} KV heads "
                "(tensor parallel): continuous batching with tensor parallelism is not supported"
            )
        self.cache = cache
        self.manager = cache.group_cache_managers[0]
        self.block_size = int(cache.block_size)

    def layout(self) -> CacheLayout:
        return flat_paged_layout(
            self.cache.key_cache,
            self.cache.value_cache,
            block_size=self.block_size,
            attention_types=attention_types(self.cache.config),
        )

    def block_table(self, request_id: str) -> list[int]:
        return self._known(self.manager.block_table, request_id)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        if request_id in self.manager.block_table:
            raise ValueError(f"request {request_id!r} already holds blocks in this cache")
        needed = math.ceil(num_tokens / self.block_size)
        if self.cache.allocate_blocks(needed, request_id, 0) is None:
            raise CacheCapacityError(
                f"the cache cannot hold {num_tokens} more tokens ({needed} blocks, "
                f"{self.cache.get_num_free_blocks()} free)"
            )
        return self.block_table(request_id)

    def register_complete_blocks(self, request_id: str, token_ids: Sequence[int]) -> list[int]:
        complete = len(token_ids) // self.block_size
        if complete:
            self.cache._block_manager.mark_shareable_blocks_as_complete(
                num_complete_blocks=complete,
                allocated_blocks=self.manager.block_table[request_id],
                prompt_ids=[int(t) for t in token_ids],
            )
        return self.block_table(request_id)

    def cached_prefix_blocks(self, token_ids: Sequence[int]) -> list[int]:
        manager = self.cache._block_manager
        found: list[int] = []
        parent = None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = manager.compute_hash(
                parent, [int(t) for t in token_ids[start : start + self.block_size]], 0
            )
            block = manager._hash_to_id.get(parent)
            if block is None:
                break
            found.append(int(block))
        return found


def paged_cache_adapter(cache: Any, *, create: bool = False) -> PagedCacheAdapter:
    """The :class:`PagedCacheAdapter` of a continuous-batching ``PagedAttentionCache`` (5.17, 5.24).

    Also accepts a ``ContinuousBatchingManager`` (its current cache; with ``create``, a manager
    without one is warmed up to create it). Raises :class:`~kvsnap.layout.LayoutError` for
    caches kvsnap cannot describe exactly.
    """
    cache = _paged_cache(cache, create=create)
    config = cache.config
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if hasattr(cache, "cache_allocators"):
        return _SectorCacheAdapter(cache, num_kv_heads)
    if hasattr(cache, "group_cache_managers"):
        return _GroupCacheAdapter(cache, num_kv_heads)
    raise LayoutError(
        f"{type(cache).__name__} from transformers {transformers.__version__} is not a "
        "continuous-batching cache kvsnap knows (supported: transformers 5.17 to 5.24)"
    )


def _paged_cache(cache_or_manager: Any, *, create: bool = False) -> Any:
    """The cache itself, given a cache or a ``ContinuousBatchingManager``.

    A manager creates its cache with its batch processor (on ``start`` or ``warmup``). With
    ``create``, a manager that has none yet is warmed up, which creates it: the same call
    ``generate_batch`` and the context manager make before starting.
    """
    if not hasattr(cache_or_manager, "input_queue"):
        return cache_or_manager
    if cache_or_manager.batch_processor is None:
        if not create:
            raise ValueError("the continuous batching manager has no cache yet: start it first")
        cache_or_manager.warmup()
    return cache_or_manager.batch_processor.cache


def paged_cache_layout(cache: Any) -> CacheLayout:
    """The :class:`CacheLayout` of a continuous-batching cache (see :func:`paged_cache_adapter`)."""
    return paged_cache_adapter(cache).layout()


def _sequence_blocks(
    sequence_id: str, tokens: Sequence[int], blocks: Sequence[int], block_size: int
) -> SequenceBlocks:
    needed = math.ceil(len(tokens) / block_size)
    if needed == 0:
        raise ValueError(f"sequence {sequence_id!r} has no tokens")
    if len(blocks) < needed:
        raise ValueError(
            f"sequence {sequence_id!r}: {len(tokens)} tokens need {needed} blocks of {block_size}, "
            f"the cache holds {len(blocks)}"
        )
    return SequenceBlocks(
        id=sequence_id,
        token_ids=np.asarray(tokens, dtype=np.int64),
        block_ids=np.asarray(blocks[:needed], dtype=np.int64),
    )


@contextmanager
def _held_still(cache_or_manager: Any) -> Iterator[None]:
    """Keep a continuous-batching cache from changing while kvsnap reads or writes it.

    A running manager is paused (``manager.pause()``, transformers 5.2x), and on CUDA the device
    is synchronized so the last forward pass has finished writing KV. A bare cache, or a manager
    that is not running, is the caller's to keep still; so is a running 5.17 manager, which
    cannot pause.
    """
    running = hasattr(cache_or_manager, "input_queue") and cache_or_manager.is_running()
    pause = getattr(cache_or_manager, "pause", None) if running else None
    with pause() if pause is not None else nullcontext():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        yield


def capture_paged_cache(
    cache: Any,
    request_ids: Sequence[str],
    token_ids: Mapping[str, Sequence[int]],
    path: str | Path,
    *,
    model: LoadedModel | None,
    **capture_kwargs: Any,
) -> CaptureResult:
    """Snapshot live requests of a continuous-batching cache, found through their block tables.

    ``cache`` is a ``PagedAttentionCache`` or a ``ContinuousBatchingManager`` (paused for the
    capture when running, see :func:`capture_manager_requests`, which also finds the tokens).
    ``token_ids[request_id]`` are the tokens whose KV the request's blocks hold, in order. Each
    request becomes a snapshot sequence named by its request id. Remaining keyword arguments go
    to :func:`kvsnap.snapshot.capture`.
    """
    with _held_still(cache):
        return _capture_requests(
            paged_cache_adapter(cache), request_ids, token_ids, path, model, capture_kwargs
        )


def _capture_requests(
    adapter: PagedCacheAdapter,
    request_ids: Sequence[str],
    token_ids: Mapping[str, Sequence[int]],
    path: str | Path,
    model: LoadedModel | None,
    capture_kwargs: dict[str, Any],
) -> CaptureResult:
    sequences = [
        _sequence_blocks(
            request_id, token_ids[request_id], adapter.block_table(request_id), adapter.block_size
        )
        for request_id in request_ids
    ]
    return capture(adapter.layout(), sequences, path, source=source_info(model), **capture_kwargs)


def capture_paged_prefix(
    cache: Any,
    token_ids: Mapping[str, Sequence[int]],
    path: str | Path,
    *,
    model: LoadedModel | None,
    **capture_kwargs: Any,
) -> CaptureResult:
    """Snapshot the prefix blocks a continuous-batching cache keeps for these token sequences.

    With block sharing on (the default), the cache keeps the complete blocks of finished
    requests, hashed by their tokens, to reuse them for later prompts. For each
    ``token_ids[name]`` this captures the longest chain of such blocks (a whole number of blocks,
    so possibly fewer tokens than given) as sequence ``name``. Raises ``ValueError`` when the
    cache holds no complete block for a sequence. A running manager is paused meanwhile.
    """
    with _held_still(cache):
        adapter = paged_cache_adapter(cache)
        sequences = []
        for name, tokens in token_ids.items():
            blocks = adapter.cached_prefix_blocks(tokens)
            if not blocks:
                raise ValueError(
                    f"the cache holds no complete block of sequence {name!r} "
                    f"(blocks of {adapter.block_size} tokens, {len(tokens)} tokens given)"
                )
            covered = len(blocks) * adapter.block_size
            sequences.append(
                _sequence_blocks(name, list(tokens[:covered]), blocks, adapter.block_size)
            )
        return capture(
            adapter.layout(), sequences, path, source=source_info(model), **capture_kwargs
        )


def live_request_tokens(manager: Any, request_id: str) -> list[int]:
    """The tokens whose KV a live request of a paused manager holds in the cache.

    That is its prompt and generated tokens up to its current length: the newest generated
    token has no KV yet (it is the next forward pass's input).
    """
    processor = manager.batch_processor
    if processor is None:
        raise ValueError("the continuous batching manager has no cache yet: start it first")
    state = processor.scheduler.active_requests.get(request_id)
    if state is None:
        known = ", ".join(sorted(processor.scheduler.active_requests)) or "none"
        raise KeyError(f"request {request_id!r} is not active in the manager (active: {known})")
    tokens = list(state.initial_tokens) + list(state.generated_tokens)
    return [int(token) for token in tokens[: state.current_len()]]


def capture_manager_requests(
    manager: Any,
    request_ids: Sequence[str],
    path: str | Path,
    *,
    model: LoadedModel | None,
    **capture_kwargs: Any,
) -> CaptureResult:
    """Snapshot live requests of a running ``ContinuousBatchingManager`` mid-generation.

    The manager is paused for the capture (``manager.pause()``, transformers 5.2x) and resumes
    afterwards with its requests intact; each request's tokens are found with
    :func:`live_request_tokens`, so each sequence holds the request's prompt and the tokens
    generated so far. Refused (:class:`~kvsnap.errors.KVSnapError`) when the manager cannot
    pause (transformers 5.17: call :func:`capture_paged_cache` from the generation thread
    instead) and with asynchronous batching, where the newest tokens' KV may still be in
    flight at a pause.
    """
    processor = manager.batch_processor
    if processor is None or not manager.is_running():
        raise ValueError("capture_manager_requests needs a running manager (live requests)")
    if getattr(processor, "use_async_batching", False):
        raise KVSnapError(
            "the manager uses asynchronous batching, whose newest KV may still be in flight at a "
            "pause: set use_async_batching=False in its ContinuousBatchingConfig to capture live "
            "requests"
        )
    if not hasattr(manager, "pause"):
        raise KVSnapError(
            f"transformers {transformers.__version__} cannot pause a running manager: capture "
            "from the generation thread with capture_paged_cache instead"
        )
    with _held_still(manager):
        tokens = {
            request_id: live_request_tokens(manager, request_id) for request_id in request_ids
        }
        return _capture_requests(
            paged_cache_adapter(manager), request_ids, tokens, path, model, capture_kwargs
        )


@dataclass(frozen=True)
class PagedRestore:
    """What :func:`restore_paged_cache` did.

    ``block_ids`` are the cache blocks holding the sequence (the request's block table when the
    blocks were kept; otherwise the blocks as restored, the complete ones now cached for prefix
    sharing). ``prefix_tokens`` is how many leading tokens a new request can take from the
    prefix cache (whole blocks); 0 when the blocks were kept for ``request_id``.
    """

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    prefix_tokens: int


def restore_paged_cache(
    snapshot: Snapshot | str | Path,
    cache: Any,
    *,
    sequence_id: str | None = None,
    request_id: str | None = None,
    as_prefix: bool = True,
    model: LoadedModel | None = None,
    force: bool = False,
    backend: str = "auto",
) -> PagedRestore:
    """Restore one snapshot sequence into a continuous-batching cache, through its own allocator.

    Blocks for the sequence are allocated to ``request_id`` (default: ``"kvsnap-restore-<id>"``)
    by the cache's allocator, and the snapshot's KV is restored into them. Then:

    * ``as_prefix=True`` (default): the complete blocks are hashed the way the cache hashes its
      own and the request is released, so they stay in the cache as prefix blocks. A request
      whose prompt starts with the sequence's tokens then skips their prefill; this is how a
      fresh engine resumes from a snapshot. Needs block sharing (``allow_block_sharing``).
    * ``as_prefix=False``: the blocks stay held by ``request_id`` (for inspection or a later
      capture); release them with ``cache.free_blocks(request_id)``.

    The snapshot must match the cache's geometry (page size, layers, KV heads, head dim, dtype)
    and, with ``model``, its fingerprint unless ``force``; nothing is allocated otherwise.
    Accepts a ``ContinuousBatchingManager`` as ``cache``. A fresh engine is restored into before
    it starts (``manager = model.init_continuous_batching(...)``, restore, ``manager.start()``):
    the manager is warmed up here to create its cache, and starting it keeps the prefix blocks.
    A running manager is paused for the restore (transformers 5.2x).
    """
    with _held_still(cache):
        return _restore_paged(
            snapshot,
            paged_cache_adapter(cache, create=True),
            sequence_id,
            request_id,
            as_prefix,
            model,
            force,
            backend,
        )


def _restore_paged(
    snapshot: Snapshot | str | Path,
    adapter: PagedCacheAdapter,
    sequence_id: str | None,
    request_id: str | None,
    as_prefix: bool,
    model: LoadedModel | None,
    force: bool,
    backend: str,
) -> PagedRestore:
    if as_prefix and not adapter.uses_prefix_sharing:
        raise LayoutError(
            "the cache does not share prefix blocks (allow_block_sharing is off), so a restored "
            "prefix could not be reused; restore with as_prefix=False to keep the blocks for a "
            "request id"
        )
    layout = adapter.layout()
    with _opened(snapshot) as opened:
        record = _pick_sequence(opened, sequence_id)
        fingerprint = model.fingerprint if model is not None else None
        opened.check_compatible(layout.geometry, model_fingerprint=fingerprint, force=force)
        tokens = [int(token) for token in record.token_ids]
        owner = request_id or f"kvsnap-restore-{record.id}"
        blocks = adapter.allocate(owner, len(tokens))
        try:
            opened.restore(
                layout,
                {record.id: np.asarray(blocks, dtype=np.int64)},
                transfer=TransferOptions(backend=backend),
                model_fingerprint=fingerprint,
                force=force,
            )
        except BaseException:
            adapter.free(owner)
            raise
    if not as_prefix:
        return PagedRestore(owner, tokens, blocks, 0)
    blocks = adapter.register_complete_blocks(owner, tokens)
    adapter.free(owner)
    return PagedRestore(
        owner, tokens, blocks, (len(tokens) // adapter.block_size) * adapter.block_size
    )


# ---------------------------------------------------------------------------------------------
# Dumping from inside generate()


class KVDumpHook(LogitsProcessor):
    """Snapshot the KV cache of a running ``model.generate(...)`` at one generation step.

    A logits processor is called once per step with every token so far, right after the forward
    pass that filled the cache for them; at step ``step`` (0 is the prompt's prefill, ``s`` is
    after ``s`` generated tokens) this one captures the cache, one sequence per batch row named
    ``sequence_ids`` (default ``seq-0``, ...), with the row's tokens so far. It returns the scores
    unchanged, so generation is not affected.

    The cache object is found by a forward pre-hook on the model (``attached``), so it works with
    the cache ``generate`` creates itself::

        hook = KVDumpHook("step5.safetensors", step=5, model=loaded)
        with hook.attached(loaded.model):
            out = loaded.model.generate(ids, max_new_tokens=20, logits_processor=[hook])
        hook.result  # the CaptureResult, or None if generation stopped before step 5
    """

    def __init__(
        self,
        path: str | Path,
        *,
        step: int,
        model: LoadedModel | None = None,
        block_size: int = 16,
        sequence_ids: Sequence[str] | None = None,
        **capture_kwargs: Any,
    ) -> None:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.path = path
        self.step = step
        self.model = model
        self.block_size = block_size
        self.sequence_ids = sequence_ids
        self.capture_kwargs = capture_kwargs
        self.result: CaptureResult | None = None
        self.cache: Cache | None = None
        self._prompt_length: int | None = None

    def _remember_cache(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        for value in kwargs.values():
            if isinstance(value, Cache):
                self.cache = value
                return

    @contextmanager
    def attached(self, module: ModelLike) -> Iterator[KVDumpHook]:
        """Watch ``module``'s forward calls for the cache while the ``with`` block runs.

        Each ``with`` block starts afresh (no cache, no result, steps counted from the next
        ``generate``'s prompt), so one hook can dump several runs in turn.
        """
        self.cache, self.result, self._prompt_length = None, None, None
        handle = _module(module).register_forward_pre_hook(self._remember_cache, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._prompt_length is None:
            self._prompt_length = input_ids.shape[1]
        if input_ids.shape[1] - self._prompt_length == self.step and self.result is None:
            if self.cache is None:
                raise RuntimeError(
                    "KVDumpHook saw no cache: use it inside `with hook.attached(model):`"
                )
            self.result = capture_dynamic_cache(
                self.cache,
                input_ids,
                self.path,
                model=self.model,
                block_size=self.block_size,
                sequence_ids=self.sequence_ids,
                **self.capture_kwargs,
            )
        return scores


def dump_at_step(
    model: LoadedModel,
    input_ids: Sequence[int] | torch.Tensor,
    step: int,
    path: str | Path,
    *,
    block_size: int = 16,
    **generate_kwargs: Any,
) -> tuple[Any, CaptureResult]:
    """Run ``model.generate`` on ``input_ids`` and snapshot its KV cache at ``step``.

    Returns ``generate``'s output (unchanged by the dump) and the capture result. Raises
    ``RuntimeError`` when generation ends before ``step``.
    """
    ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor([list(input_ids)])
    ids = ids.to(model.device)
    hook = KVDumpHook(path, step=step, model=model, block_size=block_size)
    processors = LogitsProcessorList(generate_kwargs.pop("logits_processor", None) or [])
    processors.append(hook)
    with hook.attached(model.model):
        output = model.model.generate(ids, logits_processor=processors, **generate_kwargs)
    if hook.result is None:
        raise RuntimeError(f"generation ended before step {step}; nothing was dumped")
    return output, hook.result
