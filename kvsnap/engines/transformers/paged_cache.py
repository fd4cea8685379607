"""The continuous-batching ``PagedAttentionCache`` of transformers 5.17 and 5.24, one interface.

* 5.17 keeps one ``(num_blocks * page_size, kv_heads, head_dim)`` tensor per layer for K and V
  (``kvsnap.layout.flat_paged_layout``), block ids counting from 0, two trash blocks last;
* 5.24 keeps one flat byte tensor cut into sectors; a full-attention block holds every layer's
  K page then V page, i.e. ``(num_blocks, layers, 2, page_size, kv_heads, head_dim)``
  (``kvsnap.layout.cross_layer_layout``), block ids counting the two trash sectors first.

``paged_cache_adapter`` picks the ``PagedCacheAdapter`` by the cache's attributes.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import transformers

from kvsnap.engines.transformers.model import attention_types
from kvsnap.errors import CacheCapacityError
from kvsnap.layout import CacheLayout, LayoutError, cross_layer_layout, flat_paged_layout


class _PendingRequest:
    """The two things 5.24's allocator asks of a request state: its id and its cached length."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def current_len(self) -> int:
        return 0


class PagedCacheAdapter(ABC):
    """One interface over the continuous-batching cache of transformers 5.17 and 5.24.

    Use ``paged_cache_adapter`` to get one. Only caches whose layers are all full attention
    in one group are accepted; everything kvsnap does with a paged cache goes through here.
    """

    block_size: int
    cache: Any

    @abstractmethod
    def layout(self) -> CacheLayout:
        """The cache's memory as a ``CacheLayout`` (the real tensors, no copy)."""

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
    """The ``PagedCacheAdapter`` of a continuous-batching ``PagedAttentionCache`` (5.17, 5.24).

    Also accepts a ``ContinuousBatchingManager`` (its current cache; with ``create``, a manager
    without one is warmed up to create it). Raises ``kvsnap.layout.LayoutError`` for
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
    """The ``CacheLayout`` of a continuous-batching cache (see ``paged_cache_adapter``)."""
    return paged_cache_adapter(cache).layout()
