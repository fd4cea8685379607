"""The lossless speed benchmark (``benchmarks/lossless_speed.py``) run small: both sides' code
(this checkout's ``HEAD`` from ``git archive``, and the working tree) encode the captured file
to the same bytes, decode it and restore it bit for bit, and every measure is reported."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from benchmarks import lossless_speed  # after the skip: its capture needs transformers

REPO = Path(__file__).resolve().parents[2]


def _in_a_git_checkout() -> bool:
    if shutil.which("git") is None:
        return False
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True)
    return done.returncode == 0


@pytest.mark.slow  # about 10 s: three processes import torch, one builds the 8B shape
@pytest.mark.skipif(not _in_a_git_checkout(), reason="the baseline is a git archive")
def test_a_small_run_checks_both_sides_and_reports_every_measure(tmp_path, capsys) -> None:
    results = lossless_speed.main(
        [
            "--baseline",
            "HEAD",
            "--tokens",
            "64",
            "--rounds",
            "1",
            "--repeat",
            "2",
            "--dir",
            str(tmp_path),
        ]
    )
    assert results is not None
    assert results["kv_bytes"] == 64 * 32 * 2 * 8 * 128 * 2  # 64 tokens of the 8B shape
    assert results["encoded_bytes"] < results["file_bytes"]
    for side in ("baseline", "tree"):
        figures = results[side]
        assert figures["decoded_exact"] and figures["restored_exact"], side
        assert figures["encodes_to_the_same_bytes"], side
        for measure in lossless_speed.MEASURES:
            assert figures[measure]["runs"] == 1 and figures[measure]["wall_s"] > 0, measure
    assert "baseline" in results["baseline"]["kvsnap"]  # the archive's code, not the tree's
    assert results["tree"]["kvsnap"] == str(REPO / "kvsnap" / "__init__.py")
    assert list(tmp_path.iterdir()) == []  # its scratch directory removed
    capsys.readouterr()
