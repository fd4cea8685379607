"""Measure this machine's transfer paths and derive the ``auto`` calibration.

``kvsnap bench`` and ``python -m benchmarks.transfer`` both measure through this module.

A :class:`TransferCase` is one job: a random, sorted set of ``block_ids`` of a synthetic engine
cache, copied to or from canonical pages at the start of a host buffer. :func:`measure_case`
times, for one direction, the contiguous ceiling (one copy of the job's bytes between device
memory and page-locked host memory) and a :class:`~kvsnap.transfer.TransferHandler` with each
backend, from ``submit`` to the completed ``wait``, host planning included; the first and last
pages of every capture are checked bit-exact on its warm-up run. :func:`derive_calibration`
turns measurements of the vLLM split NHD layout into the calibration ``auto`` reads
(:func:`kvsnap.transfer.base.load_policy`), and :func:`run_bench` measures the matrix
``kvsnap bench`` shows.

GB/s counts the job's canonical bytes; ratios divide by the ceiling of the same job and
direction, so they compare across machines and runs better than GB/s do.
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvsnap.pinned import PinnedPool
from kvsnap.plan import Direction, HostPages, PageCopy
from kvsnap.testing.caches import SyntheticCache, make_cache
from kvsnap.transfer import TransferHandler, available_backends, current_policy
from kvsnap.transfer.base import CALIBRATION_VERSION, SMALL_FRAGMENT_BACKEND

KiB, MiB = 1 << 10, 1 << 20
#: Canonical page size -> (tokens per block, KV heads, head dim) in bfloat16.
HEAD_PAGES = {
    2 * KiB: (16, 1, 64),
    16 * KiB: (16, 4, 128),
    128 * KiB: (32, 16, 128),
    2 * MiB: (256, 32, 128),
}
#: The canonical page sizes ``kvsnap bench`` measures.
PAGE_SIZES = tuple(HEAD_PAGES)
#: MLA pages: a 512-wide bfloat16 latent, 1 KiB per token.
MLA_LATENT = 512
#: The layout the calibration is derived from: vLLM's split NHD cache (one fragment per page).
CALIBRATION_LAYOUT = "vllm-nhd"
NUM_LAYERS = 2
#: Backends measured when available, in this order (``auto`` always).
KVSNAP_BACKENDS = ("auto", "cuda-batch", "triton", "torch", "cpu")
#: Largest job in bytes (block counts above it are cut down), for a full and a quick run.
JOB_BYTES_LIMIT = 256 * MiB
QUICK_JOB_BYTES_LIMIT = 16 * MiB
#: The jobs ``kvsnap bench`` measures per page size: a large one (cut to the job limit) and a
#: small one, where host time per job dominates.
LARGE_JOB_BLOCKS = 32768
SMALL_JOB_BLOCKS = 64
#: A method whose warm-up run took longer than this is timed once instead of ``repeats`` times.
SLOW_RUN_SECONDS = 0.5
#: ``cuda-batch`` takes over from the page size at which it reaches this share of the best
#: small-fragment backend: it leaves the SMs to the model, so a near-tie goes to it.
BATCH_COPY_SHARE = 0.97


@dataclass
class Measurement:
    """One method timed on one job in one direction.

    ``page_bytes`` is the canonical page size, ``blocks`` the job's block count, ``num_bytes``
    the job's canonical bytes, ``direction`` a :class:`~kvsnap.plan.Direction` value and
    ``method`` ``ceiling`` or ``kvsnap-BACKEND`` (benchmarks add their baselines). ``seconds``
    and ``gbps`` are None when the method failed or was skipped; ``note`` then says why.
    """

    layout: str
    page_bytes: int
    blocks: int
    direction: str
    method: str
    num_bytes: int
    seconds: float | None
    gbps: float | None
    ratio_to_ceiling: float | None = None
    host_us_per_block: float | None = None
    backend_used: str | None = None
    note: str | None = None


class Timer:
    """Wall time of enqueue + completion on a device (CUDA synchronizes the stream)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def sync(self) -> None:
        """Wait for everything queued on the device (nothing to wait for on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, action: Callable[[], object]) -> float:
        """Seconds from an idle device to the completion of what ``action`` enqueues."""
        self.sync()
        start = time.perf_counter()
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                action()
        else:
            action()
        self.sync()
        return time.perf_counter() - start


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a concrete ``cpu`` or ``cuda:N`` device.

    Raises ``ValueError`` for other device types, when CUDA is asked for but unavailable, and for
    a CUDA index this process cannot see.
    """
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"not a torch device: {device!r} ({exc})") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"device must be cuda or cpu, not {resolved.type!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"no CUDA device: torch {torch.__version__} sees no GPU")
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"no CUDA device {index}: {torch.cuda.device_count()} visible")
    return torch.device("cuda", index)


