"""The vLLM connector's worker side on vLLM-shaped caches, without vLLM: saves and loads.

Run on a CUDA machine from the repository root (``python -m benchmarks.vllm_worker``; about a
minute on an H200); ``--quick --device cpu`` runs small models on host memory (a test does).
Each model's cache is what vLLM 0.32's FLASH_ATTN backend registers with NHD physical order
(``LBNHC``): per layer a ``[num_blocks, 16, H, 2*128]`` bf16 tensor (each (token, head) cell is
key ‖ value), seen as ``[B, H, N, C]``. It is registered through
:func:`kvsnap.engines.vllm.registration.registered_cache` (what the connector's
``register_kv_caches`` builds from vLLM's config) and driven through :class:`KVSnapWorker`.
``--packing split`` registers the older split layout ``[2, num_blocks, 16, H, 128]`` per layer
(K and V planes) instead. Models:

* ``llama-8b``: 32 layers, 8 KV heads (an 8B Llama), 128 KiB of KV per token;
* ``llama-70b-tp8``: one TP=8 rank of a 70B Llama: 80 layers, 1 KV head, 40 KiB per token,
  registered as a TP=1 cache of one head (the same tensors and pages a rank holds; the TP>1
  save path, which gathers on rank 0, is not what is measured).

Per model, side by side:

* **saves** (``wait_for_save``): steps of a fake forward pass (bf16 matmuls of about
  ``--forward-ms`` on a compute stream, then a write of the blocks the step saves, so that a
  copy not ordered after the forward reads stale blocks) followed by ``wait_for_save`` and
  ``get_finished``, then a wait for the stream (the engine waits for each step's sampled
  tokens). Every ``--save-every`` steps the step saves a fresh 2k-token prompt (chunks of 16
  blocks, as the scheduler plans them). Each step also runs a fixed pure-Python workload of
  about ``--engine-python-ms`` (the engine's own host work: it needs the GIL, which the writer
  thread competes for). Reported: the host time of ``wait_for_save`` + ``get_finished``
  (median, p99, max) on saving steps; the step wall time on saving steps, on the steps after
  them and on a run without saves; the workload's time with and without saves.
* **loads** (``start_load_kv``): the first saved prompt's chunks (page-cached files) into other
  blocks, to the compute stream seeing them, checked bit-exact against the blocks the forward
  wrote; against the raw read ceiling (the same files read into pinned memory, one thread, plus
  one host->device copy of their bytes) and a device->device copy of the same blocks per layer
  (the in-memory prefix-cache hit yardstick). ``--load-variants`` also times the same load
  under each of :data:`LOAD_VARIANTS` (other settings of kvsnap's read-path tuning).

Prints a table and writes JSON to ``$OUT/vllm_worker.json`` (``--out`` overrides).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvsnap import format as fmt
from kvsnap.engines.vllm.events import EventLog, read_events
from kvsnap.engines.vllm.identity import CacheIdentity, store_key_chain
from kvsnap.engines.vllm.options import ConnectorOptions
from kvsnap.engines.vllm.prefix_store import PrefixStore, chunk_sequence_id
from kvsnap.engines.vllm.registration import RegisteredCache, registered_cache
from kvsnap.engines.vllm.specs import ChunkLoad, KVSnapConnectorMetadata, LoadSpec, SaveSpec
from kvsnap.engines.vllm.worker import KVSnapWorker
from kvsnap.layout import vllm_legacy_layout
from kvsnap.pipeline import options as staging_defaults
from kvsnap.store import slot_reads

FINGERPRINT = "ab" * 16
SOURCE = fmt.SourceInfo("benchmark", torch.__version__, "synthetic", None, FINGERPRINT)
BLOCK = 16
HEAD = 128
CHUNK_BLOCKS = 16


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    kv_heads: int


MODELS = {
    "llama-8b": Model("llama-8b", 32, 8),
    "llama-70b-tp8": Model("llama-70b-tp8", 80, 1),
}
QUICK_MODELS = {"tiny-4l": Model("tiny-4l", 4, 2), "tiny-8l-1h": Model("tiny-8l-1h", 8, 1)}


def make_cache(
    model: Model, num_blocks: int, device: torch.device, packing: str
) -> RegisteredCache:
    """A random bf16 cache of ``model`` as vLLM allocates it, registered as the worker does."""
    cells = 2 * HEAD
    if packing == "split":
        planes = [
            _random((2, num_blocks, BLOCK, model.kv_heads, HEAD), device)
            for _ in range(model.layers)
        ]
        layout = vllm_legacy_layout(planes, num_kv_heads=model.kv_heads)
        return RegisteredCache(layout, planes, "FLASH_ATTN", "split-NHD", None)
    physical = [
        _random((num_blocks, BLOCK, model.kv_heads, cells), device) for _ in range(model.layers)
    ]
    return registered_cache(
        [tensor.permute(0, 2, 1, 3) for tensor in physical],  # [B, N, H, C] -> [B, H, N, C]
        backend="FLASH_ATTN",
        kv_cache_layout="LBNHC",
        head_size=HEAD,
        num_kv_heads=model.kv_heads,
    )


def _random(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    bits = torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int32, device=device)
    return bits.to(torch.int16).view(torch.bfloat16)


def block_views(cache: RegisteredCache) -> list[torch.Tensor]:
    """Per layer a view whose first axis indexes blocks (for writing and comparing blocks)."""
    if cache.kv_cache_layout == "split-NHD":
        return [plane.transpose(0, 1) for plane in cache.caches]
    return list(cache.caches)


class FakeForward:
    """bf16 matmuls of about ``ms`` on ``stream``, then new KV written into the step's saved
    blocks, so a copy that does not follow the pass reads stale blocks."""

    def __init__(
        self,
        device: torch.device,
        ms: float,
        views: list[torch.Tensor],
        blocks: int,
        python_ms: float,
    ):
        self.device, self.views = device, views
        self.python_loops = 1000
        started = time.perf_counter()
        self.engine_python()
        self.python_loops = max(1, round(1000 * python_ms / 1000 / (time.perf_counter() - started)))
        size = 4096 if device.type == "cuda" else 128
        self.a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        # The KV the pass "computes": changed (as int16) before every write.
        self.kv = [_random(tuple(view[:blocks].shape), device).view(torch.int16) for view in views]
        self.repeats = 1
        if device.type == "cuda":
            self.run(None)
            _sync(device)
            started = time.perf_counter()
            for _ in range(10):
                self.run(None)
            _sync(device)
            self.repeats = max(1, round(ms / 1000 / ((time.perf_counter() - started) / 10)))

    def engine_python(self) -> int:
        """Pure Python the engine runs each step (scheduling, input preparation): it needs the
        GIL, so a background thread holding it shows as this taking longer."""
        total = 0
        for value in range(self.python_loops):
            total += value & 7
        return total

    def run(self, blocks: torch.Tensor | None) -> None:
        """Enqueue one pass on the current stream; with ``blocks``, new KV is written into
        them last."""
        for _ in range(self.repeats):
            torch.mm(self.a, self.a)
        if blocks is not None:
            for view, kv in zip(self.views, self.kv, strict=True):
                kv.add_(1)
                view.index_copy_(0, blocks, kv.view(torch.bfloat16))


def prompt_specs(store: PrefixStore, request: str, blocks: np.ndarray, seed: int) -> list[SaveSpec]:
    """The chunk saves of one prompt whose full blocks are ``blocks``, as the scheduler plans
    them (aligned chunks of ``CHUNK_BLOCKS``, named by their last block's prefix hash)."""
    tokens = np.random.default_rng(seed).integers(1, 32000, size=len(blocks) * BLOCK)
    chain = store_key_chain(tokens, BLOCK, CacheIdentity())
    return [
        SaveSpec(
            request_id=request,
            kind="persist",
            path=str(store.chunk_path(chain[end - 1])),
            token_ids=tokens[start * BLOCK : end * BLOCK],
            block_ids=blocks[start:end],
            sequence_id=chunk_sequence_id(
                start, chain[start - 1] if start else None, chain[end - 1]
            ),
        )
        for start, end in store.chunk_spans(len(blocks))
    ]


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "median_ms": round(statistics.median(ordered) * 1e3, 4),
        "p99_ms": round(p99 * 1e3, 4),
        "max_ms": round(ordered[-1] * 1e3, 4),
        "count": len(ordered),
    }


