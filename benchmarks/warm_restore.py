"""Fixed cost per warm restore (issue 26 item 5), side by side in one run (CUDA machine).

``python -m benchmarks.warm_restore --json-out out/warm.json --profile-dir out`` measures, per
prefix of a Llama-3-8B-shaped model (32 layers, 8 KV heads x 128, bf16, random weights):

* ``prefill``: the recompute; ``floor``: one pinned host->device copy of the KV's bytes;
* ``restore_dynamic_cache`` from a memory-backed file, hot tier off and on, the result dropped
  at once (the allocator then hands the same addresses back), and ``kept``: hot, with the last
  four results held, so every call restores into new addresses as a caller keeping its caches
  sees; each checked bit-exact against the prefilled cache;
* ``Pipeline.restore`` into a kept vLLM-shaped cache, off and hot (benchmarks/pcie_floor.py).

At 16 tokens (one block) a call is almost all fixed cost. ``--fixed`` adds the fixed-cost table
of benchmarks/pcie_floor.py (vLLM-shaped caches, ``Snapshot.open`` + restore, off / hot);
``--profile-dir`` writes cProfile reports of hot ``restore_dynamic_cache`` calls (new addresses
each) and of the 80-layer x 8-rank fixed case. Runs on any kvsnap tree that has
``restore_dynamic_cache``: put the tree first on ``PYTHONPATH`` to measure it.

``--steps`` adds the host's time per step of hot ``restore_dynamic_cache`` calls (functions
wrapped with ``time.perf_counter``, no profiler).

``--host`` needs no GPU: the host's share of a warm ``restore_dynamic_cache`` into CPU memory,
for a 32-layer model with the 8B model's KV shape (8 KV heads x 128, bf16; hidden size 256,
so the weights are small but the module tree is the 8B model's), per step (timed by wrapping
the functions, no profiler), medians of ``--repeat`` calls, new addresses every call; and
``Snapshot.open`` + restore of 16 tokens into CPU caches of the fixed-cost cases.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict, deque
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.engine import (
    build_model,
    capture_prefill,
    kv_shaped_llama,
    kv_tensors,
    median_ms,
    prefill,
)
from benchmarks.pcie_floor import _exact, _raw_copies, engine_path, fixed
from benchmarks.profiling import profile_report, profiled_calls
from kvsnap.store.hot.tier import configure_hot_tier


def one_prefix(model, tokens: int, directory: Path, repeat: int) -> dict:
    from kvsnap.engines import transformers as kt

    ids = torch.randint(0, 128000, (1, tokens), device="cuda")
    row: dict[str, float | int | bool] = {"tokens": tokens}
    row["prefill_ms"] = median_ms(lambda: prefill(model, ids), repeat)
    cache = prefill(model, ids)
    reference = kv_tensors(cache)
    row["kv_bytes"] = sum(t.numel() * t.element_size() for t in reference)
    path = directory / f"warm-{tokens}.safetensors"
    kt.capture_dynamic_cache(cache, [ids[0].tolist()], path, model=model)
    kept: deque = deque(maxlen=4)

    def restore():
        return kt.restore_dynamic_cache(path, device="cuda", model=model)[0]

    def restore_kept():
        kept.append(restore())

    configure_hot_tier(0)
    row["off_exact"] = _exact(reference, restore())
    row["off_ms"] = median_ms(restore, repeat)
    configure_hot_tier(8 << 30, register_after=1)
    row["hot_exact"] = _exact(reference, restore())
    row["hot_ms"] = median_ms(restore, repeat)
    row["kept_ms"] = median_ms(restore_kept, repeat)
    row["kept_exact"] = all(_exact(reference, held) for held in kept)
    configure_hot_tier(0)
    row.update(_raw_copies(path, path.stat().st_size, row["kv_bytes"], None, repeat))
    row.update(engine_path(tokens, directory))
    for name in ("hot", "kept", "pipeline_hot"):
        row[f"prefill_over_{name}"] = row["prefill_ms"] / row[f"{name}_ms"]
        row[f"floor_over_{name}"] = row["floor_ms"] / row[f"{name}_ms"]
    path.unlink()
    return row


def profile_dynamic(model, tokens: int, directory: Path, out: Path) -> None:
    """cProfile of 10 hot ``restore_dynamic_cache`` calls, each into new addresses."""
    from kvsnap.engines import transformers as kt

    ids = torch.randint(0, 128000, (1, tokens), device="cuda")
    path = directory / f"profile-{tokens}.safetensors"
    kt.capture_dynamic_cache(prefill(model, ids), [ids[0].tolist()], path, model=model)
    configure_hot_tier(8 << 30, register_after=1)
    kept: deque = deque(maxlen=4)

    def restore() -> None:
        kept.append(kt.restore_dynamic_cache(path, device="cuda", model=model)[0])

    profiler = profiled_calls(restore, warmup=4, repeat=10)
    (out / f"profile-dyn-{tokens}.txt").write_text(profile_report(profiler))
    configure_hot_tier(0)
    path.unlink()


def profile_fixed(directory: Path, out: Path) -> None:
    """cProfile of 20 hot ``Snapshot.open`` + restore calls, 80 layers x 8 ranks, 128 tokens."""
    import numpy as np

    from benchmarks.engine import SOURCE, case_layouts
    from kvsnap.snapshot import SequenceBlocks, Snapshot, capture

    source, target = (case_layouts("vllm-nhd", 80, 8, 128, 8) for _ in range(2))
    blocks = np.arange(8, dtype=np.int64)
    path = directory / "profile-fixed.safetensors"
    capture(source, [SequenceBlocks("s", np.arange(128), blocks)], path, source=SOURCE)
    configure_hot_tier(8 << 30, register_after=1)

    def restore() -> None:
        with Snapshot.open(path) as snap:
            snap.restore(target, {"s": blocks[::-1].copy()})

    profiler = profiled_calls(restore, warmup=4, repeat=20)
    (out / "profile-fixed-80x8.txt").write_text(profile_report(profiler))
    configure_hot_tier(0)
    path.unlink()


class _Steps:
    """Seconds per call of wrapped functions (module attributes), summed per call."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.calls: list[dict[str, float]] = []

    def wrap(self, owner: object, name: str, label: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            return  # a step this tree does not have

        def timed(*args: object, **kwargs: object) -> object:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[label] += time.perf_counter() - started

        # A classmethod comes back bound to its class: it stays bound, as a staticmethod.
        setattr(owner, name, staticmethod(timed) if inspect.ismethod(original) else timed)

    def call(self, run: Callable[[], object]) -> None:
        self.current = defaultdict(float)
        started = time.perf_counter()
        run()
        self.current["total"] = time.perf_counter() - started
        self.calls.append(self.current)

    def medians_ms(self) -> dict[str, float]:
        labels = {label for call in self.calls for label in call}
        return {
            label: statistics.median(call.get(label, 0.0) for call in self.calls) * 1e3
            for label in sorted(labels)
        }


def _dynamic_cache_steps() -> _Steps:
    """Steps timing what every ``restore_dynamic_cache`` call does around the restore."""
    from kvsnap.engines.transformers import dynamic
    from kvsnap.pipeline import pipeline
    from kvsnap.snapshot import Snapshot

    steps = _Steps()
    steps.wrap(Snapshot, "open", "open")
    steps.wrap(dynamic, "check_snapshot_fits", "model check")
    steps.wrap(dynamic, "_restore_target", "buffer + layout")
    steps.wrap(pipeline, "shared_page_table", "page table")
    steps.wrap(dynamic, "_empty_cache", "DynamicCache")
    steps.wrap(dynamic, "_fill_dynamic_cache", "DynamicCache")
    return steps


def host_costs(sizes: list[int], repeat: int) -> list[dict]:
    """The host's share of warm ``restore_dynamic_cache`` calls into CPU memory, per step."""
    from kvsnap.engines import transformers as kt
    from kvsnap.engines.transformers import dynamic
    from kvsnap.snapshot import Snapshot

    model = kv_shaped_llama("cpu")
    directory = Path(tempfile.mkdtemp(dir="/dev/shm"))
    steps = _dynamic_cache_steps()
    steps.wrap(dynamic, "contiguous_layout", "layout built")
    steps.wrap(Snapshot, "restore", "Snapshot.restore")
    steps.wrap(dynamic, "new_dynamic_cache", "DynamicCache")
    rows = []
    for tokens in sizes:
        path = directory / f"host-{tokens}.safetensors"
        cache = capture_prefill(model, tokens, path)
        kept: deque = deque(maxlen=4)

        def restore(at: Path = path, held: deque = kept) -> None:
            held.append(kt.restore_dynamic_cache(at, model=model)[0])

        for _ in range(5):
            restore()
        steps.calls = []
        for _ in range(repeat):
            steps.call(restore)
        restored = kt.dynamic_cache_states(kept[-1])
        exact = all(
            torch.equal(a.view(torch.int16), b.view(torch.int16))
            for pair, again in zip(kt.dynamic_cache_states(cache), restored, strict=True)
            for a, b in zip(pair, again, strict=True)
        )
        row = {"tokens": tokens, "exact": exact, **steps.medians_ms()}
        rows.append(row)
        print(f"{tokens} tokens (exact={exact}), medians of {repeat}, ms:")
        for label, value in row.items():
            if label not in ("tokens", "exact"):
                print(f"  {label:<18} {value:8.3f}")
    return rows


def device_steps(model, sizes: list[int], directory: Path, repeat: int) -> list[dict]:
    """The host's time per step of hot ``restore_dynamic_cache`` calls on CUDA (new addresses
    each call), medians of ``repeat``: where a call's time goes besides the device's copies
    (``collect`` is the wait for the device's page checks, the end of the device's work)."""
    from kvsnap.engines import transformers as kt
    from kvsnap.pipeline import Pipeline, fused, pipeline, restore

    steps = _dynamic_cache_steps()
    steps.wrap(Pipeline, "restore", "Pipeline.restore")
    steps.wrap(pipeline, "staging_ring", "staging ring")
    steps.wrap(pipeline, "_hot_files", "hot lease")
    steps.wrap(pipeline, "restore_slots", "restore_slots")
    steps.wrap(restore, "collect_device_checks", "collect (waits)")
    steps.wrap(fused.FusedMover, "submit", "submit")
    rows = []
    configure_hot_tier(8 << 30, register_after=1)
    for tokens in sizes:
        ids = torch.randint(0, 128000, (1, tokens), device="cuda")
        path = directory / f"steps-{tokens}.safetensors"
        kt.capture_dynamic_cache(prefill(model, ids), [ids[0].tolist()], path, model=model)
        kept: deque = deque(maxlen=4)

        def restore_call(at: Path = path, held: deque = kept) -> None:
            held.append(kt.restore_dynamic_cache(at, device="cuda", model=model)[0])
            torch.cuda.synchronize()

        for _ in range(5):
            restore_call()
        steps.calls = []
        for _ in range(repeat):
            steps.call(restore_call)
        row = {"tokens": tokens, **steps.medians_ms()}
        rows.append(row)
        print(f"hot restore_dynamic_cache, {tokens} tokens, host ms per step (median):")
        print("  " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "tokens"))
        path.unlink()
    configure_hot_tier(0)
    return rows


