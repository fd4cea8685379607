"""The device timeline's sums (benchmarks/device_timeline.py) on a trace whose answers are known:
copies and kernels that overlap, events on two streams that overlap each other, idle gaps and
what preceded them, and host records left out."""

from __future__ import annotations

import pytest

from benchmarks.device_timeline import events_of, summary


def _record(category: str, start: float, duration: float, name: str, stream: int = 7) -> dict:
    return {
        "ph": "X",
        "cat": category,
        "ts": 1000 + start,
        "dur": duration,
        "name": name,
        "tid": stream,
    }


def test_busy_overlap_idle_and_gaps_of_a_known_trace():
    records = [
        _record("gpu_memcpy", 0, 100, "copy 1", stream=17),
        _record("gpu_memcpy", 50, 100, "copy 2", stream=18),  # overlaps copy 1: 0-150 busy
        _record("kernel", 120, 60, "checks"),  # 120-150 under the copies, 150-180 alone
        _record("kernel", 400, 50, "scatter"),  # after a 220 µs gap
        _record("gpu_memset", 470, 30, "zeros"),  # after a 20 µs gap
        _record("cpu_op", 200, 100, "aten::to"),  # host work: not the device's
        {"ph": "i", "cat": "kernel", "ts": 1300, "name": "an instant"},
    ]
    events = events_of(records)
    assert [event.name for event in events] == ["copy 1", "copy 2", "checks", "scatter", "zeros"]
    assert events[0].start_us == 0 and events[-1].end_us == 500
    figures = summary(events, gaps=2)
    assert figures["events"] == 5
    assert figures["span_ms"] == pytest.approx(0.5)
    assert figures["copy_ms"] == pytest.approx(0.18)  # 0-150 and 470-500
    assert figures["kernel_ms"] == pytest.approx(0.11)
    assert figures["overlap_ms"] == pytest.approx(0.03)
    assert figures["idle_ms"] == pytest.approx(0.24)  # 180-400 and 450-470
    assert figures["longest_gaps"] == [
        {"at_ms": pytest.approx(0.18), "ms": pytest.approx(0.22), "after": "checks"},
        {"at_ms": pytest.approx(0.45), "ms": pytest.approx(0.02), "after": "scatter"},
    ]


def test_no_device_work_says_so():
    assert summary(events_of([_record("cpu_op", 0, 10, "aten::add")])) == {"events": 0}
