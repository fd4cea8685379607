"""Transfer benchmark: kvsnap's backends against the ways people copy KV blocks today.

``python -m benchmarks.transfer OUT.json`` measures, for several engine layouts (vLLM split
NHD, packed, MLA, transformers' flat paged cache), canonical page sizes from 2 KiB to 2 MiB and
jobs of 1 to 32768 blocks chosen at random from a cache twice that size, in both directions:

* ``ceiling``: one contiguous copy of the same number of bytes between device memory and
  page-locked host memory (the PCIe ceiling);
* kvsnap through a :class:`~kvsnap.transfer.TransferHandler` with ``auto`` and each backend
  (``cuda-batch``, ``triton``, ``torch``), from ``submit`` to completion, host planning included;
* baselines on the engine's own block slabs: ``per-block-copy`` (one ``copy_`` per block and
  tensor, from Python), ``batch-unmerged`` (one ``cuMemcpyBatchAsync`` descriptor per block and
  tensor) and ``index-select`` (``index_select`` into a device staging tensor, then one copy).

Each result is GB/s (median of timed runs after a warm-up), its ratio to the ceiling measured
in the same case, and for kvsnap the host time of plan + submit per block. Every kvsnap capture
is checked bit-exact against the cache on its warm-up run. The table goes to stdout, every
measurement to the JSON file; ``--write-calibration PATH`` also derives the ``auto``
thresholds from the measurements (see :func:`kvsnap.transfer.base.load_policy`).

``--device cpu`` runs the same matrix on host memory with the ``cpu`` and ``torch`` backends
(a smoke test of the script; numbers there say nothing about GPUs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from kvsnap.pinned import PinnedPool
from kvsnap.plan import Descriptors, Direction, HostPages, PageCopy
from kvsnap.testing.caches import SyntheticCache, make_cache
from kvsnap.transfer import CopyJob, TransferHandler, available_backends, make_backend
from kvsnap.transfer.base import CALIBRATION_VERSION

KiB, MiB = 1 << 10, 1 << 20
#: Canonical page size -> (tokens per block, KV heads, head dim) in bfloat16.
HEAD_PAGES = {
    2 * KiB: (16, 1, 64),
    16 * KiB: (16, 4, 128),
    128 * KiB: (32, 16, 128),
    2 * MiB: (256, 32, 128),
}
#: MLA pages: a 512-wide bfloat16 latent, 1 KiB per token.
MLA_LATENT = 512
LAYOUTS = ("vllm-nhd", "packed", "mla", "flat-paged")
BLOCK_COUNTS = (1, 64, 2048, 32768)
NUM_LAYERS = 2
#: Largest job, in bytes (counts above it are cut down).
JOB_BYTES_LIMIT = 256 * MiB
#: The Python per-block baseline is skipped above this many copies.
PER_BLOCK_COPY_LIMIT = 16384
KVSNAP_BACKENDS = ("auto", "cuda-batch", "triton", "torch", "cpu")
#: A method whose warm-up run took longer than this is timed once instead of ``repeats`` times.
SLOW_RUN_SECONDS = 0.5


@dataclass
class Measurement:
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
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def run(self, action: Callable[[], object]) -> float:
        self.sync()
        start = time.perf_counter()
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                action()
        else:
            action()
        self.sync()
        return time.perf_counter() - start


def geometry_for(kind: str, page: int) -> dict:
    if kind == "mla":
        return {"block_size": page // (MLA_LATENT * 2), "latent_dim": MLA_LATENT}
    block_size, heads, head_dim = HEAD_PAGES[page]
    return {"block_size": block_size, "num_kv_heads": heads, "head_dim": head_dim}


def slab_views(cache: SyntheticCache) -> list[torch.Tensor]:
    """Each engine tensor as ``(num_blocks, slab_bytes)`` uint8: the engine's own block slabs."""
    num_blocks = cache.layout.tensors[0].num_blocks
    return [tensor.reshape(num_blocks, -1).view(torch.uint8) for tensor in cache.tensors]


def median_time(timer: Timer, action: Callable[[], object], repeats: int) -> tuple[float, float]:
    """``(median seconds, warm-up seconds)``; slow actions are timed once after the warm-up."""
    warm = timer.run(action)
    runs = 1 if warm > SLOW_RUN_SECONDS else repeats
    return statistics.median(timer.run(action) for _ in range(runs)), warm


