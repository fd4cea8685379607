"""Copy plans: descriptor building, host page enumeration, writer election and merging.

Descriptors are executed here by a deliberately naive reference (one ``memmove`` per
descriptor), so these tests check the plan alone, not a transfer backend.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsnap.layout import flat_paged_layout
from kvsnap.testing.caches import make_cache, random_content
from kvsnap.transfer.plan import (
    CopyPlanner,
    Descriptors,
    Direction,
    HostPages,
    PageCopy,
    host_page_addresses,
    merge_adjacent,
)

D2H, H2D = Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE


def execute(descriptors: Descriptors) -> None:
    for src, dst, size in zip(descriptors.src, descriptors.dst, descriptors.sizes, strict=True):
        ctypes.memmove(int(dst), int(src), int(size))


def nhd_cache(blocks: int = 12, tp_rank: int = 0, tp_size: int = 1, heads: int = 2):
    cache = make_cache(
        "vllm-nhd",
        num_layers=2,
        num_blocks=blocks,
        block_size=4,
        num_kv_heads=heads,
        head_dim=8,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    content = random_content(cache.layout.geometry, blocks, torch.Generator().manual_seed(tp_size))
    cache.fill(content)
    return cache, content


def host_for(buffer: torch.Tensor, page: int) -> HostPages:
    return HostPages.contiguous(buffer.data_ptr(), buffer.shape[0], page)


@pytest.mark.parametrize(("kind", "merged_count"), [("vllm-legacy", 1), ("vllm-nhd", 8)])
def test_consecutive_blocks_merge_where_memory_is_contiguous(kind: str, merged_count: int) -> None:
    """NHD at TP=1 is one whole-page fragment per block. The legacy layout keeps all K pages
    back to back, so 8 consecutive blocks to 8 consecutive pages are one copy; the split layout
    interleaves K and V per block, so they stay 8."""
    cache = make_cache(kind, num_layers=2, num_blocks=12, block_size=4, num_kv_heads=2, head_dim=8)
    content = random_content(cache.layout.geometry, 12, torch.Generator().manual_seed(0))
    cache.fill(content)
    page = cache.layout.geometry.canonical_page_size_bytes
    planner = CopyPlanner(cache.layout)
    host = torch.zeros(8, page, dtype=torch.uint8)
    copy = PageCopy("layers.1.value", np.arange(2, 10), host_for(host, page), np.arange(8))
    merged = planner.descriptors([copy], D2H)
    unmerged = planner.descriptors([copy], D2H, merge=False)
    assert len(unmerged) == 8 and len(merged) == merged_count
    assert merged.num_bytes == unmerged.num_bytes == 8 * page
    assert merged.src[0] == cache.logical("layers.1.value")[2].data_ptr()
    assert merged.dst[0] == host.data_ptr()
    execute(merged)
    expected = content.pages["layers.1.value"][2:10].contiguous().view(torch.uint8).reshape(8, page)
    assert torch.equal(host, expected)


def test_merged_and_unmerged_descriptors_move_identical_bytes() -> None:
    cache = make_cache(
        "vllm-legacy", num_layers=2, num_blocks=10, block_size=3, num_kv_heads=4, head_dim=2
    )
    cache.fill(random_content(cache.layout.geometry, 10, torch.Generator().manual_seed(2)))
    page = cache.layout.geometry.canonical_page_size_bytes
    planner = CopyPlanner(cache.layout)
    blocks = np.array([1, 2, 3, 7, 8, 0])
    outputs = []
    for merge in (True, False):
        host = torch.zeros(4, 6, page, dtype=torch.uint8)
        copies = [
            PageCopy(name, blocks, host_for(host[i], page), np.arange(6))
            for i, name in enumerate(cache.layout.geometry.tensor_names())
        ]
        descriptors = planner.descriptors(copies, D2H, merge=merge)
        execute(descriptors)
        outputs.append((host, len(descriptors)))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert outputs[0][0].any()
    assert outputs[0][1] < outputs[1][1]


@settings(max_examples=80, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 16), min_size=1, max_size=30),
    breaks=st.lists(st.booleans(), min_size=30, max_size=30),
    seed=st.integers(0, 2**32 - 1),
)
def test_merge_adjacent_keeps_the_byte_mapping(
    sizes: list[int], breaks: list[bool], seed: int
) -> None:
    """Merged descriptors map exactly the same source bytes to the same destination bytes."""
    rng = np.random.default_rng(seed)
    sizes_array = np.array(sizes, dtype=np.int64)
    src = np.empty_like(sizes_array)
    dst = np.empty_like(sizes_array)
    next_src, next_dst = 1000, 50000
    for i, size in enumerate(sizes_array):
        if breaks[i]:  # a gap on one side or both: must not merge across it
            next_src += int(rng.integers(0, 3)) * 7
            next_dst += int(rng.integers(1, 3)) * 5
        src[i], dst[i] = next_src, next_dst
        next_src += size
        next_dst += size
    original = Descriptors(src, dst, sizes_array)
    merged = merge_adjacent(original)

    def byte_map(d: Descriptors) -> list[tuple[int, int]]:
        return [
            (int(s) + k, int(t) + k)
            for s, t, n in zip(d.src, d.dst, d.sizes, strict=True)
            for k in range(int(n))
        ]

    assert byte_map(merged) == byte_map(original)  # same pairs, same order of first touch
    # Maximal: no two consecutive merged descriptors continue each other.
    continues = (merged.src[1:] == merged.src[:-1] + merged.sizes[:-1]) & (
        merged.dst[1:] == merged.dst[:-1] + merged.sizes[:-1]
    )
    assert not continues.any()
    assert len(merged) == 1 + sum(
        1
        for i in range(1, len(sizes_array))
        if not (
            src[i] == src[i - 1] + sizes_array[i - 1] and dst[i] == dst[i - 1] + sizes_array[i - 1]
        )
    )


def test_host_pages_with_chunks_and_skip() -> None:
    host = HostPages(
        data_ptr=10_000,
        num_chunks=6,
        chunk_stride_bytes=1000,
        page_size_bytes=300,
        blocks_per_chunk=3,
    )
    addresses, numbers = host_page_addresses(host, np.array([4, 1, 5]), skip=2, count=5)
    # Chunk 4 pages 2; chunk 1 pages 0, 1, 2; chunk 5 page 0.
    assert numbers.tolist() == [14, 3, 4, 5, 15]
    assert addresses.tolist() == [
        10_000 + 4 * 1000 + 2 * 300,
        10_000 + 1000,
        10_000 + 1000 + 300,
        10_000 + 1000 + 600,
        10_000 + 5 * 1000,
    ]
    single = HostPages.contiguous(500, 4, 64)
    addresses, numbers = host_page_addresses(single, np.array([3, 0]), skip=0, count=2)
    assert addresses.tolist() == [500 + 192, 500] and numbers.tolist() == [3, 0]


def test_host_page_errors() -> None:
    host = HostPages(0, 4, 256, 128, 2)
    with pytest.raises(ValueError, match="skip"):
        host_page_addresses(host, np.array([0]), skip=2, count=1)
    with pytest.raises(ValueError, match="chunk ids"):
        host_page_addresses(host, np.array([4]), skip=0, count=1)
    with pytest.raises(ValueError, match="host pages"):
        host_page_addresses(host, np.array([0, 1]), skip=1, count=4)


def test_invalid_copies_are_refused() -> None:
    cache, _ = nhd_cache()
    page = cache.layout.geometry.canonical_page_size_bytes
    host = torch.zeros(4, page, dtype=torch.uint8)
    planner = CopyPlanner(cache.layout)
    with pytest.raises(ValueError, match="device block ids"):
        planner.descriptors(
            [PageCopy("layers.0.key", np.array([12]), host_for(host, page), np.array([0]))], D2H
        )
    with pytest.raises(ValueError, match="one-dimensional"):
        planner.descriptors(
            [PageCopy("layers.0.key", np.array([[1]]), host_for(host, page), np.array([0]))], D2H
        )
    wrong = HostPages.contiguous(host.data_ptr(), 2, page // 2)
    with pytest.raises(ValueError, match="canonical page"):
        planner.descriptors([PageCopy("layers.0.key", np.array([1]), wrong, np.array([0]))], H2D)
    with pytest.raises(KeyError):
        planner.descriptors(
            [PageCopy("layers.5.key", np.array([1]), host_for(host, page), np.array([0]))], H2D
        )
    assert len(planner.descriptors([], D2H)) == 0


@pytest.mark.parametrize(("heads", "tp_size"), [(2, 4), (1, 3), (4, 2)])
def test_elected_writers_cover_every_host_byte_exactly_once(heads: int, tp_size: int) -> None:
    """At capture each canonical byte of each page is the destination of exactly one rank."""
    blocks = 7
    page = make_cache(
        "vllm-nhd", num_layers=2, num_blocks=blocks, block_size=4, num_kv_heads=heads, head_dim=8
    )
    page_size = page.layout.geometry.canonical_page_size_bytes
    coverage = np.zeros(blocks * page_size, dtype=np.int64)
    base = 1 << 30  # descriptors are only counted, never executed
    host = HostPages.contiguous(base, blocks, page_size)
    restore_counts = []
    for rank in range(tp_size):
        cache, _ = nhd_cache(blocks, rank, tp_size, heads)
        planner = CopyPlanner(cache.layout)
        copy = PageCopy("layers.1.key", np.arange(blocks)[::-1].copy(), host, np.arange(blocks))
        descriptors = planner.descriptors([copy], D2H, merge=False)
        for dst, size in zip(descriptors.dst - base, descriptors.sizes, strict=True):
            coverage[dst : dst + size] += 1
        restore_counts.append(planner.descriptors([copy], H2D, merge=False).num_bytes)
    assert (coverage == 1).all()
    # At restore every rank reads its own heads of every block: nobody is elected out.
    local_bytes = page_size * max(heads // tp_size, 1) // heads
    assert restore_counts == [blocks * local_bytes] * tp_size


def test_snapshot_block_ids_key_the_writer_election() -> None:
    cache, _ = nhd_cache(6, tp_rank=1, tp_size=2, heads=1)  # 2 ranks replicate the only head
    page = cache.layout.geometry.canonical_page_size_bytes
    host = HostPages.contiguous(1 << 30, 6, page)
    planner = CopyPlanner(cache.layout)
    by_page = PageCopy("layers.0.value", np.arange(4), host, np.array([0, 1, 2, 3]))
    by_snapshot = PageCopy(
        "layers.0.value",
        np.arange(4),
        host,
        np.array([0, 1, 2, 3]),
        snapshot_block_ids=np.array([10, 12, 13, 15]),
    )
    written = [
        ((planner.descriptors([copy], D2H, merge=False).dst - (1 << 30)) // page).tolist()
        for copy in (by_page, by_snapshot)
    ]
    assert written == [[1, 3], [2, 3]]  # rank 1 writes odd page numbers, then odd snapshot ids


def test_descriptors_of_different_copies_never_merge() -> None:
    """The last K block and the first V block are adjacent in memory on both sides, but belong
    to different copies (and could be different allocations): they stay two descriptors."""
    blocks, block_size = 4, 2
    memory = torch.zeros(2 * blocks * block_size, 2, 8, dtype=torch.float16)
    keys, values = memory[: blocks * block_size], memory[blocks * block_size :]
    layout = flat_paged_layout([keys], [values], block_size=block_size)
    page = layout.geometry.canonical_page_size_bytes
    host = torch.zeros(2, page, dtype=torch.uint8)
    copies = [
        PageCopy("layers.0.key", np.array([blocks - 1]), host_for(host[:1], page), np.array([0])),
        PageCopy("layers.0.value", np.array([0]), host_for(host[1:], page), np.array([0])),
    ]
    descriptors = CopyPlanner(layout).descriptors(copies, D2H)
    assert descriptors.src[0] + page == descriptors.src[1] == values.data_ptr()
    assert descriptors.dst[0] + page == descriptors.dst[1]
    assert len(descriptors) == 2
