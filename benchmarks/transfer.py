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
thresholds from the measurements (see :func:`kvsnap.transfer.policy.load_policy`).

``--device cpu`` runs the same matrix on host memory with the ``cpu`` and ``torch`` backends
(a smoke test of the script; numbers there say nothing about GPUs).

The cases, the ceiling, the kvsnap measurements and the calibration come from
:mod:`kvsnap.bench`, which ``kvsnap bench`` runs on a smaller matrix (vLLM split NHD only);
the baselines, the Triton grid sweep and the submit profile live here.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from kvsnap.bench import (
    HEAD_PAGES,
    JOB_BYTES_LIMIT,
    NUM_LAYERS,
    KiB,
    Measurement,
    MiB,
    Timer,
    TransferCase,
    derive_calibration,
    device_name,
    geometry_for,
    measure_backend,
    measure_case,
    measure_method,
    measured_backends,
    random_cache,
    resolve_device,
    set_ratios,
    transfer_cases,
)
from kvsnap.bench.calibration import write_calibration
from kvsnap.testing.caches import SyntheticCache, make_cache
from kvsnap.transfer import CopyJob, TransferHandler, available_backends, make_backend
from kvsnap.transfer.pinned import PinnedPool
from kvsnap.transfer.plan import Descriptors, Direction, HostPages, PageCopy

LAYOUTS = ("vllm-nhd", "packed", "mla", "flat-paged")
BLOCK_COUNTS = (1, 64, 2048, 32768)
#: The Python per-block baseline is skipped above this many copies.
PER_BLOCK_COPY_LIMIT = 16384


def slab_views(cache: SyntheticCache) -> list[torch.Tensor]:
    """Each engine tensor as ``(num_blocks, slab_bytes)`` uint8: the engine's own block slabs."""
    num_blocks = cache.layout.tensors[0].num_blocks
    return [tensor.reshape(num_blocks, -1).view(torch.uint8) for tensor in cache.tensors]


def engine_slabs(case: TransferCase) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(engine slab view, pinned host rows) per engine tensor, for the baselines."""
    slabs = slab_views(case.cache)
    size = slabs[0].shape[1]
    count = case.num_blocks
    assert len(slabs) * count * size == case.job_bytes
    return [
        (slab, case.host[i * count * size : (i + 1) * count * size].view(count, size))
        for i, slab in enumerate(slabs)
    ]


def measure_direction(
    case: TransferCase, direction: Direction, backends: list[str]
) -> list[Measurement]:
    """Every method on ``case`` in ``direction``; ratios against this direction's ceiling."""
    to_host = direction is Direction.DEVICE_TO_HOST
    device = case.cache.layout.device
    results = measure_case(case, direction, backends)
    slabs = engine_slabs(case)
    blocks = case.block_ids.tolist()

    def per_block_copy() -> None:
        for slab, rows in slabs:
            for k, block in enumerate(blocks):
                if to_host:
                    rows[k].copy_(slab[block], non_blocking=True)
                else:
                    slab[block].copy_(rows[k], non_blocking=True)

    if case.num_blocks * len(slabs) <= PER_BLOCK_COPY_LIMIT:
        results.append(measure_method(case, direction, "per-block-copy", per_block_copy))
    else:
        note = f"skipped above {PER_BLOCK_COPY_LIMIT} copies"
        results.append(case.measurement(direction, "per-block-copy", None, note=note))

    if "cuda-batch" in backends:
        batch = make_backend("cuda-batch", case.cache.layout, direction)
        size = slabs[0][0].shape[1]
        device_side = np.concatenate([slab.data_ptr() + case.block_ids * size for slab, _ in slabs])
        host_side = np.concatenate(
            [
                rows.data_ptr() + np.arange(case.num_blocks, dtype=np.int64) * size
                for _, rows in slabs
            ]
        )
        sizes = np.full(len(device_side), size, dtype=np.int64)
        pair = (device_side, host_side) if to_host else (host_side, device_side)
        descriptors = Descriptors(pair[0], pair[1], sizes)

        def batch_unmerged() -> None:
            batch.execute(CopyJob(0, [], descriptors, torch.cuda.current_stream(device)))

        results.append(measure_method(case, direction, "batch-unmerged", batch_unmerged))

    ids_device = torch.from_numpy(case.block_ids).to(device)

    def index_select() -> None:
        for slab, rows in slabs:
            if to_host:
                rows.copy_(slab.index_select(0, ids_device), non_blocking=True)
            else:
                staging = torch.empty_like(rows, device=device)
                staging.copy_(rows, non_blocking=True)
                slab.index_copy_(0, ids_device, staging)

    results.append(measure_method(case, direction, "index-select", index_select))
    set_ratios(results)
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


