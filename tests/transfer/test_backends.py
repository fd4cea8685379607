"""The transfer backends on CPU tensors: every backend bit-identical with ``cpu`` (Triton under
its interpreter), their building blocks, and the ``auto`` policy that picks one."""

from __future__ import annotations

import ctypes
import itertools
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsnap.layout import CopyRun
from kvsnap.testing.caches import make_cache, random_content, same_bytes
from kvsnap.transfer import (
    AutoPolicy,
    CopyJob,
    available_backends,
    cpu,
    load_policy,
    make_backend,
    unavailable_reason,
)
from kvsnap.transfer.cpu import CpuBackend, copy_descriptors, copy_page_fragments
from kvsnap.transfer.plan import Descriptors, Direction
from kvsnap.transfer.policy import LARGE_FRAGMENT_BYTES, policy_from_calibration
from kvsnap.transfer.torch_views import fold_runs, nonnegative_runs
from kvsnap.transfer.triton_copy import split_pieces, tile_shape, word_bytes
from tests.support.transfer_helpers import D2H, H2D, HostArea, page_bytes, run_job, small_cache

# --------------------------------------------------------------------------------------------
# Every backend against cpu


def _backend_bytes(
    backend: str, case_kind: str, tp_rank: int, tp_size: int, dtype: torch.dtype
) -> list:
    """Capture and restore with ``backend``; returns the host pages and the restored tensors."""
    generator = torch.Generator().manual_seed(11)
    common = {
        "num_layers": 2,
        "num_blocks": 7,
        "block_size": 3,
        "dtype": dtype,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
    }
    extra = {"latent_dim": 5} if case_kind == "mla" else {"num_kv_heads": 4, "head_dim": 3}
    cache = make_cache(case_kind, **common, **extra)
    content = random_content(cache.layout.geometry, 7, generator)
    cache.fill(content)
    names = cache.layout.geometry.tensor_names()
    page = cache.layout.geometry.canonical_page_size_bytes
    area = HostArea(
        torch.zeros(len(names), 4, 2 * page, dtype=torch.uint8),
        names,
        page,
        2,
        np.array([3, 0, 2]),
        1,
    )
    device_ids = np.array([6, 0, 1, 2, 4])
    run_job(cache, D2H, area.copies(device_ids), backend=backend)
    restored = make_cache(case_kind, **common, **extra)
    run_job(restored, H2D, area.copies(np.array([1, 2, 3, 5, 6])), backend=backend)
    return [area.buffer, *restored.tensors]


BACKEND_CASES = [
    ("vllm-nhd", 0, 1, torch.float16),
    ("vllm-hnd", 1, 2, torch.bfloat16),
    ("packed", 3, 4, torch.float32),
    ("contiguous", 0, 1, torch.uint8),  # 3-byte fragments: the byte-word fallback
    ("mla", 1, 2, torch.float16),  # replicated latent: writer election
]


@pytest.mark.parametrize(("kind", "tp_rank", "tp_size", "dtype"), BACKEND_CASES)
def test_torch_backend_matches_cpu(
    kind: str, tp_rank: int, tp_size: int, dtype: torch.dtype
) -> None:
    reference = _backend_bytes("cpu", kind, tp_rank, tp_size, dtype)
    result = _backend_bytes("torch", kind, tp_rank, tp_size, dtype)
    assert reference[0].any()
    assert all(same_bytes(a, b) for a, b in zip(reference, result, strict=True))


