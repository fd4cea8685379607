"""The tampered-store world of ``tests/engines/vllm/test_tampered_store.py`` (its docstring
names the engines): S, T and U, one chain on one signed store (``vllm_worlds.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsnap.store.files.keys import new_key_text
from tests.support.vllm_engines import EngineRun, run_engine
from tests.support.vllm_worlds import Job, World

BLOCK = 32


@dataclass
class Tampered:
    prompts: dict[str, list[int]]
    runs: dict[str, EngineRun]
    first_chunks: dict[str, Path]


def _first_chunk(run: EngineRun, label: str) -> Path:
    """The first (two-block) chunk the engine ``run`` saved for the prompt ``label``."""
    saves = run.events_for("save", label)
    (first,) = [Path(save["path"]) for save in saves if save["blocks"] == 2]
    return first


def _prepare(tmp: Path, model: Path) -> tuple[Path, Path]:
    key = tmp / "store.key"
    key.write_text(new_key_text() + "\n")
    key.chmod(0o600)
    return tmp, model


def _store_runs(inputs: tuple[Path, Path]) -> Tampered:
    tmp, model = inputs
    key = tmp / "store.key"
    rng = np.random.default_rng(37)
    p, q, r = (rng.integers(1, 500, size=100).tolist() for _ in range(3))
    prompts = {"P": p, "P-again": p, "Q": q, "R": r}
    connector = {"path": str(tmp / "store"), "chunk_blocks": 2, "key_file": str(key)}
    runs = {"s": run_engine(tmp, "s", model, ["P", "Q", "R"], prompts, connector=connector)}
    first = {label: _first_chunk(runs["s"], label) for label in ("P", "Q", "R")}
    runs["t"] = run_engine(
        tmp,
        "t",
        model,
        ["P"],
        prompts,
        connector=connector,
        executor="mp",
        tamper={"swap": {"victim": str(first["P"]), "with": str(first["Q"])}},
    )
    # T found Q's chunk under P's name when it planned P's saves: quarantined, P stored anew
    # under its name (chunk names are the store keys).
    runs["u"] = run_engine(
        tmp,
        "u",
        model,
        ["P", "P-again", "Q"],
        prompts,
        connector=connector,
        policy=None,
        executor="uni",
        sequential=True,
        tamper={
            "rot": {"path": str(first["P"]), "after": "0"},
            "swap": {"victim": str(first["Q"]), "with": str(first["R"])},
        },
    )
    return Tampered(prompts, runs, first)


#: S, T and U: one chain.
WORLD = World(_prepare, {"store": Job(_store_runs, engines=3)}, lambda _, results: results["store"])