def measure_kvsnap(
    cache: SyntheticCache,
    direction: Direction,
    backend: str,
    copies: list[PageCopy],
    ids: np.ndarray,
    host: torch.Tensor,
    repeats: int,
    options: dict | None = None,
) -> tuple[float, float, str]:
    """``(median seconds, median host seconds of submit, backend used)`` through a handler."""
    handler = TransferHandler(cache.layout, direction, backend=backend, backend_options=options)
    seconds, submits, used = [], [], ""
    try:
        for attempt in range(repeats + 1):
            if cache.layout.device.type == "cuda":
                torch.cuda.synchronize(cache.layout.device)
            start = time.perf_counter()
            if not handler.submit(attempt, copies):
                raise RuntimeError(f"{backend}: job rejected: {handler.last_rejection}")
            submitted = time.perf_counter()
            (result,) = handler.wait([attempt])
            done = time.perf_counter()
            if not result.success:
                raise RuntimeError(f"{backend}: {result.error}")
            used = result.backend or backend
            if attempt == 0:
                if direction is Direction.DEVICE_TO_HOST:
                    check_capture(cache, ids, host)
                if done - start > SLOW_RUN_SECONDS:
                    repeats = 1
                continue
            seconds.append(done - start)
            submits.append(submitted - start)
            if len(seconds) >= repeats:
                break
    finally:
        handler.shutdown()
    return statistics.median(seconds), statistics.median(submits), used


def check_capture(cache: SyntheticCache, ids: np.ndarray, host: torch.Tensor) -> None:
    """The first and last captured page of the first and last tensor equal the cache's bytes."""
    names = cache.layout.geometry.tensor_names()
    page = cache.layout.geometry.canonical_page_size_bytes
    count = len(ids)
    for index in (0, len(names) - 1):
        for k in (0, count - 1):
            logical = (
                cache.logical(names[index])[int(ids[k])]
                .contiguous()
                .view(torch.uint8)
                .flatten()
                .cpu()
            )
            start = (index * count + k) * page
            if not torch.equal(host[start : start + page], logical):
                raise AssertionError(
                    f"capture mismatch: {cache.kind} {names[index]} block {ids[k]}"
                )


