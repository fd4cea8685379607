"""The transfer handler on CPU tensors: jobs completed in submission order, a failing backend
failing only its job, invalid jobs rejected, shutdown, merged plans, staging bounds, jobs handed
to a backend in pieces, and the bytes a result counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsnap.testing.caches import make_cache, same_bytes
from kvsnap.transfer import (
    BackendUnavailable,
    CopyJob,
    TransferHandler,
    available_backends,
    make_backend,
    unavailable_reason,
)
from kvsnap.transfer.cpu import CpuBackend
from kvsnap.transfer.cuda_batch import resolve_driver
from kvsnap.transfer.plan import HostPages, PageCopy
from tests.support.transfer_helpers import (
    D2H,
    H2D,
    HostArea,
    copies_for,
    one_block_area,
    page_bytes,
    run_job,
    small_cache,
)


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
