"""The transfer engine on CPU tensors: round trips across layouts and TP sizes, the handler's
job bookkeeping, failure isolation, and bit-identity of every backend with ``cpu``."""

from __future__ import annotations

import ctypes
import itertools
import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsnap.layout import CopyRun, head_shard
from kvsnap.testing.caches import (
    HEAD_KINDS,
    TP_KINDS,
    KVContent,
    SyntheticCache,
    make_cache,
    random_content,
    same_bytes,
)
from kvsnap.transfer import (
    AutoPolicy,
    BackendUnavailable,
    CopyJob,
    TransferHandler,
    available_backends,
    load_policy,
    make_backend,
    unavailable_reason,
)
from kvsnap.transfer.cpu import CpuBackend, copy_descriptors
from kvsnap.transfer.cuda_batch import resolve_driver
from kvsnap.transfer.plan import Descriptors, Direction, HostPages, PageCopy
from kvsnap.transfer.policy import LARGE_FRAGMENT_BYTES, policy_from_calibration
from kvsnap.transfer.torch_views import fold_runs, nonnegative_runs
from kvsnap.transfer.triton_copy import split_pieces, tile_shape, word_bytes

D2H, H2D = Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn]


# --------------------------------------------------------------------------------------------
# Host pages and the independent expectation of where each page lands