@pytest.mark.parametrize(("kind", "tp_rank", "tp_size", "dtype"), BACKEND_CASES)
def test_triton_kernel_in_interpreter_matches_cpu(
    kind: str, tp_rank: int, tp_size: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The UVA kernel dereferences raw int64 addresses; the interpreter does it on host memory."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "triton" in available_backends("cpu")
    reference = _backend_bytes("cpu", kind, tp_rank, tp_size, dtype)
    result = _backend_bytes("triton", kind, tp_rank, tp_size, dtype)
    assert all(same_bytes(a, b) for a, b in zip(reference, result, strict=True))


@pytest.mark.parametrize(("piece_bytes", "max_programs"), [(48, 3), (6000, 2), (1 << 20, 5)])
def test_triton_kernel_tiles_and_pieces(
    piece_bytes: int, max_programs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large merged descriptors (flat paged, consecutive blocks: one 8 KiB copy per tensor) go
    through the looping path, in pieces or whole; 48-byte pieces go through the row tiles."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cache = make_cache(
        "flat-paged", num_layers=1, num_blocks=9, block_size=8, num_kv_heads=2, head_dim=32
    )
    content = random_content(cache.layout.geometry, 9, torch.Generator().manual_seed(5))
    cache.fill(content)
    names = cache.layout.geometry.tensor_names()
    page = cache.layout.geometry.canonical_page_size_bytes  # 1 KiB
    area = HostArea(
        torch.zeros(len(names), 8, page, dtype=torch.uint8), names, page, 1, np.arange(8), 0
    )
    options = {"triton": {"piece_bytes": piece_bytes, "max_programs": max_programs}}
    run_job(cache, D2H, area.copies(np.arange(1, 9)), backend="triton", backend_options=options)
    for index, name in enumerate(names):
        for k in range(8):
            assert torch.equal(area.page(index, k), page_bytes(content, name, k + 1))


def test_triton_tile_shapes() -> None:
    def shape(sizes: list[int], word: int) -> tuple[int, int]:
        return tile_shape(np.array(sizes, dtype=np.int64), word)

    assert shape([65536], 8) == (1024, 1)  # long items: 8 KiB per step, looping
    assert shape([4096, 4096, 2048, 40960], 8) == (512, 2)  # the median sets the row
    assert shape([128] * 9 + [2048], 8) == (16, 64)  # 64 fragments of 128 bytes per step
    assert shape([5, 5, 3], 1) == (8, 1024)
    assert shape([1], 1) == (1, 8192)


def test_triton_is_unavailable_on_cpu_without_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "triton" not in available_backends("cpu")
    assert "TRITON_INTERPRET" in unavailable_reason("triton", "cpu")


# --------------------------------------------------------------------------------------------
# The auto policy and its calibration


def test_auto_policy_by_fragment_size_and_availability() -> None:
    policy = AutoPolicy()
    cuda = torch.device("cuda", 0)
    everything = {"cuda-batch", "triton", "torch"}
    large = LARGE_FRAGMENT_BYTES[D2H]

    def choose(direction: Direction, size: float, available=everything, whole: bool = True) -> str:
        return policy.choose(cuda, direction, size, whole_pages=whole, available=available)

    assert policy.choose(torch.device("cpu"), D2H, 1 << 30, available=everything) == "cpu"
    assert choose(D2H, large) == "cuda-batch"
    assert choose(D2H, large - 1) == "torch"  # small fragments: staging gather
    assert choose(D2H, large - 1, whole=False) == "triton"  # a TP slice: no partial host pages
    assert choose(H2D, 4096, whole=False) == "torch"  # restore reads whole host pages anyway
    assert choose(H2D, 4096, {"cuda-batch", "triton"}) == "triton"
    assert choose(H2D, 4096, {"cuda-batch"}) == "cuda-batch"
    assert choose(H2D, 1 << 20, {"triton", "torch"}) == "torch"
    assert choose(D2H, 4096, {"torch", "cuda-batch"}, whole=False) == "torch"


def test_calibration_file_overrides_thresholds(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "calibration.json"
    monkeypatch.setenv("KVSNAP_CALIBRATION", str(path))
    assert load_policy().source == "built-in defaults"  # no file: the defaults
    path.write_text(json.dumps({"version": 1, "large_fragment_bytes": {"host_to_device": 16384}}))
    policy = load_policy()
    assert policy.large_fragment_bytes[H2D] == 16384
    assert policy.large_fragment_bytes[D2H] == LARGE_FRAGMENT_BYTES[D2H]
    cuda = torch.device("cuda")
    assert policy.choose(cuda, H2D, 16384, available={"cuda-batch", "triton"}) == "cuda-batch"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="calibration"):
        load_policy()
    with pytest.raises(ValueError, match="version"):
        policy_from_calibration({"version": 2})
    with pytest.raises(ValueError, match="direction"):
        policy_from_calibration({"version": 1, "large_fragment_bytes": {"sideways": 1}})
    with pytest.raises(ValueError, match="small_backend"):
        policy_from_calibration({"version": 1, "small_backend": "magic"})


# --------------------------------------------------------------------------------------------
# Backend building blocks


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=40),
    shift=st.integers(0, 7),
    seed=st.integers(0, 2**32 - 1),
)
def test_cpu_descriptor_copy_matches_slicing(sizes: list[int], shift: int, seed: int) -> None:
    """Vectorized small copies and memmove'd large ones land exactly where slicing puts them."""
    rng = np.random.default_rng(seed)
    sizes_array = np.array(sizes, dtype=np.int64)
    if rng.integers(2):  # equal sizes in bulk: the vectorized grouping
        sizes_array[:] = sizes_array[0]
    total = int(sizes_array.sum())
    source = rng.integers(0, 256, total + 8, dtype=np.uint8)
    destination = np.zeros(total + 64, dtype=np.uint8)
    src_offsets = np.concatenate(([0], np.cumsum(sizes_array)[:-1])) + shift
    order = rng.permutation(len(sizes_array))  # destinations in another order, packed
    dst_offsets = np.empty_like(src_offsets)
    dst_offsets[order] = np.concatenate(([0], np.cumsum(sizes_array[order])[:-1])) + 8 - shift
    expected = destination.copy()
    for s, d, n in zip(src_offsets, dst_offsets, sizes_array, strict=True):
        expected[d : d + n] = source[s : s + n]
    copy_descriptors(
        source.ctypes.data + src_offsets, destination.ctypes.data + dst_offsets, sizes_array
    )
    assert np.array_equal(destination, expected)


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 600),
    num_fragments=st.integers(1, 9),
    num_pages=st.integers(1, 30),
    shift=st.integers(0, 7),
    batch_bytes=st.sampled_from([1, 700, 1 << 20]),
    seed=st.integers(0, 2**32 - 1),
)
def test_cpu_page_fragments_copy_matches_slicing(
    size: int,
    num_fragments: int,
    num_pages: int,
    shift: int,
    batch_bytes: int,
    seed: int,
) -> None:
    """Every page's fragments land where slicing puts them: odd sizes and addresses, pages
    and fragments in any order on either side, batches that split the pages unevenly."""
    rng = np.random.default_rng(seed)
    slots = num_pages * num_fragments
    source = rng.integers(0, 256, slots * size + 16, dtype=np.uint8)
    destination = np.zeros(slots * size + 16, dtype=np.uint8)
    # Fragment j of page i: source slot i * n + j, destination slot where a permutation sends
    # it; as bases plus offsets, pages are the outer order on the source side only. Offsets
    # are relative to the first fragment, as a page table keeps them: some are negative.
    fragment_slots = rng.permutation(num_fragments)
    page_slots = rng.permutation(num_pages)
    first = fragment_slots[0] * size
    src_bases = source.ctypes.data + shift + np.arange(num_pages) * num_fragments * size + first
    src_offsets = fragment_slots * size - first
    dst_bases = destination.ctypes.data + 8 - shift + page_slots * size
    dst_offsets = np.arange(num_fragments) * num_pages * size
    expected = destination.copy()
    for page in range(num_pages):
        for fragment in range(num_fragments):
            s = src_bases[page] + src_offsets[fragment] - source.ctypes.data
            d = dst_bases[page] + dst_offsets[fragment] - destination.ctypes.data
            expected[d : d + size] = source[s : s + size]
    previous = cpu.BATCH_BYTES
    cpu.BATCH_BYTES = batch_bytes
    try:
        copy_page_fragments(src_bases, src_offsets, dst_bases, dst_offsets, size)
    finally:
        cpu.BATCH_BYTES = previous
    assert np.array_equal(destination, expected)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 700), min_size=1, max_size=12),
    piece=st.integers(1, 256),
    base=st.integers(0, 1 << 40),
)
def test_triton_pieces_cover_the_same_bytes(sizes: list[int], piece: int, base: int) -> None:
    sizes_array = np.array(sizes, dtype=np.int64)
    src = base + np.concatenate(([0], np.cumsum(sizes_array)[:-1]))
    dst = src + (1 << 41)
    pieces = split_pieces(src, dst, sizes_array, piece)
    assert (pieces[2] <= piece).all() and (pieces[2] > 0).all()
    assert (pieces[1] - pieces[0] == 1 << 41).all()

    def byte_set(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        return np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])

    assert np.array_equal(byte_set(pieces[0], pieces[2]), byte_set(src, sizes_array))


