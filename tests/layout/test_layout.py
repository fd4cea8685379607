"""Cache layouts: every constructor's copy runs against the engine tensors' own indexing,
tensor-parallel tiling and writer election, and the checks that refuse broken descriptions.

The reference here is :mod:`kvsnap.testing.caches`'s logical views (plain torch indexing of
the engine tensors); copy runs are applied by a naive numpy loop over ``mapping.fragments()``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsnap.layout import (
    CacheLayout,
    CanonicalPageMapping,
    CopyRun,
    KVGeometry,
    LayoutError,
    PageRef,
    check_tiling,
    contiguous_layout,
    dtype_name,
    fold_fragments,
    head_shard,
    strided_page_runs,
    torch_dtype,
    vllm_split_layout,
)
from kvsnap.testing.caches import (
    HEAD_KINDS,
    LAYOUT_KINDS,
    TP_KINDS,
    SyntheticCache,
    make_cache,
    random_content,
)


def storage_bytes(tensor: torch.Tensor) -> tuple[np.ndarray, int]:
    """The tensor's whole storage as uint8 numpy, and the storage's address."""
    storage = tensor.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    return flat.numpy(), storage.data_ptr()


def apply_runs(cache: SyntheticCache, name: str, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Canonical page bytes the runs read from ``block``, and how often each byte is written."""
    layout = cache.layout
    ref = layout.ref(name)
    tensor = layout.tensors[ref.tensor_index]
    memory, storage_start = storage_bytes(tensor.tensor)
    block_start = tensor.data_ptr - storage_start + block * tensor.block_stride_bytes
    page = np.zeros(ref.mapping.canonical_page_size_bytes, dtype=np.uint8)
    written = np.zeros_like(page, dtype=np.int64)
    for local, canonical, size in zip(*ref.mapping.fragments(), strict=True):
        page[canonical : canonical + size] = memory[
            block_start + local : block_start + local + size
        ]
        written[canonical : canonical + size] += 1
    return page, written


def held_bytes(cache: SyntheticCache) -> np.ndarray:
    """Mask of the canonical page bytes this rank holds (its heads; all of MLA)."""
    geometry = cache.layout.geometry
    if geometry.is_mla:
        return np.ones(geometry.canonical_page_size_bytes, dtype=bool)
    mask = np.zeros(geometry.canonical_page_shape, dtype=bool)
    mask[:, cache.heads, :] = True
    return np.repeat(mask.ravel(), geometry.element_size)


