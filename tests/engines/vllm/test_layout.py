"""vLLM's registered cache layouts as kvsnap layouts, without vLLM: the CPU kernel's block order,
the cell backends' physical layouts, TP head shards, and what is refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvsnap import format as fmt
from kvsnap.engines.vllm import BlockOrder, probe_block_order, vllm_layout
from kvsnap.layout import LayoutError, check_tiling
from kvsnap.snapshot import SequenceBlocks, Snapshot, capture

BLOCK = 32


def _random_cache(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(torch.bfloat16)


def _capture_one_sequence(layouts: list, tmp_path: Path, blocks: list[int]) -> Snapshot:
    tokens = np.arange(len(blocks) * layouts[0].geometry.block_size)
    source = fmt.SourceInfo("vllm", "test", "synthetic", None, "0" * 32)
    path = tmp_path / "snap.safetensors"
    capture(layouts, [SequenceBlocks("s", tokens, np.asarray(blocks))], path, source=source)
    return Snapshot.open(path)


def _vnni_offsets(tokens: int, heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """An AMX-style block order (what vLLM's CPU kernel does on AMX machines, per its writes):
    per head, keys as [D/2][N][2] (dim pairs interleaved), then values as
    [D/16][N/2][16][2] (token pairs interleaved)."""
    t, h, d = np.indices((tokens, heads, head_dim))
    plane = h * 2 * tokens * head_dim
    key = plane + (d // 2) * 2 * tokens + t * 2 + d % 2
    value = (
        plane + tokens * head_dim + (d // 16) * tokens * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2
    )
    return key, value


def _vnni_writer(key: torch.Tensor, value: torch.Tensor, block: torch.Tensor) -> None:
    tokens, heads, head_dim = key.shape
    key_offsets, value_offsets = _vnni_offsets(tokens, heads, head_dim)
    flat = block.view(-1)
    flat[torch.from_numpy(key_offsets.ravel())] = key.reshape(-1)
    flat[torch.from_numpy(value_offsets.ravel())] = value.reshape(-1)


def test_cpu_backend_block_order_is_learned_from_the_kernel(tmp_path: Path) -> None:
    blocks, heads, tokens, head_dim = 5, 2, BLOCK, 32
    order = probe_block_order(
        _vnni_writer, heads=heads, block_size=tokens, head_size=head_dim, dtype=torch.bfloat16
    )
    assert np.array_equal(order.key, _vnni_offsets(tokens, heads, head_dim)[0])
    keys = [_random_cache((blocks, tokens, heads, head_dim), seed) for seed in (1, 2)]
    values = [_random_cache((blocks, tokens, heads, head_dim), seed) for seed in (3, 4)]
    caches = [
        torch.zeros((blocks, heads, tokens, 2 * head_dim), dtype=torch.bfloat16) for _ in keys
    ]
    for cache, key, value in zip(caches, keys, values, strict=True):
        for block in range(blocks):
            _vnni_writer(key[block], value[block], cache[block : block + 1])
    layout = vllm_layout(
        caches,
        backend="CPU_ATTN",
        kv_cache_layout="LBHNC",
        head_size=head_dim,
        num_kv_heads=heads,
        block_order=order,
    )
    with _capture_one_sequence([layout], tmp_path, [4, 1]) as snap:
        for layer in range(2):
            for part, logical in (("key", keys[layer]), ("value", values[layer])):
                expected = logical[[4, 1]].reshape(2 * tokens, heads, head_dim)
                got = snap.sequence_kv("s", f"layers.{layer}.{part}")
                assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    with pytest.raises(LayoutError, match="block_order"):
        vllm_layout(
            caches, backend="CPU_ATTN", kv_cache_layout="LBHNC", head_size=32, num_kv_heads=2
        )


def test_block_order_probe_refuses_a_kernel_it_cannot_map() -> None:
    def drops_values(key: torch.Tensor, value: torch.Tensor, block: torch.Tensor) -> None:
        _vnni_writer(key, torch.zeros_like(value), block)

    with pytest.raises(LayoutError, match="unwritten"):
        probe_block_order(
            drops_values, heads=2, block_size=BLOCK, head_size=32, dtype=torch.bfloat16
        )


@pytest.mark.parametrize("physical", ["LBNHC", "LBHNC"])
def test_cell_backends_follow_the_reported_physical_layout(tmp_path: Path, physical: str) -> None:
    # FLASH_ATTN: each (token, head) cell is key ‖ value; NHD or HND physically.
    blocks, heads, tokens, head_dim = 5, 4, BLOCK, 16
    order = (0, 2, 1, 3) if physical == "LBNHC" else (0, 1, 2, 3)
    physical_shape = [(blocks, heads, tokens, 2 * head_dim)[axis] for axis in order]
    storage = _random_cache(tuple(physical_shape), 3)
    inverse = tuple(order.index(axis) for axis in range(4))
    cache = storage.permute(*inverse)  # logical [B, H, N, C] over the physical tensor
    assert cache.shape == (blocks, heads, tokens, 2 * head_dim)
    layout = vllm_layout(
        [cache], backend="FLASH_ATTN", kv_cache_layout=physical, head_size=head_dim, num_kv_heads=4
    )
    with _capture_one_sequence([layout], tmp_path, [3, 0, 2]) as snap:
        cells = cache[[3, 0, 2]].transpose(1, 2).reshape(3 * tokens, heads, 2 * head_dim)
        for part, dims in (("key", slice(0, head_dim)), ("value", slice(head_dim, None))):
            got = snap.sequence_kv("s", f"layers.0.{part}")
            assert torch.equal(
                got.view(torch.int16), cells[..., dims].contiguous().view(torch.int16)
            )


def test_tp_ranks_tile_the_canonical_page(tmp_path: Path) -> None:
    # TP=2 over 2 KV heads: each rank holds one head; together they give the TP=1 snapshot.
    blocks, tokens, head_dim = 4, BLOCK, 32
    full = _random_cache((blocks, 2, tokens, 2 * head_dim), 5)
    ranks = [full[:, rank : rank + 1].contiguous() for rank in range(2)]

    def order(heads: int) -> BlockOrder:
        return BlockOrder(*_vnni_offsets(tokens, heads, head_dim))

    layouts = [
        vllm_layout(
            [cache],
            backend="CPU_ATTN",
            kv_cache_layout="LBHNC",
            head_size=head_dim,
            num_kv_heads=2,
            tp_rank=rank,
            tp_size=2,
            block_order=order(1),
        )
        for rank, cache in enumerate(ranks)
    ]
    check_tiling(layouts)
    reference = vllm_layout(
        [full],
        backend="CPU_ATTN",
        kv_cache_layout="LBHNC",
        head_size=head_dim,
        num_kv_heads=2,
        block_order=order(2),
    )
    with _capture_one_sequence(layouts, tmp_path, [2, 3]) as tp2:
        tp2_key = tp2.sequence_kv("s", "layers.0.value").clone()
    (tmp_path / "snap.safetensors").unlink()
    with _capture_one_sequence([reference], tmp_path, [2, 3]) as tp1:
        assert torch.equal(
            tp2_key.view(torch.int16), tp1.sequence_kv("s", "layers.0.value").view(torch.int16)
        )
    with pytest.raises(LayoutError, match="1 KV heads per rank"):
        vllm_layout(
            ranks,
            backend="CPU_ATTN",
            kv_cache_layout="LBHNC",
            head_size=32,
            num_kv_heads=4,
            tp_size=2,
            block_order=order(1),
        )


def test_unknown_or_contradicted_layouts_are_refused() -> None:
    cache = _random_cache((3, 2, BLOCK, 64), 7)
    with pytest.raises(LayoutError, match="FLASHINFER"):
        vllm_layout(
            [cache], backend="FLASHINFER", kv_cache_layout="LBHNC", head_size=32, num_kv_heads=2
        )
    with pytest.raises(LayoutError, match="unknown vLLM KV cache layout"):
        vllm_layout(
            [cache], backend="CPU_ATTN", kv_cache_layout="XYZ", head_size=32, num_kv_heads=2
        )
    # The tensor is head-major (HND) but vLLM would claim token-major (LBNHC): refused.
    with pytest.raises(LayoutError, match="reported the LBNHC layout"):
        vllm_layout(
            [cache], backend="FLASH_ATTN", kv_cache_layout="LBNHC", head_size=32, num_kv_heads=2
        )
    with pytest.raises(LayoutError, match="head size 16"):
        vllm_layout(
            [cache], backend="CPU_ATTN", kv_cache_layout="LBHNC", head_size=16, num_kv_heads=2
        )


def test_amx_ordered_ranks_write_parts_that_restore_at_tp1(tmp_path: Path) -> None:
    # The CPU kernel's pages interleave a head's dims (pieces of 4 bytes inside one head's row):
    # each TP rank still writes exactly its own heads as its part, and TP=1 reads both parts.
    blocks, tokens, head_dim = 4, BLOCK, 32
    full = _random_cache((blocks, 2, tokens, 2 * head_dim), 6)
    order = {heads: BlockOrder(*_vnni_offsets(tokens, heads, head_dim)) for heads in (1, 2)}

    def layout(cache: torch.Tensor, rank: int, tp: int):
        return vllm_layout(
            [cache],
            backend="CPU_ATTN",
            kv_cache_layout="LBHNC",
            head_size=head_dim,
            num_kv_heads=2,
            tp_rank=rank,
            tp_size=tp,
            block_order=order[2 // tp],
        )

    ranks = [layout(full[:, rank : rank + 1].contiguous(), rank, 2) for rank in range(2)]
    tokens_ids = np.arange(2 * tokens)
    source = fmt.SourceInfo("vllm", "test", "synthetic", None, "0" * 32)
    path = tmp_path / "parted.safetensors"
    sequence = SequenceBlocks("s", tokens_ids, np.array([2, 3]))
    capture(ranks, [sequence], path, source=source, per_rank_parts=True)
    restored = torch.zeros_like(full)
    with Snapshot.open(path) as snapshot:
        assert len(snapshot.part_files()) == 2 and snapshot.verify() == []
        snapshot.restore(layout(restored, 0, 1), {"s": [0, 1]})
    assert torch.equal(restored[[0, 1]].view(torch.int16), full[[2, 3]].view(torch.int16))
