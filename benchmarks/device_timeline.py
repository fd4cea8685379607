"""What a CUDA device did during one call: its copies and kernels as torch's profiler saw them,
summed into what tells where a call's time went: how long the device copied, computed, did both
at once, and did neither (and its longest idle gaps, with what came before each).

``device_events(call)`` runs ``call`` once under ``torch.profiler`` (CPU and CUDA activity) and
returns the device's copies, memsets and kernels (:class:`DeviceEvent`); ``summary(events)``
gives the figures. ``benchmarks/fp8_restore_parts.py --timeline`` reports them for an fp8
restore, whose pieces' copies should hide its checks and scatter: ``overlap_ms`` near the
kernels' time, and no long idle gap, is what that looks like.
"""

from __future__ import annotations

import itertools
import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

#: The chrome-trace categories of device work, and what each is counted as.
KINDS = {"gpu_memcpy": "copy", "gpu_memset": "copy", "kernel": "kernel"}


@dataclass(frozen=True)
class DeviceEvent:
    """One copy or kernel: when it started (µs from the first), how long it ran, its kind
    (``copy`` or ``kernel``), its stream and its name."""

    start_us: float
    duration_us: float
    kind: str
    stream: int
    name: str

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us


def device_events(call: Callable[[], object]) -> list[DeviceEvent]:
    """The device's copies and kernels while ``call`` ran (once, synchronized after), in start
    order, times from the first one's start."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        call()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as scratch:
        trace = Path(scratch) / "trace.json"
        profile.export_chrome_trace(str(trace))
        records = json.loads(trace.read_text())["traceEvents"]
    return events_of(records)


def events_of(records: Sequence[dict]) -> list[DeviceEvent]:
    """The device events of a chrome trace's ``traceEvents``, in start order, times from the
    first one's start."""
    work = [
        record
        for record in records
        if record.get("ph") == "X" and record.get("cat") in KINDS and "dur" in record
    ]
    if not work:
        return []
    first = min(float(record["ts"]) for record in work)
    events = [
        DeviceEvent(
            float(record["ts"]) - first,
            float(record["dur"]),
            KINDS[record["cat"]],
            int(record.get("tid", 0)),
            str(record.get("name", "")),
        )
        for record in work
    ]
    return sorted(events, key=lambda event: (event.start_us, event.end_us))


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``spans`` (start, end) as disjoint spans covering the same time, in order."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def _intersection(
    first: list[tuple[float, float]], second: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """Where two lists of disjoint ordered spans both are."""
    both, i, j = [], 0, 0
    while i < len(first) and j < len(second):
        start, end = max(first[i][0], second[j][0]), min(first[i][1], second[j][1])
        if start < end:
            both.append((start, end))
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return both


def summary(events: Sequence[DeviceEvent], gaps: int = 3) -> dict[str, object]:
    """``span_ms`` (first start to last end), ``copy_ms`` / ``kernel_ms`` (time the device
    copied / ran a kernel: overlapping events counted once), ``overlap_ms`` (both at once),
    ``idle_ms`` (neither), and the ``gaps`` longest idle gaps (start, length, the event that
    ended last before it), in ms."""
    if not events:
        return {"events": 0}
    copies = _merged([(e.start_us, e.end_us) for e in events if e.kind == "copy"])
    kernels = _merged([(e.start_us, e.end_us) for e in events if e.kind == "kernel"])
    busy = _merged(copies + kernels)
    span = max(e.end_us for e in events) - min(e.start_us for e in events)
    holes = [(end, start) for (_, end), (start, _) in itertools.pairwise(busy)]
    longest = sorted(holes, key=lambda hole: hole[1] - hole[0], reverse=True)[:gaps]
    return {
        "events": len(events),
        "span_ms": span / 1e3,
        "copy_ms": _length(copies) / 1e3,
        "kernel_ms": _length(kernels) / 1e3,
        "overlap_ms": _length(_intersection(copies, kernels)) / 1e3,
        "idle_ms": (span - _length(busy)) / 1e3,
        "longest_gaps": [
            {
                "at_ms": start / 1e3,
                "ms": (end - start) / 1e3,
                "after": max((e for e in events if e.end_us <= start), key=lambda e: e.end_us).name,
            }
            for start, end in longest
        ],
    }
