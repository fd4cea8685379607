"""The vLLM package imports lazily: importing it, or reading a store key from it, loads no
torch (the CLI's ``store list`` shortens store keys with ``identity.KEY_PATTERN``), and every
exported name still resolves to the object of the module it comes from. A worker's open of a
chunk missing for an instant (a pruner set it aside) waits and opens it once it is back,
through the one retry loop, ``open_retrying``."""

from __future__ import annotations

import importlib
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import kvsnap.engines.vllm as vllm_package
from kvsnap.engines.vllm import worker as worker_module
from kvsnap.errors import SnapshotIOError
from kvsnap.snapshot import capture
from tests.support.parts_helpers import SOURCE, filled, sequences

_NO_TORCH = """
import sys
import kvsnap.engines.vllm
from kvsnap.engines.vllm.identity import KEY_PATTERN
assert KEY_PATTERN.fullmatch("0" * 64)
print("torch" in sys.modules)
"""


def test_the_package_and_its_store_key_load_no_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]


def test_every_export_resolves_to_its_modules_object() -> None:
    assert sorted(vllm_package.__all__) == sorted(vllm_package._MODULE_OF)
    for name, module in vllm_package._MODULE_OF.items():
        assert getattr(vllm_package, name) is getattr(importlib.import_module(module), name)
    with pytest.raises(AttributeError, match="no_such_name"):
        vllm_package.no_such_name  # noqa: B018


def _chunk(tmp_path: Path) -> Path:
    ranks, _ = filled("vllm-nhd", 1, 2)
    path = tmp_path / "chunk.safetensors"
    capture(ranks[0].layout, sequences(1), path, source=SOURCE)
    return path


def test_a_chunk_set_aside_for_an_instant_is_opened_once_it_is_back(tmp_path: Path) -> None:
    path = _chunk(tmp_path)
    aside = path.with_name(".aside")
    path.rename(aside)
    # Put back after the first attempts have failed; the worker's attempts wait in between.
    timer = threading.Timer(0.05, aside.rename, args=(path,))
    timer.start()
    try:
        attempts, pause = worker_module._OPEN_ATTEMPTS, worker_module._OPEN_RETRY_S
        worker_module._OPEN_ATTEMPTS, worker_module._OPEN_RETRY_S = 400, 0.005
        with worker_module._open_chunk(str(path), None) as snapshot:
            assert snapshot.num_blocks == 12
    finally:
        worker_module._OPEN_ATTEMPTS, worker_module._OPEN_RETRY_S = attempts, pause
        timer.join()


def test_a_chunk_that_stays_missing_fails_after_the_attempts(tmp_path: Path) -> None:
    path = tmp_path / "never.safetensors"
    with pytest.raises(SnapshotIOError, match=r"never\.safetensors"):
        worker_module._open_chunk(str(path), None)
