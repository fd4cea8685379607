"""Where one warm call's time goes: trace spans and the top Python functions.

``python -m benchmarks.profile_calls`` (CUDA; ``--device cpu`` for caches in host memory, the
host's share alone) profiles warm captures and restores of short
prefixes (32 layers x 8 heads; 80 layers x 8 TP ranks x 1 head held in one process) and of a
2,048-token ``DynamicCache`` shaped like an 8B model's, to a memory-backed file. For each it
prints the median call, the summed trace spans per kind and cProfile's top functions.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvsnap.format import SourceInfo
from kvsnap.layout import contiguous_layout
from kvsnap.layout.allocate import allocate_cache
from kvsnap.snapshot import SequenceBlocks, Snapshot, capture

SOURCE = SourceInfo(engine="benchmark", model_id="synthetic")


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        _synchronize()


def profile(label: str, call: Callable[[Callable | None], object], repeat: int, top: int) -> None:
    for _ in range(3):
        call(None)
    spans: dict[str, float] = defaultdict(float)

    def trace(kind: str, started: float, finished: float, nbytes: int) -> None:
        spans[kind] += finished - started

    times = []
    profiler = cProfile.Profile()
    for _ in range(repeat):
        _synchronize()
        started = time.perf_counter()
        profiler.enable()
        call(trace)
        _synchronize()
        profiler.disable()
        times.append(time.perf_counter() - started)
    print(f"\n##### {label}: median {statistics.median(times) * 1e3:.2f} ms (profiled)")
    for kind, seconds in sorted(spans.items(), key=lambda item: -item[1]):
        print(f"  span {kind:<18} {seconds / repeat * 1e3:8.3f} ms/call")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(top)


def layouts(kind: str, layers: int, tp_size: int, device: str) -> list:
    return [
        allocate_cache(
            kind,
            num_layers=layers,
            num_blocks=256,
            block_size=16,
            num_kv_heads=8,
            head_dim=128,
            tp_rank=rank,
            tp_size=tp_size,
            dtype=torch.bfloat16,
            device=device,
            fill="empty",
        ).layout
        for rank in range(tp_size)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(dir="/dev/shm"))
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