@dataclass
class HostArea:
    """Host pages for every canonical tensor: chunks of ``per_chunk`` pages, padded apart."""

    buffer: torch.Tensor  # (num_tensors, num_chunks, chunk_stride) uint8
    names: list[str]
    page_size: int
    per_chunk: int
    chunk_ids: np.ndarray
    skip: int

    @classmethod
    def create(
        cls,
        names: list[str],
        page_size: int,
        count: int,
        per_chunk: int,
        skip: int,
        padding: int,
        rng: np.random.Generator,
    ) -> HostArea:
        needed = -(-(count + skip) // per_chunk)
        num_chunks = needed + int(rng.integers(0, 3))
        chunk_ids = rng.permutation(num_chunks)[:needed]
        stride = per_chunk * page_size + padding
        buffer = torch.zeros(len(names), num_chunks, stride, dtype=torch.uint8)
        return cls(buffer, names, page_size, per_chunk, chunk_ids, skip)

    def host(self, index: int) -> HostPages:
        chunks = self.buffer[index]
        return HostPages(
            chunks.data_ptr(), chunks.shape[0], chunks.shape[1], self.page_size, self.per_chunk
        )

    def copies(self, device_blocks: np.ndarray) -> list[PageCopy]:
        return [
            PageCopy(name, device_blocks, self.host(index), self.chunk_ids, self.skip)
            for index, name in enumerate(self.names)
        ]

    def page(self, index: int, k: int) -> torch.Tensor:
        """The bytes of the ``k``-th page of the enumeration (computed here, not by plan.py)."""
        chunk_slot, sub_page = divmod(self.skip + k, self.per_chunk)
        chunk = int(self.chunk_ids[chunk_slot])
        start = sub_page * self.page_size
        return self.buffer[index, chunk, start : start + self.page_size]


def page_bytes(content: KVContent, name: str, k: int) -> torch.Tensor:
    return content.pages[name][k].contiguous().view(torch.uint8).flatten()


def run_job(cache: SyntheticCache, direction: Direction, copies: list[PageCopy], **options) -> None:
    with TransferHandler(cache.layout, direction, **options) as handler:
        assert handler.submit(7, copies), handler.last_rejection
        (result,) = handler.wait([7])
    assert result.success, result.error
    assert result.job_id == 7


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
# The handler


def small_cache(blocks: int = 16) -> tuple[SyntheticCache, KVContent]:
    cache = make_cache(
        "vllm-nhd", num_layers=2, num_blocks=blocks, block_size=2, num_kv_heads=2, head_dim=4
    )
    content = random_content(cache.layout.geometry, blocks, torch.Generator().manual_seed(1))
    cache.fill(content)
    return cache, content


def one_block_area(cache: SyntheticCache, pages: int) -> HostArea:
    names = cache.layout.geometry.tensor_names()
    page = cache.layout.geometry.canonical_page_size_bytes
    return HostArea(
        torch.zeros(len(names), pages, page, dtype=torch.uint8), names, page, 1, np.arange(pages), 0
    )


def copies_for(area: HostArea, device_block: int, host_page: int) -> list[PageCopy]:
    return [
        PageCopy(name, np.array([device_block]), area.host(index), np.array([host_page]))
        for index, name in enumerate(area.names)
    ]


def test_many_jobs_complete_in_submission_order() -> None:
    cache, content = small_cache()
    area = one_block_area(cache, 16)
    handler = TransferHandler(cache.layout, D2H, backend="cpu")
    order = list(np.random.default_rng(0).permutation(16))
    for job_id, block in enumerate(order):
        assert handler.submit(100 + job_id, copies_for(area, int(block), job_id))
    waited = handler.wait([104, 101, 999])  # 999 was never submitted: ignored
    assert [result.job_id for result in waited] == [101, 104]
    finished = handler.get_finished()
    assert [result.job_id for result in finished] == [100 + i for i in range(16) if i not in (1, 4)]
    assert handler.get_finished() == []
    page_bytes_total = 2 * 2 * cache.layout.geometry.canonical_page_size_bytes
    assert all(
        result.success and result.num_bytes == page_bytes_total for result in waited + finished
    )
    for job_id, block in enumerate(order):
        for index, name in enumerate(area.names):
            assert torch.equal(area.page(index, job_id), page_bytes(content, name, int(block)))
    handler.shutdown()


class FlakyBackend(CpuBackend):
    """A real cpu backend that refuses the jobs it is told to fail."""

    name = "flaky"

    def __init__(self, *args, fail_jobs: set[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fail_jobs = fail_jobs

    def execute(self, job: CopyJob) -> None:
        if job.job_id in self.fail_jobs:
            raise OSError(f"injected failure in job {job.job_id}")
        super().execute(job)


def test_a_failing_backend_fails_only_its_job() -> None:
    cache, content = small_cache()
    area = one_block_area(cache, 3)
    backend = FlakyBackend(cache.layout, D2H, fail_jobs={2})
    handler = TransferHandler(cache.layout, D2H, backend=backend)
    assert handler.backend_name == "flaky"
    for job_id in (1, 2, 3):
        assert handler.submit(job_id, copies_for(area, job_id, job_id - 1))
    results = handler.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(1, True), (2, False), (3, True)]
    assert "injected failure in job 2" in results[1].error
    assert results[1].num_bytes == 0
    assert torch.equal(area.page(0, 0), page_bytes(content, area.names[0], 1))
    assert not area.buffer[:, 1].any()  # job 2 wrote nothing
    assert torch.equal(area.page(1, 2), page_bytes(content, area.names[1], 3))
    handler.shutdown()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_invalid_jobs_are_rejected_and_the_handler_goes_on(backend: str) -> None:
    cache, content = small_cache()
    area = one_block_area(cache, 2)
    handler = TransferHandler(cache.layout, D2H, backend=backend)
    assert not handler.submit(1, copies_for(area, 16, 0))  # block 16 of 16
    assert "device block ids" in handler.last_rejection
    assert not handler.submit(
        2, [PageCopy("layers.9.key", np.array([0]), area.host(0), np.array([0]))]
    )
    wrong_page = HostPages(area.host(0).data_ptr, 2, 64, 64)
    assert not handler.submit(
        3, [PageCopy("layers.0.key", np.array([0]), wrong_page, np.array([0]))]
    )
    assert handler.submit(4, copies_for(area, 5, 1))
    assert not handler.submit(4, copies_for(area, 6, 0))  # job 4 is still uncollected
    assert [r.job_id for r in handler.get_finished()] == [4]
    assert not area.buffer[:, 0].any()
    assert torch.equal(area.page(0, 1), page_bytes(content, area.names[0], 5))
    handler.shutdown()


def test_shutdown_drains_then_rejects() -> None:
    cache, content = small_cache()
    area = one_block_area(cache, 4)
    handler = TransferHandler(cache.layout, D2H, backend="torch")
    for job_id in range(4):
        assert handler.submit(job_id, copies_for(area, 3 * job_id, job_id))
    handler.shutdown()
    assert [r.job_id for r in handler.get_finished()] == [0, 1, 2, 3]
    assert not handler.submit(9, copies_for(area, 0, 0))
    assert "shut down" in handler.last_rejection
    handler.shutdown()  # a second call does nothing
    for job_id in range(4):
        assert torch.equal(area.page(1, job_id), page_bytes(content, area.names[1], 3 * job_id))


def test_merged_and_unmerged_plans_copy_identical_bytes() -> None:
    cache, _ = small_cache()
    blocks = np.array([2, 3, 4, 5, 9, 10, 0])
    outputs = []
    for merge in (True, False):
        area = one_block_area(cache, 7)
        with TransferHandler(cache.layout, D2H, backend="cpu", merge=merge) as handler:
            handler.submit(1, area.copies(blocks))
            (result,) = handler.wait([1])
        outputs.append((area.buffer, result.num_bytes))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert outputs[0][1] == outputs[1][1] == 7 * 4 * cache.layout.geometry.canonical_page_size_bytes


def test_torch_backend_stages_through_a_bounded_buffer() -> None:
    cache, content = small_cache()
    page = cache.layout.geometry.canonical_page_size_bytes
    area = one_block_area(cache, 9)
    blocks = np.array([15, 1, 2, 3, 7, 8, 0, 11, 12])
    backend = make_backend("torch", cache.layout, D2H, staging_bytes=2 * page + 1)
    with TransferHandler(cache.layout, D2H, backend=backend) as handler:
        handler.submit(1, area.copies(blocks))
        assert handler.wait([1])[0].success
        assert 0 < backend.allocated_staging_bytes <= 2 * page + 1
    for index, name in enumerate(area.names):
        for k, block in enumerate(blocks):
            assert torch.equal(area.page(index, k), page_bytes(content, name, int(block)))


@pytest.mark.parametrize("per_chunk", [1, 3])
def test_torch_batches_split_runs_of_host_pages_anywhere(per_chunk: int) -> None:
    """Batches of a few pages cut scattered host pages at every possible place; a round trip
    through such batches lands every page where the host layout says, and back."""
    cache, content = small_cache()
    names, page = (
        cache.layout.geometry.tensor_names(),
        cache.layout.geometry.canonical_page_size_bytes,
    )
    rng = np.random.default_rng(5)
    area = HostArea.create(names, page, 11, per_chunk, per_chunk - 1, 24, rng)
    blocks = rng.permutation(16)[:11]
    options = {"torch": {"staging_bytes": 5 * page}}
    run_job(cache, D2H, area.copies(blocks), backend="torch", backend_options=options)
    for index, name in enumerate(names):
        for k, block in enumerate(blocks):
            assert torch.equal(area.page(index, k), page_bytes(content, name, int(block)))
    target = make_cache(
        "vllm-nhd", num_layers=2, num_blocks=16, block_size=2, num_kv_heads=2, head_dim=4
    )
    targets = rng.permutation(16)[:11]
    run_job(target, H2D, area.copies(targets), backend="torch", backend_options=options)
    for name in names:
        view = target.logical(name)[torch.from_numpy(targets)]
        expected = cache.logical(name)[torch.from_numpy(blocks)]
        assert same_bytes(view, expected), name


def test_handler_rejects_backends_that_cannot_run_here() -> None:
    cache, _ = small_cache()
    with pytest.raises(BackendUnavailable, match="cuda-batch"):
        TransferHandler(cache.layout, D2H, backend="cuda-batch")
    with pytest.raises(KeyError, match="unknown transfer backend"):
        TransferHandler(cache.layout, D2H, backend="dma")
    assert TransferHandler(cache.layout, H2D).backend_name == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_cuda_batch_is_absent_gracefully_without_a_gpu() -> None:
    driver, error = resolve_driver()
    assert (driver is None) != (error is None)
    assert "cuda-batch" not in available_backends("cpu")
    assert unavailable_reason("cuda-batch", "cuda") is not None
    assert set(available_backends("cpu")) >= {"cpu", "torch"}


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


class CountingBackend(CpuBackend):
    """The cpu backend, recording the descriptor count of every piece it is handed."""

    name = "counting"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pieces: list[int] = []

    def execute(self, job: CopyJob) -> None:
        self.pieces.append(len(job.descriptors))
        super().execute(job)


def test_descriptor_backends_get_the_job_in_pieces_planned_copy_by_copy() -> None:
    cache, _ = small_cache()
    blocks = np.array([9, 3, 4, 5, 0, 12])
    outputs = []
    for flush in (1 << 16, 13, 1):
        area = one_block_area(cache, len(blocks))
        backend = CountingBackend(cache.layout, D2H)
        with TransferHandler(
            cache.layout, D2H, backend=backend, flush_descriptors=flush
        ) as handler:
            assert handler.submit(1, area.copies(blocks))
            (result,) = handler.wait([1])
        outputs.append((area.buffer, result.num_bytes, backend.pieces))
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][0], outputs[2][0])
    assert (
        outputs[0][1]
        == outputs[1][1]
        == outputs[2][1]
        == 24 * cache.layout.geometry.canonical_page_size_bytes
    )
    assert outputs[0][2] == [24]  # 4 copies x 6 blocks, one piece
    assert outputs[1][2] == [18, 6]  # flushed once 13 were planned (after the third copy)
    assert outputs[2][2] == [6, 6, 6, 6]  # one piece per copy


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_result_bytes_count_only_what_this_rank_writes(backend: str) -> None:
    cache = make_cache(
        "mla", num_layers=2, num_blocks=8, block_size=2, latent_dim=4, tp_rank=1, tp_size=3
    )
    page = cache.layout.geometry.canonical_page_size_bytes
    area = one_block_area(cache, 8)
    with TransferHandler(cache.layout, D2H, backend=backend) as handler:
        handler.submit(1, area.copies(np.arange(8)))
        (capture,) = handler.wait([1])
    with TransferHandler(cache.layout, H2D, backend=backend) as handler:
        handler.submit(2, area.copies(np.arange(8)))
        (restore,) = handler.wait([2])
    # Rank 1 of 3 replicas writes pages 1, 4 and 7 of each of the 2 tensors; it restores all 8.
    assert capture.num_bytes == 2 * 3 * page
    assert restore.num_bytes == 2 * 8 * page