def device_name(device: torch.device) -> str:
    """The GPU's name, or the host processor's for a CPU device."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or "cpu"


def measured_backends(device: torch.device) -> list[str]:
    """``auto`` and every registered backend available on ``device``, built-in ones first."""
    available = available_backends(device)
    known = [name for name in KVSNAP_BACKENDS if name == "auto" or name in available]
    return known + [name for name in available if name not in KVSNAP_BACKENDS]


def geometry_for(kind: str, page_size_bytes: int) -> dict[str, int]:
    """:func:`~kvsnap.testing.caches.make_cache` geometry giving bfloat16 pages of that size."""
    if kind == "mla":
        return {"block_size": page_size_bytes // (MLA_LATENT * 2), "latent_dim": MLA_LATENT}
    block_size, num_kv_heads, head_dim = HEAD_PAGES[page_size_bytes]
    return {"block_size": block_size, "num_kv_heads": num_kv_heads, "head_dim": head_dim}


def job_block_counts(
    kind: str, page_size_bytes: int, block_counts: Sequence[int], job_bytes_limit: int
) -> list[int]:
    """The distinct job sizes in blocks, each cut so that a job moves at most the limit."""
    parts = 1 if kind == "mla" else 2
    block_bytes = page_size_bytes * parts * NUM_LAYERS
    return sorted({min(count, job_bytes_limit // block_bytes) for count in block_counts})


def random_cache(
    kind: str, page_size_bytes: int, num_blocks: int, device: torch.device
) -> SyntheticCache:
    """A two-layer bfloat16 cache of layout ``kind`` filled with random bytes."""
    cache = make_cache(
        kind,
        num_layers=NUM_LAYERS,
        num_blocks=num_blocks,
        dtype=torch.bfloat16,
        device=device,
        fill="empty",
        **geometry_for(kind, page_size_bytes),
    )
    for tensor in cache.tensors:
        tensor.view(torch.uint8).random_(0, 256)  # arbitrary bit patterns, NaNs too
    return cache


@dataclass
class TransferCase:
    """One job: ``block_ids`` of ``cache`` to and from canonical pages at the start of ``host``.

    ``host`` is page-locked uint8 memory (on CUDA) at least :attr:`job_bytes` long;
    ``device_buffer`` is as long, on the cache's device, for the ceiling.
    """

    cache: SyntheticCache
    block_ids: np.ndarray
    host: torch.Tensor
    device_buffer: torch.Tensor
    timer: Timer
    repeats: int
    backend_options: Mapping[str, Mapping[str, Any]] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def tensor_names(self) -> list[str]:
        return self.cache.layout.geometry.tensor_names()

    @property
    def page_size_bytes(self) -> int:
        return self.cache.layout.geometry.canonical_page_size_bytes

    @property
    def job_bytes(self) -> int:
        return self.num_blocks * self.page_size_bytes * len(self.tensor_names)

    def copies(self) -> list[PageCopy]:
        """The job: each tensor's blocks to consecutive host pages, tensor after tensor."""
        count, page = self.num_blocks, self.page_size_bytes
        return [
            PageCopy(
                name,
                self.block_ids,
                HostPages.contiguous(self.host[i * count * page :].data_ptr(), count, page),
                np.arange(count),
            )
            for i, name in enumerate(self.tensor_names)
        ]

    def measurement(
        self, direction: Direction, method: str, seconds: float | None, **extra: Any
    ) -> Measurement:
        """A :class:`Measurement` of ``method`` on this job (``seconds`` None: not measured)."""
        gbps = self.job_bytes / seconds / 1e9 if seconds else None
        return Measurement(
            self.cache.kind,
            self.page_size_bytes,
            self.num_blocks,
            direction.value,
            method,
            self.job_bytes,
            seconds,
            gbps,
            **extra,
        )


