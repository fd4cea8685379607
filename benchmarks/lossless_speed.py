"""The lossless encoding's speed on this machine, the code of a git ref and of this tree side by
side (issue 39: decode >= 1 GB/s of output with both cores, encode >= 300 MB/s, and a
page-cached file never slower to restore lossless than raw).

``python -m benchmarks.lossless_speed --baseline main --json-out out/lossless_speed.json``
captures the bf16 KV of a prefill of ``--tokens`` tokens of the 8B shape with random weights
(benchmarks/encoded_files.py's capture: a vLLM-shaped cache into a snapshot file), then runs one
fresh process per side and round, the sides alternating (baseline, tree, tree, baseline, ...),
``--rounds`` rounds. The baseline is ``git archive`` of ``--baseline``'s ``kvsnap/`` in a
temporary directory, first on that process's path: the same measuring code imports either. Each
process measures, ``--repeat`` times each, wall and process CPU seconds (all threads):

* ``encode_codec``: ``lossless.encode_pages`` of every layer tensor on a 2-thread pool, one
  tensor after the other, as ``encode_file`` calls it;
* ``encode_file``: ``kvsnap.encoded.write.encode_file`` of the captured file (read, check,
  encode, write, fsync);
* ``decode_1t`` / ``decode_2t``: ``kvsnap.encoded.read.decode`` of the baseline's lossless file
  (its container checked first, not timed), without and with a 2-thread executor (the one
  ``Snapshot.open`` uses);
* the other parts of an open, alone: ``read_file`` (``read_local`` of the encoded file),
  ``check_container`` (``parse_encoded``: the trailer over every stored byte), ``copy_decoded``
  (the decoded bytes copied into a ``bytes``: what an open cost when it put them into an
  fsspec memory file, before 2026-12-06; since then the readers serve the decoded array) and
  ``restore_open`` (a restore of every block from the open snapshot into a CPU cache);
* ``open`` / ``open_restore``: ``Snapshot.open`` of the lossless file (which reads, checks and
  decodes it), and that plus the restore; ``raw_restore_open`` / ``raw_open_restore``: the same
  of the ordinary file.

Rates are of the decoded (ordinary) file's bytes, the encodes' of the KV, ``read_file`` and
``check_container``'s of the encoded file.

The first run of each measure in a process is reported apart (``first``): on this VM, memory a
process touches for the first time costs far more than memory it touched before. The rest are
pooled over the rounds (medians). The load average before each process is recorded: the VM is
shared, so the CPU seconds are what compare when it is loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MEASURES = (
    "encode_codec",
    "encode_file",
    "decode_1t",
    "decode_2t",
    "read_file",
    "check_container",
    "copy_decoded",
    "open",
    "restore_open",
    "open_restore",
    "raw_restore_open",
    "raw_open_restore",
)


def _cpu_ticks() -> tuple[int, int]:
    """(idle, total) ticks of the machine's CPUs so far (/proc/stat)."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:]]
    return values[3] + values[4], sum(values)


def _timed(run: Callable[[], object], repeat: int) -> list[tuple[float, float, float]]:
    """(wall seconds, process CPU seconds, the machine's idle share) of ``repeat`` runs."""
    times = []
    for _ in range(repeat):
        idle, total = _cpu_ticks()
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        idle_after, total_after = _cpu_ticks()
        times.append((wall, cpu, (idle_after - idle) / max(total_after - total, 1)))
    return times


def _target_cache(snapshot):
    import torch

    from kvsnap.layout.allocate import allocate_cache

    geometry = snapshot.geometry
    return allocate_cache(
        "vllm-nhd",
        num_layers=geometry.num_layers,
        num_blocks=snapshot.num_blocks,
        block_size=geometry.block_size,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        dtype=torch.bfloat16,
        device="cpu",
    )


def worker(source: Path, encoded: Path, scratch: Path, repeat: int) -> dict:
    """The measures of one process (see the module), with whichever ``kvsnap`` is first on the
    path."""
    import kvsnap

    times, facts = _codec_times(source, encoded, scratch, repeat)
    times.update(_open_times(source, encoded, repeat, facts))
    return {**facts, "times": times, "kvsnap": kvsnap.__file__}


