"""The transfer engine on real CUDA tensors and page-locked host memory (skipped without CUDA).

Every backend captures caches of several layouts and TP ranks into pinned host pages and
restores them into another layout, bit-exact; captures stay exact while another stream keeps
writing other blocks; jobs on pooled streams complete in submission order; a failing job
fails alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsnap.testing.caches import SyntheticCache, make_cache, random_content, same_bytes
from kvsnap.transfer import CopyJob, TransferHandler, available_backends, make_backend
from kvsnap.transfer.cuda_batch import CudaBatchBackend, resolve_driver
from kvsnap.transfer.pinned import PinnedPool
from kvsnap.transfer.plan import Direction, HostPages, PageCopy

pytestmark = pytest.mark.gpu

D2H, H2D = Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE
DEVICE = "cuda"
#: ``torch-pipelined``: the torch backend with staging for a few pages only, so every job is
#: many batches alternating between the job stream and the side stream.
BACKENDS = ["cuda-batch", "triton", "torch", "torch-pipelined", "auto"]


def handler_arguments(backend: str, page_size_bytes: int) -> dict:
    if backend == "torch-pipelined":
        options = {"torch": {"staging_bytes": 5 * page_size_bytes}}
        return {"backend": "torch", "backend_options": options}
    return {"backend": backend}


@pytest.fixture(scope="module")
def pool() -> PinnedPool:
    with PinnedPool(64 << 20, 1) as pinned:
        yield pinned


class PinnedArea:
    """Canonical host pages for each tensor of a geometry, in one pinned slot."""

    def __init__(self, pool: PinnedPool, names: list[str], page: int, pages: int) -> None:
        self.names, self.page, self.pages = names, page, pages
        slot = pool.slot(0)
        assert len(names) * pages * page <= slot.size_bytes
        self.buffer = slot.tensor[: len(names) * pages * page].view(len(names), pages, page)
        self.buffer.zero_()

    def copies(
        self, device_blocks: np.ndarray, host_pages: np.ndarray | None = None
    ) -> list[PageCopy]:
        pages = np.arange(len(device_blocks)) if host_pages is None else host_pages
        return [
            PageCopy(
                name,
                device_blocks,
                HostPages.contiguous(self.buffer[i].data_ptr(), self.pages, self.page),
                pages,
            )
            for i, name in enumerate(self.names)
        ]


def run(
    cache: SyntheticCache, direction: Direction, copies: list[PageCopy], backend: str, **kwargs
) -> None:
    page = cache.layout.geometry.canonical_page_size_bytes
    arguments = {**handler_arguments(backend, page), **kwargs}
    with TransferHandler(cache.layout, direction, **arguments) as handler:
        assert handler.submit(1, copies), handler.last_rejection
        (result,) = handler.wait([1])
    assert result.success, result.error
    assert result.seconds > 0


CASES = [
    # (source kind, source TP, target kind, target TP, heads, head_dim, dtype)
    ("vllm-nhd", 1, "flat-paged", 1, 4, 64, torch.bfloat16),
    ("vllm-hnd", 2, "vllm-nhd", 1, 4, 32, torch.float16),
    ("packed", 4, "vllm-legacy", 2, 2, 16, torch.float32),  # replicated heads, writer election
    ("contiguous", 1, "cross-layer", 1, 3, 5, torch.uint8),  # 5-byte fragments: byte words
    ("mla", 2, "mla", 1, 0, 72, torch.bfloat16),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("source", "source_tp", "target", "target_tp", "heads", "head_dim", "dtype"), CASES
)
def test_round_trip_on_cuda(
    pool: PinnedPool,
    backend: str,
    source: str,
    source_tp: int,
    target: str,
    target_tp: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> None:
    if backend not in ("auto", "torch-pipelined") and backend not in available_backends(DEVICE):
        pytest.skip(f"{backend} is not available here")
    rng = np.random.default_rng(len(backend) + source_tp)
    blocks, count = 40, 23

    def caches(kind: str, tp: int) -> list[SyntheticCache]:
        geometry = (
            {"latent_dim": head_dim}
            if kind == "mla"
            else {"num_kv_heads": heads, "head_dim": head_dim}
        )
        return [
            make_cache(
                kind,
                num_layers=2,
                num_blocks=blocks,
                block_size=16,
                dtype=dtype,
                device=DEVICE,
                tp_rank=rank,
                tp_size=tp,
                **geometry,
            )
            for rank in range(tp)
        ]

    sources = caches(source, source_tp)
    geometry = sources[0].layout.geometry
    content = random_content(geometry, count, torch.Generator().manual_seed(7))
    # Consecutive runs and scattered blocks, so merged and single descriptors both occur.
    source_ids = np.concatenate([np.arange(5, 15), rng.permutation(np.arange(20, 40))[:13]])
    for cache in sources:
        cache.fill(content, torch.from_numpy(source_ids))
    area = PinnedArea(pool, geometry.tensor_names(), geometry.canonical_page_size_bytes, count)
    for cache in sources:
        run(cache, D2H, area.copies(source_ids), backend)
    torch.cuda.synchronize()
    for index, name in enumerate(area.names):
        expected = content.pages[name].contiguous().view(torch.uint8).reshape(count, -1)
        assert torch.equal(area.buffer[index], expected), name

    targets = caches(target, target_tp)
    target_ids = rng.permutation(blocks)[:count]
    for cache in targets:
        run(cache, H2D, area.copies(target_ids), backend)
    torch.cuda.synchronize()
    others = torch.from_numpy(np.setdiff1d(np.arange(blocks), target_ids))
    for cache in targets:
        for name in area.names:
            view = cache.logical(name)
            assert same_bytes(
                view[torch.from_numpy(target_ids)],
                cache.expected(content, name, torch.arange(count)),
            )
            assert not view[others].reshape(-1).view(torch.uint8).any()


def test_cuda_batch_fallback_per_descriptor(pool: PinnedPool) -> None:
    if "cuda-batch" not in available_backends(DEVICE):
        pytest.skip("cuda-batch is not available here")
    cache = make_cache(
        "vllm-nhd",
        num_layers=1,
        num_blocks=8,
        block_size=16,
        num_kv_heads=2,
        head_dim=64,
        device=DEVICE,
    )
    content = random_content(cache.layout.geometry, 8, torch.Generator().manual_seed(1))
    cache.fill(content)
    area = PinnedArea(
        pool,
        cache.layout.geometry.tensor_names(),
        cache.layout.geometry.canonical_page_size_bytes,
        8,
    )
    backend = make_backend("cuda-batch", cache.layout, D2H, use_batch=False)
    with TransferHandler(cache.layout, D2H, backend=backend) as handler:
        handler.submit(3, area.copies(np.array([7, 6, 5, 4, 3, 2, 1, 0])))
        assert handler.wait([3])[0].success
    for index, name in enumerate(area.names):
        expected = content.pages[name].flip(0).contiguous().view(torch.uint8).reshape(8, -1)
        assert torch.equal(area.buffer[index], expected)


def test_the_batch_entry_point_resolves_on_a_gpu_machine() -> None:
    driver, error = resolve_driver()
    assert error is None and driver is not None
    assert driver.batch is not None, "cuMemcpyBatchAsync (CUDA >= 12.8) is missing from the driver"


@pytest.mark.parametrize("backend", ["cuda-batch", "triton", "torch"])
def test_capture_is_exact_while_another_stream_writes_other_blocks(
    pool: PinnedPool, backend: str
) -> None:
    if backend not in available_backends(DEVICE):
        pytest.skip(f"{backend} is not available here")
    blocks = 256
    cache = make_cache(
        "vllm-nhd",
        num_layers=2,
        num_blocks=blocks,
        block_size=16,
        num_kv_heads=8,
        head_dim=128,
        device=DEVICE,
    )
    content = random_content(cache.layout.geometry, blocks, torch.Generator().manual_seed(2))
    cache.fill(content)
    captured = np.arange(0, blocks, 2)  # even blocks are captured, odd ones keep changing
    writer = torch.cuda.Stream()
    noise = torch.empty(blocks // 2, 2, 16, 8, 128, dtype=torch.float16, device=DEVICE)
    odd = torch.arange(1, blocks, 2, device=DEVICE)
    torch.cuda.synchronize()
    with torch.cuda.stream(writer):
        for _ in range(200):
            noise.uniform_()
            for tensor in cache.tensors:
                tensor.index_copy_(0, odd, noise)
    area = PinnedArea(
        pool,
        cache.layout.geometry.tensor_names(),
        cache.layout.geometry.canonical_page_size_bytes,
        len(captured),
    )
    with TransferHandler(cache.layout, D2H, backend=backend) as handler:
        for job in range(4):  # several jobs while the writer runs
            part = captured[job::4]
            handler.submit(job, area.copies(part, np.arange(job, len(captured), 4)))
        results = handler.wait(range(4))
    assert all(result.success for result in results)
    for index, name in enumerate(area.names):
        expected = content.pages[name][torch.from_numpy(captured)].contiguous().view(torch.uint8)
        assert torch.equal(area.buffer[index], expected.reshape(len(captured), -1))
    writer.synchronize()


@pytest.mark.parametrize("backend", ["cuda-batch", "triton", "torch"])
def test_capture_waits_for_the_compute_stream(pool: PinnedPool, backend: str) -> None:
    """KV written on the compute stream just before submit (behind a long kernel) is captured."""
    if backend not in available_backends(DEVICE):
        pytest.skip(f"{backend} is not available here")
    cache = make_cache(
        "vllm-nhd",
        num_layers=1,
        num_blocks=16,
        block_size=16,
        num_kv_heads=4,
        head_dim=64,
        device=DEVICE,
    )
    content = random_content(cache.layout.geometry, 16, torch.Generator().manual_seed(3))
    compute = torch.cuda.Stream()
    area = PinnedArea(
        pool,
        cache.layout.geometry.tensor_names(),
        cache.layout.geometry.canonical_page_size_bytes,
        16,
    )
    torch.cuda.synchronize()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds before the KV is written
        cache.fill(content)
    with TransferHandler(cache.layout, D2H, backend=backend, compute_stream=compute) as handler:
        handler.submit(1, area.copies(np.arange(16)))
        assert handler.wait([1])[0].success
    for index, name in enumerate(area.names):
        assert torch.equal(
            area.buffer[index], content.pages[name].contiguous().view(torch.uint8).reshape(16, -1)
        )


@pytest.mark.parametrize("backend", ["cuda-batch", "triton", "torch"])
def test_jobs_on_pooled_streams_run_in_submission_order(pool: PinnedPool, backend: str) -> None:
    """32 restores of different pages into the same block: the last one submitted wins."""
    if backend not in available_backends(DEVICE):
        pytest.skip(f"{backend} is not available here")
    cache = make_cache(
        "vllm-nhd",
        num_layers=1,
        num_blocks=4,
        block_size=16,
        num_kv_heads=8,
        head_dim=128,
        device=DEVICE,
    )
    geometry = cache.layout.geometry
    jobs = 32
    area = PinnedArea(pool, geometry.tensor_names(), geometry.canonical_page_size_bytes, jobs)
    area.buffer.copy_(torch.randint(0, 256, area.buffer.shape, dtype=torch.uint8))
    with TransferHandler(cache.layout, H2D, backend=backend) as handler:
        for job in range(jobs):
            assert handler.submit(job, area.copies(np.array([2]), np.array([job])))
        middle = handler.wait([jobs // 2])
        assert [r.job_id for r in middle] == [jobs // 2]
        handler.shutdown()
        results = handler.get_finished()
    assert [r.job_id for r in results] == [j for j in range(jobs) if j != jobs // 2]
    assert all(r.success for r in results + middle)
    for index, name in enumerate(area.names):
        restored = cache.logical(name)[2].contiguous().view(torch.uint8).flatten().cpu()
        assert torch.equal(restored, area.buffer[index, jobs - 1])


class FailingBatch(CudaBatchBackend):
    """The real cuda-batch backend, refusing odd jobs before it enqueues anything."""

    name = "failing-batch"

    def execute(self, job: CopyJob) -> None:
        if job.job_id % 2:
            raise RuntimeError(f"refused job {job.job_id}")
        super().execute(job)


def test_a_failing_job_fails_alone_on_cuda(pool: PinnedPool) -> None:
    if "cuda-batch" not in available_backends(DEVICE):
        pytest.skip("cuda-batch is not available here")
    cache = make_cache(
        "vllm-nhd",
        num_layers=1,
        num_blocks=6,
        block_size=16,
        num_kv_heads=2,
        head_dim=64,
        device=DEVICE,
    )
    content = random_content(cache.layout.geometry, 6, torch.Generator().manual_seed(4))
    cache.fill(content)
    area = PinnedArea(
        pool,
        cache.layout.geometry.tensor_names(),
        cache.layout.geometry.canonical_page_size_bytes,
        6,
    )
    handler = TransferHandler(cache.layout, D2H, backend=FailingBatch(cache.layout, D2H))
    for job in range(6):
        handler.submit(job, area.copies(np.array([job]), np.array([job])))
    handler.shutdown()
    results = handler.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(j, j % 2 == 0) for j in range(6)]
    assert "refused job 3" in results[3].error
    for job in range(6):
        expected = content.pages[area.names[0]][job].contiguous().view(torch.uint8).flatten()
        assert torch.equal(area.buffer[0, job], expected) == (job % 2 == 0)


@pytest.mark.parametrize("backend", ["cuda-batch", "triton", "torch"])
def test_copies_stay_inside_one_host_registration(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PinnedPool registers whole slots (a DMA copy may not span two registrations): merged
    descriptors across the old 1 MiB chunk boundary of a slot copy correctly."""
    if backend not in available_backends(DEVICE):
        pytest.skip(f"{backend} is not available here")
    monkeypatch.setattr("kvsnap.transfer.pinned.MAX_REGISTER_CHUNK_BYTES", 1 << 20)
    cache = make_cache(
        "flat-paged",
        num_layers=1,
        num_blocks=40,
        block_size=64,
        num_kv_heads=4,
        head_dim=64,
        device=DEVICE,
    )
    content = random_content(cache.layout.geometry, 40, torch.Generator().manual_seed(6))
    cache.fill(content)
    names = cache.layout.geometry.tensor_names()
    page = cache.layout.geometry.canonical_page_size_bytes  # 32 KiB
    with PinnedPool(3 << 19, 2) as chunked:
        assert len(chunked._registered) == 2  # one registration per 1.5 MiB slot
        start = (1 << 20) - 5 * page  # 16 pages across the 1 MiB mark, inside the slot
        hosts = [chunked.slot(i).tensor[start : start + 16 * page] for i in range(2)]
        copies = [
            PageCopy(
                name,
                np.arange(4, 20),
                HostPages.contiguous(host.data_ptr(), 16, page),
                np.arange(16),
            )
            for name, host in zip(names, hosts, strict=True)
        ]
        for direction in (D2H, H2D):
            if direction is H2D:
                for tensor in cache.tensors:
                    tensor.zero_()
            with TransferHandler(cache.layout, direction, backend=backend) as handler:
                handler.submit(1, copies)
                (result,) = handler.wait([1])
            assert result.success, result.error
        for name, host in zip(names, hosts, strict=True):
            expected = content.pages[name][4:20].contiguous().view(torch.uint8).reshape(16, page)
            assert torch.equal(host.view(16, page), expected)
            assert same_bytes(cache.logical(name)[4:20].cpu(), content.pages[name][4:20])


