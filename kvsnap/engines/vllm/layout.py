"""The cache layouts vLLM registers, described as a kvsnap :class:`~kvsnap.layout.CacheLayout`.

Per layer and TP rank vLLM registers a ``[B, H, N, C]`` tensor (blocks, KV heads, tokens,
content). :func:`vllm_layout` builds the copy runs from what vLLM says about it: the physical
layout it resolved (``LBHNC``, ``LBNHC``, ...), checked against the tensors' real strides, and
the attention backend, which decides how K and V share the content axis. Backends that order
the elements of a block their own way (CPU) need the :class:`BlockOrder` that
:func:`probe_block_order` learns from vLLM's own cache-writing kernel. Anything else is refused
with a :class:`~kvsnap.layout.LayoutError`.

Nothing here needs vLLM: the functions take tensors, names and a kernel callable.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvsnap.layout import (
    KEY,
    VALUE,
    CacheLayout,
    CacheTensor,
    CanonicalPageMapping,
    CopyRun,
    HeadShard,
    KVGeometry,
    LayoutError,
    PageRef,
    dtype_name,
    fold_fragments,
    head_shard,
    vllm_split_layout,
)

#: Per layer and TP rank vLLM registers a logical ``[B, H, N, C]`` view (blocks, KV heads,
#: tokens, content); the attention backend decides how K and V share the content axis.
#: ``kv-planes``: the CPU backend splits each (block, head) plane ``[N, 2*D]`` into a key half
#: and a value half, and its kernels order the elements inside each half their own way (AMX
#: wants bf16 pairs interleaved), so the order is learned from vLLM's own cache-writing op
#: (:func:`probe_block_order`). ``kv-cells``: each (token, head) cell is key ‖ value.
KV_PLANES = "kv-planes"
KV_CELLS = "kv-cells"
#: The attention backends whose packing was read from their source (vLLM 0.32), by name.
BACKEND_KV_PACKING: dict[str, str] = {
    "CPU_ATTN": KV_PLANES,
    "FLASH_ATTN": KV_CELLS,
    "TRITON_ATTN": KV_CELLS,
}
#: vLLM's named physical layouts of the 5-D ``[L, B, H, N, C]`` cache (``KVCacheLayout``),
#: reduced to the physical order (outermost first) of one layer's ``[B, H, N, C]`` axes.
LAYER_AXIS_ORDER: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3),
    "LBNHC": (0, 2, 1, 3),
    "LHBNC": (1, 0, 2, 3),
    "BLHNC": (0, 1, 2, 3),
    "BLNHC": (0, 2, 1, 3),
    "BHLNC": (0, 1, 2, 3),
}
_AXIS_NAMES = "BHNC"


def _check_strides_follow(name: str, tensor: torch.Tensor, layout_name: str) -> None:
    """Refuse a tensor whose real strides contradict the physical layout vLLM reported."""
    order = LAYER_AXIS_ORDER[layout_name]
    shape, strides = tensor.shape, tensor.stride()
    if strides[3] != 1:
        raise LayoutError(f"{name}: the content axis C must be contiguous, strides are {strides}")
    # Axes of size 1 carry no order; among the others each outer axis must step over the inner.
    real = [axis for axis in order if shape[axis] > 1]
    for outer, inner in itertools.pairwise(real):
        if strides[outer] < strides[inner] * shape[inner]:
            raise LayoutError(
                f"{name}: vLLM reported the {layout_name} layout, but axis "
                f"{_AXIS_NAMES[outer]} (stride {strides[outer]}) does not enclose axis "
                f"{_AXIS_NAMES[inner]} (stride {strides[inner]}, size {shape[inner]}); "
                f"shape {tuple(shape)}, strides {strides}"
            )


@dataclass(frozen=True)
class BlockOrder:
    """Where an attention kernel puts each K and V element inside one cache block.

    ``key[t, h, d]`` and ``value[t, h, d]`` are element offsets from the block's start of
    token ``t``, local head ``h``, dim ``d`` (int64 arrays ``(block_size, heads, head_size)``).
    """

    key: np.ndarray
    value: np.ndarray

    def check(self, heads: int, block_size: int, head_size: int) -> None:
        """Refuse an order learned for another block shape."""
        if self.key.shape != (block_size, heads, head_size) or self.value.shape != self.key.shape:
            raise LayoutError(
                f"the block order was learned for blocks of {self.key.shape} (tokens, heads, "
                f"dims), the cache holds {(block_size, heads, head_size)}"
            )

    def runs(
        self, part: str, element_size: int, num_total_heads: int, first_head: int
    ) -> tuple[CopyRun, ...]:
        """Copy runs from this order onto the canonical token-major page of ``part``."""
        offsets = self.key if part == KEY else self.value
        tokens, heads, dims = np.indices(offsets.shape, dtype=np.int64)
        canonical = (tokens * num_total_heads + first_head + heads) * offsets.shape[2] + dims
        return fold_fragments(
            offsets.ravel() * element_size, canonical.ravel() * element_size, element_size
        )


#: ``write(key, value, block)`` stores ``key`` and ``value`` (``(block_size, heads, head_size)``)
#: as tokens ``0..block_size-1`` of a one-block cache ``block`` (``(1, heads, block_size, 2D)``).
BlockWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


def probe_block_order(
    write: BlockWriter, *, heads: int, block_size: int, head_size: int, dtype: torch.dtype
) -> BlockOrder:
    """Learn where ``write`` (the engine's own cache-writing kernel) puts each K and V element.

    Three writes into a zeroed one-block cache tag every element with its token, head and dim
    (small integers, exact in every float dtype kvsnap supports; keys positive, values
    negative). Every element of the block must be written exactly once, by exactly one
    (part, token, head, dim); otherwise :class:`~kvsnap.layout.LayoutError`.
    """
    shape = (block_size, heads, head_size)
    tokens, head_ids, dims = (axis + 1 for axis in np.indices(shape))
    tags = []
    for labels in (tokens, head_ids, dims):
        block = torch.zeros((1, heads, block_size, 2 * head_size), dtype=dtype)
        tag = torch.from_numpy(labels.astype(np.float32)).to(dtype)
        write(tag, -tag, block)
        tags.append(block.reshape(-1).float().numpy())
    token_tag, head_tag, dim_tag = tags
    written = (token_tag != 0) & (head_tag != 0) & (dim_tag != 0)
    if not written.all() or (np.sign(token_tag) != np.sign(head_tag)).any():
        raise LayoutError(
            "vLLM's cache-writing kernel left elements of a block unwritten or mixed K and V: "
            "kvsnap cannot map this cache"
        )
    order = []
    for sign in (1, -1):
        mine = np.flatnonzero(np.sign(token_tag) == sign)
        t = np.rint(np.abs(token_tag[mine])).astype(np.int64) - 1
        h = np.rint(np.abs(head_tag[mine])).astype(np.int64) - 1
        d = np.rint(np.abs(dim_tag[mine])).astype(np.int64) - 1
        offsets = np.full(shape, -1, dtype=np.int64)
        inside = (t < block_size) & (h < heads) & (d < head_size)
        if len(mine) != np.prod(shape) or not inside.all():
            raise LayoutError("vLLM's cache-writing kernel does not store one value per element")
        offsets[t, h, d] = mine
        if (offsets < 0).any():
            raise LayoutError("vLLM's cache-writing kernel stored an element twice")
        order.append(offsets)
    return BlockOrder(key=order[0], value=order[1])


def vllm_layout(
    kv_caches: Sequence[torch.Tensor],
    *,
    backend: str,
    kv_cache_layout: str,
    head_size: int,
    num_kv_heads: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    attention_types: Sequence[str] | None = None,
    block_order: BlockOrder | None = None,
) -> CacheLayout:
    """The :class:`CacheLayout` of vLLM's per-layer ``[B, H, N, C]`` cache views.

    ``kv_caches`` holds one registered tensor per attention layer, in layer order; ``backend``
    is the attention backend's name (a key of :data:`BACKEND_KV_PACKING`), ``kv_cache_layout``
    the physical layout vLLM resolved (a key of :data:`LAYER_AXIS_ORDER`), ``head_size`` the
    head dimension and ``num_kv_heads`` the model's total KV heads. ``kv-cells`` backends are
    vLLM's split cache seen through a ``[B, 2, N, H, D]`` view, built by
    :func:`kvsnap.layout.vllm_split_layout` (copy runs from the real strides); ``kv-planes``
    (CPU) backends need ``block_order``, the element order inside a block that
    :func:`probe_block_order` learned from vLLM's kernel. A backend, layout, shape or stride
    that does not fit raises :class:`~kvsnap.layout.LayoutError` naming what was found.
    """
    packing = _check_caches(kv_caches, backend, kv_cache_layout, head_size)
    encoding = f"vllm-{backend.lower().replace('_', '-')}-{kv_cache_layout.lower()}"
    if packing == KV_CELLS:
        # Each (token, head) cell is key ‖ value: [B, H, N, 2, D] permuted to vLLM's split
        # [B, 2, N, H, D], a strided view of the same bytes.
        split = [cache.unflatten(3, (2, head_size)).permute(0, 3, 2, 1, 4) for cache in kv_caches]
        layout = vllm_split_layout(
            split,
            num_kv_heads=num_kv_heads,
            tp_rank=tp_rank,
            tp_size=tp_size,
            attention_types=attention_types,
        )
        return dataclasses.replace(layout, encoding=encoding)
    return _planes_layout(
        kv_caches,
        backend=backend,
        head_size=head_size,
        num_kv_heads=num_kv_heads,
        shard_of=(tp_rank, tp_size),
        attention_types=attention_types,
        block_order=block_order,
        encoding=encoding,
    )


def _check_caches(
    kv_caches: Sequence[torch.Tensor], backend: str, kv_cache_layout: str, head_size: int
) -> str:
    """The backend's K/V packing, after checking every tensor against what vLLM reported."""
    packing = BACKEND_KV_PACKING.get(backend)
    if packing is None:
        raise LayoutError(
            f"kvsnap does not know how the {backend!r} attention backend stores K and V "
            f"(known: {', '.join(sorted(BACKEND_KV_PACKING))})"
        )
    if kv_cache_layout not in LAYER_AXIS_ORDER:
        raise LayoutError(
            f"unknown vLLM KV cache layout {kv_cache_layout!r} "
            f"(known: {', '.join(LAYER_AXIS_ORDER)})"
        )
    if not kv_caches:
        raise LayoutError("vLLM registered no KV cache tensors")
    first = kv_caches[0]
    if first.dim() != 4:
        raise LayoutError(f"expected per-layer [B, H, N, C] views, got shape {tuple(first.shape)}")
    if first.shape[3] != 2 * head_size:
        raise LayoutError(
            f"the content axis holds {first.shape[3]} elements, K and V of head size "
            f"{head_size} need {2 * head_size}"
        )
    for layer, cache in enumerate(kv_caches):
        if cache.shape != first.shape or cache.dtype != first.dtype:
            raise LayoutError(
                f"layer {layer} is {tuple(cache.shape)} {cache.dtype}, layer 0 is "
                f"{tuple(first.shape)} {first.dtype}"
            )
        _check_strides_follow(f"layer {layer}", cache, kv_cache_layout)
    return packing


def _rank_shard(num_kv_heads: int, local_heads: int, tp_rank: int, tp_size: int) -> HeadShard:
    """The rank's head shard; refused when the cache does not hold that many heads."""
    shard = head_shard(num_kv_heads, tp_rank, tp_size)
    if shard.num_local_heads != local_heads:
        raise LayoutError(
            f"the cache holds {local_heads} KV heads per rank, but {num_kv_heads} heads over "
            f"TP {tp_size} give {shard.num_local_heads}"
        )
    return shard


def _planes_layout(
    kv_caches: Sequence[torch.Tensor],
    *,
    backend: str,
    head_size: int,
    num_kv_heads: int,
    shard_of: tuple[int, int],
    attention_types: Sequence[str] | None,
    block_order: BlockOrder | None,
    encoding: str,
) -> CacheLayout:
    """The layout of a ``kv-planes`` (CPU) cache, whose blocks follow ``block_order``."""
    first = kv_caches[0]
    num_blocks, local_heads, block_size, content = first.shape
    if block_order is None:
        raise LayoutError(
            f"the {backend} backend orders each block its own way: pass the "
            "block_order probe_block_order() learned from vLLM's kernel"
        )
    block_order.check(local_heads, block_size, head_size)
    geometry = KVGeometry(
        num_layers=len(kv_caches),
        block_size=block_size,
        dtype=dtype_name(first.dtype),
        num_kv_heads=num_kv_heads,
        head_dim=head_size,
        attention_types=tuple(attention_types or ()),
    )
    tp_rank, tp_size = shard_of
    shard = _rank_shard(num_kv_heads, local_heads, tp_rank, tp_size)
    element_size = first.element_size()
    tensors: list[CacheTensor] = []
    refs: list[PageRef] = []
    for layer, cache in enumerate(kv_caches):
        block_stride, head_stride, token_stride, _ = cache.stride()
        # The kernel addresses a block as one contiguous [H, N, 2D] region.
        if (head_stride, token_stride) != (block_size * content, content):
            raise LayoutError(
                f"layer {layer}: the {backend} backend needs each block contiguous, strides "
                f"are {cache.stride()}"
            )
        tensors.append(
            CacheTensor(
                tensor=cache,
                num_blocks=num_blocks,
                block_stride_bytes=block_stride * element_size,
                data_ptr=cache.data_ptr(),
            )
        )
        for part in (KEY, VALUE):
            mapping = CanonicalPageMapping(
                canonical_page_size_bytes=geometry.canonical_page_size_bytes,
                runs=block_order.runs(part, element_size, num_kv_heads, shard.first_head),
                num_writers=shard.num_writers,
                writer_index=shard.writer_index,
            )
            refs.append(PageRef(len(tensors) - 1, layer, part, mapping))
    return CacheLayout(geometry, tensors, refs, encoding, tp_rank=tp_rank, tp_size=tp_size)