def transfer_cases(
    device: torch.device,
    layouts: Sequence[str],
    page_sizes: Sequence[int],
    block_counts: Sequence[int],
    *,
    job_bytes_limit: int,
    repeats: int,
    seed: int = 0,
    backend_options: Mapping[str, Mapping[str, Any]] | None = None,
) -> Iterator[TransferCase]:
    """Every (layout, page size, job size) case, in that order, sharing one host buffer.

    Each layout and page size gets a cache twice the size of its largest job, from which each
    job's blocks are drawn at random; a case is valid until the next one is drawn.
    """
    with PinnedPool(job_bytes_limit, 1, pin=device.type == "cuda") as pool:
        host = pool.slot(0).tensor
        device_buffer = torch.empty(job_bytes_limit, dtype=torch.uint8, device=device)
        timer = Timer(device)
        rng = np.random.default_rng(seed)
        for kind in layouts:
            for page_size_bytes in page_sizes:
                counts = job_block_counts(kind, page_size_bytes, block_counts, job_bytes_limit)
                cache_blocks = 2 * max(counts)
                cache = random_cache(kind, page_size_bytes, cache_blocks, device)
                for count in counts:
                    block_ids = np.sort(rng.choice(cache_blocks, count, replace=False))
                    yield TransferCase(
                        cache, block_ids, host, device_buffer, timer, repeats, backend_options
                    )
                del cache  # free it before the next page size's cache is allocated


def median_time(timer: Timer, action: Callable[[], object], repeats: int) -> tuple[float, float]:
    """``(median seconds, warm-up seconds)``; slow actions are timed once after the warm-up."""
    warm = timer.run(action)
    runs = 1 if warm > SLOW_RUN_SECONDS else repeats
    return statistics.median(timer.run(action) for _ in range(runs)), warm


def measure_method(
    case: TransferCase, direction: Direction, method: str, action: Callable[[], object]
) -> Measurement:
    """Time ``action`` on ``case``; a failure (a driver limit, a missing entry point) is recorded
    as a measurement without a time and a note saying why, not raised."""
    try:
        seconds, _ = median_time(case.timer, action, case.repeats)
    except Exception as exc:
        return case.measurement(direction, method, None, note=f"failed: {_describe(exc)}")
    return case.measurement(direction, method, seconds)


def measure_ceiling(case: TransferCase, direction: Direction) -> Measurement:
    """One contiguous copy of the job's bytes between ``device_buffer`` and ``host``."""
    size = case.job_bytes
    device_side, host_side = case.device_buffer[:size], case.host[:size]

    def contiguous_copy() -> None:
        if direction is Direction.DEVICE_TO_HOST:
            host_side.copy_(device_side, non_blocking=True)
        else:
            device_side.copy_(host_side, non_blocking=True)

    return measure_method(case, direction, "ceiling", contiguous_copy)


def measure_backend(case: TransferCase, direction: Direction, backend: str) -> Measurement:
    """kvsnap's handler with ``backend`` (``auto`` or a name) on ``case``, as ``kvsnap-NAME``.

    Timed from ``submit`` to the completed ``wait``; ``host_us_per_block`` is the host time of
    ``submit`` (planning included) per block and ``backend_used`` the backend that ran the job.
    """
    method = f"kvsnap-{backend}"
    try:
        seconds, submit_seconds, used = _time_handler(case, direction, backend)
    except Exception as exc:
        return case.measurement(direction, method, None, note=f"failed: {_describe(exc)}")
    return case.measurement(
        direction,
        method,
        seconds,
        host_us_per_block=submit_seconds / case.num_blocks * 1e6,
        backend_used=used,
    )


def _time_handler(
    case: TransferCase, direction: Direction, backend: str
) -> tuple[float, float, str]:
    """``(median seconds, median host seconds of submit, backend used)`` through a handler."""
    layout = case.cache.layout
    handler = TransferHandler(
        layout, direction, backend=backend, backend_options=case.backend_options
    )
    copies = case.copies()
    repeats = case.repeats
    seconds: list[float] = []
    submit_seconds: list[float] = []
    used = ""
    try:
        for attempt in range(repeats + 1):
            if layout.device.type == "cuda":
                torch.cuda.synchronize(layout.device)
            start = time.perf_counter()
            if not handler.submit(attempt, copies):
                raise RuntimeError(f"job rejected: {handler.last_rejection}")
            submitted = time.perf_counter()
            (result,) = handler.wait([attempt])
            done = time.perf_counter()
            if not result.success:
                raise _JobFailed(str(result.error))
            used = result.backend or backend
            if attempt == 0:  # the warm-up: checked, not timed
                if direction is Direction.DEVICE_TO_HOST:
                    check_capture(case)
                if done - start > SLOW_RUN_SECONDS:
                    repeats = 1
                continue
            seconds.append(done - start)
            submit_seconds.append(submitted - start)
            if len(seconds) >= repeats:
                break
    finally:
        handler.shutdown()
    return statistics.median(seconds), statistics.median(submit_seconds), used


