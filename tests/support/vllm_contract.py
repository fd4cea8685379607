"""The real-vLLM worlds of ``tests/engines/vllm/test_connector_contract.py`` (its docstring says
what they do): ``vllm_contract_child.py``'s three engines under each scheduler kind, and an
engine refused at its start, each a world of one job (``vllm_worlds.py``)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.vllm_engines import HELPERS, PYTHON, ROOT
from tests.support.vllm_worlds import Job, World, make_model

BLOCK = 16  # vllm_contract_child.BLOCK


def run_child(job: dict[str, Any], directory: Path) -> dict[str, Any]:
    """Run ``vllm_contract_child.py`` on ``job``; its report."""
    job = {
        "store": str(directory / "store"),
        "event_log": str(directory / "events.jsonl"),
        "output": str(directory / "report.json"),
        **job,
    }
    path = directory / "job.json"
    path.write_text(json.dumps(job))
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run(
        [str(PYTHON), str(HELPERS / "vllm_contract_child.py"), str(path)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((directory / "report.json").read_text())


def _prompts() -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(21)
    p = rng.integers(1, 500, size=6 * BLOCK + 5).tolist()  # 6 loadable blocks: 3 chunks
    q = p[: 2 * BLOCK] + rng.integers(1, 500, size=3 * BLOCK).tolist()  # P's first chunk
    return p, q


def _failed_load(scheduler: str) -> World:
    """Engine 0 stores P and Q, engine 1 (``scheduler``) fails a load, engine 2 loads all."""

    def run(inputs: tuple[Path, Path]) -> dict[str, Any]:
        directory, model = inputs
        p, q = _prompts()
        job = {
            "model": str(model),
            "engines": [
                {"scheduler": "sync", "policy": "recompute", "prompts": [p, q]},
                {
                    "scheduler": scheduler,
                    "policy": "recompute",
                    "prompts": [p],
                    "before": [{"flip": "0:1"}, {"remove": "0:2"}],
                },
                {"scheduler": "sync", "policy": "fail", "prompts": [p, q]},
            ],
        }
        return run_child(job, directory)

    return World(lambda *inputs: inputs, {"child": Job(run)}, lambda _, out: out["child"])


FAILED_LOAD = {scheduler: _failed_load(scheduler) for scheduler in ("sync", "async")}


@dataclass(frozen=True)
class Refusal:
    """An engine that did not start: its exit code, its output, whether it wrote its result."""

    returncode: int
    output: str
    wrote_output: bool


def _sliding_window_engine(inputs: tuple[Path, Path]) -> Refusal:
    """An engine on a Mistral whose every layer uses a sliding window, with the connector."""
    directory, _ = inputs
    model = make_model(directory / "sliding", "0", str(2 * BLOCK))
    job = {
        "model": str(model),
        "connector": {"path": str(directory / "store")},
        "prompts": [{"token_ids": list(range(1, 5 * BLOCK))}],
        "max_tokens": 2,
        "output": str(directory / "out.json"),
    }
    (directory / "job.json").write_text(json.dumps(job))
    done = subprocess.run(
        [str(PYTHON), str(HELPERS / "vllm_run_engine.py"), str(directory / "job.json")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    return Refusal(done.returncode, done.stdout + done.stderr, (directory / "out.json").exists())


SLIDING_WINDOW = World(
    lambda *inputs: inputs, {"engine": Job(_sliding_window_engine)}, lambda _, out: out["engine"]
)
