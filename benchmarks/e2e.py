"""End-to-end capture and restore against the disk and format ceilings, measured side by side.

Run on a CUDA machine (``python -m benchmarks.e2e --size-gib 8 --dir /tmp/bench``). One run
measures, on the same disk and the same bytes:

* kvsnap ``capture`` of a vLLM split NHD cache (checksums on) vs a raw O_DIRECT write of the
  same number of bytes from pinned memory (+ fsync) vs ``safetensors.save_file`` of the same
  tensors (after a ``.cpu()`` copy, which is timed separately);
* kvsnap ``restore`` (checksums verified) vs a raw O_DIRECT read vs ``safetensors.load_file``
  plus the host→device copy;
* peak host RSS growth and peak extra GPU memory of capture and restore;
* capture while a matmul loop runs on the compute stream: capture bandwidth and the loop's
  slowdown against running alone;
* time to first byte: from calling ``capture`` to the first staging slot handed to the writer:
  the first capture in the process (cold), a second one (its own pool, pinned again), and one
  staging through a pool pinned beforehand (``capture(staging=pool)``, what an engine keeping
  a pool warm gets).

With ``--timeline`` the measured capture and restore (and the three first-byte captures)
report every step through their ``trace`` hook: setup (handlers, pool, writer), per staging slot
the wait for a free slot and the transfer, per piece the checksum and the ``pwrite``/``pread``
(with bytes), verification, and the commit's drain, checksums, fsync and publish. It prints per
step kind the count, summed and longest time, and for the disk its busy time, the idle gaps
between writes (reads), and the share of the run with 0, 1 or 2+ of them in flight; the JSON
holds the same plus every span (``timeline.<run>.spans``: kind, start ms, duration ms, bytes).
It also times a raw O_DIRECT write from 4 threads into a file reserved up front, to tell whether
the disk rewards parallel writes (kvsnap writes one stream: on the H200 machine it did not).

Prints a table and writes the figures as JSON (``--json-out``). Without CUDA it runs the same
pipeline on CPU tensors: the transfers are host copies on the calling thread, so GB/s mean
little, but the ratio to the raw disk and the disk's idle gaps still show host-side overheads.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvsnap.format import SourceInfo
from kvsnap.layout import vllm_split_layout
from kvsnap.pipeline import StagingOptions
from kvsnap.snapshot import SequenceBlocks, Snapshot, capture
from kvsnap.transfer import TransferHandler
from kvsnap.transfer.pinned import PinnedPool
from kvsnap.transfer.plan import Direction, HostPages, PageCopy

SOURCE = SourceInfo("benchmark", torch.__version__, "synthetic", None, "0" * 32)
CHUNK_BYTES = 64 << 20
#: A pause of the disk shorter than this is request turnaround, not idling.
IDLE_GAP_S = 1e-3


class Timeline:
    """The spans one capture or restore reports through its ``trace`` hook, and where the time
    went: setup, per-kind totals, disk busy time and idle gaps, writes or reads in flight."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.spans: list[tuple[str, float, float, int]] = []

    def __call__(self, kind: str, started: float, finished: float, nbytes: int) -> None:
        self.spans.append((kind, started, finished, nbytes))

    def of(self, kind: str) -> list[tuple[float, float]]:
        return sorted((start, end) for name, start, end, _ in self.spans if name == kind)

    def kinds(self) -> dict[str, dict[str, float]]:
        """Per kind: how many spans, their summed and longest duration, and their bytes."""
        table: dict[str, dict[str, float]] = {}
        for kind, start, end, nbytes in self.spans:
            row = table.setdefault(kind, {"count": 0, "seconds": 0.0, "max_ms": 0.0, "bytes": 0})
            row["count"] += 1
            row["seconds"] += end - start
            row["max_ms"] = max(row["max_ms"], (end - start) * 1e3)
            row["bytes"] += nbytes
        return table

    def first_spans(self) -> dict[str, list[float]]:
        """Per kind, its first span as [start, duration] in ms from the call: the critical path
        to the first byte."""
        first: dict[str, list[float]] = {}
        for kind, start, end, _ in sorted(self.spans, key=lambda span: span[1]):
            first.setdefault(kind, [(start - self.started) * 1e3, (end - start) * 1e3])
        return first

    def disk(self, kind: str, finished: float) -> dict[str, float]:
        """Busy time of the disk spans ``kind`` (their union), the idle gaps between them, and
        the share of the run with 0, 1, 2 or more of them in flight."""
        spans = self.of(kind)
        if not spans:
            return {}
        busy, gaps, in_flight = 0.0, [], {0: 0.0, 1: 0.0, 2: 0.0}
        run_start, run_end = spans[0]
        for start, end in spans[1:]:
            if start > run_end:
                busy += run_end - run_start
                gaps.append(start - run_end)
                run_start = start
            run_end = max(run_end, end)
        busy += run_end - run_start
        edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
        depth, previous = 0, self.started
        for moment, step in [*edges, (finished, 0)]:
            in_flight[min(depth, 2)] += moment - previous
            depth, previous = depth + step, moment
        total = finished - self.started
        long_gaps = [gap for gap in gaps if gap >= IDLE_GAP_S]
        return {
            "first_start_ms": (spans[0][0] - self.started) * 1e3,
            "last_end_after_ms": (finished - run_end) * 1e3,
            "busy_s": busy,
            "idle_between_s": sum(gaps),
            "idle_gaps_over_1ms": len(long_gaps),
            "idle_in_gaps_over_1ms_s": sum(long_gaps),
            "max_gap_ms": max(gaps, default=0.0) * 1e3,
            "mean_in_flight": sum(end - start for start, end in spans) / busy if busy else 0.0,
            "share_0_in_flight": in_flight[0] / total,
            "share_1_in_flight": in_flight[1] / total,
            "share_2plus_in_flight": in_flight[2] / total,
        }

    def summary(self, disk_kind: str) -> dict[str, object]:
        finished = max(end for _, _, end, _ in self.spans)
        return {
            "wall_s": finished - self.started,
            "first_ms": self.first_spans(),
            "kinds": self.kinds(),
            "disk": self.disk(disk_kind, finished),
            "spans": [
                [kind, round((start - self.started) * 1e3, 3), round((end - start) * 1e3, 3), n]
                for kind, start, end, n in sorted(self.spans, key=lambda span: span[1])
            ],
        }