def test_triton_word_size_follows_alignment() -> None:
    aligned = np.array([4096, 8192]), np.array([1 << 20, (1 << 20) + 4096]), np.array([4096, 256])
    assert word_bytes(*aligned) == (8, True)
    assert word_bytes(np.array([8]), np.array([24]), np.array([8])) == (8, False)
    assert word_bytes(np.array([4]), np.array([0]), np.array([12])) == (4, False)
    assert word_bytes(np.array([3]), np.array([0]), np.array([16])) == (1, False)


@settings(max_examples=60, deadline=None)
@given(
    local_offset=st.integers(0, 500),
    local_stride=st.integers(-40, 40),
    canonical_offset=st.integers(0, 500),
    canonical_stride=st.integers(-40, 40),
    size=st.integers(1, 8),
    count=st.integers(1, 6),
)
def test_nonnegative_runs_describe_the_same_fragments(
    local_offset: int,
    local_stride: int,
    canonical_offset: int,
    canonical_stride: int,
    size: int,
    count: int,
) -> None:
    run = CopyRun(local_offset, local_stride, canonical_offset, canonical_stride, size, count)

    def pairs(runs: list[CopyRun]) -> set[tuple[int, int, int]]:
        return {
            (
                r.local_offset + i * r.local_stride,
                r.canonical_offset + i * r.canonical_stride,
                r.fragment_size,
            )
            for r in runs
            for i in range(r.num_fragments)
        }

    rewritten = nonnegative_runs(run)
    assert all(r.local_stride >= 0 and r.canonical_stride >= 0 for r in rewritten)
    assert pairs(rewritten) == pairs([run])


