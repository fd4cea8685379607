"""What an engine's paged KV cache bytes mean, and how each local page maps onto the canonical page.

Every engine stores a block of KV differently: K and V split or packed into one row, tokens
outermost (NHD) or heads outermost (HND), one tensor per layer or one for all layers, a
tensor-parallel rank holding only some heads. kvsnap never interprets those bytes in the hot
path; instead this package describes each cache once:

* :mod:`~kvsnap.layout.geometry`: :class:`KVGeometry`, the model-level shape of one block, which
  fixes the **canonical page** (per layer and part, ``(block_size, num_kv_heads, head_dim)``
  token-major, or ``(block_size, latent_dim)`` for MLA).
* :mod:`~kvsnap.layout.mapping`: :class:`CopyRun` and :class:`CanonicalPageMapping` (local page
  bytes onto canonical page bytes), :func:`strided_page_runs`, TP head assignment and writer
  election (:func:`head_shard`); :mod:`~kvsnap.layout.tiling`: :func:`check_tiling`.
* :mod:`~kvsnap.layout.heads`: head ranges of parted snapshots (:func:`part_layout`,
  :func:`part_assignments`, :func:`head_range`).
* :mod:`~kvsnap.layout.cache`: :class:`CacheTensor`, :class:`PageRef`, :class:`CacheLayout`.
* :mod:`~kvsnap.layout.constructors`: a :class:`CacheLayout` from the real tensors of each
  engine layout (built with :mod:`~kvsnap.layout.builder`).
* :mod:`~kvsnap.layout.allocate`: allocates an engine cache of any layout kind, with logical
  views (benchmarks and tests measure and check on these).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvsnap.errors import LayoutError
from kvsnap.layout.geometry import (
    KEY,
    KV_PARTS,
    LATENT,
    MLA_PARTS,
    SAFETENSORS_DTYPES,
    VALUE,
    KVGeometry,
    canonical_name,
    dtype_name,
    torch_dtype,
)
from kvsnap.layout.mapping import (
    CanonicalPageMapping,
    CopyRun,
    HeadShard,
    fold_fragments,
    head_shard,
    strided_page_runs,
)
from kvsnap.layout.tiling import check_tiling

if TYPE_CHECKING:  # what type checkers see of the names below, imported on first use
    from kvsnap.layout.cache import CacheLayout, CacheTensor, PageRef
    from kvsnap.layout.constructors import (
        contiguous_layout,
        cross_layer_layout,
        flat_paged_layout,
        mla_layout,
        packed_layout,
        vllm_legacy_layout,
        vllm_split_layout,
    )
    from kvsnap.layout.geometry import DTYPES
    from kvsnap.layout.heads import (
        PartAssignment,
        head_range,
        part_assignments,
        part_geometry,
        part_layout,
    )

#: Names whose modules import torch, imported on first use: the geometry and the page mapping
#: (what reading a snapshot's metadata needs) come without torch.
_LAZY = {
    "kvsnap.layout.cache": ("CacheLayout", "CacheTensor", "PageRef"),
    "kvsnap.layout.constructors": (
        "contiguous_layout",
        "cross_layer_layout",
        "flat_paged_layout",
        "mla_layout",
        "packed_layout",
        "vllm_legacy_layout",
        "vllm_split_layout",
    ),
    "kvsnap.layout.geometry": ("DTYPES",),
    "kvsnap.layout.heads": (
        "PartAssignment",
        "head_range",
        "part_geometry",
        "part_layout",
        "part_assignments",
    ),
}
_MODULE_OF = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'kvsnap.layout' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "DTYPES",
    "KEY",
    "KV_PARTS",
    "LATENT",
    "MLA_PARTS",
    "SAFETENSORS_DTYPES",
    "VALUE",
    "CacheLayout",
    "CacheTensor",
    "CanonicalPageMapping",
    "CopyRun",
    "HeadShard",
    "KVGeometry",
    "LayoutError",
    "PageRef",
    "PartAssignment",
    "canonical_name",
    "check_tiling",
    "contiguous_layout",
    "cross_layer_layout",
    "dtype_name",
    "flat_paged_layout",
    "fold_fragments",
    "head_range",
    "head_shard",
    "mla_layout",
    "packed_layout",
    "part_assignments",
    "part_geometry",
    "part_layout",
    "strided_page_runs",
    "torch_dtype",
    "vllm_legacy_layout",
    "vllm_split_layout",
]