def print_first_spans(label: str, summary: dict) -> None:
    """One line: when each step first started and how long it took, up to the first write."""
    first = summary["first_ms"]
    steps = sorted(first.items(), key=lambda item: item[1][0])
    shown = "  ".join(f"{kind} @{start:.1f}+{length:.1f}" for kind, (start, length) in steps[:9])
    print(f"timeline {label} (first of each step, ms): {shown}")


def print_timeline(label: str, summary: dict, disk_kind: str) -> None:
    """A few lines: setup, per-kind totals and the disk's busy and idle time."""
    kinds, disk = summary["kinds"], summary["disk"]
    print(f"timeline {label}: {summary['wall_s']:.3f} s wall")
    for kind, row in sorted(kinds.items(), key=lambda item: -item[1]["seconds"]):
        moved = row["bytes"] and row["seconds"] > 0
        rate = f"  {row['bytes'] / row['seconds'] / 1e9:6.2f} GB/s each" if moved else ""
        print(
            f"  {kind:<18} {int(row['count']):>6} x  total {row['seconds']:8.3f} s  "
            f"mean {row['seconds'] / row['count'] * 1e3:8.2f} ms  max {row['max_ms']:8.2f} ms"
            f"{rate}"
        )
    if disk:
        print(
            f"  disk ({disk_kind}): first at {disk['first_start_ms']:.1f} ms, busy "
            f"{disk['busy_s']:.3f} s, idle between {disk['idle_between_s']:.3f} s "
            f"({disk['idle_gaps_over_1ms']} gaps >= 1 ms, max {disk['max_gap_ms']:.1f} ms), "
            f"after last {disk['last_end_after_ms']:.1f} ms; mean in flight "
            f"{disk['mean_in_flight']:.2f}; share of wall with 0/1/2+ in flight "
            f"{disk['share_0_in_flight']:.2f}/{disk['share_1_in_flight']:.2f}/"
            f"{disk['share_2plus_in_flight']:.2f}"
        )


