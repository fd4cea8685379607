"""Shared test options and environment markers.

* ``slow``: heavier variants, run only with ``--run-slow``.
* ``gpu``: needs CUDA; skips with "needs CUDA" where torch sees no GPU. ``make gpu-test`` runs
  ``pytest -m gpu tests``.
* ``vllm``: needs real vLLM in ``.venv-vllm`` (``scripts/setup_vllm_venv.sh``); skips, saying
  how to create it, where that virtualenv is missing.

Environment needs are markers, not folders: every test lives in the folder of the layer it
tests (``tests/<layer>/`` mirrors ``kvsnap/``), and helpers in ``tests/support/``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV = ROOT / ".venv-vllm"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="also run the heavier variants marked @pytest.mark.slow",
    )


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _vllm_installed() -> bool:
    """Whether ``scripts/setup_vllm_venv.sh`` has built ``.venv-vllm``."""
    return (VLLM_VENV / ".installed").exists()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = config.getoption("--run-slow")
    skip_slow = pytest.mark.skip(reason="heavier variant: run with --run-slow")
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_vllm = pytest.mark.skip(
        reason=f"real vLLM is not installed: run scripts/setup_vllm_venv.sh to create {VLLM_VENV}"
    )
    cuda = vllm = None  # looked up once, and only when a test needs it
    for item in items:
        if not run_slow and item.get_closest_marker("slow") is not None:
            item.add_marker(skip_slow)
        if item.get_closest_marker("gpu") is not None:
            cuda = _cuda_available() if cuda is None else cuda
            if not cuda:
                item.add_marker(skip_gpu)
        if item.get_closest_marker("vllm") is not None:
            vllm = _vllm_installed() if vllm is None else vllm
            if not vllm:
                item.add_marker(skip_vllm)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh directory on a memory-backed filesystem (/dev/shm), removed afterwards."""
    from kvsnap.store.write.local_file import memory_backed

    if not os.path.isdir("/dev/shm") or not memory_backed("/dev/shm"):
        pytest.skip("no memory-backed /dev/shm here")
    directory = Path(tempfile.mkdtemp(prefix="kvsnap-test-", dir="/dev/shm"))
    yield directory
    _drop_spares(directory)
    shutil.rmtree(directory, ignore_errors=True)


def _drop_spares(directory: Path) -> None:
    """Remove the spare capture files a test's DMA captures left in ``directory`` (they hold
    memory until dropped) and wait for their mappings' releases."""
    from kvsnap.store.hot.mapping_release import wait_for_releases
    from kvsnap.store.hot.spare_files import drop_spare_files

    drop_spare_files(str(directory))
    wait_for_releases()


@pytest.fixture
def mapped_from_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Map every snapshot written to a memory-backed file, however small (the production
    bound, ``tuning.MAPPED_WRITE_MIN_BYTES``, is some MiB)."""
    from kvsnap.store.base import tuning

    monkeypatch.setattr(tuning, "MAPPED_WRITE_MIN_BYTES", 0)


@pytest.fixture
def spare_capture_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spare capture files on (``tuning.SPARE_CAPTURE_FILES_BYTES``, off by default), at the
    2 GiB the design is drawn for."""
    from kvsnap.store.base import tuning

    monkeypatch.setattr(tuning, "SPARE_CAPTURE_FILES_BYTES", 2 << 30)
