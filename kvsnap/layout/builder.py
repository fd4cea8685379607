"""The shared machinery of the layout constructors: a builder and the checks they all make."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvsnap.errors import LayoutError
from kvsnap.layout.cache import CacheLayout, CacheTensor, PageRef
from kvsnap.layout.geometry import LATENT, KVGeometry, dtype_name
from kvsnap.layout.mapping import (
    CanonicalPageMapping,
    CopyRun,
    HeadShard,
    head_shard,
    strided_page_runs,
)


def _byte_offset(view: torch.Tensor, base: torch.Tensor) -> int:
    return view.data_ptr() - base.data_ptr()


class LayoutBuilder:
    """Accumulates tensors and refs for one layout; keeps the constructors short."""

    def __init__(self, geometry: KVGeometry, tp_rank: int, tp_size: int) -> None:
        self.geometry = geometry
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tensors: list[CacheTensor] = []
        self.refs: list[PageRef] = []

    def add_tensor(self, tensor: torch.Tensor, block_stride_elements: int, num_blocks: int) -> int:
        self.tensors.append(
            CacheTensor(
                tensor=tensor,
                num_blocks=num_blocks,
                block_stride_bytes=block_stride_elements * tensor.element_size(),
                data_ptr=tensor.data_ptr(),
            )
        )
        return len(self.tensors) - 1

    def add_heads_part(
        self,
        tensor_index: int,
        layer: int,
        part: str,
        page_view: torch.Tensor,
        shard: HeadShard,
    ) -> None:
        """``page_view``: block 0's (tokens, local_heads, head_dim) view inside the tensor."""
        base = self.tensors[tensor_index].tensor
        tokens, local_heads, head_dim = page_view.shape
        runs = strided_page_runs(
            element_size=page_view.element_size(),
            offset_bytes=_byte_offset(page_view, base),
            token_stride=page_view.stride(0),
            head_stride=page_view.stride(1),
            dim_stride=page_view.stride(2),
            block_size=tokens,
            num_local_heads=local_heads,
            head_dim=head_dim,
            num_total_heads=self.geometry.num_kv_heads,
            first_head=shard.first_head,
        )
        self._add(tensor_index, layer, part, runs, shard)

    def add_latent_part(
        self, tensor_index: int, layer: int, page_view: torch.Tensor, shard: HeadShard
    ) -> None:
        """``page_view``: block 0's (tokens, latent_dim) view inside the tensor."""
        base = self.tensors[tensor_index].tensor
        runs = strided_page_runs(
            element_size=page_view.element_size(),
            offset_bytes=_byte_offset(page_view, base),
            token_stride=page_view.stride(0),
            head_stride=0,
            dim_stride=page_view.stride(1),
            block_size=page_view.shape[0],
            num_local_heads=1,
            head_dim=page_view.shape[1],
            num_total_heads=1,
            first_head=0,
        )
        self._add(tensor_index, layer, LATENT, runs, shard)

    def _add(
        self, tensor_index: int, layer: int, part: str, runs: tuple[CopyRun, ...], shard: HeadShard
    ) -> None:
        mapping = CanonicalPageMapping(
            canonical_page_size_bytes=self.geometry.canonical_page_size_bytes,
            runs=runs,
            num_writers=shard.num_writers,
            writer_index=shard.writer_index,
        )
        self.refs.append(PageRef(tensor_index, layer, part, mapping))

    def build(self, encoding: str) -> CacheLayout:
        return CacheLayout(
            geometry=self.geometry,
            tensors=self.tensors,
            refs=self.refs,
            encoding=encoding,
            tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )


def head_geometry(
    num_layers: int,
    block_size: int,
    dtype: torch.dtype,
    num_kv_heads: int,
    head_dim: int,
    attention_types: Sequence[str] | None,
) -> KVGeometry:
    """The standard-attention geometry of a cache whose tensors hold ``dtype``."""
    return KVGeometry(
        num_layers=num_layers,
        block_size=block_size,
        dtype=dtype_name(dtype),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        attention_types=tuple(attention_types or ()),
    )


def require(condition: bool, message: str) -> None:
    """Raise :class:`LayoutError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise LayoutError(message)


def tp_shard(num_kv_heads: int, local_heads: int, tp_rank: int, tp_size: int) -> HeadShard:
    """The rank's :class:`HeadShard`, checked against the ``local_heads`` its cache holds."""
    shard = head_shard(num_kv_heads, tp_rank, tp_size)
    require(
        shard.num_local_heads == local_heads,
        f"the cache holds {local_heads} KV heads per rank, but {num_kv_heads} heads over TP "
        f"{tp_size} give {shard.num_local_heads}",
    )
    return shard


def uniform_layers(
    kv_caches: Sequence[torch.Tensor], shape_text: str, ndim: int, *, pair_dim: int | None = None
) -> torch.Tensor:
    """Layer 0's tensor, after checking every layer has its shape and dtype.

    ``pair_dim`` names a dimension that must have size 2 (K and V); ``shape_text`` is the
    expected shape as the error shows it.
    """
    require(len(kv_caches) > 0, "no KV cache tensors given")
    first = kv_caches[0]
    require(
        first.dim() == ndim and (pair_dim is None or first.shape[pair_dim] == 2),
        f"expected {shape_text}, got {tuple(first.shape)}",
    )
    for layer, cache in enumerate(kv_caches):
        require(
            cache.shape == first.shape and cache.dtype == first.dtype,
            f"layer {layer} differs from layer 0: {tuple(cache.shape)} {cache.dtype}",
        )
    return first


def sharded_builder(
    first: torch.Tensor,
    *,
    num_layers: int,
    block_size: int,
    local_heads: int,
    head_dim: int,
    num_kv_heads: int | None,
    tp_rank: int,
    tp_size: int,
    attention_types: Sequence[str] | None,
) -> tuple[LayoutBuilder, HeadShard]:
    """A builder for a head-sharded cache and the rank's shard (``num_kv_heads``: the total)."""
    total_heads = num_kv_heads or local_heads * tp_size
    geometry = head_geometry(
        num_layers, block_size, first.dtype, total_heads, head_dim, attention_types
    )
    shard = tp_shard(total_heads, local_heads, tp_rank, tp_size)
    return LayoutBuilder(geometry, tp_rank, tp_size), shard