def check_capture(case: TransferCase) -> None:
    """Raise ``AssertionError`` unless the first and last captured page of the first and last
    tensor equal the cache's bytes."""
    names = case.tensor_names
    page, count = case.page_size_bytes, case.num_blocks
    for index in (0, len(names) - 1):
        for k in (0, count - 1):
            block = int(case.block_ids[k])
            expected = (
                case.cache.logical(names[index])[block].contiguous().view(torch.uint8).flatten()
            )
            start = (index * count + k) * page
            if not torch.equal(case.host[start : start + page], expected.cpu()):
                raise AssertionError(f"capture mismatch: {case.cache.kind} {names[index]} {block}")


def set_ratios(results: Sequence[Measurement]) -> None:
    """Fill ``ratio_to_ceiling`` of every measurement from the ceiling of its job and direction."""
    ceilings = {
        _job_key(m): m.gbps for m in results if m.method == "ceiling" and m.gbps is not None
    }
    for m in results:
        ceiling = ceilings.get(_job_key(m))
        if m.gbps is not None and ceiling:
            m.ratio_to_ceiling = m.gbps / ceiling


def _job_key(m: Measurement) -> tuple[str, int, int, str]:
    return (m.layout, m.page_bytes, m.blocks, m.direction)


def measure_case(
    case: TransferCase, direction: Direction, backends: Sequence[str]
) -> list[Measurement]:
    """The ceiling and kvsnap with each of ``backends`` on ``case``, ratios filled in."""
    results = [measure_ceiling(case, direction)]
    results += [measure_backend(case, direction, backend) for backend in backends]
    set_ratios(results)
    return results


def derive_calibration(results: Sequence[Measurement], device_name: str) -> dict[str, Any]:
    """The ``auto`` calibration (see :func:`kvsnap.transfer.base.load_policy`) from measurements.

    Only vLLM split NHD rows count, and per page size only its largest job. Per direction,
    ``cuda-batch`` is used from the smallest page size at which it was measured and reached
    :data:`BATCH_COPY_SHARE` of the best small-fragment backend (``triton`` or ``torch``); where
    it never did, from four times the largest page measured. ``small_backend`` is the one of
    ``triton`` and ``torch`` that was faster at more page sizes (``triton`` on a tie), or the
    built-in default when neither was measured.
    """
    thresholds: dict[str, int] = {}
    small_votes = {"triton": 0, "torch": 0}
    for direction in Direction:
        by_page = _largest_job_gbps(results, direction)
        threshold = None
        for page_size_bytes in sorted(by_page):
            gbps = by_page[page_size_bytes]
            triton, torch_gbps = gbps.get("kvsnap-triton", 0.0), gbps.get("kvsnap-torch", 0.0)
            if triton or torch_gbps:
                small_votes["triton" if triton >= torch_gbps else "torch"] += 1
            batch = gbps.get("kvsnap-cuda-batch")
            if threshold is None and batch and batch >= BATCH_COPY_SHARE * max(triton, torch_gbps):
                threshold = page_size_bytes
        thresholds[direction.value] = (
            threshold if threshold is not None else 4 * max(by_page, default=MiB)
        )
    small_backend = (
        max(small_votes, key=small_votes.__getitem__)
        if any(small_votes.values())
        else SMALL_FRAGMENT_BACKEND
    )
    return {
        "version": CALIBRATION_VERSION,
        "large_fragment_bytes": thresholds,
        "small_backend": small_backend,
        "measured_on": device_name,
        "date": datetime.date.today().isoformat(),
    }


def _largest_job_gbps(
    results: Sequence[Measurement], direction: Direction
) -> dict[int, dict[str, float]]:
    """Page size -> method -> GB/s of the largest calibration-layout job in ``direction``."""
    rows = [
        m
        for m in results
        if m.layout == CALIBRATION_LAYOUT and m.direction == direction.value and m.gbps is not None
    ]
    largest: dict[int, int] = {}
    for m in rows:
        largest[m.page_bytes] = max(largest.get(m.page_bytes, 0), m.blocks)
    by_page: dict[int, dict[str, float]] = {page: {} for page in largest}
    for m in rows:
        if m.blocks == largest[m.page_bytes]:
            by_page[m.page_bytes][m.method] = m.gbps
    return by_page