def _codec_times(source: Path, encoded: Path, scratch: Path, repeat: int) -> tuple[dict, dict]:
    from kvsnap.encoded.original import parse_original, read_local
    from kvsnap.encoded.read import decode, parse_encoded
    from kvsnap.encoded.write import encode_file
    from kvsnap.encoding import lossless

    original = parse_original(read_local(source), str(source))
    tensors = [np.ascontiguousarray(original.pages(e)) for e in original.layer_entries]
    times: dict[str, list] = {}
    with ThreadPoolExecutor(2) as pool:
        times["encode_codec"] = _timed(
            lambda: [lossless.encode_pages(t, 2, executor=pool) for t in tensors], repeat
        )
        written = scratch / f"encoded-{os.getpid()}.safetensors"
        times["encode_file"] = _timed(lambda: encode_file(source, written, "lossless"), repeat)
        times["read_file"] = _timed(lambda: read_local(encoded), repeat)
        data = read_local(encoded)
        times["check_container"] = _timed(lambda: parse_encoded(data, str(encoded)), repeat)
        checked = parse_encoded(data, str(encoded))
        times["decode_1t"] = _timed(lambda: decode(checked), repeat)
        times["decode_2t"] = _timed(lambda: decode(checked, pool), repeat)
        decoded = decode(checked, pool)
    # What opening an encoded file did with the decoded bytes before 2026-12-06: a copy into a
    # memory file (a baseline from before then still does).
    times["copy_decoded"] = _timed(lambda: np.ascontiguousarray(decoded).tobytes(), repeat)
    facts = {
        "decoded_exact": bool(np.array_equal(decoded, read_local(source))),
        "encodes_to_the_same_bytes": written.read_bytes() == encoded.read_bytes(),
        "kv_bytes": sum(t.nbytes for t in tensors),
        "file_bytes": source.stat().st_size,
    }
    written.unlink()
    return times, facts


def _open_times(source: Path, encoded: Path, repeat: int, facts: dict) -> dict:
    import torch

    import kvsnap

    with kvsnap.Snapshot.open(source) as snapshot:
        cache = _target_cache(snapshot)
        ids = {record.id: record.block_ids for record in snapshot.sequences}

    def open_restore(path: Path) -> None:
        with kvsnap.Snapshot.open(path) as snapshot:
            snapshot.restore(cache.layout, ids)

    times = {"open": _timed(lambda: kvsnap.Snapshot.open(encoded).close(), repeat)}
    for name, path in (("raw_", source), ("", encoded)):
        with kvsnap.Snapshot.open(path) as snapshot:
            times[f"{name}restore_open"] = _timed(
                lambda s=snapshot: s.restore(cache.layout, ids), repeat
            )
    times["raw_open_restore"] = _timed(lambda: open_restore(source), repeat)
    want = {name: view.clone() for name, view in cache.views.items()}
    for view in cache.views.values():
        view.zero_()
    times["open_restore"] = _timed(lambda: open_restore(encoded), repeat)
    facts["restored_exact"] = all(  # bit for bit (an equal of bf16 values fails on a NaN)
        view.view(torch.int16).equal(want[name].view(torch.int16))
        for name, view in cache.views.items()
    )
    return times


def capture_source(directory: Path, tokens: int) -> Path:
    """The 8B shape's KV of a ``tokens``-token prefill captured into a snapshot file."""
    import torch

    import kvsnap
    from benchmarks.encoded_files import BLOCK, filled_cache, prefill_pages

    torch.set_num_threads(1)
    pages = prefill_pages("8b-shape", tokens, "cpu")
    cache = filled_cache(pages, "cpu")
    blocks = next(iter(pages.values())).shape[0]
    source = directory / "8b-shape.safetensors"
    sequence = kvsnap.SequenceBlocks("s", np.arange(blocks * BLOCK), np.arange(blocks))
    kvsnap.capture(cache.layout, [sequence], source)
    return source


def _commit(ref: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", ref], check=True, capture_output=True, text=True
    )
    return done.stdout.strip()


def _baseline_tree(commit: str, directory: Path) -> Path:
    tree = directory / "baseline"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", commit, "kvsnap"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


def _python(tree: Path, arguments: list[str], directory: Path) -> str:
    """stdout of ``python ARGUMENTS`` with ``tree``'s ``kvsnap`` first on the path (run from
    ``directory``, which holds none: a ``-m`` run puts its working directory first)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(REPO)]))
    done = subprocess.run(
        [sys.executable, *arguments],
        env=env,
        cwd=directory,
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout


#: What each measure's rate is of: the KV encoded, the encoded file read and checked, else the
#: decoded (ordinary) file.
RATE_OF = {"encode_codec": "kv", "encode_file": "kv", "read_file": "encoded"}
RATE_OF["check_container"] = "encoded"


def _summary(runs: list[dict], sizes: dict[str, int]) -> dict:
    """Medians per measure of the runs after each process's first, and of the first runs."""
    result: dict = {}
    for measure in MEASURES:
        later = [t for run in runs for t in run["times"][measure][1:]]
        first = [run["times"][measure][0] for run in runs]
        size = sizes[RATE_OF.get(measure, "decoded")]
        wall = statistics.median(t[0] for t in later)
        cpu = statistics.median(t[1] for t in later)
        result[measure] = {
            "wall_s": wall,
            "cpu_s": cpu,
            "gbs_wall": size / wall / 1e9,
            "gbs_per_cpu_s": size / cpu / 1e9,
            "first_wall_s": statistics.median(t[0] for t in first),
            "first_cpu_s": statistics.median(t[1] for t in first),
            "machine_idle_share": statistics.median(t[2] for t in later),
            "runs": len(later),
        }
    return result