@pytest.mark.parametrize(
    ("kind", "groups_per_ref"), [("packed", 1), ("vllm-nhd", 1), ("vllm-hnd", 1)]
)
def test_fold_runs_turns_one_run_per_head_into_one_view(kind: str, groups_per_ref: int) -> None:
    cache = make_cache(kind, num_layers=1, num_blocks=2, block_size=4, num_kv_heads=4, head_dim=8)
    for ref in cache.layout.refs:
        runs = [split for run in ref.mapping.runs for split in nonnegative_runs(run)]
        groups = fold_runs(runs)
        assert len(groups) == groups_per_ref, (kind, ref.name, runs)
        # Every group is one progression: equally spaced on both sides.
        for group in groups:
            steps = {
                (b.local_offset - a.local_offset, b.canonical_offset - a.canonical_offset)
                for a, b in itertools.pairwise(group)
            }
            assert len(steps) <= 1
        assert [run for group in groups for run in group] == runs


def test_fold_runs_keeps_irregular_runs_apart() -> None:
    runs = [CopyRun(0, 4, 0, 4, 4, 2), CopyRun(16, 4, 8, 4, 4, 2), CopyRun(40, 4, 16, 4, 4, 2)]
    assert [len(group) for group in fold_runs(runs)] == [2, 1]
    shapes = [CopyRun(0, 4, 0, 4, 4, 2), CopyRun(16, 8, 8, 4, 4, 2)]
    assert [len(group) for group in fold_runs(shapes)] == [1, 1]


def test_cpu_backend_executes_a_plain_descriptor_job() -> None:
    cache, _ = small_cache()
    source = (ctypes.c_uint8 * 64).from_buffer_copy(bytes(range(64)))
    target = (ctypes.c_uint8 * 64)()
    base_src, base_dst = ctypes.addressof(source), ctypes.addressof(target)
    descriptors = Descriptors(
        np.array([base_src, base_src + 10]), np.array([base_dst + 32, base_dst]), np.array([10, 20])
    )
    CpuBackend(cache.layout, D2H).execute(CopyJob(0, [], descriptors))
    assert bytes(target[32:42]) == bytes(range(10))
    assert bytes(target[0:20]) == bytes(range(10, 30))
    assert not any(target[20:32]) and not any(target[42:])


@pytest.mark.parametrize(
    "sizes",
    [[8, 8, 8, 8, 8000, 8, 24], [3, 700, 1, 1, 1, 64], [4096] * 3, [16] * 2100 + [400, 16]],
)
def test_triton_kernel_mixed_sizes_loop_within_tiles(sizes: list[int], monkeypatch) -> None:
    """Rows sized by the median; longer items loop inside their tile; two programs take turns
    over several tiles, each with its own longest item (interpreter)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cache, _ = small_cache()
    sizes_array = np.array(sizes, dtype=np.int64)
    rng = np.random.default_rng(len(sizes))
    source = rng.integers(0, 256, int(sizes_array.sum()) + 64, dtype=np.uint8)
    target = np.zeros_like(source)
    offsets = np.concatenate(([0], np.cumsum(sizes_array)[:-1]))
    order = rng.permutation(len(sizes))
    dst_offsets = np.empty_like(offsets)
    dst_offsets[order] = np.concatenate(([0], np.cumsum(sizes_array[order])[:-1]))
    descriptors = Descriptors(
        source.ctypes.data + offsets, target.ctypes.data + dst_offsets, sizes_array
    )
    make_backend("triton", cache.layout, D2H, max_programs=2).execute(CopyJob(0, [], descriptors))
    for s, d, n in zip(offsets, dst_offsets, sizes_array, strict=True):
        assert np.array_equal(target[d : d + n], source[s : s + n])
    assert not target[int(sizes_array.sum()) :].any()


def test_torch_backend_moves_words_when_aligned() -> None:
    cache = make_cache(
        "packed", num_layers=1, num_blocks=2, block_size=4, num_kv_heads=2, head_dim=64
    )
    assert set(make_backend("torch", cache.layout, D2H).words.values()) == {8}
    odd = make_cache(
        "contiguous",
        num_layers=1,
        num_blocks=2,
        block_size=2,
        num_kv_heads=2,
        head_dim=3,
        dtype=torch.uint8,
    )
    assert set(make_backend("torch", odd.layout, D2H).words.values()) == {1}