@dataclass
class Geometry:
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16

    @property
    def page_bytes(self) -> int:
        """One canonical page: one block of one layer's key or value."""
        return self.block_size * self.num_kv_heads * self.head_dim * 2

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * 2


def time_to_first_byte(
    layout, sequences: list[SequenceBlocks], path: Path, timeline: Timeline | None, **options
) -> float:
    """Milliseconds from calling ``capture`` to its first slot handed to the writer."""
    marks: list[float] = []
    started = time.perf_counter()

    def first_progress(done: int, total: int) -> None:
        if not marks:
            marks.append(time.perf_counter() - started)

    capture(
        layout, sequences, path, source=SOURCE, progress=first_progress, trace=timeline, **options
    )
    return marks[0] * 1e3


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> None:
    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        pass


def current_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to forget ``path``'s cached pages so reads hit the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_direct_write(path: Path, num_bytes: int) -> float:
    """Seconds to write ``num_bytes`` with O_DIRECT from an aligned buffer, then fsync."""
    buffer = mmap.mmap(-1, CHUNK_BYTES)
    buffer.write(os.urandom(1 << 20) * (CHUNK_BYTES >> 20))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    started = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        written = 0
        while written < num_bytes:
            written += os.write(fd, memoryview(buffer)[: min(CHUNK_BYTES, num_bytes - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def raw_direct_write_parallel(path: Path, num_bytes: int, threads: int = 4) -> float:
    """Seconds to write ``num_bytes`` with O_DIRECT from ``threads`` threads in CHUNK_BYTES
    pieces into a file whose blocks are reserved first (as kvsnap reserves them), + fsync.
    Next to :func:`raw_direct_write` it says whether this disk rewards writes in parallel."""
    buffer = mmap.mmap(-1, CHUNK_BYTES)
    buffer.write(os.urandom(1 << 20) * (CHUNK_BYTES >> 20))
    offsets = range(0, num_bytes, CHUNK_BYTES)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    try:
        os.posix_fallocate(fd, 0, num_bytes)

        def write(offset: int) -> None:
            view = memoryview(buffer)[: min(CHUNK_BYTES, num_bytes - offset)]
            while len(view):
                written = os.pwrite(fd, view, offset)
                view, offset = view[written:], offset + written

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(write, offsets))
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started


def raw_direct_read(path: Path) -> float:
    """Seconds to read ``path`` with O_DIRECT into an aligned buffer."""
    drop_page_cache(path)
    buffer = mmap.mmap(-1, CHUNK_BYTES)
    started = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        while os.readv(fd, [buffer]) > 0:
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - started


def build_cache(geometry: Geometry, num_blocks: int, device: str) -> list[torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (num_blocks, 2, geometry.block_size, geometry.num_kv_heads, geometry.head_dim)
    return [
        torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16)
        for _ in range(geometry.num_layers)
    ]


def sequences_over(
    num_blocks: int, block_size: int, blocks_per_sequence: int
) -> list[SequenceBlocks]:
    rng = np.random.default_rng(0)
    order = rng.permutation(num_blocks)
    sequences = []
    for index, start in enumerate(
        range(0, num_blocks - blocks_per_sequence + 1, blocks_per_sequence)
    ):
        tokens = rng.integers(0, 32_000, size=blocks_per_sequence * block_size)
        sequences.append(
            SequenceBlocks(f"seq-{index}", tokens, order[start : start + blocks_per_sequence])
        )
    return sequences


def matmul_loop(stop: threading.Event, device: str, counter: list[int]) -> None:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(8):
            a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        counter[0] += 8


def matmul_rate(seconds: float, device: str) -> float:
    stop = threading.Event()
    counter = [0]
    thread = threading.Thread(target=matmul_loop, args=(stop, device, counter))
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join()
    return counter[0] / seconds


def transfer_rate(
    layout, block_ids: np.ndarray, sm_budget: int | None, seconds: float, with_compute: bool
) -> tuple[float, float]:
    """GPU→host GB/s of repeated capture-shaped copies (no disk), and the matmul loop's rate.

    ``sm_budget`` runs the copies on the Triton kernel with that many programs (what
    ``capture(sm_budget=...)`` does); ``None`` uses ``auto``. With ``with_compute`` the matmul
    loop runs on the default stream meanwhile, which the copies wait on, as an engine's would.
    """
    page = layout.geometry.canonical_page_size_bytes
    count = min(len(block_ids), (256 << 20) // page)
    ids = block_ids[:count]
    options = None if sm_budget is None else {"triton": {"max_programs": sm_budget}}
    backend = "auto" if sm_budget is None else "triton"
    stop = threading.Event()
    counter = [0]
    thread = threading.Thread(target=matmul_loop, args=(stop, "cuda", counter))
    with PinnedPool(count * page, 1) as pool:
        host = HostPages.contiguous(pool.slot(0).data_ptr, count, page)
        handler = TransferHandler(
            layout, Direction.DEVICE_TO_HOST, backend=backend, backend_options=options
        )
        if with_compute:
            thread.start()
        moved, job = 0, 0
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            for name in layout.geometry.tensor_names():
                copy = PageCopy(name, ids, host, np.arange(count, dtype=np.int64))
                handler.submit(job, [copy])
                (result,) = handler.wait([job])
                assert result.success, result.error
                job += 1
                moved += count * page
        elapsed = time.perf_counter() - started
        stop.set()
        if with_compute:
            thread.join()
        handler.shutdown()
    return moved / elapsed / 1e9, counter[0] / elapsed


def sm_budget_table(layout, block_ids: np.ndarray) -> dict[str, float]:
    """Per SM budget: copy GB/s alone and beside the matmul loop, and the loop's slowdown."""
    results: dict[str, float] = {}
    alone = matmul_rate(3.0, "cuda")
    print(f"{'budget':>8} {'copy GB/s alone':>16} {'with compute':>13} {'matmul slowdown':>16}")
    for budget in (None, 4, 8, 16, 32):
        label = "auto" if budget is None else str(budget)
        solo, _ = transfer_rate(layout, block_ids, budget, 2.0, with_compute=False)
        busy, rate = transfer_rate(layout, block_ids, budget, 3.0, with_compute=True)
        slowdown = (1 - rate / alone) * 100
        print(f"{label:>8} {solo:>16.1f} {busy:>13.1f} {slowdown:>15.1f}%", flush=True)
        results[f"sm_budget_{label}_alone_gbs"] = solo
        results[f"sm_budget_{label}_with_compute_gbs"] = busy
        results[f"sm_budget_{label}_slowdown_pct"] = slowdown
    return results


def sweep(layout, cache, sequences, kv_bytes: int, directory: Path) -> None:
    """Capture and restore GB/s for a grid of staging sizes and slot counts."""
    target_layout = vllm_split_layout([torch.zeros_like(tensor) for tensor in cache])
    path = directory / "sweep.safetensors"
    print(f"{'staging MiB':>12} {'slots':>6} {'capture GB/s':>13} {'restore GB/s':>13}")
    for staging_mib, slots in ((128, 4), (256, 4), (256, 8), (512, 8), (512, 16), (1024, 16)):
        staging_options = StagingOptions(slot_bytes=(staging_mib << 20) // slots, num_slots=slots)
        captured = capture(layout, sequences, path, source=SOURCE, staging=staging_options)
        drop_page_cache(path)
        with Snapshot.open(path) as snap:
            restored = snap.restore(
                target_layout,
                {s.id: s.block_ids for s in sequences},
                staging=staging_options,
            )
        print(
            f"{staging_mib:>12} {slots:>6} {kv_bytes / captured.seconds / 1e9:>13.3f} "
            f"{kv_bytes / restored.seconds / 1e9:>13.3f}",
            flush=True,
        )
    path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=8.0, help="KV bytes to capture")
    parser.add_argument(
        "--dir", type=Path, default=Path("/tmp/kvsnap-bench"), help="directory on the disk to test"
    )
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument(
        "--staging-mib",
        type=int,
        default=None,
        help="stage through a private pool of this size (default: kvsnap's process-wide slots)",
    )
    parser.add_argument("--staging-slots", type=int, default=8)
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="only time capture and restore for several staging sizes and slot counts",
    )
    parser.add_argument(
        "--skip-compute", action="store_true", help="skip the alongside-compute run"
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="record where the measured capture's and restore's time goes (printed, and in "
        "the JSON under 'timeline')",
    )
    parser.add_argument(
        "--sm-budget-only",
        action="store_true",
        help="only measure copies beside compute for several SM budgets (CUDA)",
    )
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    geometry = Geometry()
    num_blocks = max(64, int(args.size_gib * (1 << 30)) // geometry.block_bytes)
    args.dir.mkdir(parents=True, exist_ok=True)
    staging_options = (
        None
        if args.staging_mib is None
        else StagingOptions(
            slot_bytes=(args.staging_mib << 20) // args.staging_slots,
            num_slots=args.staging_slots,
        )
    )
    results: dict[str, float | int | str] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"
    }

    cache = build_cache(geometry, num_blocks, device)
    layout = vllm_split_layout(cache)
    sequences = sequences_over(num_blocks, geometry.block_size, 64)
    kv_bytes = sum(len(s.block_ids) for s in sequences) * geometry.block_bytes
    results["kv_bytes"] = kv_bytes
    if args.sweep:
        sweep(layout, cache, sequences, kv_bytes, args.dir)
        return
    if args.sm_budget_only:
        table = sm_budget_table(layout, np.concatenate([s.block_ids for s in sequences]))
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(table, indent=2))
        return
    timelines: dict[str, dict] = {}

    # Time to first byte: the first capture in this process (cold: allocator, backends and
    # pinning all start here), a second one (warm process; capture still pins its own pool),
    # and one staging through a pool that is already pinned (what an engine keeping a pool
    # warm gets).
    ttfb_path = args.dir / "ttfb.safetensors"
    for label in ("ttfb_cold", "ttfb_warm"):
        timeline = Timeline() if args.timeline else None
        results[f"{label}_ms"] = time_to_first_byte(
            layout, sequences[:1], ttfb_path, timeline, staging=staging_options
        )
        if timeline is not None:
            timelines[label] = timeline.summary("write")
    slot_bytes = (64 << 20) // geometry.page_bytes * geometry.page_bytes
    with PinnedPool(slot_bytes, 4) as warm_pool:
        timeline = Timeline() if args.timeline else None
        results["ttfb_warm_pool_ms"] = time_to_first_byte(
            layout, sequences[:1], ttfb_path, timeline, staging=warm_pool
        )
        if timeline is not None:
            timelines["ttfb_warm_pool"] = timeline.summary("write")

    raw_path = args.dir / "raw.bin"
    results["raw_write_gbs"] = kv_bytes / raw_direct_write(raw_path, kv_bytes) / 1e9
    results["raw_read_gbs"] = kv_bytes / raw_direct_read(raw_path) / 1e9
    raw_path.unlink()
    if args.timeline:
        seconds = raw_direct_write_parallel(raw_path, kv_bytes)
        results["raw_write_parallel_reserved_gbs"] = kv_bytes / seconds / 1e9
        raw_path.unlink()

    snap_path = args.dir / "snap.safetensors"
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base_gpu = torch.cuda.memory_allocated() if device == "cuda" else 0
    reset_peak_rss()
    base_rss = current_rss_bytes()
    capture_timeline = Timeline() if args.timeline else None
    result = capture(
        layout,
        sequences,
        snap_path,
        source=SOURCE,
        staging=staging_options,
        trace=capture_timeline,
    )
    if capture_timeline is not None:
        timelines["capture"] = capture_timeline.summary("write")
    results["capture_gbs"] = kv_bytes / result.seconds / 1e9
    results["capture_backend"] = result.backend
    results["capture_direct_io_fallback"] = str(result.direct_io_fallback)
    results["capture_peak_rss_growth_mib"] = (peak_rss_bytes() - base_rss) / 2**20
    if device == "cuda":
        results["capture_peak_extra_gpu_mib"] = (
            torch.cuda.max_memory_allocated() - base_gpu
        ) / 2**20

    # zeros, not empty: the pages are touched now, so RSS growth below is the pipeline alone.
    target = [torch.zeros_like(tensor) for tensor in cache]
    target_layout = vllm_split_layout(target)
    drop_page_cache(snap_path)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_gpu = torch.cuda.memory_allocated()
    reset_peak_rss()
    base_rss = current_rss_bytes()
    restore_timeline = Timeline() if args.timeline else None
    with Snapshot.open(snap_path) as snap:
        restore = snap.restore(
            target_layout,
            {s.id: s.block_ids for s in sequences},
            staging=staging_options,
            trace=restore_timeline,
        )
    if restore_timeline is not None:
        timelines["restore"] = restore_timeline.summary("read")
    results["restore_gbs"] = kv_bytes / restore.seconds / 1e9
    results["restore_backend"] = restore.backend
    results["restore_peak_rss_growth_mib"] = (peak_rss_bytes() - base_rss) / 2**20
    if device == "cuda":
        results["restore_peak_extra_gpu_mib"] = (
            torch.cuda.max_memory_allocated() - base_gpu
        ) / 2**20
    used = torch.from_numpy(np.concatenate([s.block_ids for s in sequences])).to(device)
    results["restore_bit_exact"] = str(
        all(
            torch.equal(a[used].view(torch.int16), b[used].view(torch.int16))
            for a, b in zip(cache, target, strict=True)
        )
    )
    del target
    # Only one copy of the KV on the disk at a time (20 GiB runs fill a small disk otherwise).
    snap_path.unlink()

    # safetensors' own save/load of the same tensors (the used blocks, per layer tensor).
    st_path = args.dir / "st.safetensors"
    started = time.perf_counter()
    host = {f"layers.{i}": tensor[used].cpu() for i, tensor in enumerate(cache)}
    results["st_gather_to_host_s"] = time.perf_counter() - started
    from safetensors.torch import load_file, save_file

    started = time.perf_counter()
    save_file(host, str(st_path))
    os.sync()
    results["st_save_gbs"] = kv_bytes / (time.perf_counter() - started) / 1e9
    del host
    drop_page_cache(st_path)
    started = time.perf_counter()
    loaded = load_file(str(st_path), device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    results["st_load_gbs"] = kv_bytes / (time.perf_counter() - started) / 1e9
    del loaded
    st_path.unlink()

    if device == "cuda" and not args.skip_compute:
        alone = matmul_rate(3.0, device)
        stop = threading.Event()
        counter = [0]
        thread = threading.Thread(target=matmul_loop, args=(stop, device, counter))
        thread.start()
        started = time.perf_counter()
        busy = capture(layout, sequences, snap_path, source=SOURCE, staging=staging_options)
        elapsed = time.perf_counter() - started
        stop.set()
        thread.join()
        results["compute_capture_gbs"] = kv_bytes / busy.seconds / 1e9
        results["compute_slowdown_pct"] = (1 - (counter[0] / elapsed) / alone) * 100

    shutil.rmtree(args.dir, ignore_errors=True)
    results["capture_vs_raw_write"] = results["capture_gbs"] / results["raw_write_gbs"]
    results["restore_vs_raw_read"] = results["restore_gbs"] / results["raw_read_gbs"]
    width = max(len(key) for key in results)
    for key, value in results.items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
    for label, summary in timelines.items():
        if label.startswith("ttfb"):
            print_first_spans(label, summary)
        else:
            print_timeline(label, summary, "read" if label == "restore" else "write")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({**results, "timeline": timelines}, indent=2))


if __name__ == "__main__":
    main()
