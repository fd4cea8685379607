"""Restores against recompute and the PCIe floor, side by side in one run (CUDA machine).

``python -m benchmarks.pcie_floor --json-out out/floor.json`` measures, per prefix length of
a Llama-3-8B-shaped model (32 layers, 8 KV heads x 128, bf16, random weights, transformers):

* ``prefill``: the recompute an engine would do;
* ``restore``: ``restore_dynamic_cache`` from a memory-backed file with the hot tier off (every
  call reads the file: what a first touch of a page-cached file costs);
* ``hot first``: the same from a file seen for the first time, registered on the caller's word
  (``register_after=1``): the registration included;
* ``hot``: the same once the file is registered (copied straight from the page cache);
* ``kvikio``: kvikio's ``CuFile.pread`` of the whole file into device memory (its C++ thread
  pool, compat mode; bytes only, no checks, no scatter), where kvikio is installed;
* ``floor``: one host->device copy of the same number of bytes from pinned memory;
* ``pipeline`` / ``pipeline hot``: ``Pipeline.restore`` as an engine calls it (a kept pipeline
  over a vLLM-shaped paged cache of the same shape, the snapshot opened per call), hot tier off
  and on.

Every restore is checked bit-exact against the prefilled cache. With ``--disk-dir`` it also
measures a 2,048-token prefix on a disk: a cold restore (page cache dropped) read with O_DIRECT
and read through the page cache, the next restore after each (page-cached, or not), and a hot
restore from the disk's page cache. With ``--fixed`` it times warm restores of 16 and 128
tokens (open included) of benchmarks/engine.py's fixed-cost cases with the hot tier off and on.

With ``--capture 128,2048,8192`` it times captures to the memory-backed directory instead
(issue 26, item 4), per prefix of the same shape, the calls of each kind interleaved round by
round, each path in a directory of its own: ``Pipeline.capture`` by DMA into the registered
mapping of the spare file the previous capture into the directory left (``dma_spare``: made
and registered in the background; ``dma_spare_populated``: made and populated, registered by
the capture), by DMA into a file it makes itself (``dma``: spares off), all forced at every
size (``default_path`` says which path the size gets by default); the same forced through
pinned staging and ``pwrite`` (``write``, today's path); a raw ``pwrite`` of the file's bytes
from pinned memory into a new file on the same filesystem (64 MiB writes, fsync, the file
created and removed each time); and the pinned device->host copy of the KV bytes (the floor).
Each timed call starts with the background settled (the spare made, the last mapping
released); what the background still had to do when a capture returned is
``*_background_ms``; ``*_back_to_back_ms`` are the DMA paths' captures in a row with nothing
settled between them. Every path must give the staged file byte for byte, and the file written
into a spare restores bit-exact. With ``--populate-sweep 1,4,8,16`` it also times DMA captures
of 2,048 tokens (no spares) with that many threads faulting the new file's pages in
(``tuning.POPULATE_THREADS``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.engine import (
    FIXED_CASES,
    build_model,
    case_layouts,
    drop_cache,
    kv_tensors,
    median_ms,
    prefill,
)
from benchmarks.profiling import SpanTotals, profile_report, profiled_calls
from kvsnap.store.base import tuning
from kvsnap.store.hot.tier import configure_hot_tier, hot_tier


def _kvikio() -> object | None:
    """kvikio configured as the prototypes ran it (16 threads, 4 MiB tasks), or ``None``."""
    os.environ.setdefault("KVIKIO_COMPAT_MODE", "ON")
    try:
        import kvikio
        import kvikio.defaults
    except ImportError:
        return None
    kvikio.defaults.set({"num_threads": 16, "task_size": 4 << 20})
    return kvikio


def _exact(reference: list[torch.Tensor], cache) -> bool:
    return all(
        torch.equal(a.view(torch.int16), b.view(torch.int16))
        for a, b in zip(reference, kv_tensors(cache), strict=True)
    )


def _once_ms(run: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    run()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def one_prefix(model, tokens: int, directory: Path, kvikio) -> dict:
    from kvsnap.engines import transformers as kt

    ids = torch.randint(0, 128000, (1, tokens), device="cuda")
    repeat = 7
    row: dict[str, float | int | bool | str] = {"tokens": tokens}
    row["prefill_ms"] = median_ms(lambda: prefill(model, ids), repeat)
    cache = prefill(model, ids)
    reference = kv_tensors(cache)
    row["kv_bytes"] = sum(t.numel() * t.element_size() for t in reference)
    path = directory / f"floor-{tokens}.safetensors"
    kt.capture_dynamic_cache(cache, [ids[0].tolist()], path, model=model)
    row["file_bytes"] = path.stat().st_size

    def restore(at: Path = path):
        return kt.restore_dynamic_cache(at, device="cuda", model=model)[0]

    configure_hot_tier(0)  # off: every restore reads the file (today's path)
    row["restore_exact"] = _exact(reference, restore())
    row["restore_ms"] = median_ms(restore, repeat)
    configure_hot_tier(8 << 30, register_after=1)
    firsts = []
    for attempt in range(3):
        # A new inode each time (page-cached, as a file just written is): registered anew.
        fresh = directory / f"floor-{tokens}-{attempt}.safetensors"
        shutil.copyfile(path, fresh)
        firsts.append(_once_ms(lambda at=fresh: restore(at)))
    row["hot_first_ms"] = statistics.median(firsts)
    row["hot_exact"] = _exact(reference, restore())
    row["hot_ms"] = median_ms(restore, repeat)
    row["hot_registered_bytes"] = hot_tier().stats().registered_bytes
    configure_hot_tier(0)
    row.update(_raw_copies(path, row["file_bytes"], row["kv_bytes"], kvikio, repeat))
    for name in ("restore", "hot", "hot_first"):
        row[f"prefill_over_{name}"] = row["prefill_ms"] / row[f"{name}_ms"]
    row["floor_over_hot"] = row["floor_ms"] / row["hot_ms"]
    row.update(engine_path(tokens, directory))
    row["prefill_over_pipeline_hot"] = row["prefill_ms"] / row["pipeline_hot_ms"]
    row["floor_over_pipeline_hot"] = row["floor_ms"] / row["pipeline_hot_ms"]
    for file in directory.glob(f"floor-{tokens}*"):
        file.unlink()
    return row


def _raw_copies(path: Path, file_bytes: int, kv_bytes: int, kvikio, repeat: int) -> dict:
    """kvikio's read of the whole file into device memory (checked), and the pinned floor."""
    row: dict[str, float | bool] = {}
    data = torch.empty(file_bytes, dtype=torch.uint8, device="cuda")
    if kvikio is not None:
        handle = kvikio.CuFile(path, "r")
        try:
            row["kvikio_ms"] = median_ms(lambda: handle.pread(data, data.numel(), 0).get(), repeat)
        finally:
            handle.close()
        expected = torch.from_numpy(np.fromfile(path, dtype=np.uint8))
        row["kvikio_exact"] = bool(torch.equal(data.cpu(), expected))
    pinned = torch.empty(kv_bytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")
    row["floor_ms"] = median_ms(lambda: target.copy_(pinned, non_blocking=True), repeat)
    return row


def engine_path(tokens: int, directory: Path, profile_out: Path | None = None) -> dict:
    """``Pipeline.restore`` as an engine calls it: a kept pipeline over a vLLM-shaped paged
    cache of the same shape (blocks of 16 tokens), the snapshot opened per call; hot tier off
    and on, each checked bit-exact against the captured cache. With ``profile_out``, also
    where 10 hot restores spend the host's time (cProfile, and the summed trace spans per
    step) in ``profile_out/profile-engine-TOKENS.txt``."""
    from benchmarks.engine import SOURCE
    from kvsnap.layout.allocate import allocate_cache
    from kvsnap.pipeline import Pipeline
    from kvsnap.snapshot import SequenceBlocks, Snapshot, capture

    blocks = tokens // 16
    shape = {"num_layers": 32, "num_blocks": blocks, "block_size": 16, "num_kv_heads": 8}
    source, target = (
        allocate_cache("vllm-nhd", **shape, head_dim=128, dtype=torch.bfloat16, device="cuda")
        for _ in range(2)
    )
    for tensor in source.layout.tensors:
        tensor.tensor.view(torch.uint8).random_()
    ids = np.arange(blocks, dtype=np.int64)
    path = directory / f"engine-{tokens}.safetensors"
    sequence = SequenceBlocks("s", np.arange(tokens), ids)
    capture(source.layout, [sequence], path, source=SOURCE)
    pipeline = Pipeline(target.layout)

    def restore() -> None:
        with Snapshot.open(path) as snap:
            pipeline.restore(snap, {"s": ids})

    def exact() -> bool:
        for tensor in target.layout.tensors:
            tensor.tensor.zero_()
        restore()
        torch.cuda.synchronize()
        pairs = zip(source.layout.tensors, target.layout.tensors, strict=True)
        # As bytes: random bits hold NaNs, which never equal themselves as bf16.
        return all(
            torch.equal(a.tensor.view(torch.uint8), b.tensor.view(torch.uint8)) for a, b in pairs
        )

    row: dict[str, float | bool] = {}
    configure_hot_tier(0)
    row["pipeline_exact"] = exact()
    row["pipeline_ms"] = median_ms(restore, 7)
    configure_hot_tier(8 << 30, register_after=1)
    row["pipeline_hot_exact"] = exact()
    row["pipeline_hot_ms"] = median_ms(restore, 7)
    if profile_out is not None:
        _profile_engine(pipeline, path, ids, profile_out / f"profile-engine-{tokens}.txt")
    configure_hot_tier(0)
    path.unlink()
    return row


def _profile_engine(pipeline, path: Path, ids: np.ndarray, out: Path) -> None:
    from kvsnap.snapshot import Snapshot

    trace = SpanTotals()

    def restore() -> None:
        with Snapshot.open(path) as snap:
            pipeline.restore(snap, {"s": ids}, trace=trace)

    started = time.perf_counter()
    profiler = profiled_calls(restore, warmup=0, repeat=10)
    text = io.StringIO()
    text.write(f"10 hot restores in {(time.perf_counter() - started) * 1e3:.1f} ms (profiled)\n")
    for kind, milliseconds in trace.per_call_ms(10):
        text.write(f"{kind:>24}: {milliseconds:8.3f} ms per restore\n")
    text.write(profile_report(profiler, top_own=0))
    out.write_text(text.getvalue())


def disk_prefix(model, tokens: int, directory: Path) -> dict:
    """Cold and second restores of one prefix on a disk, O_DIRECT and buffered, and hot."""
    from kvsnap.engines import transformers as kt

    ids = torch.randint(0, 128000, (1, tokens), device="cuda")
    cache = prefill(model, ids)
    reference = kv_tensors(cache)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"disk-{tokens}.safetensors"
    kt.capture_dynamic_cache(cache, [ids[0].tolist()], path, model=model)

    def restore():
        return kt.restore_dynamic_cache(path, device="cuda", model=model)[0]

    row: dict[str, float | int | bool] = {"tokens": tokens, "file_bytes": path.stat().st_size}
    configure_hot_tier(0)
    previous = tuning.COLD_READS_DIRECT
    try:
        for label, direct in (("direct", True), ("buffered", False)):
            tuning.COLD_READS_DIRECT = direct
            cold, second = [], []
            for _ in range(3):
                drop_cache(path)
                cold.append(_once_ms(restore))
                second.append(_once_ms(restore))
            row[f"cold_{label}_ms"] = statistics.median(cold)
            row[f"second_{label}_ms"] = statistics.median(second)
            row[f"{label}_exact"] = _exact(reference, restore())
    finally:
        tuning.COLD_READS_DIRECT = previous
    configure_hot_tier(8 << 30, register_after=1)
    restore()  # page-cached now (buffered): registered from the disk's page cache
    row["hot_ms"] = median_ms(restore, 7)
    row["hot_exact"] = _exact(reference, restore())
    configure_hot_tier(0)
    path.unlink()
    return row


def fixed(directory: Path, repeat: int) -> list[dict]:
    """Warm ``Snapshot.open`` + restore of 16 and 128 tokens, hot tier off and on."""
    rows = []
    for label, kind, layers, heads, dim, tp_size in FIXED_CASES:
        source = case_layouts(kind, layers, heads, dim, tp_size)
        target = case_layouts(kind, layers, heads, dim, tp_size)
        for tokens in (16, 128):
            row = _fixed_row(source, target, tokens, directory / "fixed.safetensors", repeat)
            row["case"] = label
            rows.append(row)
            print(f"{label:>16} {tokens:>4}: {row['restore_ms']:.2f} / hot {row['hot_ms']:.2f} ms")
        del source, target
        torch.cuda.empty_cache()
    return rows


def _fixed_row(source: list, target: list, tokens: int, path: Path, repeat: int) -> dict:
    from benchmarks.engine import BLOCK, SOURCE
    from kvsnap.snapshot import SequenceBlocks, Snapshot, capture

    blocks = np.arange(tokens // BLOCK, dtype=np.int64)
    capture(source, [SequenceBlocks("s", np.arange(tokens), blocks)], path, source=SOURCE)
    targets = {"s": blocks[::-1].copy()}

    def restore() -> None:
        with Snapshot.open(path) as snap:
            snap.restore(target, targets)

    row: dict[str, float | int | str] = {"tokens": tokens}
    configure_hot_tier(0)
    row["restore_ms"] = median_ms(restore, repeat)
    configure_hot_tier(8 << 30, register_after=1)
    row["hot_ms"] = median_ms(restore, repeat)
    configure_hot_tier(0)
    return row


def profile(model, tokens: int, directory: Path, out: Path) -> None:
    """Where a hot ``restore_dynamic_cache`` of ``tokens`` spends its time: the host's calls
    (cProfile, 10 restores) and the device's kernels and copies (torch.profiler, 3 restores),
    written to ``out/profile-TOKENS-{host,device}.txt``."""
    from kvsnap.engines import transformers as kt

    ids = torch.randint(0, 128000, (1, tokens), device="cuda")
    path = directory / f"profile-{tokens}.safetensors"
    kt.capture_dynamic_cache(prefill(model, ids), [ids[0].tolist()], path, model=model)
    configure_hot_tier(8 << 30, register_after=1)

    def restore():
        return kt.restore_dynamic_cache(path, device="cuda", model=model)[0]

    profiler = profiled_calls(restore, warmup=3, repeat=10)
    (out / f"profile-{tokens}-host.txt").write_text(profile_report(profiler, 40, 40))
    try:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as device_profile

        with device_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                restore()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        (out / f"profile-{tokens}-device.txt").write_text(table)
    except Exception as error:  # a profiler that cannot run here is reported, not fatal
        (out / f"profile-{tokens}-device.txt").write_text(repr(error))
    configure_hot_tier(0)
    path.unlink()


#: The capture paths ``--capture`` times: by DMA taking the spare file its directory's previous
#: capture left (registered in the background, or only populated), by DMA making its own file
#: (no spares), and through pinned staging and ``pwrite`` (today's path).
CAPTURE_PATHS = ("dma_spare", "dma_spare_populated", "dma", "write")


class _CaptureCase:
    """One prefix of the 8B shape in a vLLM NHD cache of random bits, captured by a kept
    ``Pipeline`` into a directory of its own per path (a spare file belongs to a directory),
    each path forced whatever the size (the sizes under the bound show what it costs)."""

    def __init__(self, tokens: int, directory: Path) -> None:
        from kvsnap.layout.allocate import allocate_cache
        from kvsnap.pipeline import Pipeline
        from kvsnap.snapshot import SequenceBlocks

        blocks = tokens // 16
        shape = {"num_layers": 32, "num_blocks": blocks, "block_size": 16, "num_kv_heads": 8}
        self.source, self.target = (
            allocate_cache("vllm-nhd", **shape, head_dim=128, dtype=torch.bfloat16, device="cuda")
            for _ in range(2)
        )
        for tensor in self.source.layout.tensors:
            tensor.tensor.view(torch.uint8).random_()
        self.ids = np.arange(blocks, dtype=np.int64)
        self.sequence = SequenceBlocks("s", np.arange(tokens), self.ids)
        self.pipeline = Pipeline(self.source.layout)
        self.paths = {}
        for name in CAPTURE_PATHS:
            (directory / f"kvsnap-capture-{name}").mkdir(exist_ok=True)
            self.paths[name] = (
                directory / f"kvsnap-capture-{name}" / f"capture-{tokens}.safetensors"
            )
        self.kv_bytes = sum(
            t.tensor.numel() * t.tensor.element_size() for t in self.source.layout.tensors
        )

    def capture(self, name: str, trace: Callable[..., None] | None = None) -> object:
        """One capture by path ``name`` (the tuning it needs set for the call only)."""
        from benchmarks.engine import SOURCE

        previous = (
            tuning.MAPPED_WRITE_MIN_BYTES,
            tuning.SPARE_CAPTURE_FILES_BYTES,
            tuning.SPARE_CAPTURE_FILES_REGISTERED,
        )
        tuning.MAPPED_WRITE_MIN_BYTES = 1 << 62 if name == "write" else 0
        # Room for a spare in each directory that keeps one (one 8,192-token file is 1.07 GB).
        tuning.SPARE_CAPTURE_FILES_BYTES = 0 if name == "dma" else 4 * self.kv_bytes
        tuning.SPARE_CAPTURE_FILES_REGISTERED = name != "dma_spare_populated"
        try:
            return self.pipeline.capture(
                [self.sequence], self.paths[name], source=SOURCE, reproducible=True, trace=trace
            )
        finally:
            (
                tuning.MAPPED_WRITE_MIN_BYTES,
                tuning.SPARE_CAPTURE_FILES_BYTES,
                tuning.SPARE_CAPTURE_FILES_REGISTERED,
            ) = previous

    def checked(self) -> dict[str, object]:
        """Every path once (the spare paths twice: the second call takes the spare the first
        left): the path each DMA capture took, whether every path gave the staged file byte for
        byte, and whether the file written into a spare restores bit-exact."""
        from kvsnap.snapshot import Snapshot

        results = {}
        for name in CAPTURE_PATHS:
            results[name] = self.capture(name)
            if name.startswith("dma_spare"):
                background_settled()
                kinds: list[str] = []
                results[name] = self.capture(name, lambda kind, *_, seen=kinds: seen.append(kind))
                results[f"{name}_taken"] = "setup.map.spare" in kinds
        with Snapshot.open(self.paths["dma_spare"]) as snap:
            snap.restore(self.target.layout, {"s": self.ids})
        torch.cuda.synchronize()
        pairs = zip(self.source.layout.tensors, self.target.layout.tensors, strict=True)
        staged = self.paths["write"].read_bytes()
        row: dict[str, object] = {"file_bytes": len(staged)}
        for name in CAPTURE_PATHS[:-1]:
            row[f"{name}_data_path"] = results[name].data_path  # type: ignore[attr-defined]
            row[f"{name}_same_file"] = self.paths[name].read_bytes() == staged
        row["spare_taken"] = results["dma_spare_taken"]
        row["spare_populated_taken"] = results["dma_spare_populated_taken"]
        row["dma_refused"] = results["dma"].dma_refused  # type: ignore[attr-defined]
        row["dma_spare_exact"] = all(
            torch.equal(a.tensor.view(torch.uint8), b.tensor.view(torch.uint8)) for a, b in pairs
        )
        return row

    def spans(self, name: str) -> dict[str, float]:
        """One traced capture by ``name``: the summed ms of each kind of span."""
        spans: dict[str, float] = {}

        def trace(kind: str, started: float, finished: float, nbytes: int) -> None:
            spans[kind] = spans.get(kind, 0.0) + (finished - started) * 1e3

        background_settled()
        self.paths[name].unlink(missing_ok=True)
        self.capture(name, trace)
        self.paths[name].unlink()
        return {kind: round(ms, 3) for kind, ms in sorted(spans.items())}

    def remove(self) -> None:
        """Drop the spares and the directories."""
        from kvsnap.store.hot.spare_files import drop_spare_files

        background_settled()
        for path in self.paths.values():
            drop_spare_files(str(path.parent))
            shutil.rmtree(path.parent, ignore_errors=True)


def background_settled() -> float:
    """Wait until no spare file is being made and no mapping waits to be released; the ms
    waited (what the background still had to do)."""
    from kvsnap.store.hot.mapping_release import wait_for_releases
    from kvsnap.store.hot.spare_files import spare_files

    started = time.perf_counter()
    spare_files().wait()
    wait_for_releases()
    return (time.perf_counter() - started) * 1e3


def capture_to_memory(tokens: int, directory: Path, repeat: int) -> dict:
    """Captures of one prefix to ``directory`` (memory-backed) by each of
    :data:`CAPTURE_PATHS`, a raw write of the same bytes and the pinned D2H floor,
    interleaved round by round; medians in ms. Every timed call starts with the background
    settled (the spare made, the last mapping released: what a capture finds when captures
    are further apart than the background's work, reported as ``*_background_ms``)."""
    case = _CaptureCase(tokens, directory)
    row: dict[str, object] = {"tokens": tokens}
    row["default_path"] = "dma" if case.kv_bytes >= tuning.MAPPED_WRITE_MIN_BYTES else "write"
    row["kv_bytes"] = case.kv_bytes
    row.update(case.checked())
    raw_write = _raw_write(directory / f"raw-{tokens}.bin", int(row["file_bytes"]))
    pinned = torch.empty(case.kv_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(pinned, device="cuda").random_(0, 255)
    runs: dict[str, Callable[[], object]] = {
        name: (lambda name=name: case.capture(name)) for name in CAPTURE_PATHS
    }
    runs["raw_write"] = raw_write
    runs["floor"] = lambda: pinned.copy_(device, non_blocking=True)
    timings: dict[str, list[float]] = {name: [] for name in runs}
    background: dict[str, list[float]] = {name: [] for name in CAPTURE_PATHS}
    for round_ in range(repeat + 1):
        for name, run in runs.items():
            if name in case.paths:
                case.paths[name].unlink(missing_ok=True)  # a new file each time, as raw writes
            background_settled()
            elapsed = _once_ms(run)
            settled = background_settled() if name in background else 0.0
            if round_:  # the first round warms up (and leaves the spares)
                timings[name].append(elapsed)
                if name in background:
                    background[name].append(settled)
    medians = {name: statistics.median(values) for name, values in timings.items()}
    row.update({f"{name}_ms": value for name, value in medians.items()})
    row.update({f"{name}_background_ms": statistics.median(v) for name, v in background.items()})
    for name in ("dma_spare", "dma"):
        row[f"raw_over_{name}"] = medians["raw_write"] / medians[name]
        row[f"write_over_{name}"] = medians["write"] / medians[name]
        row[f"floor_over_{name}"] = medians["floor"] / medians[name]
    row["raw_over_write"] = medians["raw_write"] / medians["write"]
    for name in CAPTURE_PATHS:
        row[f"{name}_spans_ms"] = case.spans(name)
    row.update(back_to_back(case, repeat))
    case.remove()
    return row


def back_to_back(case: _CaptureCase, repeat: int) -> dict[str, float]:
    """``repeat`` DMA captures in a row by each DMA path, nothing settled between them (an
    engine saving request after request: the background's unregistering and the next spare
    run beside the next capture, which waits for a spare still being made): medians, ms."""
    background_settled()
    row: dict[str, float] = {}
    for name in CAPTURE_PATHS[:-1]:
        times = []
        for _ in range(repeat + 1):
            case.paths[name].unlink(missing_ok=True)
            times.append(_once_ms(lambda name=name: case.capture(name)))
        row[f"{name}_back_to_back_ms"] = statistics.median(times[1:])
        background_settled()
    return row


def populate_sweep(tokens: int, directory: Path, repeat: int, counts: list[int]) -> dict:
    """DMA captures of one prefix with ``tuning.POPULATE_THREADS`` at each of ``counts``
    (medians in ms, interleaved round by round), and what the machine's tmpfs offers."""
    from benchmarks.engine import SOURCE
    from kvsnap.layout.allocate import allocate_cache
    from kvsnap.pipeline import Pipeline
    from kvsnap.snapshot import SequenceBlocks

    blocks = tokens // 16
    shape = {"num_layers": 32, "num_blocks": blocks, "block_size": 16, "num_kv_heads": 8}
    source = allocate_cache("vllm-nhd", **shape, head_dim=128, dtype=torch.bfloat16, device="cuda")
    pipeline = Pipeline(source.layout)
    sequence = SequenceBlocks("s", np.arange(tokens), np.arange(blocks, dtype=np.int64))
    path = directory / f"sweep-{tokens}.safetensors"
    previous = (
        tuning.POPULATE_THREADS,
        tuning.MAPPED_WRITE_MIN_BYTES,
        tuning.SPARE_CAPTURE_FILES_BYTES,
    )
    timings: dict[int, list[float]] = {count: [] for count in counts}
    try:
        tuning.MAPPED_WRITE_MIN_BYTES = 0
        tuning.SPARE_CAPTURE_FILES_BYTES = 0  # every capture populates its own file
        for round_ in range(repeat + 1):
            for count in counts:
                tuning.POPULATE_THREADS = count
                path.unlink(missing_ok=True)
                elapsed = _once_ms(lambda: pipeline.capture([sequence], path, source=SOURCE))
                if round_:
                    timings[count].append(elapsed)
    finally:
        (
            tuning.POPULATE_THREADS,
            tuning.MAPPED_WRITE_MIN_BYTES,
            tuning.SPARE_CAPTURE_FILES_BYTES,
        ) = previous
        path.unlink(missing_ok=True)
    row: dict[str, object] = {"tokens": tokens}
    row.update({f"dma_ms_{count}_threads": statistics.median(timings[count]) for count in counts})
    thp = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    row["shmem_thp"] = thp.read_text().strip() if thp.exists() else None
    mounts = Path("/proc/mounts").read_text().splitlines()
    row["mount"] = next((line for line in mounts if f" {directory} " in f" {line} "), None)
    return row


def _raw_write(path: Path, num_bytes: int) -> Callable[[], None]:
    """A raw write of ``num_bytes`` from pinned memory into a new file at ``path``: created,
    written in 64 MiB ``pwrite``s, fsynced, closed and removed again."""
    source = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    source.random_(0, 255)
    view = memoryview(source.numpy())
    chunk = 64 << 20

    def run() -> None:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            for offset in range(0, num_bytes, chunk):
                os.pwrite(fd, view[offset : offset + chunk], offset)
            os.fsync(fd)
        finally:
            os.close(fd)
            path.unlink()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--sizes", default="128,2048,8192", help="'' for none")
    parser.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--disk-dir", type=Path, default=None)
    parser.add_argument("--fixed", action="store_true")
    parser.add_argument("--profile", default="", help="prefix lengths to profile, e.g. 128,2048")
    parser.add_argument("--profile-engine", default="", help="prefix lengths, e.g. 2048")
    parser.add_argument("--profile-dir", type=Path, default=Path("."))
    parser.add_argument("--repeat", type=int, default=30, help="timed calls per fixed-cost case")
    parser.add_argument(
        "--capture", default="", help="prefix lengths to time captures of, e.g. 128,2048,8192"
    )
    parser.add_argument("--capture-repeat", type=int, default=9, help="timed rounds per size")
    parser.add_argument(
        "--populate-sweep", default="", help="populating threads to time at 2,048 tokens, e.g. 1,8"
    )
    args = parser.parse_args()
    kvikio = _kvikio()
    out: dict[str, object] = {
        "torch": torch.__version__,
        "kvikio": getattr(kvikio, "__version__", None),
    }
    captures = []
    for tokens in [int(size) for size in args.capture.split(",") if size]:
        row = capture_to_memory(tokens, args.shm_dir, args.capture_repeat)
        captures.append(row)
        print(json.dumps(row), flush=True)
    out["captures"] = captures
    if args.populate_sweep:
        counts = [int(count) for count in args.populate_sweep.split(",")]
        out["populate_sweep"] = populate_sweep(2048, args.shm_dir, args.capture_repeat, counts)
        print(json.dumps(out["populate_sweep"]), flush=True)
    if not args.sizes and not args.profile and not args.profile_engine:
        # Captures only: no model to build.
        if args.json_out is not None:
            args.json_out.parent.mkdir(parents=True, exist_ok=True)
            args.json_out.write_text(json.dumps(out, indent=1))
        return
    model = build_model()
    for tokens in [int(size) for size in args.profile.split(",") if size]:
        profile(model, tokens, args.shm_dir, args.profile_dir)
    rows = []
    for tokens in [int(size) for size in args.sizes.split(",") if size]:
        row = one_prefix(model, tokens, args.shm_dir, kvikio)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out["prefixes"] = rows
    for tokens in [int(size) for size in args.profile_engine.split(",") if size]:
        engine_path(tokens, args.shm_dir, args.profile_dir)
    if args.disk_dir is not None:
        out["disk"] = disk_prefix(model, 2048, args.disk_dir)
        print(json.dumps(out["disk"]), flush=True)
    if args.fixed:
        del model
        torch.cuda.empty_cache()
        out["fixed"] = fixed(args.shm_dir, args.repeat)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