def _sync(device: torch.device) -> None:
    """Wait for the current (compute) stream only, as an engine waits for its sampled tokens;
    the staging stream's copies are not waited for."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@dataclass
class Steps:
    """What :func:`run_steps` measured and what it saved."""

    figures: dict[str, Any]
    #: The first saved prompt's chunk saves, and its blocks as the forward pass wrote them.
    first_specs: list[SaveSpec]
    first_blocks: list[torch.Tensor]


def run_steps(
    worker: KVSnapWorker | None,
    forward: FakeForward,
    store: PrefixStore,
    cache: RegisteredCache,
    plan: tuple[int, int, int],
    seed: int = 0,
) -> Steps:
    """``steps`` engine steps (``plan``: steps, save_every, prompt_blocks); with a ``worker``,
    every ``save_every``-th saves a fresh prompt (tokens drawn from ``seed`` and the step) of
    ``prompt_blocks`` blocks into rotating blocks, reused only once ``get_finished`` has
    reported the request that held them."""
    steps, save_every, prompt_blocks = plan
    device, views = cache.layout.device, block_views(cache)
    slots = (cache.layout.num_blocks - prompt_blocks) // prompt_blocks  # last range: loads
    host, walls, saving_walls, next_walls, python = [], [], [], [], []
    prompt_walls, after_prompt_walls = [], []
    holders: dict[int, str] = {}
    reported: set[str] = set()
    first: tuple[list[SaveSpec], list[torch.Tensor]] = ([], [])
    reuse_waits = saves = 0
    for step in range(steps):
        # Every save_every-th step writes a fresh prompt's blocks, with or without a worker:
        # the forward passes compared are the same.
        prompt_step = step % save_every == 0
        saving = worker is not None and prompt_step
        blocks = None
        request = f"req-{seed}-{step}"
        if prompt_step:
            slot = saves % slots
            if worker is not None and slot in holders and holders[slot] not in reported:
                # The engine out of free blocks: as if the holder had been preempted.
                assert worker is not None
                worker.handle_preemptions(KVSnapConnectorMetadata(preempted=[holders[slot]]))
                reuse_waits += 1
            holders[slot] = request
            blocks = np.arange(slot * prompt_blocks, (slot + 1) * prompt_blocks, dtype=np.int64)
        meta = KVSnapConnectorMetadata()
        if saving:  # the scheduler's work (prefix hashes, chunk plans): not the step's
            meta.saves = prompt_specs(store, request, blocks, seed=seed * 1_000_003 + step)
        started = time.perf_counter()
        index = torch.from_numpy(blocks).to(device) if blocks is not None else None
        forward.run(index)
        if worker is not None:
            host_started = time.perf_counter()
            worker.wait_for_save(meta)
            done, _ = worker.get_finished({f"req-{seed}-{step - 1}"})
            if saving:
                host.append(time.perf_counter() - host_started)
            reported |= done or set()
            if saving and saves == 0:
                first = (meta.saves, [view[index].clone() for view in views])
            saves += saving
        python_started = time.perf_counter()
        forward.engine_python()
        python.append(time.perf_counter() - python_started)
        _sync(device)
        elapsed = time.perf_counter() - started
        walls.append(elapsed)
        if prompt_step:
            prompt_walls.append(elapsed)
        elif step % save_every == 1:
            after_prompt_walls.append(elapsed)
        if saving:
            saving_walls.append(elapsed)
        elif worker is not None and step % save_every == 1:
            next_walls.append(elapsed)
    figures: dict[str, Any] = {
        "step_wall": _stats(walls),
        "engine_python": _stats(python),
        # The steps that write a fresh prompt's blocks, and the steps after them, with or
        # without saves: what the saving steps and the next steps compare with.
        "prompt_step_wall": _stats(prompt_walls),
        "after_prompt_step_wall": _stats(after_prompt_walls),
    }
    if worker is not None:
        figures.update(
            save_host=_stats(host),
            saving_step_wall=_stats(saving_walls),
            next_step_wall=_stats(next_walls) if next_walls else None,
            prompts_saved=saves,
            block_reuse_waits=reuse_waits,
        )
    return Steps(figures, *first)


def measure_loads(
    worker: KVSnapWorker, cache: RegisteredCache, steps: Steps, repeats: int, sweep: bool
) -> dict[str, Any]:
    """Load the first saved prompt into the last blocks through ``start_load_kv`` (scrubbed
    before each repeat), check it bit-exact, and time it against the yardsticks; with
    ``sweep``, also under each of :data:`LOAD_VARIANTS`."""
    device, views = cache.layout.device, block_views(cache)
    specs = steps.first_specs
    prompt_blocks = sum(len(spec.block_ids) for spec in specs)
    target = np.arange(cache.layout.num_blocks - prompt_blocks, cache.layout.num_blocks)
    chunks, offset = [], 0
    for spec in specs:
        count = len(spec.block_ids)
        # The chunk's sequence as the scheduler's check reads it: its blocks numbered from 0.
        checked = fmt.SequenceRecord(spec.sequence_id, spec.token_ids, np.arange(count), ())
        chunks.append(
            ChunkLoad(spec.path, np.arange(count), target[offset : offset + count], checked)
        )
        offset += count
    meta = KVSnapConnectorMetadata(loads=[LoadSpec("load", tuple(chunks), prompt_blocks * BLOCK)])
    index = torch.from_numpy(target).to(device)

    def timed_loads() -> tuple[dict[str, float], bool, int]:
        times = []
        # The first load compiles the restore kernels for this cache (an engine pays it once),
        # or pins a variant's staging and starts its threads.
        worker.start_load_kv(meta)
        _sync(device)
        for _ in range(repeats):
            for view in views:
                view.index_fill_(0, index, 0.0)
            _sync(device)
            started = time.perf_counter()
            worker.start_load_kv(meta)
            _sync(device)
            times.append(time.perf_counter() - started)
        failed = worker.get_block_ids_with_load_errors()
        exact = not failed and all(
            torch.equal(view[index].view(torch.int16), wrote.view(torch.int16))
            for view, wrote in zip(views, steps.first_blocks, strict=True)
        )
        return _stats(times), exact, len(failed)

    load, exact, failed = timed_loads()
    variants = {}
    for label, settings in LOAD_VARIANTS.items() if sweep else ():
        with read_path_settings(**settings):
            figures, variant_exact, _ = timed_loads()
        variants[label] = {**figures, "bit_exact": variant_exact}
    source = torch.cat([torch.from_numpy(spec.block_ids) for spec in specs]).to(device)
    return {
        "load": load,
        "load_bit_exact": exact,
        "load_failed_blocks": failed,
        "load_variants": variants,
        "raw_read": raw_read([Path(spec.path) for spec in specs], device, repeats),
        "device_copy": _timed(lambda: _copy_blocks(views, source, index), device, repeats),
    }


def _variant(
    pieces: int | None, slots: str, threads: int | None = None, switch_ms: float | None = None
) -> tuple[str, dict[str, Any]]:
    """One :data:`LOAD_VARIANTS` entry: its label and its :func:`read_path_settings`."""
    label = f"pieces={pieces or 'threads'}, {slots} slots"
    label += f", {threads} threads" if threads else ""
    label += f", GIL switch {switch_ms} ms" if switch_ms else ""
    settings = {
        "pieces_per_slot": pieces,
        "large_restores_from": 128 << 20 if slots == "large" else 1 << 62,
        "read_threads": threads,
        "switch_interval_s": switch_ms / 1000 if switch_ms else None,
    }
    return label, settings


#: Variants of the read path's tuning (see :func:`read_path_settings`) that ``--load-variants``
#: times after the defaults (4 pieces, large slots from 128 MiB, one read thread per core up to
#: 16). The GIL switch interval is a diagnostic, not a setting kvsnap may choose for an engine:
#: it shows how much of a load is threads waiting for the GIL (the interpreter's default is 5 ms).
LOAD_VARIANTS: dict[str, dict[str, Any]] = dict(
    [
        _variant(4, "large"),
        _variant(2, "large"),
        _variant(1, "large"),
        _variant(None, "large"),
        _variant(4, "large", threads=8),
        _variant(2, "large", threads=8),
        _variant(4, "large", threads=4),
        _variant(4, "small"),
        _variant(2, "small"),
        _variant(8, "small"),
        _variant(None, "small"),
        _variant(None, "small", threads=12),
        _variant(None, "small", threads=8),
        _variant(4, "large", switch_ms=20),
        _variant(None, "small", switch_ms=0.5),
    ]
)


@contextlib.contextmanager
def read_path_settings(
    pieces_per_slot: int | None,
    large_restores_from: int,
    read_threads: int | None = None,
    switch_interval_s: float | None = None,
) -> Iterator[None]:
    """kvsnap's read-path tuning set for the block: pieces per slot read, the restore size from
    which large staging slots are used, the read threads (a pool of that size is started), and
    the interpreter's thread switch interval."""
    saved = (
        slot_reads.PIECES_PER_SLOT,
        staging_defaults.LARGE_RESTORE_JOB_BYTES,
        slot_reads.READ_THREADS,
        sys.getswitchinterval(),
    )
    slot_reads.PIECES_PER_SLOT = pieces_per_slot
    staging_defaults.LARGE_RESTORE_JOB_BYTES = large_restores_from
    slot_reads.READ_THREADS = read_threads
    if switch_interval_s is not None:
        sys.setswitchinterval(switch_interval_s)
    try:
        yield
    finally:
        (
            slot_reads.PIECES_PER_SLOT,
            staging_defaults.LARGE_RESTORE_JOB_BYTES,
            slot_reads.READ_THREADS,
            interval,
        ) = saved
        sys.setswitchinterval(interval)