@pytest.mark.parametrize("backend", ["cuda-batch", "triton"])
def test_a_job_enqueued_in_pieces(pool: PinnedPool, backend: str) -> None:
    """Small flush_descriptors: the job reaches the backend as several pinned pieces."""
    if backend not in available_backends(DEVICE):
        pytest.skip(f"{backend} is not available here")
    cache = make_cache(
        "vllm-hnd",
        num_layers=3,
        num_blocks=30,
        block_size=16,
        num_kv_heads=4,
        head_dim=64,
        device=DEVICE,
    )
    content = random_content(cache.layout.geometry, 30, torch.Generator().manual_seed(8))
    cache.fill(content)
    geometry = cache.layout.geometry
    area = PinnedArea(pool, geometry.tensor_names(), geometry.canonical_page_size_bytes, 30)
    ids = np.random.default_rng(0).permutation(30)
    with TransferHandler(cache.layout, D2H, backend=backend, flush_descriptors=100) as handler:
        handler.submit(1, area.copies(ids))
        assert handler.wait([1])[0].success
    for index, name in enumerate(area.names):
        expected = content.pages[name][torch.from_numpy(ids)].contiguous().view(torch.uint8)
        assert torch.equal(area.buffer[index], expected.reshape(30, -1))


def test_cuda_batch_refuses_a_job_of_too_many_descriptors(pool: PinnedPool) -> None:
    if "cuda-batch" not in available_backends(DEVICE):
        pytest.skip("cuda-batch is not available here")
    from kvsnap.transfer.cuda_batch import MAX_DESCRIPTORS_PER_JOB

    count = 9000  # 4 copies of 1 KiB pages that never merge: 36000 descriptors
    cache = make_cache(
        "vllm-nhd",
        num_layers=2,
        num_blocks=count,
        block_size=16,
        num_kv_heads=1,
        head_dim=32,
        dtype=torch.bfloat16,
        device=DEVICE,
    )
    geometry = cache.layout.geometry
    area = PinnedArea(pool, geometry.tensor_names(), geometry.canonical_page_size_bytes, count)
    blocks = np.random.default_rng(0).permutation(count)
    assert 4 * count > MAX_DESCRIPTORS_PER_JOB
    with TransferHandler(cache.layout, D2H, backend="cuda-batch") as handler:
        assert handler.submit(1, area.copies(blocks))
        (refused,) = handler.wait([1])
        assert not refused.success and "refuses" in refused.error
        # The handler goes on: a job within the bound runs.
        assert handler.submit(2, area.copies(blocks[:100]))
        (result,) = handler.wait([2])
    assert result.success, result.error