@dataclass
class Case:
    """One job: ``ids`` of ``cache`` to and from host pages at the start of the pinned slot."""

    cache: SyntheticCache
    ids: np.ndarray
    host: torch.Tensor  # the pinned slot, uint8
    device_buffer: torch.Tensor
    timer: Timer
    repeats: int
    options: dict | None = None

    @property
    def count(self) -> int:
        return len(self.ids)

    @property
    def names(self) -> list[str]:
        return self.cache.layout.geometry.tensor_names()

    @property
    def page(self) -> int:
        return self.cache.layout.geometry.canonical_page_size_bytes

    @property
    def job_bytes(self) -> int:
        return self.count * self.page * len(self.names)

    def copies(self) -> list[PageCopy]:
        count, page = self.count, self.page
        return [
            PageCopy(
                name,
                self.ids,
                HostPages.contiguous(self.host[i * count * page :].data_ptr(), count, page),
                np.arange(count),
            )
            for i, name in enumerate(self.names)
        ]

    def slabs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(engine slab view, pinned host rows) per engine tensor, for the baselines."""
        slabs = slab_views(self.cache)
        size = slabs[0].shape[1]
        count = self.count
        assert len(slabs) * count * size == self.job_bytes
        return [
            (slab, self.host[i * count * size : (i + 1) * count * size].view(count, size))
            for i, slab in enumerate(slabs)
        ]


def measure_direction(case: Case, direction: Direction, backends: list[str]) -> list[Measurement]:
    """Every method on ``case`` in ``direction``; ratios against this direction's ceiling."""
    to_host = direction is Direction.DEVICE_TO_HOST
    device = case.cache.layout.device
    results: list[Measurement] = []

    def record(method: str, seconds: float | None, **extra: object) -> None:
        gbps = case.job_bytes / seconds / 1e9 if seconds else None
        results.append(
            Measurement(
                case.cache.kind,
                case.page,
                case.count,
                direction.value,
                method,
                case.job_bytes,
                seconds,
                gbps,
                **extra,
            )
        )

    def timed(method: str, action: Callable[[], object]) -> None:
        # A method that fails (a driver limit, a missing entry point) is recorded, not fatal.
        try:
            record(method, median_time(case.timer, action, case.repeats)[0])
        except Exception as exc:
            record(method, None, note=f"failed: {type(exc).__name__}: {exc}")

    def ceiling() -> None:
        size = case.job_bytes
        if to_host:
            case.host[:size].copy_(case.device_buffer[:size], non_blocking=True)
        else:
            case.device_buffer[:size].copy_(case.host[:size], non_blocking=True)

    timed("ceiling", ceiling)
    copies = case.copies()
    for backend in backends:
        try:
            seconds, submit, used = measure_kvsnap(
                case.cache,
                direction,
                backend,
                copies,
                case.ids,
                case.host,
                case.repeats,
                case.options,
            )
        except Exception as exc:
            record(f"kvsnap-{backend}", None, note=f"failed: {type(exc).__name__}: {exc}")
            continue
        record(
            f"kvsnap-{backend}",
            seconds,
            host_us_per_block=submit / case.count * 1e6,
            backend_used=used,
        )

    slabs = case.slabs()
    blocks = case.ids.tolist()

    def per_block_copy() -> None:
        for slab, rows in slabs:
            for k, block in enumerate(blocks):
                if to_host:
                    rows[k].copy_(slab[block], non_blocking=True)
                else:
                    slab[block].copy_(rows[k], non_blocking=True)

    if case.count * len(slabs) <= PER_BLOCK_COPY_LIMIT:
        timed("per-block-copy", per_block_copy)
    else:
        record("per-block-copy", None, note=f"skipped above {PER_BLOCK_COPY_LIMIT} copies")

    if "cuda-batch" in backends:
        batch = make_backend("cuda-batch", case.cache.layout, direction)
        size = slabs[0][0].shape[1]
        device_side = np.concatenate([slab.data_ptr() + case.ids * size for slab, _ in slabs])
        host_side = np.concatenate(
            [rows.data_ptr() + np.arange(case.count, dtype=np.int64) * size for _, rows in slabs]
        )
        sizes = np.full(len(device_side), size, dtype=np.int64)
        pair = (device_side, host_side) if to_host else (host_side, device_side)
        descriptors = Descriptors(pair[0], pair[1], sizes)

        def batch_unmerged() -> None:
            batch.execute(CopyJob(0, [], descriptors, torch.cuda.current_stream(device)))

        timed("batch-unmerged", batch_unmerged)

    ids_device = torch.from_numpy(case.ids).to(device)

    def index_select() -> None:
        for slab, rows in slabs:
            if to_host:
                rows.copy_(slab.index_select(0, ids_device), non_blocking=True)
            else:
                staging = torch.empty_like(rows, device=device)
                staging.copy_(rows, non_blocking=True)
                slab.index_copy_(0, ids_device, staging)

    timed("index-select", index_select)
    ceiling_gbps = results[0].gbps
    for measurement in results:
        if measurement.gbps and ceiling_gbps:
            measurement.ratio_to_ceiling = measurement.gbps / ceiling_gbps
    return results


def print_table(results: list[Measurement], methods: list[str]) -> None:
    header = f"{'layout':<11}{'page':>7}{'blocks':>7} {'dir':<4}{'ceiling':>8}" + "".join(
        f"{method.removeprefix('kvsnap-'):>17}" for method in methods[1:]
    )
    print(header)
    print("-" * len(header))
    rows: dict[tuple, dict[str, Measurement]] = {}
    for m in results:
        rows.setdefault((m.layout, m.page_bytes, m.blocks, m.direction), {})[m.method] = m
    for (layout, page, blocks, direction), by_method in rows.items():
        page_text = f"{page // MiB}M" if page >= MiB else f"{page // KiB}K"
        arrow = "d2h" if direction == Direction.DEVICE_TO_HOST.value else "h2d"
        cells = []
        for method in methods[1:]:
            m = by_method.get(method)
            if m is None or m.gbps is None:
                cells.append(f"{'-':>17}")
            else:
                cells.append(f"{m.gbps:>8.1f} ({m.ratio_to_ceiling or 0:4.2f})")
        ceiling = by_method["ceiling"].gbps or 0.0
        print(f"{layout:<11}{page_text:>7}{blocks:>7} {arrow:<4}{ceiling:>8.1f}" + "".join(cells))


