"""The vllm-cpu hit benchmark (``benchmarks/vllm_cpu_hit.py``) run short on real vLLM: every
timed kvsnap hit must be a real one (the connector loaded the prefix, vLLM counted it cached,
the token equals the recompute's), and vLLM's own hits beside it too; ``--spans`` times the
hit's checks, opens and load and none in vLLM's hit beside it. Its ``--copy-alone``
question (no vLLM): every copy variant moves the same bytes; its ``--open-alone`` one: the
chunks pass the scheduler's check and load bit-exact."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks.vllm_cpu_hit import copy_alone, open_alone
from tests.support.vllm_engines import PYTHON, ROOT


def test_every_copy_variant_moves_the_same_bytes() -> None:
    result = copy_alone(num_layers=1, tokens=160, repeat=1)
    assert result["pages"] == 2 * (159 // 32)
    assert result["same_bytes"]
    assert set(result["ms"]) == {
        f"{direction}/{name}"
        for direction in ("restore", "capture")
        for name in ("strided", "held", "gather", "numpy", "memcpy")
    }


def test_open_alone_checks_and_loads_every_chunk() -> None:
    # 4 prompts of 5 blocks (the last block is never stored): one chunk each, the first
    # prompt untimed. open_alone itself refuses a failed check or a load that is not exact.
    result = open_alone(num_layers=2, count=4, tokens=160)
    assert (result["layers"], result["prompts"], result["chunks"]) == (2, 3, 1)
    assert set(result["ms"]) == {"check", "load", "open", "verify"}
    assert all(value > 0 for value in result["ms"].values())


# About a minute (three engines): a heavier variant, with --run-slow.
@pytest.mark.vllm
@pytest.mark.slow
def test_short_run_times_only_real_hits(tmp_path: Path) -> None:
    out = tmp_path / "hit.json"
    command = [
        str(PYTHON),
        str(ROOT / "benchmarks" / "vllm_cpu_hit.py"),
        *("--layers", "2", "--tokens", "160", "--requests", "2", "--warmup", "1"),
        *("--shm-dir", str(tmp_path / "store"), "--json-out", str(out), "--spans"),
    ]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    (result,) = json.loads(out.read_text())
    assert result["layers"] == 2 and result["vllm_hit_checked"]
    (hit,) = result["kvsnap"].values()
    assert hit["checked"]
    assert hit["hit_ms"] > 0 and hit["vllm_hit_beside_ms"] > 0
    # --spans: the hit loaded its chunks and checked them first; the vLLM hit beside it did not.
    spans = hit["spans"]
    for name in (
        "scheduler: first check of a chunk",
        "SnapshotReader.opened",
        "worker: restore_chunks",
        "vLLM: model forward",
    ):
        assert spans["hit"][name] > 0, name
    assert spans["beside"].get("worker: restore_chunks", 0.0) == 0.0
    assert spans["beside"]["vLLM: model forward"] > 0
