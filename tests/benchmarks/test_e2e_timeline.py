"""The end-to-end benchmark's timeline: its disk accounting on known spans, and one small run
of the script on CPU with ``--timeline``."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def e2e() -> ModuleType:
    spec = importlib.util.spec_from_file_location("e2e_benchmark", ROOT / "benchmarks" / "e2e.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_disk_busy_time_gaps_and_writes_in_flight(e2e: ModuleType) -> None:
    timeline = e2e.Timeline()
    t0 = timeline.started
    # Writes over [0, 10] and [5, 15] overlap, then the disk idles until [20, 30]; the run
    # ends at 40. Seconds, so the 5 s gap counts as an idle gap over 1 ms.
    for start, end in ((0, 10), (5, 15), (20, 30)):
        timeline("write", t0 + start, t0 + end, 100)
    timeline("hash", t0 + 1, t0 + 2, 100)
    disk = timeline.disk("write", t0 + 40)
    assert disk["busy_s"] == pytest.approx(25)
    assert disk["idle_between_s"] == pytest.approx(5)
    assert disk["idle_gaps_over_1ms"] == 1 and disk["max_gap_ms"] == pytest.approx(5000)
    assert disk["first_start_ms"] == pytest.approx(0)
    assert disk["last_end_after_ms"] == pytest.approx(10_000)
    assert disk["mean_in_flight"] == pytest.approx(30 / 25)
    # 0 in flight over [15, 20] and [30, 40]; 1 over [0, 5], [10, 15], [20, 30]; 2 over [5, 10].
    assert disk["share_0_in_flight"] == pytest.approx(15 / 40)
    assert disk["share_1_in_flight"] == pytest.approx(20 / 40)
    assert disk["share_2plus_in_flight"] == pytest.approx(5 / 40)
    kinds = timeline.kinds()
    assert kinds["write"]["count"] == 3 and kinds["write"]["bytes"] == 300
    assert kinds["hash"]["seconds"] == pytest.approx(1)


def test_the_script_records_a_timeline_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.e2e",
            "--size-gib",
            "0.05",
            "--dir",
            str(tmp_path / "bench"),
            "--timeline",
            "--skip-compute",
            "--json-out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["restore_bit_exact"] == "True"
    kv_bytes = report["kv_bytes"]
    for run, disk_kind in (("capture", "write"), ("restore", "read")):
        timeline = report["timeline"][run]
        assert timeline["kinds"][disk_kind]["bytes"] == kv_bytes
        disk = timeline["disk"]
        assert disk["busy_s"] <= timeline["wall_s"]
        shares = [disk[f"share_{n}_in_flight"] for n in ("0", "1", "2plus")]
        assert sum(shares) == pytest.approx(1.0)
    assert {"ttfb_cold", "ttfb_warm", "ttfb_warm_pool"} <= set(report["timeline"])
    assert "timeline capture" in result.stdout and "disk (write)" in result.stdout
