"""The benchmarks' one profiling helper: cProfile over warm calls with the device idle at both
ends, the report pstats prints, the trace hook that sums spans per kind, and wall-clock runs
timed with the device drained in each (:func:`timed_runs`).

``benchmarks/pcie_floor.py``, ``benchmarks/warm_restore.py`` and
``benchmarks/profile_calls.py`` profile through it, so a number one of them prints is
measured as the others measure it.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections import defaultdict
from collections.abc import Callable

import torch


def synchronize() -> None:
    """Wait for the device, when CUDA is in use (nothing to wait for otherwise)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed_runs(run: Callable[[], object], repeat: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeat`` calls of ``run`` after ``warmup`` untimed ones, the
    device drained before each clock is read."""
    for _ in range(warmup):
        run()
    synchronize()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - started)
    return times


class SpanTotals:
    """A trace hook (:data:`kvsnap.store.TraceHook`) summing each kind's span seconds."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def __call__(self, kind: str, started: float, finished: float, nbytes: int) -> None:
        self.seconds[kind] += finished - started

    def per_call_ms(self, calls: int) -> list[tuple[str, float]]:
        """Each kind's milliseconds per call over ``calls`` calls, largest first."""
        rows = [(kind, seconds / calls * 1e3) for kind, seconds in self.seconds.items()]
        return sorted(rows, key=lambda row: -row[1])


def profiled_calls(run: Callable[[], object], warmup: int, repeat: int) -> cProfile.Profile:
    """cProfile of ``repeat`` calls of ``run``, after ``warmup`` calls and with the device
    idle at both ends (the profile then holds what the calls cost the host)."""
    for _ in range(warmup):
        run()
    synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(repeat):
        run()
    synchronize()
    profiler.disable()
    return profiler


def profile_report(profiler: cProfile.Profile, top_own: int = 30, top_cumulative: int = 45) -> str:
    """The functions with most time of their own, then most time in all, as pstats prints them."""
    text = io.StringIO()
    if top_own:
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top_own)
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top_cumulative)
    return text.getvalue()
