"""Allocate an engine cache of any supported layout kind, with its layout and logical views.

Benchmarks measure transfers on real engine caches, and tests check them; both need caches laid
out the way each engine lays them out, on any device and at any tensor-parallel rank.
:func:`allocate_cache` allocates the engine tensors, describes them with the matching
:mod:`kvsnap.layout` constructor, and exposes each (layer, part) as a *logical view*: a
``(num_blocks, block_size, local_heads, head_dim)`` tensor (``(num_blocks, block_size,
latent_dim)`` for MLA) built with plain torch indexing and transposes of the engine tensor. The
logical views never go through copy runs, so they are an independent check of what the layout,
the planner and the transfer backends compute. A rank's cache holds the head slice
:func:`~kvsnap.layout.mapping.head_shard` assigns it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvsnap.layout.cache import CacheLayout
from kvsnap.layout.constructors import (
    contiguous_layout,
    cross_layer_layout,
    flat_paged_layout,
    mla_layout,
    packed_layout,
    vllm_legacy_layout,
    vllm_split_layout,
)
from kvsnap.layout.geometry import LATENT
from kvsnap.layout.mapping import head_shard

#: Every layout kind this module builds. ``flat-paged`` and ``contiguous`` are TP=1 only.
LAYOUT_KINDS = (
    "vllm-nhd",
    "vllm-hnd",
    "vllm-legacy",
    "packed",
    "cross-layer",
    "flat-paged",
    "contiguous",
    "mla",
)
#: Kinds whose constructor takes a tensor-parallel rank.
TP_KINDS = ("vllm-nhd", "vllm-hnd", "vllm-legacy", "packed", "cross-layer", "mla")
#: Kinds for standard attention (all but MLA).
HEAD_KINDS = tuple(kind for kind in LAYOUT_KINDS if kind != "mla")


@dataclass
class AllocatedCache:
    """An engine cache of one layout kind, its :class:`CacheLayout` and its logical views."""

    kind: str
    layout: CacheLayout
    tensors: list[torch.Tensor]
    views: dict[str, torch.Tensor]
    heads: slice  # global KV heads this rank holds (all for MLA)

    def logical(self, name: str) -> torch.Tensor:
        """``(num_blocks, block_size, local_heads, head_dim)`` view (MLA: ``(..., latent_dim)``)."""
        return self.views[name]


@dataclass(frozen=True)
class _Spec:
    """What a layout builder allocates: one rank's share of a model's cache."""

    num_layers: int
    num_blocks: int
    block_size: int
    local_heads: int
    head_dim: int
    total_heads: int
    tp_rank: int
    tp_size: int
    dtype: torch.dtype
    device: torch.device
    fill: str
    attention_types: Sequence[str] | None

    def sharding(self) -> dict[str, Any]:
        """The keyword arguments every head-sharded layout constructor takes."""
        return {
            "num_kv_heads": self.total_heads,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "attention_types": self.attention_types,
        }

    def new(self, *shape: int) -> torch.Tensor:
        if self.fill == "zeros":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.fill == "empty":
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        raise ValueError(f"fill must be 'zeros' or 'empty', not {self.fill!r}")


def allocate_cache(
    kind: str,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int = 0,
    head_dim: int = 0,
    latent_dim: int = 0,
    dtype: torch.dtype = torch.float16,
    device: torch.device | str = "cpu",
    tp_rank: int = 0,
    tp_size: int = 1,
    fill: str = "zeros",
    attention_types: Sequence[str] | None = None,
) -> AllocatedCache:
    """Allocate a cache of layout ``kind`` for a model with ``num_kv_heads`` heads in total.

    ``tp_rank``/``tp_size`` pick the head slice the rank holds (kinds in :data:`TP_KINDS`);
    MLA takes ``latent_dim`` instead of heads. The cache is zeroed (``fill="zeros"``) or left
    uninitialized (``"empty"``, for benchmarks).
    """
    device = torch.device(device)
    if kind not in LAYOUT_KINDS:
        raise ValueError(f"unknown layout kind {kind!r}; known: {', '.join(LAYOUT_KINDS)}")
    if tp_size > 1 and kind not in TP_KINDS:
        raise ValueError(f"layout kind {kind!r} has no tensor-parallel form")
    is_mla = kind == "mla"
    shard = head_shard(
        1 if is_mla else num_kv_heads, 0 if is_mla else tp_rank, 1 if is_mla else tp_size
    )
    spec = _Spec(
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        local_heads=shard.num_local_heads,
        head_dim=latent_dim if is_mla else head_dim,
        total_heads=num_kv_heads,
        tp_rank=tp_rank,
        tp_size=tp_size,
        dtype=dtype,
        device=device,
        fill=fill,
        attention_types=attention_types,
    )
    if is_mla:
        tensors = [spec.new(num_blocks, block_size, latent_dim) for _ in range(num_layers)]
        layout = mla_layout(
            tensors, tp_rank=tp_rank, tp_size=tp_size, attention_types=attention_types
        )
        views = {f"layers.{layer}.{LATENT}": tensor for layer, tensor in enumerate(tensors)}
        return AllocatedCache(kind, layout, tensors, views, slice(None))
    heads = slice(shard.first_head, shard.first_head + shard.num_local_heads)
    tensors, layout, view_of = _BUILDERS[kind](spec)
    views = {}
    for layer in range(num_layers):
        for part_index, part in enumerate(layout.geometry.parts):
            views[f"layers.{layer}.{part}"] = view_of(layer, part_index)
    return AllocatedCache(kind, layout, tensors, views, heads)


#: A builder's result: engine tensors, their layout, and the logical view of (layer, part index).
_Built = tuple[list[torch.Tensor], CacheLayout, Callable[[int, int], torch.Tensor]]


def _vllm_split_nhd(spec: _Spec) -> _Built:
    s = spec
    tensors = [
        s.new(s.num_blocks, 2, s.block_size, s.local_heads, s.head_dim) for _ in range(s.num_layers)
    ]
    return _vllm_split(spec, tensors)


def _vllm_split_hnd(spec: _Spec) -> _Built:
    s = spec
    # vLLM allocates head-major physically and permutes to the logical shape.
    tensors = [
        s.new(s.num_blocks, 2, s.local_heads, s.block_size, s.head_dim).permute(0, 1, 3, 2, 4)
        for _ in range(s.num_layers)
    ]
    return _vllm_split(spec, tensors)


def _vllm_split(spec: _Spec, tensors: list[torch.Tensor]) -> _Built:
    layout = vllm_split_layout(tensors, **spec.sharding())
    return tensors, layout, lambda layer, part: tensors[layer][:, part]


def _vllm_legacy(spec: _Spec) -> _Built:
    s = spec
    tensors = [
        s.new(2, s.num_blocks, s.block_size, s.local_heads, s.head_dim) for _ in range(s.num_layers)
    ]
    layout = vllm_legacy_layout(tensors, **s.sharding())
    return tensors, layout, lambda layer, part: tensors[layer][part]


def _packed(spec: _Spec) -> _Built:
    s, dim = spec, spec.head_dim
    tensors = [
        s.new(s.num_blocks, s.local_heads, s.block_size, 2 * dim) for _ in range(s.num_layers)
    ]
    layout = packed_layout(tensors, **s.sharding())
    return (
        tensors,
        layout,
        lambda layer, part: tensors[layer][..., part * dim : (part + 1) * dim].transpose(1, 2),
    )


def _cross_layer(spec: _Spec) -> _Built:
    s = spec
    tensor = s.new(s.num_blocks, s.num_layers, 2, s.block_size, s.local_heads, s.head_dim)
    layout = cross_layer_layout(tensor, **s.sharding())
    return [tensor], layout, lambda layer, part: tensor[:, layer, part]


def _flat_paged(spec: _Spec) -> _Built:
    s = spec
    rows = s.num_blocks * s.block_size
    keys = [s.new(rows, s.local_heads, s.head_dim) for _ in range(s.num_layers)]
    values = [s.new(rows, s.local_heads, s.head_dim) for _ in range(s.num_layers)]
    layout = flat_paged_layout(
        keys, values, block_size=s.block_size, attention_types=s.attention_types
    )

    def view(layer: int, part: int) -> torch.Tensor:
        return (keys if part == 0 else values)[layer].unflatten(0, (s.num_blocks, s.block_size))

    return [*keys, *values], layout, view


def _contiguous(spec: _Spec) -> _Built:
    s = spec
    # A batch of two rows, the cache described from row 1, so the batch stride is exercised too.
    seq = s.num_blocks * s.block_size
    keys = [s.new(2, s.local_heads, seq, s.head_dim) for _ in range(s.num_layers)]
    values = [s.new(2, s.local_heads, seq, s.head_dim) for _ in range(s.num_layers)]
    layout = contiguous_layout(
        keys, values, block_size=s.block_size, batch_index=1, attention_types=s.attention_types
    )

    def view(layer: int, part: int) -> torch.Tensor:
        row = (keys if part == 0 else values)[layer][1]  # (heads, seq, head_dim)
        return row.transpose(0, 1).unflatten(0, (s.num_blocks, s.block_size))

    return [*keys, *values], layout, view


_BUILDERS: dict[str, Callable[[_Spec], _Built]] = {
    "vllm-nhd": _vllm_split_nhd,
    "vllm-hnd": _vllm_split_hnd,
    "vllm-legacy": _vllm_legacy,
    "packed": _packed,
    "cross-layer": _cross_layer,
    "flat-paged": _flat_paged,
    "contiguous": _contiguous,
}