@st.composite
def cache_specs(draw: st.DrawFn) -> dict:
    kind = draw(st.sampled_from(LAYOUT_KINDS))
    heads = draw(st.integers(1, 4))
    tp_size = 1
    if kind in TP_KINDS:
        tp_size = draw(st.sampled_from([1, 2, 4]))
        if kind != "mla" and (heads % tp_size if tp_size <= heads else tp_size % heads):
            tp_size = 1
    return {
        "kind": kind,
        "num_layers": draw(st.integers(1, 3)),
        "num_blocks": draw(st.integers(1, 5)),
        "block_size": draw(st.sampled_from([1, 2, 3, 5, 16])),
        "num_kv_heads": heads,
        "head_dim": draw(st.integers(1, 9)),
        "latent_dim": draw(st.integers(1, 12)),
        "dtype": draw(
            st.sampled_from([torch.float16, torch.float32, torch.int8, torch.float8_e5m2])
        ),
        "tp_size": tp_size,
        "tp_rank": draw(st.integers(0, tp_size - 1)),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@settings(max_examples=80, deadline=None)
@given(spec=cache_specs())
def test_copy_runs_read_exactly_the_logical_pages(spec: dict) -> None:
    """For every constructor, TP rank and block, the runs fill the canonical page with the bytes
    the engine tensor holds there, on exactly this rank's heads, each byte once."""
    seed = spec.pop("seed")
    cache = make_cache(**spec)
    geometry = cache.layout.geometry
    content = random_content(geometry, spec["num_blocks"], torch.Generator().manual_seed(seed))
    cache.fill(content)
    held = held_bytes(cache)
    for name in geometry.tensor_names():
        for block in range(spec["num_blocks"]):
            page, written = apply_runs(cache, name, block)
            assert np.array_equal(written, held.astype(np.int64)), (cache.kind, name)
            expected = content.pages[name][block].contiguous().view(torch.uint8).numpy().ravel()
            assert np.array_equal(page[held], expected[held]), (cache.kind, name, block)


@pytest.mark.parametrize(
    ("kind", "tp_size", "runs_per_part"),
    [
        ("vllm-nhd", 1, 1),  # a whole NHD page is one run
        ("vllm-legacy", 1, 1),
        ("cross-layer", 1, 1),
        ("flat-paged", 1, 1),
        ("mla", 2, 1),
        ("vllm-nhd", 2, 1),  # a rank's head slice: one strided run
        ("vllm-hnd", 1, 4),  # head-major: one run per head
        ("packed", 1, 4),
        ("contiguous", 1, 4),
    ],
)
def test_runs_are_folded_as_documented(kind: str, tp_size: int, runs_per_part: int) -> None:
    cache = make_cache(
        kind,
        num_layers=2,
        num_blocks=3,
        block_size=8,
        num_kv_heads=4,
        head_dim=16,
        latent_dim=32,
        tp_size=tp_size,
    )
    assert {len(ref.mapping.runs) for ref in cache.layout.refs} == {runs_per_part}


def rank_layouts(kind: str, heads: int, tp_size: int) -> list[CacheLayout]:
    return [
        make_cache(
            kind,
            num_layers=2,
            num_blocks=4,
            block_size=2,
            num_kv_heads=heads,
            head_dim=4,
            latent_dim=6,
            tp_rank=rank,
            tp_size=tp_size,
        ).layout
        for rank in range(tp_size)
    ]


@pytest.mark.parametrize("kind", TP_KINDS)
@pytest.mark.parametrize(("heads", "tp_size"), [(4, 1), (4, 2), (4, 4), (2, 4), (1, 2), (2, 8)])
def test_check_tiling_accepts_every_complete_rank_set(kind: str, heads: int, tp_size: int) -> None:
    layouts = rank_layouts(kind, heads, tp_size)
    check_tiling(layouts)
    check_tiling(layouts[::-1])  # any order
    writers = {
        layout.ref("layers.1." + layout.geometry.parts[0]).mapping.num_writers for layout in layouts
    }
    expected_writers = tp_size if kind == "mla" else max(tp_size // heads, 1)
    assert writers == {expected_writers}


def test_check_tiling_rejects_missing_duplicate_and_overlapping_ranks() -> None:
    layouts = rank_layouts("vllm-nhd", 4, 4)
    with pytest.raises(LayoutError, match="every TP rank"):
        check_tiling(layouts[:3])
    with pytest.raises(LayoutError, match="every TP rank"):
        check_tiling([layouts[0], layouts[1], layouts[1], layouts[3]])
    with pytest.raises(LayoutError, match="at least one"):
        check_tiling([])
    # Rank 2 claims rank 1's heads: rank 1's bytes are covered twice, rank 2's never.
    impostor = dataclasses.replace(layouts[1], tp_rank=2)
    with pytest.raises(LayoutError, match="exactly once"):
        check_tiling([layouts[0], layouts[1], impostor, layouts[3]])
    # Rank 3 leaves its last token of layers.0.key out: a hole nobody covers.
    key = layouts[3].ref("layers.0.key")
    (run,) = key.mapping.runs
    shorter = dataclasses.replace(run, num_fragments=run.num_fragments - 1)
    holed = dataclasses.replace(key, mapping=dataclasses.replace(key.mapping, runs=(shorter,)))
    refs = [holed if ref.name == key.name else ref for ref in layouts[3].refs]
    with pytest.raises(LayoutError, match="0 times"):
        check_tiling([*layouts[:3], dataclasses.replace(layouts[3], refs=refs)])
    # Replicated ranks that both claim to be writer 0: every other block is never written.
    replicated = rank_layouts("mla", 1, 2)
    refs = [
        dataclasses.replace(ref, mapping=dataclasses.replace(ref.mapping, writer_index=0))
        for ref in replicated[1].refs
    ]
    both_first = dataclasses.replace(replicated[1], refs=refs)
    with pytest.raises(LayoutError, match="exactly once"):
        check_tiling([replicated[0], both_first])


def test_layout_refuses_overlapping_and_out_of_bounds_runs() -> None:
    cache = make_cache(
        "vllm-nhd", num_layers=1, num_blocks=3, block_size=2, num_kv_heads=2, head_dim=4
    )
    layout = cache.layout
    page = layout.geometry.canonical_page_size_bytes
    key = layout.ref("layers.0.key")

    def with_runs(*runs: CopyRun) -> list[PageRef]:
        mapping = CanonicalPageMapping(page, runs)
        return [dataclasses.replace(key, mapping=mapping), layout.ref("layers.0.value")]

    def build(refs: list[PageRef], **changes: object) -> CacheLayout:
        fields = {
            "geometry": layout.geometry,
            "tensors": layout.tensors,
            "refs": refs,
            "encoding": "test",
        }
        return CacheLayout(**{**fields, **changes})

    half = page // 2
    build(
        with_runs(CopyRun(0, 0, 0, 0, half, 1), CopyRun(half, 0, half, 0, half, 1))
    )  # a valid split
    with pytest.raises(LayoutError, match="twice"):
        build(with_runs(CopyRun(0, 0, 0, 0, half + 2, 1), CopyRun(half, 0, half, 0, half, 1)))
    block_stride = layout.tensors[0].block_stride_bytes
    with pytest.raises(LayoutError, match="outside its tensor"):
        build(with_runs(CopyRun(block_stride, 0, 0, 0, page, 1)))
    with pytest.raises(LayoutError, match="outside the canonical page"):
        build(with_runs(CopyRun(0, 0, 2, 0, page, 1)))
    with pytest.raises(LayoutError, match="missing"):
        build([key])
    with pytest.raises(LayoutError, match="twice"):
        build([key, key])
    with pytest.raises(LayoutError, match="not registered"):
        build([dataclasses.replace(key, tensor_index=5), layout.ref("layers.0.value")])
    with pytest.raises(LayoutError, match="outside tp_size"):
        build(layout.refs, tp_rank=2, tp_size=2)


def test_constructors_refuse_inconsistent_tensors() -> None:
    good = [torch.zeros(4, 2, 2, 2, 8, dtype=torch.float16) for _ in range(2)]
    vllm_split_layout(good)
    with pytest.raises(LayoutError, match="expected"):
        vllm_split_layout([torch.zeros(4, 3, 2, 2, 8)])
    with pytest.raises(LayoutError, match="differs"):
        vllm_split_layout([good[0], torch.zeros(4, 2, 2, 2, 8, dtype=torch.float32)])
    with pytest.raises(LayoutError, match="per rank"):
        vllm_split_layout(good, num_kv_heads=8, tp_rank=0, tp_size=2)  # 8 heads / TP 2 = 4 per rank
    with pytest.raises(LayoutError, match="do not split evenly"):
        vllm_split_layout(good, num_kv_heads=6, tp_size=4)
    with pytest.raises(LayoutError, match="contiguous"):
        vllm_split_layout([torch.zeros(4, 2, 2, 2, 8).transpose(3, 4)])
    with pytest.raises(LayoutError, match="no KV cache"):
        vllm_split_layout([])


def test_geometry_validation_and_names() -> None:
    geometry = KVGeometry(
        num_layers=2, block_size=16, dtype="bfloat16", num_kv_heads=8, head_dim=128
    )
    assert geometry.tensor_names() == [
        "layers.0.key",
        "layers.0.value",
        "layers.1.key",
        "layers.1.value",
    ]
    assert geometry.canonical_page_size_bytes == 16 * 8 * 128 * 2
    assert geometry.bytes_per_block == 4 * geometry.canonical_page_size_bytes
    assert geometry.attention_types == ("full", "full")
    mla = KVGeometry(num_layers=1, block_size=4, dtype="float16", latent_dim=576)
    assert mla.parts == ("latent",) and mla.canonical_page_shape == (4, 576)
    assert mla.attention_types == ("mla",)
    for bad in (
        {"num_layers": 0, "block_size": 1, "dtype": "float16", "num_kv_heads": 1, "head_dim": 1},
        {"num_layers": 1, "block_size": 1, "dtype": "float16", "num_kv_heads": 0, "head_dim": 1},
        {"num_layers": 1, "block_size": 1, "dtype": "float16", "latent_dim": 4, "head_dim": 1},
        {"num_layers": 1, "block_size": 1, "dtype": "complex64", "num_kv_heads": 1, "head_dim": 1},
        {
            "num_layers": 2,
            "block_size": 1,
            "dtype": "float16",
            "num_kv_heads": 1,
            "head_dim": 1,
            "attention_types": ("full",),
        },
    ):
        with pytest.raises(LayoutError):
            KVGeometry(**bad)
    assert dtype_name(torch_dtype("float8_e4m3fn")) == "float8_e4m3fn"
    with pytest.raises(LayoutError, match="unsupported"):
        dtype_name(torch.complex64)


@pytest.mark.parametrize(
    ("heads", "rank", "size", "expected"),
    [
        (8, 3, 4, (6, 2, 1, 0)),
        (4, 0, 1, (0, 4, 1, 0)),
        (2, 3, 4, (1, 1, 2, 1)),  # 2 ranks per head; rank 3 is head 1's second replica
        (1, 2, 3, (0, 1, 3, 2)),
    ],
)
def test_head_shard(heads: int, rank: int, size: int, expected: tuple[int, int, int, int]) -> None:
    shard = head_shard(heads, rank, size)
    assert (
        shard.first_head,
        shard.num_local_heads,
        shard.num_writers,
        shard.writer_index,
    ) == expected


def test_head_shard_refuses_uneven_splits() -> None:
    with pytest.raises(LayoutError):
        head_shard(6, 0, 4)
    with pytest.raises(LayoutError):
        head_shard(4, 0, 6)


def byte_pairs(runs: tuple[CopyRun, ...]) -> set[tuple[int, int]]:
    return {
        (
            run.local_offset + i * run.local_stride + k,
            run.canonical_offset + i * run.canonical_stride + k,
        )
        for run in runs
        for i in range(run.num_fragments)
        for k in range(run.fragment_size)
    }


@settings(max_examples=80, deadline=None)
@given(
    order=st.permutations(["token", "head", "pad"]),
    tokens=st.integers(1, 5),
    local_heads=st.integers(1, 3),
    extra_heads=st.integers(0, 2),
    head_dim=st.integers(1, 4),
    element_size=st.sampled_from([1, 2, 4]),
    pad=st.integers(1, 3),
    offset=st.integers(0, 64),
)
def test_strided_page_runs_match_brute_force(
    order: list[str],
    tokens: int,
    local_heads: int,
    extra_heads: int,
    head_dim: int,
    element_size: int,
    pad: int,
    offset: int,
) -> None:
    """Any physical order of (token, head, padding) axes gives runs with the brute-force mapping."""
    sizes = {"token": tokens, "head": local_heads, "pad": pad}
    strides, step = {}, head_dim
    for axis in reversed(order):  # innermost last
        strides[axis] = step
        step *= sizes[axis]
    first_head = extra_heads
    total_heads = local_heads + 2 * extra_heads
    runs = strided_page_runs(
        element_size=element_size,
        offset_bytes=offset,
        token_stride=strides["token"],
        head_stride=strides["head"],
        dim_stride=1,
        block_size=tokens,
        num_local_heads=local_heads,
        head_dim=head_dim,
        num_total_heads=total_heads,
        first_head=first_head,
    )
    fragment = head_dim * element_size
    expected = {
        (
            offset + (t * strides["token"] + h * strides["head"]) * element_size + k,
            ((t * total_heads) + first_head + h) * fragment + k,
        )
        for t in range(tokens)
        for h in range(local_heads)
        for k in range(fragment)
    }
    assert byte_pairs(runs) == expected


@settings(max_examples=80, deadline=None)
@given(
    count=st.integers(1, 24),
    size=st.integers(1, 6),
    local_gap=st.integers(0, 2),
    seed=st.integers(0, 2**32 - 1),
)
def test_fold_fragments_keeps_every_byte(count: int, size: int, local_gap: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    local = rng.permutation(count * (1 + local_gap))[:count].astype(np.int64) * size
    canonical = rng.permutation(count).astype(np.int64) * size
    if rng.integers(2):  # regular structure: a strided run that folding should find
        local = np.arange(count, dtype=np.int64) * size * (1 + local_gap)
        canonical = np.arange(count, dtype=np.int64) * size
    runs = fold_fragments(local, canonical, size)
    expected = {
        (int(lo) + k, int(c) + k)
        for lo, c in zip(local, canonical, strict=True)
        for k in range(size)
    }
    assert byte_pairs(runs) == expected
    if (np.diff(local) == np.diff(local)[:1]).all() and (np.diff(canonical) == size).all():
        assert len(runs) == 1


def test_the_snapshot_view_of_every_head_kind_is_token_major() -> None:
    """The canonical page is (block_size, heads, head_dim), token-major, whatever the engine."""
    content = None
    pages = []
    for kind in HEAD_KINDS:
        cache = make_cache(
            kind, num_layers=1, num_blocks=2, block_size=3, num_kv_heads=2, head_dim=2
        )
        if content is None:
            content = random_content(cache.layout.geometry, 2, torch.Generator().manual_seed(9))
        cache.fill(content)
        pages.append(apply_runs(cache, "layers.0.value", 1)[0])
    expected = content.pages["layers.0.value"][1].contiguous().view(torch.uint8).numpy().ravel()
    assert all(np.array_equal(page, expected) for page in pages)


def test_layers_of_one_page_shape_derive_their_runs_once() -> None:
    # A 64-layer cache builds 128 page refs; the runs of layer 0 serve them all (not recomputed).
    buffer = torch.zeros((2, 64, 1, 2, 32, 8), dtype=torch.float16)
    layout = contiguous_layout(list(buffer[0]), list(buffer[1]), block_size=16)
    runs = {id(ref.mapping.runs) for ref in layout.refs}
    assert len(runs) == 1
    assert layout.ref("layers.63.value").mapping.runs == layout.ref("layers.0.key").mapping.runs