@dataclass
class BenchReport:
    """What :func:`run_bench` measured, and the calibration derived from it."""

    device: str
    device_name: str
    quick: bool
    backends: list[str]
    #: Where the ``auto`` policy in force during the run came from (a calibration file or the
    #: built-in defaults); the ``kvsnap-auto`` rows ran under it.
    auto_policy: str
    results: list[Measurement]
    calibration: dict[str, Any]
    seconds: float

    @property
    def smoke_test(self) -> bool:
        """True for host memory: the figures then say nothing about GPU transfers."""
        return not self.device.startswith("cuda")

    def to_json(self) -> dict[str, Any]:
        """The report as a JSON-ready mapping (``smoke_test`` included)."""
        payload = dataclasses.asdict(self)
        payload["smoke_test"] = self.smoke_test
        payload["torch"] = torch.__version__
        return payload


#: ``on_progress(steps done, total steps, what runs next)``; a step is one case and direction.
ProgressCallback = Callable[[int, int, str], None]


def run_bench(
    device: str | torch.device = "cuda",
    *,
    quick: bool = False,
    on_progress: ProgressCallback | None = None,
) -> BenchReport:
    """Measure ``kvsnap bench``'s matrix on ``device`` and derive the ``auto`` calibration.

    The matrix: the vLLM split NHD layout (two bfloat16 layers) at canonical pages of 2 KiB,
    16 KiB, 128 KiB and 2 MiB; per page size a large job (up to :data:`LARGE_JOB_BLOCKS` blocks,
    cut to :data:`JOB_BYTES_LIMIT`) and a small one of :data:`SMALL_JOB_BLOCKS` blocks; both
    directions; the ceiling and kvsnap with ``auto`` and every available backend. ``quick`` cuts
    jobs to :data:`QUICK_JOB_BYTES_LIMIT` and times each method once after its warm-up.

    Raises ``ValueError`` when ``device`` is not usable (see :func:`resolve_device`).
    """
    target = resolve_device(device)
    job_bytes_limit = QUICK_JOB_BYTES_LIMIT if quick else JOB_BYTES_LIMIT
    block_counts = (SMALL_JOB_BLOCKS, LARGE_JOB_BLOCKS)
    backends = measured_backends(target)
    total_steps = len(Direction) * sum(
        len(job_block_counts(CALIBRATION_LAYOUT, page, block_counts, job_bytes_limit))
        for page in PAGE_SIZES
    )
    report = on_progress or (lambda done, total, label: None)
    started = time.perf_counter()
    results: list[Measurement] = []
    cases = transfer_cases(
        target,
        [CALIBRATION_LAYOUT],
        PAGE_SIZES,
        block_counts,
        job_bytes_limit=job_bytes_limit,
        repeats=1 if quick else 3,
    )
    steps_done = 0
    for case in cases:
        for direction in Direction:
            report(steps_done, total_steps, _case_label(case, direction))
            results += measure_case(case, direction, backends)
            steps_done += 1
    report(total_steps, total_steps, "done")
    name = device_name(target)
    return BenchReport(
        device=str(target),
        device_name=name,
        quick=quick,
        backends=backends,
        auto_policy=_policy_source(),
        results=results,
        calibration=derive_calibration(results, name),
        seconds=time.perf_counter() - started,
    )


def _case_label(case: TransferCase, direction: Direction) -> str:
    arrow = "device→host" if direction is Direction.DEVICE_TO_HOST else "host→device"
    return f"{format_bytes(case.page_size_bytes)} pages x {case.num_blocks} blocks, {arrow}"


def _policy_source() -> str:
    try:
        return current_policy().source
    except ValueError as exc:  # an unreadable calibration: the auto rows then failed with it
        return f"unreadable calibration ({exc})"


def format_bytes(size: int) -> str:
    """``2048`` -> ``"2 KiB"``: whole binary units, as page sizes are written in the docs."""
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


class _JobFailed(RuntimeError):
    """A measured job reported failure; its message is already the handler's description."""


def _describe(exc: BaseException) -> str:
    # A failed job's error already names its exception type ("RuntimeError: ...").
    return str(exc) if isinstance(exc, _JobFailed) else f"{type(exc).__name__}: {exc}"
