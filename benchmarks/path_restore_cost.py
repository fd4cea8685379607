"""Fixed cost of ``Pipeline.restore(PATH)`` per call on the host, for kvsnap source trees side by
side (e.g. a checkout of main for "before" and this tree for "after").

Each tree runs in fresh processes (``PYTHONPATH`` the tree), the trees taking turns round after
round so that the machine's load falls on both alike. A process captures one block of 16
tokens (2 layers, 2 KV heads of 64, bfloat16 normal samples, a vLLM-split cache in host
memory) to a file in ``/dev/shm``, keeps one ``kvsnap.Pipeline`` over a second cache of the
same shape, warms it, then times ``--calls`` calls of ``pipeline.restore(PATH, {"s": [1]})``:
the snapshot opened, checked, restored and closed per call, as an engine loading a small
prefix by path pays. The table gives, per tree, the median over rounds of each round's
median wall time per call, and of its CPU time per call. Where the tree reads them (not main
before 2026-12-06), the same restore of that block stored ``lossless`` and ``fp8`` is timed
too. Needs no GPU::

    python -m benchmarks.path_restore_cost [--trees DIR,DIR] [--rounds 5] [--calls 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

#: One process of one tree: argv is the work folder and the number of calls; prints one JSON
#: object. Written against kvsnap's public API only, so any tree runs it.
CHILD = r"""
import json, os, statistics, sys, time
import numpy as np, torch, kvsnap

work, calls = sys.argv[1], int(sys.argv[2])
def cache():
    return [torch.zeros(4, 2, 16, 2, 64, dtype=torch.bfloat16) for _ in range(2)]
torch.manual_seed(0)
source = cache()
for tensor in source:
    tensor.normal_()
sequence = kvsnap.SequenceBlocks("s", np.arange(16), np.array([2]))
layout = kvsnap.vllm_split_layout(source)
out = {"kvsnap": os.path.dirname(kvsnap.__file__)}
for name, compression in (("plain", None), ("lossless", "lossless"), ("fp8", "fp8")):
    path = os.path.join(work, f"{name}.safetensors")
    extra = {} if compression is None else {"compression": compression}
    kvsnap.capture(layout, [sequence], path, reproducible=True, **extra)
    target = cache()
    pipeline = kvsnap.Pipeline(kvsnap.vllm_split_layout(target))
    try:
        for _ in range(20):
            pipeline.restore(path, {"s": [1]})
    except kvsnap.KVSnapError as error:
        out[name] = {"refused": type(error).__name__}
        continue
    walls = []
    cpu = time.process_time()
    for _ in range(calls):
        started = time.perf_counter()
        pipeline.restore(path, {"s": [1]})
        walls.append(time.perf_counter() - started)
    cpu = time.process_time() - cpu
    out[name] = {"wall_us": statistics.median(walls) * 1e6, "cpu_us": cpu / calls * 1e6}
print(json.dumps(out))
"""


def run_tree(tree: Path, calls: int) -> dict[str, Any]:
    """One fresh process of ``tree``: its medians per encoding (see :data:`CHILD`)."""
    memory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=memory) as work:
        shown = subprocess.run(
            [sys.executable, "-c", CHILD, work, str(calls)],
            capture_output=True,
            text=True,
            check=True,
            cwd=work,  # not a tree: the tree on PYTHONPATH is the kvsnap imported
            env={**os.environ, "PYTHONPATH": str(tree)},
        )
    result: dict[str, Any] = json.loads(shown.stdout.strip().splitlines()[-1])
    if Path(str(result["kvsnap"])).resolve() != (tree / "kvsnap").resolve():
        raise RuntimeError(f"{tree}: imported kvsnap from {result['kvsnap']}")
    return result


def measure(trees: list[Path], rounds: int, calls: int) -> list[dict[str, Any]]:
    """Per tree, per encoding: the median over ``rounds`` of the rounds' medians."""
    runs: dict[Path, list[dict[str, Any]]] = {tree: [] for tree in trees}
    for number in range(rounds):
        order = trees if number % 2 == 0 else trees[::-1]
        for tree in order:
            runs[tree].append(run_tree(tree, calls))
    rows: list[dict[str, Any]] = []
    for tree, results in runs.items():
        for name in ("plain", "lossless", "fp8"):
            timed = [result[name] for result in results if "wall_us" in result[name]]
            row: dict[str, Any] = {"tree": str(tree), "snapshot": name, "rounds": len(timed)}
            if timed:
                for key in ("wall_us", "cpu_us"):
                    values = [float(entry[key]) for entry in timed]
                    row[key] = statistics.median(values)
                    row[f"{key}_rounds"] = values
            else:
                row["refused"] = results[0][name]["refused"]
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", default=str(REPO), help="source trees, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    trees = [Path(tree).resolve() for tree in args.trees.split(",") if tree]
    rows = measure(trees, args.rounds, args.calls)
    print(f"cores {os.cpu_count()}, load {os.getloadavg()[0]:.2f}, {args.calls} calls a round")
    print(f"{'tree':<28}{'snapshot':>10}{'wall us':>10}{'cpu us':>10}  rounds (wall us)")
    for row in rows:
        if "refused" in row:
            print(f"{row['tree'][-28:]:<28}{row['snapshot']:>10}  refused: {row['refused']}")
            continue
        spread = " ".join(f"{value:.0f}" for value in row["wall_us_rounds"])
        print(
            f"{row['tree'][-28:]:<28}{row['snapshot']:>10}{row['wall_us']:>10.1f}"
            f"{row['cpu_us']:>10.1f}  {spread}"
        )
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
