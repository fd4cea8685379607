"""``kvsnap convert`` of a vLLM fs-tier namespace, on an idle and on a busy CPU.

Writes a 64 MiB namespace in vLLM 0.32's fs-tier layout (``--blocks`` block files of
``--layers`` layers, 8 KV heads of 128, bfloat16, 16 tokens a block, random KV, ``cells-nhd``
pages as ``--tp`` workers write them, named by vLLM's prefix hashes of a random prompt), then
times ``kvsnap convert`` of it in a fresh process (the conversion itself, as its ``--json``
reports it), ``--runs`` times alone and ``--runs`` times while one busy-looping process per core
runs beside it (what a serving machine's other work
does to a conversion). Torch keeps its default thread count: the point is what a user who set
nothing gets. Reports the median and fastest wall time of each and the busy/idle ratio of the
medians, beside the same ratio of a single-threaded numpy gather of 64 MiB (the control: what
the busy loops do to any work on this machine, kvsnap or not). No GPU needed. Run it with
``PYTHONPATH`` naming the tree to measure::

    PYTHONPATH=. python -m benchmarks.foreign_convert [--runs 5] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

try:
    from kvsnap.foreign.vllm_fs_config import namespace_name, prefix_hashes
except ImportError:  # a tree from before the names moved out of vllm_fs.py (a baseline run)
    from kvsnap.foreign.vllm_fs import namespace_name, prefix_hashes  # type: ignore[no-redef]

BLOCK_SIZE = 16
HEADS = 8
HEAD_DIM = 128


def write_namespace(root: Path, *, layers: int, blocks: int) -> list[int]:
    """A vLLM fs-tier namespace under ``root`` holding one prompt's ``blocks`` blocks of random
    KV; returns the prompt's token ids."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32000, size=blocks * BLOCK_SIZE).tolist()
    fields = {
        "model_name": "bench-model",
        "tokens_per_hash": BLOCK_SIZE,
        "blocks_per_file": 1,
        "tp_size": 1,
        "pp_size": 1,
        "pcp_size": 1,
        "dcp_size": 1,
        "dtype": "bfloat16",
        "kv_cache_groups": [
            {"tokens_per_block": BLOCK_SIZE, "layer_names": [f"l{i}" for i in range(layers)]}
        ],
        "inference_engine": "vllm",
    }
    namespace = root / namespace_name(fields)
    namespace.mkdir(parents=True)
    (namespace / "config.json").write_text(json.dumps(fields, indent=4))
    file_bytes = 2 * BLOCK_SIZE * HEADS * HEAD_DIM * 2 * layers
    for digest in prefix_hashes(tokens, BLOCK_SIZE):
        name = digest.hex()
        folder = namespace.with_name(f"{namespace.name}_r0") / name[:3] / f"{name[3:5]}_g0"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.bin").write_bytes(rng.bytes(file_bytes))
    model = root / "model"
    model.mkdir()
    config = {"num_attention_heads": HEADS, "num_key_value_heads": HEADS, "head_dim": HEAD_DIM}
    (model / "config.json").write_text(json.dumps(config))
    (root / "prompt.json").write_text(json.dumps(tokens))
    return tokens


def _spin(stop: Any) -> None:
    value = 0
    while not stop.is_set():
        for step in range(100_000):
            value ^= step


def time_convert(root: Path, tp: int, runs: int, *, busy: bool) -> list[float]:
    """Seconds ``runs`` fresh ``kvsnap convert`` processes of the namespace took to convert
    (their ``--json`` ``seconds``: from opening the namespace to the snapshot published; the
    interpreter's start and imports, which a busy machine slows as it slows anything, are
    left out)."""
    command = [
        sys.executable,
        "-m",
        "kvsnap.cli",
        "convert",
        str(root),
        "--tokens",
        str(root / "prompt.json"),
        "--model",
        str(root / "model"),
        "--page-order",
        "cells-nhd",
        "--tp",
        str(tp),
        "-o",
        str(root / "out.safetensors"),
        "--json",
    ]
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    stop = multiprocessing.Event()
    spinners = [
        multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
        for _ in range((os.cpu_count() or 1) if busy else 0)
    ]
    for spinner in spinners:
        spinner.start()
    try:
        times = []
        for _ in range(runs):
            done = subprocess.run(command, check=True, capture_output=True, env=env, text=True)
            times.append(float(json.loads(done.stdout)["seconds"]))
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join()
    return times


#: A single-threaded CPU-bound control of about a conversion's size: what the machine's share of
#: a core does to any work, whatever kvsnap does (64 MiB of 2-byte words gathered by index).
CONTROL = (
    "import time, numpy as np; rng = np.random.default_rng(0); "
    "words = rng.integers(0, 2**16, 32 << 20, dtype=np.uint16); "
    "index = rng.permutation(words.size); started = time.perf_counter(); "
    "words.take(index); print(time.perf_counter() - started)"
)


def time_control(runs: int, *, busy: bool) -> list[float]:
    """Seconds of ``runs`` fresh processes of the single-threaded control, alone or beside
    one busy loop per core."""
    stop = multiprocessing.Event()
    spinners = [
        multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
        for _ in range((os.cpu_count() or 1) if busy else 0)
    ]
    for spinner in spinners:
        spinner.start()
    try:
        return [
            float(
                subprocess.run(
                    [sys.executable, "-c", CONTROL], check=True, capture_output=True, text=True
                ).stdout
            )
            for _ in range(runs)
        ]
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvsnap-convert-") as scratch:
        root = Path(scratch) / "fs"
        write_namespace(root, layers=args.layers, blocks=args.blocks)
        size = sum(p.stat().st_size for p in root.rglob("*.bin"))
        load = os.getloadavg()[0]
        idle = time_convert(root, args.tp, args.runs, busy=False)
        busy = time_convert(root, args.tp, args.runs, busy=True)
        control_idle = time_control(args.runs, busy=False)
        control_busy = time_control(args.runs, busy=True)
    rows: dict[str, Any] = {
        "bytes": size,
        "cores": os.cpu_count(),
        "load_average_before": load,
        "idle_s": {"median": statistics.median(idle), "min": min(idle), "runs": idle},
        "busy_s": {"median": statistics.median(busy), "min": min(busy), "runs": busy},
        "busy_over_idle": statistics.median(busy) / statistics.median(idle),
        "control_idle_s": control_idle,
        "control_busy_s": control_busy,
        "control_busy_over_idle": statistics.median(control_busy) / statistics.median(control_idle),
    }
    print(
        f"{size / 2**20:.0f} MiB, {args.tp} workers' pages, {os.cpu_count()} cores, load "
        f"average {load:.1f} before the runs (other processes' work counts as idle)"
    )
    for name in ("idle_s", "busy_s"):
        print(
            f"  {name[:-2]:<5} median {rows[name]['median']:.2f} s, min {rows[name]['min']:.2f} s"
        )
    print(f"  busy / idle (medians): {rows['busy_over_idle']:.2f}")
    print(
        f"  single-threaded control: busy / idle {rows['control_busy_over_idle']:.2f} "
        f"(medians {statistics.median(control_idle):.2f} s and "
        f"{statistics.median(control_busy):.2f} s): the machine's own slowdown"
    )
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
