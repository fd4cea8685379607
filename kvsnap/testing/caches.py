"""Synthetic KV caches in every supported engine layout, with known content.

Tests need caches whose bytes they know, laid out the way each engine lays them out, on any
device and at any tensor-parallel rank. :func:`make_cache` allocates one through the library's
:func:`kvsnap.layout.allocate.allocate_cache` (engine tensors, their layout, and a *logical view*
per (layer, part) built with plain torch indexing, never through copy runs, so an independent
oracle for what :mod:`kvsnap.layout`, :mod:`kvsnap.transfer.plan` and the transfer backends
compute) and adds what tests need on top: writing known content and saying what each view must hold.

Content is a :class:`KVContent`: the TP=1 canonical pages of every block, as random bytes. A
rank's cache holds the head slice :func:`kvsnap.layout.head_shard` assigns it, so ranks of one
model hold consistent data and replicated heads are identical.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvsnap.layout import KVGeometry, torch_dtype
from kvsnap.layout.allocate import (
    HEAD_KINDS,
    LAYOUT_KINDS,
    TP_KINDS,
    AllocatedCache,
    allocate_cache,
)

__all__ = [
    "HEAD_KINDS",
    "LAYOUT_KINDS",
    "TP_KINDS",
    "KVContent",
    "SyntheticCache",
    "make_cache",
    "random_content",
    "same_bytes",
]


@dataclass(frozen=True)
class KVContent:
    """The TP=1 canonical pages of ``num_blocks`` blocks: ``pages[name]`` is
    ``(num_blocks, *canonical_page_shape)`` in the geometry's dtype."""

    geometry: KVGeometry
    pages: dict[str, torch.Tensor]

    @property
    def num_blocks(self) -> int:
        return next(iter(self.pages.values())).shape[0]


def random_content(geometry: KVGeometry, num_blocks: int, generator: torch.Generator) -> KVContent:
    """Random bytes (NaN payloads included) for every canonical page of ``num_blocks`` blocks."""
    dtype = torch_dtype(geometry.dtype)
    element_size = geometry.element_size
    pages = {}
    for name in geometry.tensor_names():
        shape = (num_blocks, *geometry.canonical_page_shape)
        raw = torch.randint(
            0, 256, (*shape[:-1], shape[-1] * element_size), dtype=torch.uint8, generator=generator
        )
        pages[name] = raw.view(dtype)
    return KVContent(geometry, pages)


def same_bytes(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Bit-exact equality of two tensors of one shape and dtype (NaN payloads included)."""
    if first.shape != second.shape or first.dtype != second.dtype:
        return False
    as_bytes = [tensor.contiguous().view(torch.uint8) for tensor in (first, second)]
    return torch.equal(as_bytes[0].cpu(), as_bytes[1].cpu())


@dataclass
class SyntheticCache(AllocatedCache):
    """An :class:`~kvsnap.layout.allocate.AllocatedCache` that can be filled with known content."""

    def expected(self, content: KVContent, name: str, blocks: torch.Tensor) -> torch.Tensor:
        """What this rank's logical view must hold for ``content``'s pages ``blocks``."""
        pages = content.pages[name][blocks]
        return pages if self.layout.geometry.is_mla else pages[:, :, self.heads]

    def fill(self, content: KVContent, blocks: torch.Tensor | None = None) -> None:
        """Write page ``i`` of ``content`` into block ``blocks[i]`` (default ``i``) of each view."""
        for name, view in self.views.items():
            target = torch.arange(view.shape[0]) if blocks is None else blocks
            source = self.expected(content, name, torch.arange(len(target)))
            view[target.to(view.device)] = source.to(view.device)


def make_cache(
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
) -> SyntheticCache:
    """Allocate a cache of layout ``kind`` (see :func:`~kvsnap.layout.allocate.allocate_cache`).

    The cache is zeroed (``fill="zeros"``) or left uninitialized (``"empty"``);
    :meth:`SyntheticCache.fill` writes content.
    """
    allocated = allocate_cache(
        kind,
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        latent_dim=latent_dim,
        dtype=dtype,
        device=device,
        tp_rank=tp_rank,
        tp_size=tp_size,
        fill=fill,
        attention_types=attention_types,
    )
    fields = {field.name: getattr(allocated, field.name) for field in dataclasses.fields(allocated)}
    return SyntheticCache(**fields)
