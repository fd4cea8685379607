"""A restore's device path checks every page against its signed BLAKE3 digest before the
scatter: :meth:`FusedMover.check_and_scatter <kvsnap.pipeline.fused.FusedMover.
check_and_scatter>`, the step each piece of a slot takes once it is in the device buffer, run
by Triton's interpreter on host memory (the BLAKE3 kernel and the page-copy kernel themselves;
compiled on a GPU: tests/pipeline/test_pipeline_gpu.py), in a fresh process
(tests/support/device_page_checks.py: the interpreter must be chosen before Triton is
imported).

The slot holds every page of a signed snapshot, one of them replaced by a real xxh3-64
forgery (other bytes, the same xxh3-64): the BLAKE3 check refuses it, the scatter leaves its
target untouched, and every other page lands where it belongs. The same slot checked against
its xxh3-64 (the accident check, what a reader without keys has) lets the forgery through.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_device_check_refuses_a_forged_page_and_scatters_the_rest(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.device_page_checks", str(tmp_path)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    forged = result["forged"]
    assert result["blake3"] == [0 if page == forged else 1 for page in range(len(result["blake3"]))]
    assert all(result["landed"])
    assert result["xxh3"] == [1] * len(result["xxh3"])  # the forgery passes its xxh3-64
