"""Where a transfer job's host time goes: per step of ``submit``, and per torch operation.

Run on a CUDA machine (``python -m benchmarks.host_cost``). Two tables:

* per step: the host time of each stage of ``TransferHandler.submit`` with the ``torch``
  backend (validation, preparing copies, cutting batches, uploading block ids, gathering or
  scattering, host copies), averaged over 20 jobs, for a large job (vLLM NHD, 16 KiB pages,
  4096 blocks of two layers: 256 MiB, 8 batches) and a one-block job;
* per operation: the host cost of one call of each torch operation a job issues.

The steps are timed by wrapping the methods with ``time.perf_counter`` (no profiler, whose
per-call overhead would swamp calls of a few microseconds).
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from kvsnap.testing.caches import make_cache
from kvsnap.transfer import TransferHandler, torch_copy
from kvsnap.transfer import handler as handler_module
from kvsnap.transfer.pinned import PinnedPool
from kvsnap.transfer.plan import CopyPlanner, Direction, HostPages, PageCopy

JOBS = 20
STEPS = {
    handler_module.TransferHandler: ("_validate", "_submit_cuda"),
    CopyPlanner: ("resolve_job",),
    torch_copy.TorchBackend: (
        "execute",
        "_prepare",
        "_segments",
        "_batch",
        "_gather",
        "_to_host",
        "_from_host",
        "_scatter",
    ),
}


class StepClock:
    """Summed host seconds and calls per wrapped method."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()

    def wrap(self, owner: type, name: str) -> None:
        original = getattr(owner, name)
        label = f"{owner.__name__}.{name}"

        @functools.wraps(original)
        def timed(*args: object, **kwargs: object) -> object:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - started
                self.calls[label] += 1

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def job_copies(host: torch.Tensor, names: list[str], ids: np.ndarray, page: int) -> list[PageCopy]:
    count = len(ids)
    return [
        PageCopy(
            name,
            ids,
            HostPages.contiguous(host[i * count * page :].data_ptr(), count, page),
            np.arange(count),
        )
        for i, name in enumerate(names)
    ]


def per_step(pool: PinnedPool, clock: StepClock) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    for label, heads, dim, count in (("256 MiB, 8 batches", 4, 128, 4096), ("one block", 1, 64, 1)):
        cache = make_cache(
            "vllm-nhd",
            num_layers=2,
            num_blocks=2 * count,
            block_size=16,
            num_kv_heads=heads,
            head_dim=dim,
            dtype=torch.bfloat16,
            device=device,
            fill="empty",
        )
        page = cache.layout.geometry.canonical_page_size_bytes
        ids = np.sort(np.random.default_rng(0).choice(2 * count, count, replace=False))
        copies = job_copies(pool.slot(0).tensor, cache.layout.geometry.tensor_names(), ids, page)
        for direction in Direction:
            with TransferHandler(cache.layout, direction, backend="torch") as handler:
                for job_id in range(3):  # warm-up: buffers, streams, views
                    handler.submit(job_id, copies)
                    handler.wait([job_id])
                clock.reset()
                submits = []
                for job_id in range(3, 3 + JOBS):
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    handler.submit(job_id, copies)
                    submits.append(time.perf_counter() - started)
                    handler.wait([job_id])
            print(f"\n{label}, {direction.value}: submit {statistics.median(submits) * 1e6:.0f} us")
            for step, seconds in sorted(clock.seconds.items(), key=lambda item: -item[1]):
                calls = clock.calls[step] / JOBS
                print(f"  {step:34s} {seconds / JOBS * 1e6:8.1f} us/job {calls:5.1f} calls/job")


def per_call(label: str, action: Callable[[], object], repeats: int = 200) -> None:
    action()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        action()
    seconds = (time.perf_counter() - started) / repeats
    torch.cuda.synchronize()
    print(f"  {label:42s} {seconds * 1e6:6.1f} us")


def per_operation(pool: PinnedPool) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    ids = np.arange(16384, dtype=np.int64)
    source = torch.empty(8192, 2048, dtype=torch.int64, device=device)
    index = torch.arange(0, 8192, 2, device=device)
    gathered = torch.empty(4096, 2048, dtype=torch.int64, device=device)
    staging = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    host = torch_copy.host_bytes(pool.slot(0).data_ptr, 1 << 20)
    event, side = torch.cuda.Event(), torch.cuda.Stream(device)
    print("\nhost cost of one call")
    per_call("block ids to the GPU (16384, pageable)", lambda: torch.from_numpy(ids).to(device))
    address = host.data_ptr()
    per_call(
        "host_bytes (a tensor over host memory)", lambda: torch_copy.host_bytes(address, 1 << 20)
    )
    per_call("copy_ GPU->host 1 MiB, non_blocking", lambda: host.copy_(staging, non_blocking=True))
    per_call(
        "index_select(out=), 4096 rows", lambda: torch.index_select(source, 0, index, out=gathered)
    )
    per_call("Event.record", lambda: event.record())
    per_call("Stream.wait_event", lambda: side.wait_event(event))
    per_call("Stream.wait_stream", lambda: side.wait_stream(torch.cuda.current_stream()))
    per_call("with torch.cuda.stream(side): pass", lambda: _enter_exit(side))


def _enter_exit(stream: torch.cuda.Stream) -> None:
    with torch.cuda.stream(stream):
        pass


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.host_cost measures CUDA submission costs: it needs a GPU")
    clock = StepClock()
    for owner, names in STEPS.items():
        for name in names:
            clock.wrap(owner, name)
    with PinnedPool(256 << 20, 1) as pool:
        per_step(pool, clock)
        per_operation(pool)


if __name__ == "__main__":
    main()
