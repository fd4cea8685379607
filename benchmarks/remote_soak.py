"""Soak one remote tier shared by several nodes of engines, with random kills and faults.

Nodes are local stores (one directory each, bounded by ``store_capacity_bytes``); each runs
``--engines-per-node`` engine processes, and every engine of every node has the same remote
tier: a real S3-protocol server on loopback (moto, :class:`~benchmarks.s3_loopback.
LoopbackS3`) behind a fault-injecting proxy (:class:`~benchmarks.s3_loopback.FaultProxy`).
An engine is the connector's own scheduler and worker code without vLLM, as in
``benchmarks/store_soak.py`` (:class:`~benchmarks.store_soak.Engine`): it serves random prompts
of a shared pool, asking the scheduler again every millisecond while it answers "not yet" (a
remote lookup in flight), loads what it matched (every loaded block compared bit-exact with
the prompt's reference KV), computes the rest and saves what the store lacks, which its worker
then uploads. Every chunk is signed; the remote lookups have a deadline of ``--deadline-s``.

Meanwhile this process samples each node's local store size (under its commit lock), SIGKILLs
a random engine every ``--kill-every`` seconds (mid-save, mid-fetch or mid-upload as it comes)
and starts another on the same node, and with ``--faults`` switches the proxy every
``--fault-every`` seconds to one of: no fault, slow answers (past the deadline), 500, 503
``SlowDown``, 403, bodies cut short, connections dropped, the port closed.

At the end the engines are stopped (SIGTERM: each drains its saves and uploads), the proxy's
faults are cleared, and every object in the bucket is read and checked as ``kvsnap store
verify`` does (signature, structure, checksums, its name). The report (stdout, and JSON in
``$OUT/remote_soak.json``) holds ``wrong_kv`` and ``failed_loads`` (must be 0),
``engine_crashes`` (engines that exited other than by this process's signals: must be 0),
``bad_objects`` (objects that are not a whole, valid chunk of their name: must be 0),
``incomplete_uploads`` (multipart uploads left open: must be 0), ``max_over_bound_chunks``
per node (at most 1), ``temp_files_left``, and the counts that show it did something:
cross-node fetches, uploads, kills, faults.

    python -m benchmarks.remote_soak                                  # 2 nodes x 4, 120 s
    python -m benchmarks.remote_soak --duration 10 --kill-every 2 --faults
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import store_soak
from benchmarks.s3_loopback import Fault, FaultProxy, LoopbackS3

#: Faults the proxy cycles through with ``--faults`` (name -> rules; ``None``: port closed).
FAULTS: dict[str, list[Fault] | None] = {
    "none": [],
    "slow": [Fault(delay_s=1.5)],
    "500": [Fault(status=500)],
    "503": [Fault(status=503, code="SlowDown")],
    "403": [Fault(status=403, code="AccessDenied")],
    "truncate": [Fault(method="GET", truncate=True)],
    "drop": [Fault(drop=True)],
    "down": None,
}
_COUNTS = (*store_soak._COUNTS, "fetched", "uploads", "remote_lookups", "remote_failures")


def run_engine(args: argparse.Namespace) -> None:
    """An engine process: serve random prompts until SIGTERM, writing its counts after each."""
    from kvsnap.store.files import publish
    from kvsnap.store.files.keys import load_key_ring

    def make_engine() -> store_soak.Engine:
        extra = {
            "remote_url": args.remote_url,
            "remote_deadline_s": args.deadline_s,
            "remote_fetches": 4,
            "remote_max_uploads": 2,
        }
        keys = load_key_ring([args.key_file])
        return store_soak.Engine(
            args.store, args.capacity, "fail", 8, args.min_idle_s, extra=extra, keys=keys
        )

    counts = dict.fromkeys(_COUNTS, 0)
    engine = store_soak.serve_until_stopped(make_engine, args, counts, _merge_event_counts)
    engine.scheduler.shutdown()
    _merge_event_counts(engine, counts)
    publish.publish_bytes(args.counts, json.dumps(counts).encode())


def _merge_event_counts(engine: store_soak.Engine, counts: dict[str, int]) -> None:
    scheduler, worker = engine.scheduler_events.counts, engine.events.counts
    counts["evictions"] = worker.get("evict", 0) + scheduler.get("evict", 0)
    counts["fetched"] = scheduler.get("fetch", 0)
    counts["remote_lookups"] = scheduler.get("remote_lookup", 0)
    counts["uploads"] = worker.get("upload", 0)
    remote = engine.scheduler.remote
    uploader = engine.worker._saves.uploader if engine.worker._saves is not None else None
    counts["remote_failures"] = 0
    for role, health in (
        ("fetch", remote and remote.health),
        ("upload", uploader and uploader.health),
    ):
        for kind, count in (health.counts if health else {}).items():
            counts[f"{role}_failed_{kind}"] = count
            counts["remote_failures"] += count


def _spawn(args: argparse.Namespace, node: int, counts: Path, env: dict[str, str]) -> Any:
    store = args.work / f"node{node}" / "store"
    command = [sys.executable, "-m", "benchmarks.remote_soak", "--engine", "--counts", str(counts)]
    command += ["--store", str(store), "--capacity", str(args.capacity)]
    command += ["--seed", str(args.seed), "--prompts", str(args.prompts)]
    command += ["--min-idle-s", str(args.min_idle_s), "--think-s", str(args.think_s)]
    command += ["--remote-url", args.remote_url, "--key-file", str(args.key_file)]
    command += ["--deadline-s", str(args.deadline_s)]
    log = counts.with_suffix(".log").open("wb")
    return subprocess.Popen(
        command,
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _check_bucket(s3: LoopbackS3, url: str, key_file: Path, env: dict[str, str]) -> dict[str, int]:
    """Every object under ``url`` checked by ``kvsnap store verify URL`` (signature,
    structure, checksums, name), and the multipart uploads left open."""
    command = [sys.executable, "-m", "kvsnap.cli", "store", "verify", url, "--json"]
    command += ["--key-file", str(key_file)]
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, check=False)
    report = json.loads(done.stdout)
    fs = s3.filesystem()
    uploads = fs.call_s3("list_multipart_uploads", Bucket=s3.bucket).get("Uploads") or []
    return {
        "objects_checked": report["checked"],
        "bad_objects": report["bad"],
        "other_objects": sum(not entry["checked"] for entry in report["entries"]),
        "incomplete_uploads": len(uploads),
    }


class _Faults:
    """The proxy's fault, switched at random every ``every`` seconds."""

    def __init__(self, proxy: FaultProxy, every: float, rng: random.Random) -> None:
        self.proxy, self.every, self.rng = proxy, every, rng
        self.switches: dict[str, int] = {}
        self.current = "none"
        self.next_at = time.monotonic() + every

    def tick(self) -> None:
        if time.monotonic() < self.next_at:
            return
        self.next_at += self.every
        self.set(self.rng.choice(list(FAULTS)))

    def set(self, name: str) -> None:
        if self.current == "down":
            self.proxy.start()
        rules = FAULTS[name]
        if rules is None:
            self.proxy.set_faults()
            self.proxy.stop()
        else:
            self.proxy.set_faults(*[Fault(**vars(rule)) for rule in rules])
        self.current = name
        self.switches[name] = self.switches.get(name, 0) + 1


