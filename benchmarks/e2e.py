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
* time to first byte: from calling ``capture`` to the first staging slot handed to the writer,
  with the pinned pool cold (first capture in the process) and warm.

Prints a table and writes the figures as JSON (``--json-out``). Without CUDA it runs the same
pipeline on CPU tensors (useful to check the script; the figures then mean little).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvsnap.format import SourceInfo
from kvsnap.layout import vllm_split_layout
from kvsnap.pinned import PinnedPool
from kvsnap.plan import Direction, HostPages, PageCopy
from kvsnap.snapshot import (
    DEFAULT_STAGING_BYTES,
    DEFAULT_STAGING_SLOTS,
    SequenceBlocks,
    Snapshot,
    capture,
)
from kvsnap.transfer import TransferHandler

SOURCE = SourceInfo("benchmark", torch.__version__, "synthetic", None, "0" * 32)
CHUNK_BYTES = 64 << 20


@dataclass
class Geometry:
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * 2


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
        staging = staging_mib << 20
        captured = capture(
            layout, sequences, path, source=SOURCE, staging_bytes=staging, staging_slots=slots
        )
        drop_page_cache(path)
        with Snapshot.open(path) as snap:
            restored = snap.restore(
                target_layout,
                {s.id: s.block_ids for s in sequences},
                staging_bytes=staging,
                staging_slots=slots,
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
    parser.add_argument("--staging-mib", type=int, default=DEFAULT_STAGING_BYTES >> 20)
    parser.add_argument("--staging-slots", type=int, default=DEFAULT_STAGING_SLOTS)
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="only time capture and restore for several staging sizes and slot counts",
    )
    parser.add_argument(
        "--skip-compute", action="store_true", help="skip the alongside-compute run"
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
    staging = args.staging_mib << 20
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
    slots = args.staging_slots

    # Time to first byte: the first capture in this process (cold: CUDA context, allocator and
    # pinning all start here), then a second one (warm; capture still pins its own pool).
    for label in ("ttfb_cold_ms", "ttfb_warm_ms"):
        first_byte: list[float] = []
        started = time.perf_counter()
        capture(
            layout,
            sequences[:1],
            args.dir / "ttfb.safetensors",
            source=SOURCE,
            staging_bytes=staging,
            staging_slots=slots,
            progress=lambda done, total, marks=first_byte, t0=started: (
                marks.append(time.perf_counter() - t0) if not marks else None
            ),
        )
        results[label] = first_byte[0] * 1e3

    raw_path = args.dir / "raw.bin"
    results["raw_write_gbs"] = kv_bytes / raw_direct_write(raw_path, kv_bytes) / 1e9
    results["raw_read_gbs"] = kv_bytes / raw_direct_read(raw_path) / 1e9
    raw_path.unlink()

    snap_path = args.dir / "snap.safetensors"
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base_gpu = torch.cuda.memory_allocated() if device == "cuda" else 0
    reset_peak_rss()
    base_rss = current_rss_bytes()
    result = capture(
        layout, sequences, snap_path, source=SOURCE, staging_bytes=staging, staging_slots=slots
    )
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
    with Snapshot.open(snap_path) as snap:
        restore = snap.restore(
            target_layout,
            {s.id: s.block_ids for s in sequences},
            staging_bytes=staging,
            staging_slots=slots,
        )
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
        busy = capture(
            layout, sequences, snap_path, source=SOURCE, staging_bytes=staging, staging_slots=slots
        )
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
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