def derive_calibration(results: list[Measurement], device_name: str) -> dict:
    """``auto`` thresholds: per direction, the smallest page size from which ``cuda-batch`` reaches
    97% of the best small-fragment backend on vLLM NHD pages (largest job of each page size)."""
    thresholds = {}
    small_votes = {"triton": 0, "torch": 0}
    for direction in Direction:
        largest: dict[int, dict[str, float]] = {}
        sizes: dict[int, int] = {}
        for m in results:
            if m.layout != "vllm-nhd" or m.direction != direction.value or m.gbps is None:
                continue
            if m.blocks >= sizes.get(m.page_bytes, 0):
                if m.blocks > sizes.get(m.page_bytes, 0):
                    largest[m.page_bytes] = {}
                sizes[m.page_bytes] = m.blocks
                largest[m.page_bytes][m.method] = m.gbps
        threshold = None
        for page in sorted(largest):
            by_method = largest[page]
            small = max(by_method.get("kvsnap-triton", 0.0), by_method.get("kvsnap-torch", 0.0))
            if by_method.get("kvsnap-triton", 0.0) >= by_method.get("kvsnap-torch", 0.0):
                small_votes["triton"] += 1
            else:
                small_votes["torch"] += 1
            if threshold is None and by_method.get("kvsnap-cuda-batch", 0.0) >= 0.97 * small:
                threshold = page
        thresholds[direction.value] = (
            threshold if threshold is not None else 4 * max(largest, default=MiB)
        )
    return {
        "version": CALIBRATION_VERSION,
        "large_fragment_bytes": thresholds,
        "small_backend": max(small_votes, key=small_votes.get),
        "measured_on": device_name,
        "date": datetime.date.today().isoformat(),
    }


#: (layout, page bytes, blocks) measured by ``--sweep-triton``, for each program count.
SWEEP_CASES = (
    ("vllm-nhd", 2 * KiB, 32768),
    ("vllm-nhd", 16 * KiB, 4096),
    ("packed", 16 * KiB, 2048),
)
SWEEP_PROGRAMS = (16, 32, 64, 132, 264)


def sweep_triton(pool: PinnedPool, device: torch.device, repeats: int) -> list[dict]:
    """GB/s of the Triton backend for several grid bounds (``max_programs``)."""
    rows = []
    rng = np.random.default_rng(1)
    for kind, page, count in SWEEP_CASES:
        cache = make_cache(
            kind,
            num_layers=NUM_LAYERS,
            num_blocks=2 * count,
            dtype=torch.bfloat16,
            device=device,
            fill="empty",
            **geometry_for(kind, page),
        )
        for tensor in cache.tensors:
            tensor.view(torch.uint8).random_(0, 256)
        ids = np.sort(rng.choice(2 * count, count, replace=False))
        case = Case(cache, ids, pool.slot(0).tensor, pool.slot(0).tensor, Timer(device), repeats)
        for direction in Direction:
            for programs in SWEEP_PROGRAMS:
                options = {"triton": {"max_programs": programs}}
                seconds, _, _ = measure_kvsnap(
                    cache, direction, "triton", case.copies(), ids, case.host, repeats, options
                )
                gbps = case.job_bytes / seconds / 1e9
                rows.append(
                    {
                        "layout": kind,
                        "page_bytes": page,
                        "blocks": count,
                        "direction": direction.value,
                        "max_programs": programs,
                        "gbps": gbps,
                    }
                )
                label = f"{kind} {page} B x {count} {direction.value}"
                print(f"  triton {label} P={programs}: {gbps:.1f} GB/s", flush=True)
        del cache
    return rows


def profile_submit(device: torch.device) -> None:
    """Where the host time of ``submit`` goes: cProfile of 300 one-block jobs per backend."""
    import cProfile
    import pstats

    cache = make_cache(
        "vllm-nhd",
        num_layers=NUM_LAYERS,
        num_blocks=64,
        device=device,
        **geometry_for("vllm-nhd", 16 * KiB),
    )
    page = cache.layout.geometry.canonical_page_size_bytes
    with PinnedPool(4 * page, 1, pin=device.type == "cuda") as pool:
        base = pool.slot(0).data_ptr
        copies = [
            PageCopy(
                name, np.array([3]), HostPages.contiguous(base + i * page, 1, page), np.array([0])
            )
            for i, name in enumerate(cache.layout.geometry.tensor_names())
        ]
        for backend in [
            b for b in ("cuda-batch", "triton", "torch", "cpu") if b in available_backends(device)
        ]:
            handler = TransferHandler(cache.layout, Direction.DEVICE_TO_HOST, backend=backend)
            handler.submit(0, copies)
            handler.wait([0])
            profiler = cProfile.Profile()
            started = time.perf_counter()
            profiler.enable()
            for job in range(1, 301):
                handler.submit(job, copies)
                handler.wait([job])
            profiler.disable()
            per_job = (time.perf_counter() - started) / 300 * 1e6
            print(
                f"\n--- submit+wait, {backend}: {per_job:.0f} us per one-block job of 4 copies ---"
            )
            pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
            handler.shutdown()


