"""Soak one prefix store shared by many engines at its capacity bound, killing engines at random.

Each engine is a process running the connector's own scheduler and worker code without vLLM
(:class:`~kvsnap.engines.vllm.scheduler.KVSnapScheduler` matching, checking and touching
chunks and planning loads and saves; :class:`~kvsnap.engines.vllm.worker.KVSnapWorker`
loading them into, and saving them from, a random ``FLASH_ATTN``-shaped cache on the CPU, and
committing each chunk within ``store_capacity_bytes``). In a loop it takes a random prompt of
a shared pool (prompts share system prefixes), matches it, loads the matched blocks, compares
every loaded block bit-exact with the prompt's reference KV (a function of the prompt's tokens
up to that block), "computes" the rest and saves what the store lacks. Meanwhile this process
samples the store's size (:func:`~kvsnap.engines.vllm.eviction.store_bytes`, under the
store's commit lock so that each sample is a consistent view) every few milliseconds,
SIGKILLs a random engine every ``--kill-every`` seconds and starts a new one.

At the end the engines are stopped (SIGTERM: each drains its writes), the temporary files
left by killed writers are counted, then one more prune (what any engine's next commit does)
runs and they are counted again. The report (stdout, and JSON in ``$OUT/store_soak.json``)
holds ``wrong_kv`` (loaded blocks that differ from the reference: must be 0), ``failed_loads``
(loads whose blocks were reported failed, a failed request under vLLM's default policy:
must be 0), ``max_over_bound_chunks`` (the largest sample above the bound, in chunks: at most
1; pruning keeps chunks used in the last ``store_min_idle_s``, so a working set that large can
exceed it), ``temp_files_left``, and the
counts that show it did something (loads, saves, evictions, kills).

    python -m benchmarks.store_soak                                   # 16 engines, 180 s
    python -m benchmarks.store_soak --processes 4 --duration 5 --kill-every 1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import xxhash

from kvsnap import format as fmt
from kvsnap.engines.vllm import ChunkChecker, ConnectorOptions, EventLog, PrefixStore
from kvsnap.engines.vllm.capacity import capacity_lock
from kvsnap.engines.vllm.eviction import STAGE_MARKER, prune_store, store_bytes
from kvsnap.engines.vllm.registration import registered_cache
from kvsnap.engines.vllm.remote_tier import check_remote_options, remote_fetcher
from kvsnap.engines.vllm.scheduler import KVSnapScheduler
from kvsnap.engines.vllm.worker import KVSnapWorker
from kvsnap.format.signing import KeyRing
from kvsnap.store.files import publish

BLOCK, HEADS, HEAD_DIM, LAYERS = 16, 2, 32, 2
CHUNK_BLOCKS = 2
NAMESPACE = "soak"
FINGERPRINT = "5a" * 16
SOURCE = fmt.SourceInfo("vllm", "soak", "synthetic", None, FINGERPRINT)
GEOMETRY = {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": HEAD_DIM}


def prompt_pool(seed: int, count: int) -> list[np.ndarray]:
    """``count`` prompts: 8 system prefixes of 2 or 4 blocks, each followed by its own 1 to 4
    blocks and 5 tokens (so every full block is loadable)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(1, 30000, size=BLOCK * int(rng.choice([2, 4]))) for _ in range(8)]
    prompts = []
    for index in range(count):
        tail = rng.integers(1, 30000, size=BLOCK * int(rng.integers(1, 5)) + 5)
        prompts.append(np.concatenate([systems[index % len(systems)], tail]).astype(np.int64))
    return prompts


def reference_block(prompt: np.ndarray, block: int) -> torch.Tensor:
    """The reference KV of ``block`` of ``prompt``: ``[LAYERS, BLOCK, HEADS, 2 * HEAD_DIM]``,
    a function of the prompt's tokens up to the block's end (as a model's KV is)."""
    seed = xxhash.xxh3_64_intdigest(prompt[: (block + 1) * BLOCK].tobytes()) >> 1
    generator = torch.Generator().manual_seed(seed)
    shape = (LAYERS, BLOCK, HEADS, 2 * HEAD_DIM)
    return torch.randn(shape, generator=generator).to(torch.bfloat16)