#: (layout, page bytes, blocks) measured by ``--sweep-triton``, for each program count.
SWEEP_CASES = (
    ("vllm-nhd", 2 * KiB, 32768),
    ("vllm-nhd", 16 * KiB, 4096),
    ("packed", 16 * KiB, 2048),
)
SWEEP_PROGRAMS = (16, 32, 64, 132, 264)


def sweep_triton(device: torch.device, repeats: int) -> list[dict]:
    """GB/s of the Triton backend for several grid bounds (``max_programs``)."""
    rows = []
    rng = np.random.default_rng(1)
    # Each case is a two-part layout: its job is count x page x 2 parts x layers bytes.
    largest_job = max(count * page * 2 * NUM_LAYERS for _, page, count in SWEEP_CASES)
    with PinnedPool(largest_job, 1, pin=device.type == "cuda") as pool:
        for kind, page, count in SWEEP_CASES:
            cache = random_cache(kind, page, 2 * count, device)
            ids = np.sort(rng.choice(2 * count, count, replace=False))
            host = pool.slot(0).tensor
            case = TransferCase(cache, ids, host, host, Timer(device), repeats)
            for direction in Direction:
                for programs in SWEEP_PROGRAMS:
                    options = {"triton": {"max_programs": programs}}
                    measured = measure_backend(
                        dataclasses.replace(case, backend_options=options), direction, "triton"
                    )
                    if measured.gbps is None:
                        raise RuntimeError(f"triton sweep: {measured.note}")
                    rows.append(
                        {
                            "layout": kind,
                            "page_bytes": page,
                            "blocks": count,
                            "direction": direction.value,
                            "max_programs": programs,
                            "gbps": measured.gbps,
                        }
                    )
                    label = f"{kind} {page} B x {count} {direction.value}"
                    print(f"  triton {label} P={programs}: {measured.gbps:.1f} GB/s", flush=True)
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
    path: Path, argv: list[str] | None, name: str, started: float, results: list[Measurement]
) -> dict:
    """Write every measurement so far (after each case, so an interrupted run keeps its data)."""
    payload = {
        "command": " ".join(
            ["python -m benchmarks.transfer", *(sys.argv[1:] if argv is None else argv)]
        ),
        "device": name,
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

    device = resolve_device(args.device)
    backends = measured_backends(device)
    methods = ["ceiling", *(f"kvsnap-{b}" for b in backends), "per-block-copy"]
    methods += ["batch-unmerged"] if "cuda-batch" in backends else []
    methods += ["index-select"]
    name = device_name(device)
    print(f"kvsnap transfer benchmark on {name}; backends {', '.join(backends)}", flush=True)
    started = time.perf_counter()
    results: list[Measurement] = []
    options = (
        None if args.triton_programs is None else {"triton": {"max_programs": args.triton_programs}}
    )
    if args.profile_submit:
        profile_submit(device)
    sweep = sweep_triton(device, args.repeats) if args.sweep_triton else None
    cases = transfer_cases(
        device,
        args.layouts.split(","),
        [int(page) for page in args.pages.split(",")],
        [int(count) for count in args.blocks.split(",")],
        job_bytes_limit=args.job_bytes_limit,
        repeats=args.repeats,
        seed=args.seed,
        backend_options=options,
    )
    for case in cases:
        for direction in Direction:
            results += measure_direction(case, direction, backends)
        elapsed = time.perf_counter() - started
        print(
            f"  {case.cache.kind} {case.page_size_bytes} B x {case.num_blocks}: "
            f"done at {elapsed:.0f} s",
            flush=True,
        )
        write_results(args.output, argv, name, started, results)
    print()
    print_table(results, methods)
    payload = write_results(args.output, argv, name, started, results)
    if sweep is not None:
        payload["triton_sweep"] = sweep
        args.output.write_text(json.dumps(payload, indent=1))
    if args.write_calibration is not None:
        calibration = derive_calibration(results, name)
        write_calibration(calibration, args.write_calibration)
        payload["calibration"] = calibration
        args.output.write_text(json.dumps(payload, indent=1))
        print(f"\ncalibration written to {args.write_calibration}: {calibration}")
    print(f"\n{len(results)} measurements in {payload['seconds']:.0f} s written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