def write_results(
    path: Path, argv: list[str] | None, device_name: str, started: float, results: list[Measurement]
) -> dict:
    """Write every measurement so far (after each case, so an interrupted run keeps its data)."""
    payload = {
        "command": " ".join(
            ["python -m benchmarks.transfer", *(sys.argv[1:] if argv is None else argv)]
        ),
        "device": device_name,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": time.perf_counter() - started,
        "results": [asdict(m) for m in results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="JSON file for every measurement")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument(
        "--pages", default=",".join(str(p) for p in HEAD_PAGES), help="page sizes in bytes"
    )
    parser.add_argument("--blocks", default=",".join(str(c) for c in BLOCK_COUNTS))
    parser.add_argument("--job-bytes-limit", type=int, default=JOB_BYTES_LIMIT)
    parser.add_argument("--write-calibration", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--triton-programs", type=int, default=None, help="max_programs for triton")
    parser.add_argument("--sweep-triton", action="store_true", help="also sweep triton's grid")
    parser.add_argument("--profile-submit", action="store_true", help="profile submit's host time")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    backends = [
        name for name in KVSNAP_BACKENDS if name == "auto" or name in available_backends(device)
    ]
    methods = ["ceiling", *(f"kvsnap-{b}" for b in backends), "per-block-copy"]
    methods += ["batch-unmerged"] if "cuda-batch" in backends else []
    methods += ["index-select"]
    device_name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu"
    )
    print(f"kvsnap transfer benchmark on {device_name}; backends {', '.join(backends)}", flush=True)
    rng = np.random.default_rng(args.seed)
    limit = args.job_bytes_limit
    started = time.perf_counter()
    results: list[Measurement] = []
    options = (
        None if args.triton_programs is None else {"triton": {"max_programs": args.triton_programs}}
    )
    if args.profile_submit:
        profile_submit(device)
    with PinnedPool(limit, 1, pin=device.type == "cuda") as pool:
        sweep = sweep_triton(pool, device, args.repeats) if args.sweep_triton else None
        device_buffer = torch.empty(limit, dtype=torch.uint8, device=device)
        timer = Timer(device)
        for kind in args.layouts.split(","):
            for page in (int(p) for p in args.pages.split(",")):
                parts = 1 if kind == "mla" else 2
                per_block = page * parts * NUM_LAYERS
                counts = sorted({min(int(c), limit // per_block) for c in args.blocks.split(",")})
                cache = make_cache(
                    kind,
                    num_layers=NUM_LAYERS,
                    num_blocks=2 * max(counts),
                    dtype=torch.bfloat16,
                    device=device,
                    fill="empty",
                    **geometry_for(kind, page),
                )
                for tensor in cache.tensors:
                    tensor.view(torch.uint8).random_(0, 256)  # arbitrary bit patterns, NaNs too
                for count in counts:
                    ids = np.sort(rng.choice(2 * max(counts), count, replace=False))
                    case = Case(
                        cache, ids, pool.slot(0).tensor, device_buffer, timer, args.repeats, options
                    )
                    for direction in Direction:
                        results += measure_direction(case, direction, backends)
                    elapsed = time.perf_counter() - started
                    print(f"  {kind} {page} B x {count}: done at {elapsed:.0f} s", flush=True)
                    write_results(args.output, argv, device_name, started, results)
                del cache
    print()
    print_table(results, methods)
    payload = write_results(args.output, argv, device_name, started, results)
    if sweep is not None:
        payload["triton_sweep"] = sweep
        args.output.write_text(json.dumps(payload, indent=1))
    if args.write_calibration is not None:
        calibration = derive_calibration(results, device_name)
        args.write_calibration.parent.mkdir(parents=True, exist_ok=True)
        args.write_calibration.write_text(json.dumps(calibration, indent=2))
        payload["calibration"] = calibration
        args.output.write_text(json.dumps(payload, indent=1))
        print(f"\ncalibration written to {args.write_calibration}: {calibration}")
    print(f"\n{len(results)} measurements in {payload['seconds']:.0f} s written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