def host_fixed(repeat: int) -> list[dict]:
    """``Snapshot.open`` + restore of 16 tokens into CPU caches shaped as benchmarks/engine.py's
    fixed-cost cases (the same layout objects every call, as an engine passes them), per step."""
    import numpy as np

    from benchmarks.engine import BLOCK, FIXED_CASES, SOURCE, case_layouts
    from kvsnap.pipeline import pipeline
    from kvsnap.snapshot import SequenceBlocks, Snapshot, capture

    steps = _Steps()
    steps.wrap(pipeline, "shared_page_table", "page table")
    path = Path(tempfile.mkdtemp(dir="/dev/shm")) / "fixed.safetensors"
    rows = []
    for label, kind, layers, heads, dim, tp_size in FIXED_CASES:
        source, target = (
            case_layouts(
                kind, layers, heads, dim, tp_size, num_blocks=8, device="cpu", fill="zeros"
            )
            for _ in range(2)
        )
        blocks = np.arange(1, dtype=np.int64)
        capture(source, [SequenceBlocks("s", np.arange(BLOCK), blocks)], path, source=SOURCE)

        def restore(t: list = target, b: np.ndarray = blocks) -> None:
            with Snapshot.open(path) as snap:
                snap.restore(t, {"s": b})

        for _ in range(3):
            restore()
        steps.calls = []
        for _ in range(repeat):
            steps.call(restore)
        row = {"case": label, **steps.medians_ms()}
        rows.append(row)
        print(f"  {label:<16} total {row['total']:7.3f} ms, page table {row['page table']:6.3f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--sizes", default="16,128,2048")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--fixed", action="store_true")
    parser.add_argument("--profile-dir", type=Path, default=None)
    parser.add_argument("--host", action="store_true", help="host costs only, no GPU")
    parser.add_argument(
        "--steps", action="store_true", help="also the host's time per step of hot calls"
    )
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",") if size]
    if args.host:
        rows = host_costs(sizes, args.repeat)
        print(f"fixed-cost cases, 16 tokens into CPU caches, medians of {args.repeat}:")
        fixed_rows = host_fixed(args.repeat)
        if args.json_out is not None:
            args.json_out.write_text(json.dumps({"host": rows, "fixed": fixed_rows}, indent=1))
        sys.exit(0)
    directory = Path(tempfile.mkdtemp(dir="/dev/shm"))
    model = build_model()
    out: dict[str, object] = {"torch": torch.__version__, "prefixes": []}
    columns = ("prefill", "off", "hot", "kept", "pipeline", "pipeline_hot", "floor")
    print(f"{'tokens':>6} " + " ".join(f"{name:>12}" for name in columns), flush=True)
    for tokens in sizes:
        row = one_prefix(model, tokens, directory, args.repeat)
        out["prefixes"].append(row)  # type: ignore[union-attr]
        cells = " ".join(f"{row[f'{name}_ms']:12.2f}" for name in columns)
        checks = all(value for key, value in row.items() if key.endswith("_exact"))
        print(f"{tokens:>6} {cells}  exact={checks}", flush=True)
    if args.steps:
        out["steps"] = device_steps(model, sizes, directory, args.repeat)
    if args.profile_dir is not None:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        profile_dynamic(model, 2048, directory, args.profile_dir)
    del model
    torch.cuda.empty_cache()
    if args.profile_dir is not None:
        profile_fixed(directory, args.profile_dir)
    if args.fixed:
        out["fixed"] = fixed(directory, args.repeat)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
