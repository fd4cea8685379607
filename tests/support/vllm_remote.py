"""The remote-tier world of ``tests/engines/vllm/test_remote_engines.py`` (its docstring names
the engines): A, then B, one chain against moto's S3 server on loopback behind a fault proxy
(``benchmarks/s3_loopback.py``), which the chain stops while B waits (``vllm_worlds.py``)."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from benchmarks.s3_loopback import FaultProxy, LoopbackS3
from kvsnap.engines.vllm import CacheIdentity, store_key_chain
from kvsnap.store.files.keys import new_key_text
from tests.support.vllm_engines import (
    PYTHON,
    ROOT,
    EngineRun,
    finish_engine,
    launch_engine,
    run_engine,
)
from tests.support.vllm_worlds import Job, World

BLOCK, CHUNK_BLOCKS = 32, 2


@dataclass
class RemoteRun:
    tmp: Path
    model: Path
    key: Path
    prompts: dict[str, list[int]]
    runs: dict[str, EngineRun]
    stores: dict[str, Path]
    bucket_after_a: list[str]
    environment: dict[str, str]  # the engines': the S3 endpoint (the proxy's) and credentials


def _prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(41)
    return {label: rng.integers(1, 500, size=100).tolist() for label in ("P1", "X", "P2")}


def _first_chunk(tokens: list[int]) -> str:
    """The store key naming a prompt's first chunk (its second block's)."""
    chain = store_key_chain(np.asarray(tokens[: 2 * BLOCK]), BLOCK, CacheIdentity())
    return chain[CHUNK_BLOCKS - 1]


def _vllm_has_s3fs() -> bool:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [str(PYTHON), "-c", "import s3fs"], env={**os.environ, "PYTHONPATH": path}, check=False
    )
    return done.returncode == 0


def _prepare(tmp: Path, model: Path) -> tuple[Path, Path, Path]:
    key = tmp / "key"
    key.write_text(new_key_text())
    key.chmod(0o600)
    return tmp, model, key


def _served(inputs: tuple[Path, Path, Path]) -> RemoteRun:
    """A and B against the bucket; the servers stopped whatever happens."""
    if not _vllm_has_s3fs():
        pytest.skip("s3fs is not installed in .venv-vllm (scripts/setup_vllm_venv.sh adds it)")
    tmp, model, key = inputs
    s3 = LoopbackS3("kvsnap-engines")
    proxy = FaultProxy(s3.port)
    try:
        return _run(tmp, model, key, s3, proxy)
    finally:
        proxy.stop()
        s3.stop()


def node_connector(tmp: Path, name: str, key: Path) -> dict[str, object]:
    """The connector of node ``name``: a store of its own under ``tmp``, the shared bucket."""
    store = tmp / name
    store.mkdir(mode=0o700)
    return {
        "path": str(store),
        "chunk_blocks": CHUNK_BLOCKS,
        "key_file": str(key),
        "remote_url": "s3://kvsnap-engines/tier",
    }


def _run(tmp: Path, model: Path, key: Path, s3: LoopbackS3, proxy: FaultProxy) -> RemoteRun:
    prompts = _prompts()
    labels = list(prompts)
    # The engines reach the bucket through the proxy, configured the standard way.
    environment = s3.client_environment(proxy.endpoint)
    node_a = node_connector(tmp, "a", key)
    runs = {
        "a": run_engine(tmp, "a", model, labels, prompts, connector=node_a, environment=environment)
    }
    fs = s3.filesystem()
    objects = sorted(fs.find(f"{s3.bucket}/tier"))
    # A foreign identity planted: P1's first chunk (valid, signed) over X's first chunk.
    source = next(name for name in objects if _first_chunk(prompts["P1"]) in name)
    target = next(name for name in objects if _first_chunk(prompts["X"]) in name)
    fs.copy(source, target)
    pause = tmp / "server-stopped"
    process, job, log, events, dumps = launch_engine(
        tmp,
        "b",
        model,
        labels,
        prompts,
        connector=node_connector(tmp, "b", key),
        sequential=True,
        pause={"before": labels.index("P2"), "file": str(pause)},
        environment=environment,
    )
    waiting = Path(f"{pause}.waiting")
    while not waiting.exists() and process.poll() is None:
        time.sleep(0.1)  # (a failed engine is reported by finish_engine)
    proxy.stop()  # the remote is down: connections refused,
    s3.stop()  # and the server itself gone
    pause.write_text("go")
    runs["b"] = finish_engine(process, job, labels, log, events, dumps)
    stores = {"a": tmp / "a", "b": tmp / "b"}
    return RemoteRun(tmp, model, key, prompts, runs, stores, objects, environment)


#: A, then B: one chain.
WORLD = World(_prepare, {"engines": Job(_served, engines=2)}, lambda _, results: results["engines"])