def _copy_blocks(views: list[torch.Tensor], source: torch.Tensor, target: torch.Tensor) -> None:
    for view in views:
        view.index_copy_(0, target, view.index_select(0, source))


def _timed(work: Callable[[], None], device: torch.device, repeats: int) -> dict[str, float]:
    times = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        work()
        _sync(device)
        times.append(time.perf_counter() - started)
    return _stats(times)


def raw_read(paths: list[Path], device: torch.device, repeats: int) -> dict[str, Any]:
    """The ceiling: the chunk files read whole into pinned memory (one thread), and that plus
    one host->device copy of their bytes."""
    sizes = [path.stat().st_size for path in paths]
    total = sum(sizes)
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    memory = memoryview(pinned.numpy())
    upload = torch.empty(total, dtype=torch.uint8, device=device)

    def read() -> None:
        offset = 0
        for path, size in zip(paths, sizes, strict=True):
            with open(path, "rb", buffering=0) as file:
                file.readinto(memory[offset : offset + size])
            offset += size

    def read_and_upload() -> None:
        read()
        upload.copy_(pinned, non_blocking=True)

    return {
        "bytes": total,
        "read": _timed(read, device, repeats),
        "read_and_upload": _timed(read_and_upload, device, repeats),
    }


def bench_model(model: Model, packing: str, args: argparse.Namespace, root: Path) -> dict:
    """Saves with and without, then loads, on one freshly allocated cache of ``model``."""
    device = torch.device(args.device)
    prompt_blocks = args.prompt_tokens // BLOCK
    num_blocks = prompt_blocks * (args.prompt_slots + 1)
    cache = make_cache(model, num_blocks, device, packing)
    directory = root / f"{model.name}-{packing}"
    options = ConnectorOptions.from_extra_config(
        {"path": str(directory), "chunk_blocks": CHUNK_BLOCKS, "event_log": str(root / "ev.jsonl")}
    )
    store = PrefixStore(directory, "bench", chunk_blocks=CHUNK_BLOCKS)
    events = EventLog(options.event_log, "worker", 0)
    worker = KVSnapWorker(
        options, store, events, vllm_config=None, fingerprint=FINGERPRINT, source=SOURCE
    )
    worker.attach(cache)
    forward = FakeForward(
        device, args.forward_ms, block_views(cache), prompt_blocks, args.engine_python_ms
    )
    plan = (args.steps, args.save_every, prompt_blocks)
    # Warm up both runs (staging pinned, kernels compiled, page table built), then measure.
    run_steps(worker, forward, store, cache, (2 * args.save_every, args.save_every, prompt_blocks))
    worker.wait_for_writes()
    without = run_steps(None, forward, store, cache, plan)
    with_saves = run_steps(worker, forward, store, cache, plan, seed=1)
    started = time.perf_counter()
    worker.wait_for_writes()
    drain = time.perf_counter() - started
    loads = measure_loads(worker, cache, with_saves, args.repeats, args.load_variants)
    worker.shutdown()
    logged = read_events(root / "ev.jsonl")
    result = {
        "model": model.name,
        "packing": packing,
        "layers": model.layers,
        "kv_heads": model.kv_heads,
        "kv_bytes_per_token": model.layers * model.kv_heads * HEAD * 2 * 2,
        "prompt_tokens": prompt_blocks * BLOCK,
        "forward_repeats": forward.repeats,
        "without_saves": without.figures,
        "with_saves": with_saves.figures,
        "drain_after_steps_s": round(drain, 4),
        "saves_written": sum(event["event"] == "save" for event in logged),
        "saves_failed": sum(event["event"] == "save_failed" for event in logged),
        **loads,
    }
    (root / "ev.jsonl").unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)
    del cache, forward, worker
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _cell(figures: dict[str, float] | None) -> str:
    """``median/p99`` in ms."""
    if figures is None:
        return "-"
    return f"{figures['median_ms']:.3f}/{figures['p99_ms']:.3f}"