def _alternate(
    trees: dict[str, Path], worker: list[str], directory: Path, rounds: int
) -> tuple[dict[str, list], list[float]]:
    """Each side's worker results over ``rounds`` rounds (baseline, tree, tree, baseline, ...),
    and the load average before each process."""
    runs: dict[str, list] = {"baseline": [], "tree": []}
    loads = []
    order = ["baseline", "tree"]
    for round_index in range(rounds):
        for side in order if round_index % 2 == 0 else order[::-1]:
            loads.append(os.getloadavg()[0])
            command = ["-m", "benchmarks.lossless_speed", "--worker", *worker]
            output = _python(trees[side], command, directory)
            runs[side].append(json.loads(output.strip().splitlines()[-1]))
            print(side, "round", round_index, "load", loads[-1], file=sys.stderr)
    return runs, loads


def compare(args: argparse.Namespace) -> dict:
    base = args.dir or Path(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(dir=base, prefix="kvsnap-lossless-") as scratch:
        directory = Path(scratch)
        source = capture_source(directory, args.tokens)
        baseline = _commit(args.baseline)
        trees = {"baseline": _baseline_tree(baseline, directory), "tree": REPO}
        encoded = directory / "8b-shape.lossless.safetensors"
        encode = f"encode_file({str(source)!r}, {str(encoded)!r}, 'lossless')"
        _python(
            trees["baseline"],
            ["-c", f"from kvsnap.encoded.write import encode_file; {encode}"],
            directory,
        )
        worker = [str(source), str(encoded), str(directory), str(args.repeat)]
        runs, loads = _alternate(trees, worker, directory, args.rounds)
        decoded_bytes = runs["tree"][0]["file_bytes"]
        kv_bytes = runs["tree"][0]["kv_bytes"]
        results: dict = {
            "baseline_ref": args.baseline,
            "baseline_commit": baseline,
            "tree_commit": _commit("HEAD"),
            "tree_changed": bool(
                subprocess.run(
                    ["git", "-C", str(REPO), "status", "--porcelain", "kvsnap"],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout.strip()
            ),
            "tokens": args.tokens,
            "kv_bytes": kv_bytes,
            "file_bytes": decoded_bytes,
            "encoded_bytes": encoded.stat().st_size,
            "rounds": args.rounds,
            "repeat": args.repeat,
            "load_average": {
                "min": min(loads),
                "median": statistics.median(loads),
                "max": max(loads),
            },
            "cpus": os.cpu_count(),
        }
        sizes = {"kv": kv_bytes, "decoded": decoded_bytes, "encoded": encoded.stat().st_size}
        for side, side_runs in runs.items():
            results[side] = _summary(side_runs, sizes)
            results[side]["times"] = [run["times"] for run in side_runs]
            results[side]["kvsnap"] = side_runs[0]["kvsnap"]
            results[side]["decoded_exact"] = all(r["decoded_exact"] for r in side_runs)
            results[side]["restored_exact"] = all(r["restored_exact"] for r in side_runs)
            results[side]["encodes_to_the_same_bytes"] = all(
                r["encodes_to_the_same_bytes"] for r in side_runs
            )
        results["tree_over_baseline_wall"] = {
            m: results["tree"][m]["wall_s"] / results["baseline"][m]["wall_s"] for m in MEASURES
        }
    return results


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="main", help="git ref of the code to compare with")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--worker", nargs=4, metavar=("SOURCE", "ENCODED", "DIR", "REPEAT"))
    args = parser.parse_args(argv)
    if args.worker:
        source, encoded, directory, repeat = args.worker
        print(json.dumps(worker(Path(source), Path(encoded), Path(directory), int(repeat))))
        return None
    results = compare(args)
    text = json.dumps(results, indent=1)
    print(text)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(text)
    return results


if __name__ == "__main__":
    main()
