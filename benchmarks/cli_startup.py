"""How long the ``kvsnap`` command line takes to start and finish a light command.

Runs each command as a fresh process (``python -m kvsnap.cli ...``, what the ``kvsnap`` script
runs) ``--runs`` times and reports the median and the fastest wall time and the median CPU time
(user + system, of the child: what a busy machine inflates least), plus the bare interpreter's
start (``python -c pass``) as the floor. The commands: ``--version``, ``--help``, ``inspect``
and ``verify`` of a small synthetic snapshot (written once, first), ``inspect`` of a vLLM fs-tier
namespace (the tree's ``fixtures/foreign/vllm-fs``), and ``capture`` of the built-in model for
comparison (it needs torch and transformers). Works on any machine, no GPU
needed. Run it from outside the source tree (``python -m`` puts the working directory first on
the path), with ``PYTHONPATH`` naming the tree to measure::

    python -m benchmarks.cli_startup [--runs 10] [--json-out FILE]

Where a command's time goes: ``python -X importtime -m kvsnap.cli COMMAND`` lists every import
with its cumulative microseconds.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: What each case runs after the interpreter; ``{snapshot}``/``{out}`` are filled in.
CASES: dict[str, list[str]] = {
    "python -c pass": ["-c", "pass"],
    "kvsnap --version": ["-m", "kvsnap.cli", "--version"],
    "kvsnap --help": ["-m", "kvsnap.cli", "--help"],
    "kvsnap inspect": ["-m", "kvsnap.cli", "inspect", "{snapshot}"],
    "kvsnap verify": ["-m", "kvsnap.cli", "verify", "{snapshot}"],
    "kvsnap inspect vllm-fs": ["-m", "kvsnap.cli", "inspect", "{vllm_fs}"],
    "kvsnap capture": ["-m", "kvsnap.cli", "capture", "-o", "{out}", "--json"],
}


#: A vLLM fs-tier namespace vLLM wrote (fixtures/foreign/vllm-fs: 3 blocks of a tiny model).
VLLM_FS_NAMESPACE = str(
    next(
        (Path(__file__).resolve().parents[1] / "fixtures/foreign/vllm-fs/tp1/fs").glob(
            "*/config.json"
        )
    ).parent
)


def time_runs(arguments: list[str], runs: int) -> tuple[list[float], list[float]]:
    """Wall and CPU (user + system) seconds of ``runs`` fresh processes ``python ARGUMENTS``
    (each must exit 0)."""
    wall, cpu = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        subprocess.run([sys.executable, *arguments], check=True, capture_output=True)
        wall.append(time.perf_counter() - started)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return wall, cpu


def measure(runs: int, capture_runs: int) -> list[dict[str, object]]:
    """One row per case: median and fastest wall seconds over its runs."""
    with tempfile.TemporaryDirectory(prefix="kvsnap-startup-") as scratch:
        snapshot = str(Path(scratch) / "fixture.safetensors")
        out = str(Path(scratch) / "captured.safetensors")
        subprocess.run(
            [sys.executable, "-m", "kvsnap.cli", "fixture", snapshot],
            check=True,
            capture_output=True,
        )
        rows = []
        for name, template in CASES.items():
            arguments = [
                part.format(snapshot=snapshot, out=out, vllm_fs=VLLM_FS_NAMESPACE)
                for part in template
            ]
            count = capture_runs if name == "kvsnap capture" else runs
            seconds, cpu = time_runs(arguments, count)
            rows.append(
                {
                    "command": name,
                    "runs": count,
                    "median_s": round(statistics.median(seconds), 4),
                    "min_s": round(min(seconds), 4),
                    "median_cpu_s": round(statistics.median(cpu), 4),
                }
            )
            print(
                f"{name:<22} median {statistics.median(seconds):6.3f} s   "
                f"fastest {min(seconds):6.3f} s   CPU {statistics.median(cpu):6.3f} s   "
                f"({count} runs)",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="processes per light command")
    parser.add_argument("--capture-runs", type=int, default=3, help="processes of capture")
    parser.add_argument("--json-out", type=Path, help="also write the rows as JSON here")
    options = parser.parse_args()
    rows = measure(options.runs, options.capture_runs)
    if options.json_out is not None:
        options.json_out.write_text(json.dumps({"python": sys.version, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