def print_table(results: list[dict]) -> None:
    """Per model: what saves cost the engine's steps, then loads against their yardsticks."""
    print("saves (ms, median/p99)")
    header = ("model", "save host", "prompt step", "saving step", "next, no saves")
    header += ("next step", "engine py, no saves", "engine py, saves")
    print("".join(f"{name:>22}" for name in header))
    for row in results:
        saves, without = row["with_saves"], row["without_saves"]
        cells = (
            f"{row['model']}/{row['packing']}",
            _cell(saves["save_host"]),
            _cell(without["prompt_step_wall"]),
            _cell(saves["saving_step_wall"]),
            _cell(without["after_prompt_step_wall"]),
            _cell(saves["next_step_wall"]),
            _cell(without["engine_python"]),
            _cell(saves["engine_python"]),
        )
        print("".join(f"{cell:>22}" for cell in cells))
    print("loads of a prompt prefix (ms, median/p99)")
    header = ("model", "tokens", "start_load_kv", "read files", "read + H2D", "D2D copy", "exact")
    print("".join(f"{name:>18}" for name in header))
    for row in results:
        raw = row["raw_read"]
        cells = (
            f"{row['model']}/{row['packing']}",
            str(row["prompt_tokens"]),
            _cell(row["load"]),
            _cell(raw["read"]),
            _cell(raw["read_and_upload"]),
            _cell(row["device_copy"]),
            str(row["load_bit_exact"]),
        )
        print("".join(f"{cell:>18}" for cell in cells))
    for row in results:
        for label, figures in row["load_variants"].items():
            exact = "" if figures["bit_exact"] else "  NOT BIT-EXACT"
            print(f"  {row['model']}/{row['packing']} load, {label}: {_cell(figures)}{exact}")
    print(
        "save host: wait_for_save + get_finished on saving steps; prompt step / next, no saves: "
        "the same steps without a worker; engine py: a fixed pure-Python "
        "step workload (longer when the writer thread holds the GIL)"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small models, few steps")
    parser.add_argument("--packing", choices=["cells", "split", "both"], default="cells")
    parser.add_argument("--models", nargs="*", help="model names (default: all of the run)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--save-every", type=int, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--prompt-slots", type=int, default=6, help="prompts the cache holds")
    parser.add_argument("--forward-ms", type=float, default=5.0)
    parser.add_argument(
        "--engine-python-ms", type=float, default=1.0, help="pure Python per step (GIL users)"
    )
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--dir", type=Path, default=None, help="store directory (default: tmp)")
    parser.add_argument(
        "--load-variants", action="store_true", help="also time loads under LOAD_VARIANTS"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    quick = args.quick
    args.steps = args.steps or (12 if quick else 640)
    args.save_every = args.save_every or (3 if quick else 32)
    args.prompt_tokens = args.prompt_tokens or (512 if quick else 2048)
    args.repeats = args.repeats or (3 if quick else 20)
    if args.out is None:
        args.out = Path(os.environ.get("OUT", ".")) / "vllm_worker.json"
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    catalogue = QUICK_MODELS if args.quick else MODELS
    names = args.models or list(catalogue)
    packings = ["cells", "split"] if args.packing == "both" else [args.packing]
    started = time.perf_counter()
    results: list[dict] = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvsnap-vllm-worker-") as root:
        stream = torch.cuda.Stream(args.device) if args.device.startswith("cuda") else None
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:  # the engine's compute stream: not the staging stream, not the default
            for name in names:
                for packing in packings:
                    results.append(bench_model(catalogue[name], packing, args, Path(root)))
                    # Written after every model: a run cut short keeps what it measured.
                    report = write_report(args, results, time.perf_counter() - started)
    print_table(results)
    print(f"wrote {args.out} in {report['seconds']} s")
    return report


def write_report(args: argparse.Namespace, results: list[dict], seconds: float) -> dict:
    """The run's settings and ``results`` as JSON at ``args.out``; returns the report."""
    cuda = args.device.startswith("cuda")
    report = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(args.device) if cuda else "cpu",
        "torch": torch.__version__,
        "quick": args.quick,
        "settings": {
            key: getattr(args, key)
            for key in (
                "steps",
                "save_every",
                "prompt_tokens",
                "prompt_slots",
                "forward_ms",
                "engine_python_ms",
            )
        },
        "seconds": round(seconds, 2),
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
