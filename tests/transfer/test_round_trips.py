"""Capture and restore through the transfer handler on CPU tensors: every TP rank of one layout
captures into host pages, every rank of another layout restores them, bit-exact, with every
CPU backend (hypothesis round trips across layouts, TP sizes, dtypes and host page layouts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsnap.layout import head_shard
from kvsnap.testing.caches import (
    HEAD_KINDS,
    TP_KINDS,
    SyntheticCache,
    make_cache,
    random_content,
    same_bytes,
)
from tests.support.transfer_helpers import D2H, H2D, HostArea, page_bytes, run_job

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn]


def geometry_args(is_mla: bool, heads: int, head_dim: int) -> dict:
    return {"latent_dim": head_dim} if is_mla else {"num_kv_heads": heads, "head_dim": head_dim}


def tp_sizes_for(heads: int) -> list[int]:
    sizes = []
    for size in (1, 2, 3, 4):
        try:
            head_shard(heads, 0, size)
        except ValueError:
            continue
        sizes.append(size)
    return sizes


@st.composite
def round_trips(draw: st.DrawFn) -> dict:
    is_mla = draw(st.integers(0, 5)) == 0
    heads = draw(st.integers(1, 4))
    tp_sizes = [1] if not tp_sizes_for(heads) else tp_sizes_for(heads)
    source_tp = draw(st.sampled_from(tp_sizes))
    target_tp = draw(st.sampled_from(tp_sizes))
    if is_mla:
        source_kind = target_kind = "mla"
    else:
        source_kind = draw(st.sampled_from(TP_KINDS[:-1] if source_tp > 1 else HEAD_KINDS))
        target_kind = draw(st.sampled_from(TP_KINDS[:-1] if target_tp > 1 else HEAD_KINDS))
    source_blocks = draw(st.integers(2, 9))
    target_blocks = draw(st.integers(2, 9))
    count = draw(st.integers(1, min(source_blocks, target_blocks)))
    per_chunk = draw(st.integers(1, 3))
    return {
        "is_mla": is_mla,
        "heads": heads,
        "head_dim": draw(st.integers(1, 9)),
        "layers": draw(st.integers(1, 2)),
        "block_size": draw(st.sampled_from([1, 2, 3, 4, 8])),
        "dtype": draw(st.sampled_from(DTYPES)),
        "source": (source_kind, source_tp, source_blocks),
        "target": (target_kind, target_tp, target_blocks),
        "count": count,
        "per_chunk": per_chunk,
        "skip": draw(st.integers(0, per_chunk - 1)),
        "padding": draw(st.sampled_from([0, 8, 3])),
        "capture_backend": draw(st.sampled_from(["cpu", "torch", "auto"])),
        "restore_backend": draw(st.sampled_from(["cpu", "torch", "auto"])),
        "merge": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


def ranks(kind: str, tp: int, blocks: int, case: dict) -> list[SyntheticCache]:
    return [
        make_cache(
            kind,
            num_layers=case["layers"],
            num_blocks=blocks,
            block_size=case["block_size"],
            dtype=case["dtype"],
            tp_rank=rank,
            tp_size=tp,
            **geometry_args(case["is_mla"], case["heads"], case["head_dim"]),
        )
        for rank in range(tp)
    ]


def check_round_trip(case: dict) -> None:
    """Every TP rank of layout A captures into one host area; every rank of layout B restores."""
    rng = np.random.default_rng(case["seed"])
    generator = torch.Generator().manual_seed(case["seed"])
    source_kind, source_tp, source_blocks = case["source"]
    target_kind, target_tp, target_blocks = case["target"]
    count = case["count"]
    sources = ranks(source_kind, source_tp, source_blocks, case)
    geometry = sources[0].layout.geometry
    content = random_content(geometry, count, generator)
    source_ids = rng.permutation(source_blocks)[:count]
    for cache in sources:
        cache.fill(content, torch.from_numpy(source_ids))
    names = geometry.tensor_names()
    area = HostArea.create(
        names,
        geometry.canonical_page_size_bytes,
        count,
        case["per_chunk"],
        case["skip"],
        case["padding"],
        rng,
    )
    for cache in sources:
        run_job(
            cache,
            D2H,
            area.copies(source_ids),
            backend=case["capture_backend"],
            merge=case["merge"],
        )
    # The ranks' pages reassemble the TP=1 canonical page exactly.
    for index, name in enumerate(names):
        for k in range(count):
            assert torch.equal(area.page(index, k), page_bytes(content, name, k)), (name, k)

    targets = ranks(target_kind, target_tp, target_blocks, case)
    target_ids = rng.permutation(target_blocks)[:count]
    for cache in targets:
        run_job(
            cache,
            H2D,
            area.copies(target_ids),
            backend=case["restore_backend"],
            merge=case["merge"],
        )
    untouched = torch.from_numpy(np.setdiff1d(np.arange(target_blocks), target_ids))
    for cache in targets:
        for name in names:
            view = cache.logical(name)
            expected = cache.expected(content, name, torch.arange(count))
            assert same_bytes(view[torch.from_numpy(target_ids)], expected), (cache.kind, name)
            # Nothing outside the restored blocks was written.
            assert not view[untouched].reshape(-1).view(torch.uint8).any(), (cache.kind, name)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=round_trips())
def test_capture_then_restore_into_another_layout_is_bit_exact(case: dict) -> None:
    check_round_trip(case)


@pytest.mark.slow
@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=round_trips())
def test_capture_then_restore_many_more_cases(case: dict) -> None:
    check_round_trip(case)


def test_tp_capture_equals_tp1_capture_with_replicated_heads() -> None:
    """TP=4 over 2 KV heads (each head on 2 ranks, writers elected) gives TP=1's bytes."""
    generator = torch.Generator().manual_seed(3)
    common = {"num_layers": 2, "num_blocks": 6, "block_size": 4, "num_kv_heads": 2, "head_dim": 8}
    single = make_cache("vllm-hnd", **common)
    content = random_content(single.layout.geometry, 6, generator)
    single.fill(content)
    shards = [make_cache("packed", tp_rank=r, tp_size=4, **common) for r in range(4)]
    for shard in shards:
        shard.fill(content)
    # Replicated ranks hold identical bytes.
    assert all(same_bytes(a, b) for a, b in zip(shards[0].tensors, shards[1].tensors, strict=True))
    names = single.layout.geometry.tensor_names()
    page = single.layout.geometry.canonical_page_size_bytes
    blocks = np.array([5, 0, 3, 2, 1, 4])
    buffers = []
    for group in ([single], shards):
        area = HostArea(
            torch.zeros(len(names), 6, page, dtype=torch.uint8), names, page, 1, np.arange(6), 0
        )
        for cache in group:
            run_job(cache, D2H, area.copies(blocks), backend="torch")
        buffers.append(area.buffer)
    assert torch.equal(buffers[0], buffers[1])
    assert buffers[0].any()