class CountingLog(EventLog):
    """An event log that counts the events (by name), and with ``keep`` keeps them too."""

    def __init__(self, role: str, keep: bool = False) -> None:
        super().__init__(None, role, 0)
        self.counts: dict[str, int] = {}
        self.keep = keep
        self.records: list[dict[str, Any]] = []

    def emit(self, event: str, level: int = logging.INFO, **fields: Any) -> None:
        self.counts[event] = self.counts.get(event, 0) + 1
        if self.keep:
            self.records.append({"event": event, **fields})

    def named(self, event: str) -> list[dict[str, Any]]:
        """The kept events called ``event``, in order."""
        return [record for record in self.records if record["event"] == event]


class Engine:
    """One engine's connector halves on one store, and its cache. ``extra`` adds connector
    options (a remote tier: ``remote_url``, ...), ``keys`` sign and check every chunk."""

    def __init__(
        self,
        root: Path,
        capacity: int | None,
        policy: str,
        blocks: int,
        min_idle_s: float = 0.1,
        *,
        extra: dict[str, Any] | None = None,
        keys: KeyRing | None = None,
        keep_events: bool = False,
    ) -> None:
        options = ConnectorOptions.from_extra_config(
            {
                "path": str(root),
                "chunk_blocks": CHUNK_BLOCKS,
                "store_min_idle_s": min_idle_s,
                **({} if capacity is None else {"store_capacity_bytes": capacity}),
                **(extra or {}),
            }
        )
        check_remote_options(options, keys)
        store = PrefixStore(root, NAMESPACE, chunk_blocks=CHUNK_BLOCKS)
        self.physical = [
            torch.zeros((blocks, BLOCK, HEADS, 2 * HEAD_DIM), dtype=torch.bfloat16)
            for _ in range(LAYERS)
        ]
        self.events = CountingLog("worker", keep_events)
        self.worker = KVSnapWorker(
            options,
            store,
            self.events,
            vllm_config=None,
            fingerprint=FINGERPRINT,
            source=SOURCE,
            keys=keys,
        )
        self.worker.attach(
            registered_cache(
                [tensor.permute(0, 2, 1, 3) for tensor in self.physical],
                backend="FLASH_ATTN",
                kv_cache_layout="LBNHC",
                head_size=HEAD_DIM,
                num_kv_heads=HEADS,
            )
        )
        checker = ChunkChecker(FINGERPRINT, GEOMETRY, BLOCK, verify=policy == "fail", keys=keys)
        self.block_ids: list[int] = []
        self.scheduler_events = CountingLog("scheduler", keep_events)
        self.scheduler = KVSnapScheduler(
            options,
            store,
            self.scheduler_events,
            block_size=BLOCK,
            checker=checker,
            block_ids_of=lambda request_id: self.block_ids,
            remote=remote_fetcher(options, store, checker, self.scheduler_events),
        )

    def wait_for_uploads(self) -> None:
        """Block until the worker's uploads queued so far are done (a remote tier's)."""
        saves = self.worker._saves
        if saves is not None and saves.uploader is not None:
            saves.uploader.drain()

    def matched(self, request: Any) -> int:
        """vLLM's question, asked as its scheduler asks it: again every millisecond while the
        answer is "not yet" (a remote lookup under way), as vLLM's engine loop sleeps a
        millisecond between steps that ran nothing."""
        while True:
            matched, _ = self.scheduler.get_num_new_matched_tokens(request, 0)
            if matched is not None:
                return matched
            time.sleep(0.001)

    def serve(self, request_id: str, prompt: np.ndarray, counts: dict[str, int]) -> None:
        """One request: match, load (compared bit-exact), compute the rest, save."""
        blocks = (len(prompt) - 1) // BLOCK
        self.block_ids = list(range(blocks + 1))
        for layer in self.physical:  # stale contents: a block not loaded must not look right
            layer.normal_()
        request = SimpleNamespace(
            request_id=request_id,
            prompt_token_ids=prompt.tolist(),
            sampling_params=SimpleNamespace(extra_args=None),
            all_token_ids=prompt.tolist(),
        )
        matched = self.matched(request)
        allocated = SimpleNamespace(get_block_ids=lambda: (self.block_ids,))
        self.scheduler.update_state_after_alloc(request, allocated, matched)
        meta = self.scheduler.build_connector_meta(_step(request_id, 0, len(prompt), new=True))
        self.worker.start_load_kv(meta)
        failed = self.worker.get_block_ids_with_load_errors()
        loaded = matched // BLOCK
        if meta.loads:
            counts["loads"] += 1
            counts["failed_loads"] += bool(failed)
        for block in range(loaded):
            if block in failed:
                continue
            counts["loaded_blocks"] += 1
            expected = reference_block(prompt, block)
            got = torch.stack([layer[block] for layer in self.physical])
            counts["wrong_kv"] += not torch.equal(got.view(torch.int16), expected.view(torch.int16))
        for block in range(blocks):  # the forward pass: what was not loaded is computed
            if block >= loaded or block in failed:
                expected = reference_block(prompt, block)
                for layer, values in zip(self.physical, expected, strict=True):
                    layer[block] = values
        counts["saves"] += len(meta.saves)
        self.worker.wait_for_save(meta)  # a request that loaded nothing saves in this step
        report = self.worker.build_connector_worker_meta()
        self.scheduler.update_connector_output(
            SimpleNamespace(
                finished_sending=None, kv_connector_worker_meta=report, invalid_block_ids=failed
            )
        )
        meta = self.scheduler.build_connector_meta(_step(request_id, len(prompt), 1, new=False))
        counts["saves"] += len(meta.saves)
        self.worker.wait_for_save(meta)
        self.worker.wait_for_writes()  # its blocks are reused by the next request
        self.scheduler.request_finished(request)