def _sample(nodes: int, work: Path, capacity: int, over: list[int]) -> None:
    """Each node's store size above its bound, the largest seen kept in ``over``."""
    from kvsnap.engines.vllm.capacity import capacity_lock
    from kvsnap.engines.vllm.eviction import store_bytes

    for node in range(nodes):
        store = work / f"node{node}" / "store"
        with capacity_lock(store):  # a consistent view: no commit or prune midway
            over[node] = max(over[node], store_bytes(store) - capacity)


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Run the soak; the report."""
    from kvsnap.engines.vllm.eviction import prune_store
    from kvsnap.store.files.keys import load_key_ring, new_key_text

    s3 = LoopbackS3("kvsnap-soak")
    proxy = FaultProxy(s3.port)
    args.key_file = args.work / "key"
    args.key_file.write_text(new_key_text())
    args.key_file.chmod(0o600)
    args.remote_url = f"s3://{s3.bucket}/tier"
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, **s3.client_environment(proxy.endpoint), "PYTHONPATH": path}
    for node in range(args.nodes):
        (args.work / f"node{node}" / "store").mkdir(parents=True, mode=0o700)
    chunk = store_soak.chunk_bytes(args.work, load_key_ring([args.key_file]))
    args.capacity = args.capacity_chunks * chunk
    counts_dir = args.work / "counts"
    counts_dir.mkdir()
    engines: dict[int, tuple[int, Any]] = {}
    for index in range(args.nodes * args.engines_per_node):
        node = index % args.nodes
        engines[index] = (node, _spawn(args, node, counts_dir / f"{index}.json", env))
    ready_by = time.monotonic() + 300
    while len(list(counts_dir.glob("*.json"))) < len(engines) and time.monotonic() < ready_by:
        time.sleep(0.05)
    rng = random.Random(args.seed)
    faults = _Faults(proxy, args.fault_every, rng)
    next_id, kills, crashes, samples = len(engines), 0, 0, 0
    over = [0] * args.nodes
    started = time.monotonic()
    next_kill = started + args.kill_every
    while time.monotonic() - started < args.duration:
        _sample(args.nodes, args.work, args.capacity, over)
        samples += 1
        if args.faults:
            faults.tick()
        for index, (node, process) in list(engines.items()):
            if process.poll() is not None:  # died of itself: a crash
                crashes += 1
                engines[next_id] = (node, _spawn(args, node, counts_dir / f"{next_id}.json", env))
                next_id += 1
                del engines[index]
        ready = [index for index in engines if (counts_dir / f"{index}.json").exists()]
        if time.monotonic() >= next_kill and ready:
            victim = rng.choice(ready)  # one serving requests, not one still importing
            node, killed = engines.pop(victim)
            killed.send_signal(signal.SIGKILL)
            killed.wait()
            kills += 1
            engines[next_id] = (node, _spawn(args, node, counts_dir / f"{next_id}.json", env))
            next_id += 1
            next_kill += args.kill_every
        time.sleep(0.005)
    faults.set("none")  # the engines' last uploads, and the check, against a healthy server
    ready_by = time.monotonic() + 300  # an engine stops cleanly once it serves
    while not all((counts_dir / f"{i}.json").exists() for i in engines):
        if time.monotonic() > ready_by:
            break
        time.sleep(0.05)
    for _, process in engines.values():
        process.send_signal(signal.SIGTERM)
    for _, process in engines.values():
        crashes += process.wait(timeout=180) != 0
    temps_before = sum(
        len(store_soak._temp_files(args.work / f"node{n}")) for n in range(args.nodes)
    )
    for node in range(args.nodes):
        prune_store(args.work / f"node{node}" / "store", args.capacity, min_idle_s=0)
    totals = store_soak.total_counts(counts_dir, _COUNTS)
    bucket = _check_bucket(s3, args.remote_url, args.key_file, env)
    proxy.stop()
    s3.stop()
    return {
        "nodes": args.nodes,
        "engines_per_node": args.engines_per_node,
        "duration_s": args.duration,
        "chunk_bytes": chunk,
        "capacity_chunks": args.capacity_chunks,
        "engines_started": next_id,
        "kills": kills,
        "engine_crashes": crashes,
        "fault_switches": faults.switches,
        "samples": samples,
        "max_over_bound_chunks": [round(max(o, 0) / chunk, 3) for o in over],
        "temp_files_left_by_killed_writers": temps_before,
        "temp_files_left": sum(
            len(store_soak._temp_files(args.work / f"node{n}")) for n in range(args.nodes)
        ),
        "proxy_requests": dict(proxy.requests),
        **bucket,
        **totals,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--engines-per-node", type=int, default=4)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds")
    parser.add_argument("--kill-every", type=float, default=2.0, help="seconds between kills")
    parser.add_argument("--faults", action="store_true", help="switch proxy faults at random")
    parser.add_argument("--fault-every", type=float, default=1.5, help="seconds per fault")
    parser.add_argument("--deadline-s", type=float, default=0.5, help="remote_deadline_s")
    parser.add_argument("--capacity-chunks", type=int, default=64, help="per node")
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--min-idle-s", type=float, default=0.1)
    parser.add_argument("--think-s", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=41)
    parser.add_argument("--work", type=Path, default=None, help="directory (default: a temp)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--counts", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--capacity", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--remote-url", help=argparse.SUPPRESS)
    parser.add_argument("--key-file", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.engine:
        run_engine(args)
        return {}
    with tempfile.TemporaryDirectory() as scratch:
        args.work = args.work or Path(scratch)
        report = soak(args)
    print(json.dumps(report, indent=2))
    out = args.out or Path(os.environ.get("OUT", ".")) / "remote_soak.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
