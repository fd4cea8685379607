"""How fast ``kvsnap inspect --stats`` and ``kvsnap diff`` read a large snapshot, and in how
much memory: wall time, CPU time and peak RSS of each command, run as a fresh process from a
source tree (this one, or ``--tree`` another, e.g. a checkout of main for "before").

Two synthetic snapshots of about ``--gib`` GiB each (bfloat16, 32 layers, 8 KV heads of 128,
two sequences; ``kvsnap fixture`` with seeds 1 and 2: other KV everywhere, so the comparison
has every element to measure) are written once into ``--work`` and read once before the
runs, so that they are in the page cache: the figures are the tool's, not the disk's. Each
command runs ``--runs`` times; the table gives the median and fastest wall time, the median
CPU time (user + system) and the largest peak RSS, and MB/s per snapshot (its bytes over the
wall time). A tree without ``kvsnap diff`` (main before issue 38) is measured with the
comparison it had, ``kvsnap verify A --against B``. Needs no GPU::

    python -m benchmarks.analysis_speed [--gib 1] [--runs 3] [--tree DIR] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Tokens per GiB of the fixture's shape (32 layers x K and V x 8 heads x 128 x 2 bytes).
TOKENS_PER_GIB = 8192
SHAPE = ["--layers", "32", "--heads", "8", "--head-dim", "128", "--dtype", "bfloat16"]


def _cli(tree: Path, *arguments: str) -> list[str]:
    return [sys.executable, "-m", "cli", *arguments] if (tree / "cli").is_dir() else []


def snapshots(work: Path, gib: float) -> tuple[Path, Path]:
    """The two snapshots of about ``gib`` GiB each, written by this tree's ``kvsnap fixture``
    (the same bytes on every machine) unless already there."""
    tokens = max(32, int(TOKENS_PER_GIB * gib) // 32 * 16)  # two sequences, whole blocks
    paths = []
    for seed in (1, 2):
        path = work / f"kv-{gib:g}gib-seed{seed}.safetensors"
        if not path.exists():
            lengths = f"{tokens},{tokens}"
            command = [*_cli(REPO, "fixture", str(path), "--lengths", lengths), *SHAPE]
            command += ["--seed", str(seed), "--json"]
            subprocess.run(command, check=True, capture_output=True, cwd=REPO, env=_env(REPO))
        paths.append(path)
    return paths[0], paths[1]


def _env(tree: Path) -> dict[str, str]:
    # The tree measured comes first; what the caller's path adds (a folder of wheels installed
    # with --target, say) stays after it.
    inherited = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), inherited]))}


def _warm(*paths: Path) -> None:
    """Read every byte once: the runs find the files in the page cache."""
    for path in paths:
        with path.open("rb") as file:
            while file.read(64 << 20):
                pass


def run_once(tree: Path, arguments: list[str]) -> dict[str, float]:
    """One fresh process of ``kvsnap ARGUMENTS`` from ``tree``: wall and CPU seconds, peak RSS
    (the child's ``ru_maxrss``, measured by a wrapper process of its own)."""
    wrapper = (
        "import resource, subprocess, sys\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True)\n"
        "usage = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "print(done.returncode, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime)\n"
    )
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", wrapper, *_cli(tree, *arguments)],
        capture_output=True,
        text=True,
        cwd=tree,
        env=_env(tree),
        check=True,
    )
    wall = time.perf_counter() - started
    code, peak, cpu = done.stdout.split()
    if int(code) not in (0, 1):  # 1: a comparison that found differences
        raise RuntimeError(f"kvsnap {' '.join(arguments)} exited {code}")
    return {"wall_s": wall, "cpu_s": float(cpu), "peak_rss_bytes": int(peak)}


def measure(tree: Path, first: Path, second: Path, runs: int) -> list[dict[str, object]]:
    """A row per command: its runs' median and fastest wall time, CPU time, peak RSS, MB/s."""
    has_diff = (tree / "cli" / "diff.py").is_file()
    compare = (
        ["diff", str(first), str(second)]
        if has_diff
        else [
            "verify",
            str(first),
            "--against",
            str(second),
        ]
    )
    cases = {"inspect --stats": ["inspect", str(first), "--stats", "--json"]}
    cases["diff" if has_diff else "verify --against"] = [*compare, "--json"]
    rows = []
    for name, arguments in cases.items():
        _warm(first, second)
        results = [run_once(tree, arguments) for _ in range(runs)]
        walls = [result["wall_s"] for result in results]
        size = first.stat().st_size
        rows.append(
            {
                "command": name,
                "snapshot_bytes": size,
                "runs": runs,
                "wall_s_median": statistics.median(walls),
                "wall_s_min": min(walls),
                "cpu_s_median": statistics.median(result["cpu_s"] for result in results),
                "peak_rss_mib": max(result["peak_rss_bytes"] for result in results) / (1 << 20),
                "mb_per_s_per_snapshot": size / statistics.median(walls) / 1e6,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of each snapshot")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tree", type=Path, default=REPO, help="the source tree to measure")
    parser.add_argument("--work", type=Path, default=Path("/tmp/kvsnap-analysis-speed"))
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    first, second = snapshots(args.work, args.gib)
    rows = measure(args.tree.resolve(), first, second, args.runs)
    print(f"tree {args.tree.resolve()}, cores {os.cpu_count()}, load {os.getloadavg()[0]:.2f}")
    print(f"{'command':<18}{'GiB':>6}{'wall s (min)':>16}{'cpu s':>8}{'peak RSS':>12}{'MB/s':>8}")
    for row in rows:
        print(
            f"{row['command']:<18}{row['snapshot_bytes'] / (1 << 30):>6.2f}"
            f"{row['wall_s_median']:>9.2f} ({row['wall_s_min']:.2f}){row['cpu_s_median']:>8.2f}"
            f"{row['peak_rss_mib']:>9.0f} MiB{row['mb_per_s_per_snapshot']:>8.0f}"
        )
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