def _step(request_id: str, computed: int, scheduled: int, *, new: bool) -> Any:
    """A scheduler output with one request, as ``build_connector_meta`` reads it."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=request_id, num_computed_tokens=computed)]
        if new
        else [],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[] if new else [request_id], num_computed_tokens=[] if new else [computed]
        ),
        num_scheduled_tokens={request_id: scheduled},
        preempted_req_ids=None,
    )


def serve_until_stopped(
    make_engine: Callable[[], Engine],
    args: argparse.Namespace,
    counts: dict[str, int],
    tally: Callable[[Engine, dict[str, int]], None],
) -> Engine:
    """An engine process's loop: serve random prompts of the pool until SIGTERM, publishing
    ``counts`` to ``args.counts`` once the engine is up and after each request (``tally`` adds
    the engine's own counts first); then shut the worker down (its writes drained)."""
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    torch.set_num_threads(1)
    engine = make_engine()
    prompts = prompt_pool(args.seed, args.prompts)
    rng = random.Random(os.getpid())
    publish.publish_bytes(args.counts, json.dumps(counts).encode())  # ready
    while not stopping:
        prompt = prompts[rng.randrange(len(prompts))]
        engine.serve(f"{os.getpid()}-{counts['requests']}", prompt, counts)
        counts["requests"] += 1
        tally(engine, counts)
        publish.publish_bytes(args.counts, json.dumps(counts).encode())
        time.sleep(rng.uniform(0, 2 * args.think_s))  # requests arrive, not back to back
    engine.worker.shutdown()
    return engine


def run_engine(args: argparse.Namespace) -> None:
    """An engine process: serve random prompts until SIGTERM, writing its counts after each."""

    def make_engine() -> Engine:
        return Engine(args.store, args.capacity, args.policy, blocks=8, min_idle_s=args.min_idle_s)

    def evictions(engine: Engine, counts: dict[str, int]) -> None:
        counts["evictions"] = engine.events.counts.get("evict", 0)

    serve_until_stopped(make_engine, args, dict.fromkeys(_COUNTS, 0), evictions)


def chunk_bytes(directory: Path, keys: KeyRing | None = None) -> int:
    """The size of one chunk (signed with ``keys``), written by a throwaway engine into a
    scratch store in ``directory``."""
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        engine = Engine(Path(scratch), None, "recompute", blocks=8, keys=keys)
        engine.serve("probe", prompt_pool(0, 1)[0], dict.fromkeys(_COUNTS, 0))
        engine.worker.shutdown()
        return min(path.stat().st_size for path in Path(scratch).glob("*/chunks/*/*.safetensors"))


def total_counts(counts_dir: Path, names: Sequence[str]) -> dict[str, int]:
    """Every engine's counts (one JSON file each in ``counts_dir``) added up; ``names`` first."""
    totals = dict.fromkeys(names, 0)
    for path in counts_dir.glob("*.json"):
        for key, value in json.loads(path.read_text()).items():
            totals[key] = totals.get(key, 0) + value
    return totals


_COUNTS = ("requests", "loads", "loaded_blocks", "wrong_kv", "failed_loads", "saves", "evictions")


def _spawn(args: argparse.Namespace, counts: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "benchmarks.store_soak", "--engine", "--counts", str(counts)]
    command += ["--store", str(args.store), "--capacity", str(args.capacity)]
    command += ["--policy", args.policy, "--seed", str(args.seed), "--prompts", str(args.prompts)]
    command += ["--min-idle-s", str(args.min_idle_s), "--think-s", str(args.think_s)]
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen(command, cwd=root, env={**os.environ, "PYTHONPATH": path})


def _temp_files(root: Path) -> list[Path]:
    return [
        path
        for path in root.rglob(".*")
        if path.is_file() and (publish.TEMP_MARKER in path.name or STAGE_MARKER in path.name)
    ]


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Run the soak; the report."""
    args.store.mkdir(parents=True, exist_ok=True)
    chunk = chunk_bytes(args.store.parent)
    args.capacity = args.capacity_chunks * chunk
    counts_dir = args.store.parent / "counts"
    counts_dir.mkdir(exist_ok=True)
    engines = {i: _spawn(args, counts_dir / f"{i}.json") for i in range(args.processes)}
    ready_by = time.monotonic() + 300
    # The clock starts once every engine is up (imports take seconds on a busy machine).
    while len(list(counts_dir.glob("*.json"))) < args.processes and time.monotonic() < ready_by:
        time.sleep(0.05)
    next_id, kills, samples, over = args.processes, 0, 0, 0
    started = time.monotonic()
    next_kill = started + args.kill_every
    while time.monotonic() - started < args.duration:
        with capacity_lock(args.store):  # a consistent view: no commit or prune midway
            over = max(over, store_bytes(args.store) - args.capacity)
        samples += 1
        if time.monotonic() >= next_kill:
            victim = random.choice(list(engines))
            killed = engines.pop(victim)
            killed.send_signal(signal.SIGKILL)
            killed.wait()
            kills += 1
            engines[next_id] = _spawn(args, counts_dir / f"{next_id}.json")
            next_id += 1
            next_kill += args.kill_every
        time.sleep(0.005)
    for process in engines.values():
        process.send_signal(signal.SIGTERM)
    for process in engines.values():
        process.wait(timeout=120)
    left_before = len(_temp_files(args.store))
    prune_store(args.store, args.capacity, min_idle_s=args.min_idle_s)
    totals = total_counts(counts_dir, _COUNTS)
    return {
        "processes": args.processes,
        "duration_s": args.duration,
        "policy": args.policy,
        "chunk_bytes": chunk,
        "capacity_chunks": args.capacity_chunks,
        "min_idle_s": args.min_idle_s,
        "engines_started": next_id,
        "kills": kills,
        "samples": samples,
        "max_over_bound_chunks": round(max(over, 0) / chunk, 3),
        "temp_files_left_by_killed_writers": left_before,
        "temp_files_left": len(_temp_files(args.store)),
        "final_chunks_bytes_within_bound": store_bytes(args.store) <= args.capacity,
        **totals,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=16)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds")
    parser.add_argument("--kill-every", type=float, default=2.0, help="seconds between kills")
    parser.add_argument("--capacity-chunks", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument(
        "--min-idle-s", type=float, default=0.1, help="the engines' store_min_idle_s"
    )
    parser.add_argument("--think-s", type=float, default=0.02, help="mean pause between requests")
    parser.add_argument("--policy", choices=("fail", "recompute"), default="fail")
    parser.add_argument("--seed", type=int, default=21)
    parser.add_argument("--work", type=Path, default=None, help="directory (default: a temp)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--counts", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--capacity", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.engine:
        run_engine(args)
        return {}
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or Path(scratch)
        args.store = work / "store"
        report = soak(args)
    print(json.dumps(report, indent=2))
    out = args.out or Path(os.environ.get("OUT", ".")) / "store_soak.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
