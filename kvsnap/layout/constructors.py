"""Engine-neutral ``CacheLayout`` constructors from real tensors.

vLLM split (NHD or HND physically) and legacy, packed K|V rows, MLA latents, one cross-layer
tensor, transformers' flat paged cache, and contiguous ``DynamicCache`` tensors. Each reads the
tensors' shapes and strides and goes through ``kvsnap.layout.mapping.strided_page_runs``, so a
new layout is a few lines and never a new copy loop. No constructor copies or keeps anything
but the tensors' addresses: the layout describes memory the engine owns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvsnap.layout.builder import (
    LayoutBuilder,
    head_geometry,
    require,
    sharded_builder,
    tp_shard,
    uniform_layers,
)
from kvsnap.layout.cache import CacheLayout
from kvsnap.layout.geometry import KEY, KV_PARTS, VALUE, KVGeometry, dtype_name
from kvsnap.layout.mapping import HeadShard


def vllm_split_layout(
    kv_caches: Sequence[torch.Tensor],
    *,
    num_kv_heads: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    attention_types: Sequence[str] | None = None,
) -> CacheLayout:
    """vLLM's split cache: per layer ``(num_blocks, 2, block_size, heads, head_dim)``.

    The shape is the logical one; the physical order may be NHD or HND (vLLM allocates HND
    physically and permutes), and the runs follow the real strides either way.

    Args:
        kv_caches: One tensor per layer, K at index 0 and V at index 1 of dimension 1; this
            rank's heads only.
        num_kv_heads: The model's total number of KV heads. Default ``None``: the local
            count times ``tp_size``.
        tp_rank: This rank in the tensor-parallel group. Default ``0``.
        tp_size: The tensor-parallel group's size. Default ``1``.
        attention_types: Per layer ``"full"`` or ``"sliding"``. Default ``None``: all full.

    Returns:
        The ``CacheLayout`` of the tensors (encoding ``vllm-split-nhd`` or ``-hnd``).

    Raises:
        LayoutError: The tensors are not of this layout (wrong rank of shape, layers that
            differ, heads that do not divide among the ranks), or not exactly mappable.

    Example:
        >>> import torch, kvsnap
        >>> kv_caches = [torch.zeros(8, 2, 16, 2, 64) for _ in range(2)]  # this rank: 2 of 4
        >>> layout = kvsnap.vllm_split_layout(kv_caches, num_kv_heads=4, tp_rank=1, tp_size=2)
        >>> layout.encoding, layout.geometry.num_kv_heads, layout.num_blocks, layout.tp_rank
        ('vllm-split-nhd', 4, 8, 1)
        >>> hnd = [torch.zeros(8, 2, 2, 16, 64).transpose(2, 3) for _ in range(2)]
        >>> kvsnap.vllm_split_layout(hnd).encoding
        'vllm-split-hnd'
    """
    first = uniform_layers(kv_caches, "(num_blocks, 2, block_size, heads, head_dim)", 5, pair_dim=1)
    num_blocks, _, block_size, local_heads, head_dim = first.shape
    builder, shard = sharded_builder(
        first,
        num_layers=len(kv_caches),
        block_size=block_size,
        local_heads=local_heads,
        head_dim=head_dim,
        num_kv_heads=num_kv_heads,
        tp_rank=tp_rank,
        tp_size=tp_size,
        attention_types=attention_types,
    )
    for layer, cache in enumerate(kv_caches):
        index = builder.add_tensor(cache, cache.stride(0), num_blocks)
        builder.add_heads_part(index, layer, KEY, cache[0, 0], shard)
        builder.add_heads_part(index, layer, VALUE, cache[0, 1], shard)
    physical = "hnd" if first.stride(3) > first.stride(2) else "nhd"
    return builder.build(f"vllm-split-{physical}")


def vllm_legacy_layout(
    kv_caches: Sequence[torch.Tensor],
    *,
    num_kv_heads: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    attention_types: Sequence[str] | None = None,
) -> CacheLayout:
    """The older vLLM layout: per layer ``(2, num_blocks, block_size, heads, head_dim)``.

    K and V are two block-major halves of one tensor; each half is registered as its own tensor.

    Args:
        kv_caches: One tensor per layer, K then V along dimension 0; this rank's heads only.
        num_kv_heads: The model's total number of KV heads. Default ``None``: the local
            count times ``tp_size``.
        tp_rank: This rank in the tensor-parallel group. Default ``0``.
        tp_size: The tensor-parallel group's size. Default ``1``.
        attention_types: Per layer ``"full"`` or ``"sliding"``. Default ``None``: all full.

    Returns:
        The ``CacheLayout`` of the tensors (encoding ``vllm-legacy``).

    Raises:
        LayoutError: The tensors are not of this layout (wrong rank of shape, layers that
            differ, heads that do not divide among the ranks), or not exactly mappable.

    Example:
        >>> import torch, kvsnap
        >>> layout = kvsnap.vllm_legacy_layout([torch.zeros(2, 8, 16, 2, 64) for _ in range(2)])
        >>> layout.encoding, layout.num_blocks, len(layout.tensors)
        ('vllm-legacy', 8, 4)
    """
    first = uniform_layers(kv_caches, "(2, num_blocks, block_size, heads, head_dim)", 5, pair_dim=0)
    _, num_blocks, block_size, local_heads, head_dim = first.shape
    builder, shard = sharded_builder(
        first,
        num_layers=len(kv_caches),
        block_size=block_size,
        local_heads=local_heads,
        head_dim=head_dim,
        num_kv_heads=num_kv_heads,
        tp_rank=tp_rank,
        tp_size=tp_size,
        attention_types=attention_types,
    )
    for layer, cache in enumerate(kv_caches):
        for part_index, part in enumerate(KV_PARTS):
            half = cache[part_index]
            index = builder.add_tensor(half, half.stride(0), num_blocks)
            builder.add_heads_part(index, layer, part, half[0], shard)
    return builder.build("vllm-legacy")


def packed_layout(
    kv_caches: Sequence[torch.Tensor],
    *,
    num_kv_heads: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    attention_types: Sequence[str] | None = None,
) -> CacheLayout:
    """The packed layout: per layer ``(num_blocks, heads, block_size, 2 * head_dim)``, K then V.

    Args:
        kv_caches: One tensor per layer, each row a token's K followed by its V; this rank's
            heads only.
        num_kv_heads: The model's total number of KV heads. Default ``None``: the local
            count times ``tp_size``.
        tp_rank: This rank in the tensor-parallel group. Default ``0``.
        tp_size: The tensor-parallel group's size. Default ``1``.
        attention_types: Per layer ``"full"`` or ``"sliding"``. Default ``None``: all full.

    Returns:
        The ``CacheLayout`` of the tensors (encoding ``packed``).

    Raises:
        LayoutError: The tensors are not of this layout (wrong rank of shape, layers that
            differ, heads that do not divide among the ranks), or not exactly mappable.

    Example:
        >>> import torch, kvsnap
        >>> layout = kvsnap.packed_layout([torch.zeros(8, 2, 16, 128) for _ in range(2)])
        >>> layout.geometry.num_kv_heads, layout.geometry.head_dim
        (2, 64)
    """
    first = uniform_layers(kv_caches, "(num_blocks, heads, block_size, 2*head_dim)", 4)
    require(first.shape[3] % 2 == 0, f"the last dimension {first.shape[3]} is not 2*head_dim")
    num_blocks, local_heads, block_size, packed_dim = first.shape
    head_dim = packed_dim // 2
    builder, shard = sharded_builder(
        first,
        num_layers=len(kv_caches),
        block_size=block_size,
        local_heads=local_heads,
        head_dim=head_dim,
        num_kv_heads=num_kv_heads,
        tp_rank=tp_rank,
        tp_size=tp_size,
        attention_types=attention_types,
    )
    for layer, cache in enumerate(kv_caches):
        index = builder.add_tensor(cache, cache.stride(0), num_blocks)
        page = cache[0].transpose(0, 1)  # (block_size, heads, 2*head_dim)
        builder.add_heads_part(index, layer, KEY, page[..., :head_dim], shard)
        builder.add_heads_part(index, layer, VALUE, page[..., head_dim:], shard)
    return builder.build("packed")


def mla_layout(
    kv_caches: Sequence[torch.Tensor],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    attention_types: Sequence[str] | None = None,
) -> CacheLayout:
    """MLA: per layer ``(num_blocks, block_size, latent_dim)``, replicated on every TP rank.

    Every rank holds the whole latent; a capture takes it from one rank only.

    Args:
        kv_caches: One tensor per layer, the compressed latent (its RoPE part included).
        tp_rank: This rank in the tensor-parallel group. Default ``0``.
        tp_size: The tensor-parallel group's size. Default ``1``.
        attention_types: Per layer attention type. Default ``None``: ``"mla"`` everywhere.

    Returns:
        The ``CacheLayout`` of the tensors (encoding ``mla``).

    Raises:
        LayoutError: The tensors are not ``(num_blocks, block_size, latent_dim)`` alike.

    Example:
        >>> import torch, kvsnap
        >>> latents = [torch.zeros(8, 16, 576, dtype=torch.bfloat16) for _ in range(2)]
        >>> kvsnap.mla_layout(latents).describe()
        'mla: 2 layers, latent 576, 16 tokens/block, bfloat16, 8 blocks'
    """
    first = uniform_layers(kv_caches, "(num_blocks, block_size, latent_dim)", 3)
    num_blocks, block_size, latent_dim = first.shape
    geometry = KVGeometry(
        num_layers=len(kv_caches),
        block_size=block_size,
        dtype=dtype_name(first.dtype),
        latent_dim=latent_dim,
        attention_types=tuple(attention_types or ()),
    )
    shard = HeadShard(0, 1, tp_size, tp_rank)
    builder = LayoutBuilder(geometry, tp_rank, tp_size)
    for layer, cache in enumerate(kv_caches):
        index = builder.add_tensor(cache, cache.stride(0), num_blocks)
        builder.add_latent_part(index, layer, cache[0], shard)
    return builder.build("mla")


def cross_layer_layout(
    cache: torch.Tensor,
    *,
    num_kv_heads: int | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    attention_types: Sequence[str] | None = None,
) -> CacheLayout:
    """One tensor for all layers: ``(num_blocks, num_layers, 2, block_size, heads, head_dim)``.

    Args:
        cache: The tensor; this rank's heads only.
        num_kv_heads: The model's total number of KV heads. Default ``None``: the local
            count times ``tp_size``.
        tp_rank: This rank in the tensor-parallel group. Default ``0``.
        tp_size: The tensor-parallel group's size. Default ``1``.
        attention_types: Per layer ``"full"`` or ``"sliding"``. Default ``None``: all full.

    Returns:
        The ``CacheLayout`` of the tensor (encoding ``cross-layer``).

    Raises:
        LayoutError: The tensors are not of this layout (wrong rank of shape, layers that
            differ, heads that do not divide among the ranks), or not exactly mappable.

    Example:
        >>> import torch, kvsnap
        >>> kvsnap.cross_layer_layout(torch.zeros(8, 2, 2, 16, 2, 64)).describe()
        'cross-layer: 2 layers, 2 KV heads x head dim 64, 16 tokens/block, float32, 8 blocks'
    """
    require(
        cache.dim() == 6 and cache.shape[2] == 2,
        "expected (num_blocks, num_layers, 2, block_size, heads, head_dim), "
        f"got {tuple(cache.shape)}",
    )
    num_blocks, num_layers, _, block_size, local_heads, head_dim = cache.shape
    total_heads = num_kv_heads or local_heads * tp_size
    geometry = head_geometry(
        num_layers, block_size, cache.dtype, total_heads, head_dim, attention_types
    )
    shard = tp_shard(total_heads, local_heads, tp_rank, tp_size)
    builder = LayoutBuilder(geometry, tp_rank, tp_size)
    index = builder.add_tensor(cache, cache.stride(0), num_blocks)
    for layer in range(num_layers):
        builder.add_heads_part(index, layer, KEY, cache[0, layer, 0], shard)
        builder.add_heads_part(index, layer, VALUE, cache[0, layer, 1], shard)
    return builder.build("cross-layer")


def flat_paged_layout(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    *,
    block_size: int,
    attention_types: Sequence[str] | None = None,
) -> CacheLayout:
    """A flat paged cache: per layer K and V tensors ``(num_blocks * block_size, heads, head_dim)``.

    This is transformers' continuous-batching ``PagedAttentionCache`` storage (5.17), where
    block ``b`` is rows ``b*block_size .. (b+1)*block_size``.

    Args:
        key_caches: One key tensor per layer.
        value_caches: One value tensor per layer, shaped as the keys.
        block_size: Tokens per block.
        attention_types: Per layer ``"full"`` or ``"sliding"``. Default ``None``: all full.

    Returns:
        The ``CacheLayout`` of the tensors (encoding ``flat-paged``).

    Raises:
        LayoutError: Tensors of other shapes, layers that differ, or rows that are not a
            whole number of blocks.

    Example:
        >>> import torch, kvsnap
        >>> keys = [torch.zeros(128, 2, 64) for _ in range(2)]
        >>> values = [torch.zeros(128, 2, 64) for _ in range(2)]
        >>> kvsnap.flat_paged_layout(keys, values, block_size=16).num_blocks
        8
    """
    require(len(key_caches) == len(value_caches) > 0, "need one key and one value tensor per layer")
    first = key_caches[0]
    require(
        first.dim() == 3,
        f"expected (num_blocks * block_size, heads, head_dim), got {tuple(first.shape)}",
    )
    rows, heads, head_dim = first.shape
    require(
        rows % block_size == 0, f"{rows} rows are not a whole number of {block_size}-token blocks"
    )
    geometry = head_geometry(
        len(key_caches), block_size, first.dtype, heads, head_dim, attention_types
    )
    shard = HeadShard(0, heads, 1, 0)
    builder = LayoutBuilder(geometry, 0, 1)
    for layer, (keys, values) in enumerate(zip(key_caches, value_caches, strict=True)):
        for part, tensor in ((KEY, keys), (VALUE, values)):
            require(
                tensor.shape == first.shape and tensor.dtype == first.dtype,
                f"layer {layer} {part} differs: {tuple(tensor.shape)}",
            )
            index = builder.add_tensor(tensor, tensor.stride(0) * block_size, rows // block_size)
            builder.add_heads_part(index, layer, part, tensor[:block_size], shard)
    return builder.build("flat-paged")


def contiguous_layout(
    key_states: Sequence[torch.Tensor],
    value_states: Sequence[torch.Tensor],
    *,
    block_size: int,
    batch_index: int = 0,
    attention_types: Sequence[str] | None = None,
) -> CacheLayout:
    """Contiguous per-layer ``(batch, heads, seq, head_dim)`` tensors (``DynamicCache``) as blocks.

    Block ``b`` of the chosen batch row is tokens ``b*block_size .. (b+1)*block_size``. The
    sequence length must be a whole number of blocks: ``kvsnap.engines.transformers`` pads a
    ``DynamicCache`` into such a buffer before capturing it.

    Args:
        key_states: One key tensor per layer.
        value_states: One value tensor per layer, shaped as the keys.
        block_size: Tokens per block.
        batch_index: The batch row the layout describes. Default ``0``.
        attention_types: Per layer ``"full"`` or ``"sliding"``. Default ``None``: all full.

    Returns:
        The ``CacheLayout`` of that row (encoding ``contiguous-hnd``).

    Raises:
        LayoutError: Tensors of other shapes, layers that differ, or a sequence length that
            is not a whole number of blocks.

    Example:
        >>> import torch, kvsnap
        >>> keys = [torch.zeros(1, 2, 48, 64) for _ in range(2)]
        >>> values = [torch.zeros(1, 2, 48, 64) for _ in range(2)]
        >>> kvsnap.contiguous_layout(keys, values, block_size=16).num_blocks
        3
        >>> kvsnap.contiguous_layout([k[:, :, :40] for k in keys], values, block_size=16)
        Traceback (most recent call last):
        ...
        kvsnap.errors.LayoutError: sequence length 40 is not a whole number of 16-token blocks
    """
    require(len(key_states) == len(value_states) > 0, "need one key and one value tensor per layer")
    first = key_states[0]
    require(first.dim() == 4, f"expected (batch, heads, seq, head_dim), got {tuple(first.shape)}")
    _, heads, seq_len, head_dim = first.shape
    require(
        seq_len % block_size == 0,
        f"sequence length {seq_len} is not a whole number of {block_size}-token blocks",
    )
    geometry = head_geometry(
        len(key_states), block_size, first.dtype, heads, head_dim, attention_types
    )
    shard = HeadShard(0, heads, 1, 0)
    builder = LayoutBuilder(geometry, 0, 1)
    for layer, (keys, values) in enumerate(zip(key_states, value_states, strict=True)):
        for part, tensor in ((KEY, keys), (VALUE, values)):
            require(
                tensor.shape == first.shape, f"layer {layer} {part} differs: {tuple(tensor.shape)}"
            )
            row = tensor[batch_index]  # (heads, seq, head_dim)
            index = builder.add_tensor(row, row.stride(1) * block_size, seq_len // block_size)
            builder.add_heads_part(index, layer, part, row[:, :block_size].transpose(0, 1), shard)
    return builder.build("contiguous-hnd")
