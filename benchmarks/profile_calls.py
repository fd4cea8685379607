"""Where one warm call's time goes: trace spans and the top Python functions.

``python -m benchmarks.profile_calls`` (CUDA; ``--device cpu`` for caches in host memory, the
host's share alone) profiles warm captures and restores of short
prefixes (32 layers x 8 heads; 80 layers x 8 TP ranks x 1 head held in one process) and of a
2,048-token ``DynamicCache`` shaped like an 8B model's, to a memory-backed file. For each it
prints the median call, the summed trace spans per kind and cProfile's top functions.

``--fixed`` profiles the calls whose fixed cost issue 26 bounds instead: warm ``Snapshot.open``
+ restore of 16 tokens into the four fixed-cost cases of benchmarks/engine.py, and warm
``restore_dynamic_cache`` calls with their model check (a 32-layer model with the 8B model's
module tree); the header of each prints the Python calls per call (deterministic, unlike
times on a shared machine).

``--per-byte`` asks another question, on caches in host memory: what a byte costs when the
cache is many small tensors. It captures and restores (``Snapshot.open`` + ``restore``) the same
number of bytes (``--per-byte-mib``, default 256) for 32 layers x 8 heads (64 K/V tensors of
32 KiB pages) and 80 layers x 8 TP ranks x 1 head held in one process (1,280 K/V tensors, each
page a rank's 16 fragments of 256 bytes), side by side with the ceilings: one copy of a
contiguous buffer of the same bytes, one thread's ``pread`` of the snapshot file, a write of
a new file renamed over the last, and the host's xxh3-64 of every page; every case once per
round (``--repeat`` rounds). Prints medians in ns per byte and GB/s, wall and CPU time (all
threads), the ratio of the two shapes, and whether the restores were bit-exact.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.profiling import SpanTotals, synchronize
from kvsnap.format import SourceInfo
from kvsnap.format.hashing import block_digests
from kvsnap.layout import contiguous_layout
from kvsnap.layout.allocate import allocate_cache
from kvsnap.snapshot import SequenceBlocks, Snapshot, capture

SOURCE = SourceInfo(engine="benchmark", model_id="synthetic")


def profile(label: str, call: Callable[[Callable | None], object], repeat: int, top: int) -> None:
    """Print the median wall and CPU time (every thread of the process) of ``repeat`` plain
    calls, then the Python calls per call, the trace spans and cProfile's ``top`` functions
    of ``repeat`` profiled ones."""
    for _ in range(3):
        call(None)
    wall, cpu = [], []
    for _ in range(repeat):
        synchronize()
        started, started_cpu = time.perf_counter(), time.process_time()
        call(None)
        synchronize()
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    trace = SpanTotals()
    times = []
    profiler = cProfile.Profile()
    for _ in range(repeat):
        synchronize()
        started = time.perf_counter()
        profiler.enable()
        call(trace)
        synchronize()
        profiler.disable()
        times.append(time.perf_counter() - started)
    stats = pstats.Stats(profiler)
    print(
        f"\n##### {label}: median {statistics.median(wall) * 1e3:.2f} ms, CPU "
        f"{statistics.median(cpu) * 1e3:.2f} ms; {stats.total_calls / repeat:.0f} Python calls "
        f"per call, median {statistics.median(times) * 1e3:.2f} ms profiled"
    )
    for kind, milliseconds in trace.per_call_ms(repeat):
        print(f"  span {kind:<18} {milliseconds:8.3f} ms/call")
    stats.sort_stats("tottime").print_stats(top)


def layouts(
    kind: str,
    layers: int,
    tp_size: int,
    device: str,
    *,
    num_blocks: int = 256,
    random: bool = False,
) -> list:
    """One cache of ``kind`` per TP rank (8 KV heads x 128 in all, bf16); ``random``: filled
    with random bytes (host memory only; else left as allocated)."""
    caches = [
        allocate_cache(
            kind,
            num_layers=layers,
            num_blocks=num_blocks,
            block_size=16,
            num_kv_heads=8,
            head_dim=128,
            tp_rank=rank,
            tp_size=tp_size,
            dtype=torch.bfloat16,
            device=device,
            fill="empty",
        )
        for rank in range(tp_size)
    ]
    if random:
        generator = torch.Generator().manual_seed(0)
        for cache in caches:
            for tensor in cache.tensors:
                tensor.view(torch.int16).random_(generator=generator)
    return [cache.layout for cache in caches]


#: The per-byte shapes: label, layers, TP ranks held in the process (8 KV heads in all).
PER_BYTE_SHAPES = (("32L x 8H (64 tensors)", 32, 1), ("80L x 8TP x 1H (1,280 tensors)", 80, 8))
#: One canonical page: 16 tokens x 8 KV heads x 128 x 2 bytes.
PAGE_BYTES = 16 * 8 * 128 * 2


def per_byte(directory: Path, mib: int, repeat: int) -> None:
    """Capture and restore about ``mib`` MiB into CPU caches of both shapes, next to the
    ceilings; every case once per round, ``repeat`` rounds, so drift in the machine's load
    reaches every case alike. Prints the medians."""
    cases: dict[str, tuple[Callable[[], object], int]] = {}
    checks: dict[str, Callable[[], bool]] = {}
    for label, layers, tp_size in PER_BYTE_SHAPES:
        shape_cases, checks[label] = per_byte_cases(directory, label, layers, tp_size, mib)
        cases.update(shape_cases)
    nbytes = next(iter(cases.values()))[1]
    source_bytes = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    copy = np.ones_like(source_bytes)
    written, published = directory / "written.tmp", directory / "written"
    cases["memcpy of one buffer"] = (lambda: np.copyto(copy, source_bytes), nbytes)
    cases["write of a new file, renamed over the last"] = (
        lambda: write_file(written, published, source_bytes),
        nbytes,
    )
    cases["xxh3-64 of every 32 KiB page"] = (
        lambda: block_digests(source_bytes, PAGE_BYTES),
        nbytes,
    )
    for call, _ in cases.values():
        call()
    # Wall time, and the CPU time of all the process's threads: on a shared machine the second
    # says what a byte costs even when other work takes the cores away.
    wall: dict[str, list[float]] = defaultdict(list)
    cpu: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeat):
        for label, (call, _) in cases.items():
            started, started_cpu = time.perf_counter(), time.process_time()
            call()
            wall[label].append(time.perf_counter() - started)
            cpu[label].append(time.process_time() - started_cpu)
    print(f"\n{'case':<50} {'MB':>6} {'ms':>7} {'ns/byte':>8} {'GB/s':>6} {'CPU ns/byte':>12}")
    per_byte_of = {}
    for label, (_, size) in cases.items():
        seconds, cpu_seconds = statistics.median(wall[label]), statistics.median(cpu[label])
        per_byte_of[label] = (seconds / size, cpu_seconds / size)
        print(
            f"{label:<50} {size / 1e6:6.1f} {seconds * 1e3:7.1f} {seconds / size * 1e9:8.3f} "
            f"{size / seconds / 1e9:6.2f} {cpu_seconds / size * 1e9:12.3f}"
        )
    for kind in ("capture", "restore"):
        many, few = (per_byte_of[f"{kind} {label}"] for label, _, _ in PER_BYTE_SHAPES[::-1])
        print(
            f"{kind}: 1,280 tensors cost {many[0] / few[0]:.2f}x per byte of 64 tensors "
            f"({many[1] / few[1]:.2f}x in CPU time)"
        )
    for label, check in checks.items():
        print(f"restored bit-exact, {label}: {check()}")


def per_byte_cases(
    directory: Path, label: str, layers: int, tp_size: int, mib: int
) -> tuple[dict[str, tuple[Callable[[], object], int]], Callable[[], bool]]:
    """The capture, restore and ``pread`` of one shape, with the bytes each moves, and a check
    that the target cache holds the source's bytes (after a restore)."""
    block_bytes = layers * 2 * PAGE_BYTES  # K and V of every layer, one block of 16 tokens
    num_blocks = max(1, (mib << 20) // block_bytes)
    source = layouts("vllm-nhd", layers, tp_size, "cpu", num_blocks=num_blocks, random=True)
    target = layouts("vllm-nhd", layers, tp_size, "cpu", num_blocks=num_blocks)
    blocks = np.arange(num_blocks)
    sequence = [SequenceBlocks("s", np.arange(num_blocks * 16), blocks)]
    path = directory / f"per-byte-{layers}-{tp_size}.safetensors"
    nbytes = num_blocks * block_bytes

    def run_capture() -> None:
        capture(source, sequence, path, source=SOURCE)

    def run_restore() -> None:
        with Snapshot.open(path) as snap:
            snap.restore(target, {"s": blocks})

    run_capture()
    into = np.ones(path.stat().st_size, dtype=np.uint8)  # touched: no page faults timed
    cases = {
        f"capture {label}": (run_capture, nbytes),
        f"restore {label}": (run_restore, nbytes),
        f"pread of its file, {label}": (lambda: pread(path, into), nbytes),
    }
    return cases, lambda: same_caches(source, target)


def same_caches(source: list, target: list) -> bool:
    """Whether every tensor of the ``target`` layouts holds the bytes of ``source``'s."""
    return all(
        torch.equal(a.tensor.view(torch.int16), b.tensor.view(torch.int16))
        for left, right in zip(source, target, strict=True)
        for a, b in zip(left.tensors, right.tensors, strict=True)
    )


def write_file(temporary: Path, path: Path, data: np.ndarray, chunk: int = 16 << 20) -> None:
    """Write ``data`` to a new file ``temporary`` in ``chunk``-byte calls and rename it over
    ``path`` (what a capture does with its file, without anything else)."""
    buffer = memoryview(data)
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for offset in range(0, len(buffer), chunk):
            os.pwrite(descriptor, buffer[offset : offset + chunk], offset)
    finally:
        os.close(descriptor)
    os.replace(temporary, path)


def pread(path: Path, into: np.ndarray, chunk: int = 16 << 20) -> None:
    """One thread's ``pread`` of the whole file into ``into``, ``chunk`` bytes a call."""
    buffer = memoryview(into)
    descriptor = os.open(path, os.O_RDONLY)
    try:
        for offset in range(0, len(buffer), chunk):
            os.preadv(descriptor, [buffer[offset : offset + chunk]], offset)
    finally:
        os.close(descriptor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--per-byte", action="store_true", help="per-byte cost in CPU caches")
    parser.add_argument("--per-byte-mib", type=int, default=256)
    parser.add_argument(
        "--fixed", action="store_true", help="the fixed-cost cases and the model check instead"
    )
    args = parser.parse_args()
    # The files live in memory: removed at the end, also after a failure or ^C.
    with tempfile.TemporaryDirectory(dir="/dev/shm") as name:
        if args.per_byte:
            per_byte(Path(name), args.per_byte_mib, args.repeat)
        elif args.fixed:
            profile_fixed(Path(name), args)
        else:
            profile_calls(Path(name), args)


def profile_fixed(directory: Path, args: argparse.Namespace) -> None:
    """Profile warm ``Snapshot.open`` + restore of one block (16 tokens) into the caches of
    benchmarks/engine.py's fixed-cost cases (the same layout objects every call, as an engine
    passes them), and warm ``restore_dynamic_cache`` calls of 16 and 128 tokens checked
    against a 32-layer transformers model with the 8B model's module tree and KV shape (the
    model check included; a new cache every call, the last four kept)."""
    from benchmarks.engine import BLOCK, FIXED_CASES, case_layouts
    from kvsnap.pipeline.jobs import restore_pairs
    from kvsnap.pipeline.shared_tables import shared_page_table
    from kvsnap.transfer.plan import Direction

    path = directory / "fixed.safetensors"
    for label, kind, layers, heads, dim, tp_size in FIXED_CASES:
        source, target = (
            case_layouts(
                kind, layers, heads, dim, tp_size, num_blocks=8, device=args.device, fill="zeros"
            )
            for _ in range(2)
        )
        blocks = np.arange(1, dtype=np.int64)
        capture(source, [SequenceBlocks("s", np.arange(BLOCK), blocks)], path, source=SOURCE)

        def restore(trace, t=target, b=blocks):
            with Snapshot.open(path) as snap:
                snap.restore(t, {"s": b}, trace=trace)

        profile(f"fixed {label} 16", restore, args.repeat, args.top)
        with Snapshot.open(path) as snap:
            steps = {
                "Snapshot.open + close": lambda: Snapshot.open(path).close(),
                "page table lookup": lambda t=target: shared_page_table(
                    t, Direction.HOST_TO_DEVICE
                ),
                "block pairs": lambda s=snap, b=blocks: restore_pairs(
                    s.metadata.sequences, {"s": b}, 8, ""
                ),
            }
            print(
                "  steps, best of 7 rounds of 200 calls: "
                + ", ".join(f"{name} {best_us(step):.1f} us" for name, step in steps.items())
            )
    profile_model_check(directory, args)


def best_us(call: Callable[[], object], calls: int = 200, rounds: int = 7) -> float:
    """The least mean time of ``call`` over ``rounds`` rounds of ``calls`` calls, in us: on a
    shared machine the round the others left alone."""
    call()
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e6


def profile_model_check(directory: Path, args: argparse.Namespace) -> None:
    """The ``restore_dynamic_cache`` calls of :func:`profile_fixed`."""
    from collections import deque

    from benchmarks.engine import capture_prefill, kv_shaped_llama
    from kvsnap.engines import transformers as kt

    model = kv_shaped_llama(args.device)
    for tokens in (16, 128):
        path = directory / f"dynamic-{tokens}.safetensors"
        capture_prefill(model, tokens, path)
        kept: deque = deque(maxlen=4)

        def restore(trace, at=path, held=kept):
            held.append(kt.restore_dynamic_cache(at, device=args.device, model=model)[0])

        profile(f"restore_dynamic_cache {tokens} (model check)", restore, args.repeat, args.top)
    # The model check alone: in a loop, and after 64 MiB copied (what a restore does to the
    # CPU's caches between two checks).
    moved, into = np.ones(64 << 20, dtype=np.uint8), np.empty(64 << 20, dtype=np.uint8)
    cold = []
    with Snapshot.open(path) as snap:
        for _ in range(200):
            np.copyto(into, moved)
            started = time.perf_counter()
            kt.check_snapshot_fits(snap, model)
            cold.append(time.perf_counter() - started)
        warm = best_us(lambda: kt.check_snapshot_fits(snap, model))
    print(
        f"  check_snapshot_fits: {warm:.0f} us in a loop (best of 7 rounds of 200), "
        f"{statistics.median(cold) * 1e6:.0f} us after 64 MiB copied (median of 200)"
    )


def profile_calls(directory: Path, args: argparse.Namespace) -> None:
    """Profile the warm calls of the module's docstring, with files in ``directory``."""
    path = directory / "p.safetensors"
    for label, layers, tp_size, tokens in (("32L x 8H", 32, 1, 128), ("80L x 8TP", 80, 8, 16)):
        source = layouts("vllm-nhd", layers, tp_size, args.device)
        target = layouts("vllm-nhd", layers, tp_size, args.device)
        blocks = np.arange(tokens // 16)
        sequence = [SequenceBlocks("s", np.arange(tokens), blocks)]
        profile(
            f"capture {label} {tokens}",
            lambda trace, s=source, q=sequence: capture(s, q, path, source=SOURCE, trace=trace),
            args.repeat,
            args.top,
        )

        def restore(trace, t=target, b=blocks):
            with Snapshot.open(path) as snap:
                snap.restore(t, {"s": b}, trace=trace)

        profile(f"restore {label} {tokens}", restore, args.repeat, args.top)
    # A DynamicCache of 2,048 tokens: 32 layers of (1, 8, T, 128) bf16, head-major.
    tokens = 2048
    keys = [
        torch.randn(1, 8, tokens, 128, device=args.device, dtype=torch.bfloat16) for _ in range(32)
    ]
    values = [torch.randn_like(key) for key in keys]
    layout = contiguous_layout(keys, values, block_size=16)
    sequence = [SequenceBlocks("s", np.arange(tokens), np.arange(tokens // 16))]
    profile(
        "capture dynamic 2048",
        lambda trace: capture(layout, sequence, path, source=SOURCE, trace=trace),
        5,
        args.top,
    )
    targets = ([torch.empty_like(k) for k in keys], [torch.empty_like(v) for v in values])

    def restore_dynamic(trace):
        target = contiguous_layout(*targets, block_size=16)
        with Snapshot.open(path) as snap:
            snap.restore(target, {"s": np.arange(tokens // 16)}, trace=trace)

    profile("restore dynamic 2048", restore_dynamic, 5, args.top)


if __name__ == "__main__":
    main()
