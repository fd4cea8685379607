"""TP capture and restore across processes, one GPU each: how kvsnap scales with the GPUs.

``python -m benchmarks.tp_scaling --gpus 2 --json-out out/tp.json`` spawns one process per GPU
(gloo group for control messages only), each holding its TP rank's heads of an 8B-shaped and a
70B-shaped vLLM cache (split NHD, bf16, 16-token blocks) of ``--gib-per-gpu`` per GPU, and
measures side by side in one run, per target directory (a memory-backed one and the disk):

* the ceilings with every GPU at once: pinned copy GPU->host and host->GPU, a raw write of the
  same bytes from pinned memory into the target, a 16-thread read of the page-cached file;
* ``kvsnap.distributed.capture`` at TP = number of GPUs (each rank writes its own part), then
  ``kvsnap.distributed.restore`` of it at the same TP from the page cache, checked bit-exact;
* the same on one GPU alone moving the same bytes per GPU (a TP=1 model of the per-GPU heads),
  so the table reads as aggregate GB/s of N GPUs against 1;
* a TP=1 restore of the TP=N snapshot into one GPU holding every head, checked bit-exact
  (page digests computed on each GPU, only the digests are exchanged).

``--share-gpu`` puts every rank on GPU 0 (a correctness run on a one-GPU machine; its GB/s say
nothing about scaling).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from kvsnap import distributed
from kvsnap.layout.allocate import AllocatedCache, allocate_cache
from kvsnap.pipeline import SequenceBlocks
from kvsnap.snapshot import Snapshot
from kvsnap.transfer.pinned import PinnedPool

BLOCK = 16
SHAPES = {"8b": (32, 8, 128), "70b": (80, 8, 128)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--gib-per-gpu", type=float, default=4.0)
    parser.add_argument("--shapes", default="8b,70b")
    parser.add_argument("--targets", default="shm,disk", help="shm: /dev/shm; disk: --disk-dir")
    parser.add_argument("--disk-dir", default=str(Path.home() / "kvsnap-tp"))
    parser.add_argument("--share-gpu", action="store_true")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        for target in args.targets.split(","):
            for world in sorted({1, args.gpus}):
                rows.append(_spawn(world, shape, target, args))
                print(json.dumps(rows[-1]), flush=True)
    _print_table(rows)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2))


def _spawn(world: int, shape: str, target: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one configuration in ``world`` processes; rank 0's report."""
    base = Path("/dev/shm") if target == "shm" else Path(args.disk_dir)
    base.mkdir(parents=True, exist_ok=True)
    directory = Path(tempfile.mkdtemp(prefix="kvsnap-tp-", dir=base))
    job = {
        "shape": shape,
        "target": target,
        "gpus": args.gpus,
        "gib_per_gpu": args.gib_per_gpu,
        "share_gpu": args.share_gpu,
        "directory": str(directory),
        "rendezvous": str(directory / "rdv"),
        "report": str(directory / "report.json"),
    }
    try:
        torch.multiprocessing.spawn(_rank_main, args=(world, job), nprocs=world, join=True)
        return json.loads(Path(job["report"]).read_text())
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _rank_main(rank: int, world: int, job: dict[str, Any]) -> None:
    device = torch.device("cuda", 0 if job["share_gpu"] else rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{job['rendezvous']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    try:
        report = _measure(rank, world, job, device)
        if rank == 0:
            Path(job["report"]).write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def _cache(shape: str, world: int, rank: int, gpus: int, gib: float, device: torch.device):
    """This rank's cache: at TP = ``world`` a rank of the model; at ``world == 1`` a TP=1 model
    of one GPU's share of the heads (the same bytes per GPU as the TP = ``gpus`` run)."""
    layers, heads, dim = SHAPES[shape]
    model_heads = heads if world > 1 else heads // gpus
    per_block = layers * 2 * BLOCK * (heads // gpus) * dim * 2
    num_blocks = int(gib * (1 << 30)) // per_block
    return allocate_cache(
        "vllm-nhd",
        num_layers=layers,
        num_blocks=num_blocks,
        block_size=BLOCK,
        num_kv_heads=model_heads,
        head_dim=dim,
        dtype=torch.bfloat16,
        device=device,
        tp_rank=rank,
        tp_size=world,
        fill="empty",
    )


def _measure(rank: int, world: int, job: dict[str, Any], device: torch.device) -> dict[str, Any]:
    gpus, gib = job["gpus"], job["gib_per_gpu"]
    source = _cache(job["shape"], world, rank, gpus, gib, device)
    for tensor in source.tensors:
        tensor.view(torch.int16).random_(generator=None)
    num_blocks = source.layout.num_blocks
    per_gpu_bytes = sum(tensor.numel() * tensor.element_size() for tensor in source.tensors)
    sequences = [SequenceBlocks("s", np.arange(num_blocks * BLOCK), np.arange(num_blocks))]
    directory = Path(job["directory"])
    # Warm once (kernels compiled, staging pinned), as an engine's process is after its first call.
    warm = [SequenceBlocks("w", np.arange(4 * BLOCK), np.arange(4))]
    distributed.capture(source.layout, warm, directory / "warm.safetensors")
    row: dict[str, Any] = {
        "shape": job["shape"],
        "target": job["target"],
        "gpus": world,
        "bytes_per_gpu": per_gpu_bytes,
    }
    with PinnedPool(per_gpu_bytes, 1) as pool:
        pinned = pool.slot(0).tensor
        row["pinned_d2h_gbs"] = _aggregate(
            world, per_gpu_bytes, lambda: _copy(source, pinned, True)
        )
        row["pinned_h2d_gbs"] = _aggregate(
            world, per_gpu_bytes, lambda: _copy(source, pinned, False)
        )
        raw = directory / f"raw-{rank}.bin"
        row["raw_write_gbs"] = _aggregate(world, per_gpu_bytes, lambda: _raw_write(raw, pinned))
        row["read_cached_gbs"] = _aggregate(world, per_gpu_bytes, lambda: _read(raw, pinned))
        raw.unlink()
    path = directory / "snap.safetensors"
    row["capture_gbs"] = _aggregate(
        world, per_gpu_bytes, lambda: distributed.capture(source.layout, sequences, path)
    )
    target = _cache(job["shape"], world, rank, gpus, gib, device)
    blocks = {"s": np.arange(num_blocks)}
    restore = lambda: distributed.restore(path, target.layout, blocks)  # noqa: E731
    restore()  # the page cache holds the snapshot from here on
    row["restore_cached_gbs"] = _aggregate(world, per_gpu_bytes, restore)
    row["bit_exact_tp_same"] = _all_true(
        all(
            torch.equal(a.view(torch.int16), b.view(torch.int16))
            for a, b in zip(source.tensors, target.tensors, strict=True)
        )
    )
    row["capture_over_write"] = row["capture_gbs"] / row["raw_write_gbs"]
    row["restore_over_read"] = row["restore_cached_gbs"] / row["read_cached_gbs"]
    if world > 1:
        row["bit_exact_tp1"] = _restore_on_one_gpu(rank, world, source, path, job, device)
    return row


def _aggregate(world: int, per_gpu_bytes: int, run: Callable[[], object]) -> float:
    """GB/s of every rank running ``run`` at once: all bytes over the slowest rank's time."""
    dist.barrier()
    torch.cuda.synchronize()
    started = time.perf_counter()
    run()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    times: list[float] = [0.0] * world
    dist.all_gather_object(times, seconds)
    return world * per_gpu_bytes / max(times) / 1e9


def _copy(cache: AllocatedCache, pinned: torch.Tensor, to_host: bool) -> None:
    offset = 0
    for tensor in cache.tensors:
        flat = tensor.view(-1).view(torch.uint8)
        host = pinned[offset : offset + flat.numel()]
        (host.copy_(flat, non_blocking=True) if to_host else flat.copy_(host, non_blocking=True))
        offset += flat.numel()


def _raw_write(path: Path, pinned: torch.Tensor) -> None:
    data = memoryview(pinned.numpy())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for offset in range(0, len(data), 64 << 20):
            os.pwrite(fd, data[offset : offset + (64 << 20)], offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(path: Path, pinned: torch.Tensor, threads: int = 16) -> None:
    data = pinned.numpy()
    size, chunk = path.stat().st_size, 4 << 20
    fd = os.open(path, os.O_RDONLY)
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(
                pool.map(
                    lambda o: os.preadv(fd, [memoryview(data[o : o + chunk])], o),
                    range(0, size, chunk),
                )
            )
    finally:
        os.close(fd)


def _all_true(value: bool) -> bool:
    values: list[bool] = [False] * dist.get_world_size()
    dist.all_gather_object(values, bool(value))
    return all(values)


def _page_digests(tensors: list[torch.Tensor], heads: slice) -> list[str]:
    """xxh3-128 per layer tensor of the pages of ``heads`` (on the host: a check, untimed)."""
    import xxhash

    digests = []
    for tensor in tensors:
        for part in range(tensor.shape[1]):  # vLLM split NHD: [blocks, 2, tokens, heads, dim]
            pages = tensor[:, part][:, :, heads].contiguous().view(torch.uint8).cpu().numpy()
            digests.append(xxhash.xxh3_128_hexdigest(pages))
    return digests


def _restore_on_one_gpu(
    rank: int,
    world: int,
    source: AllocatedCache,
    path: Path,
    job: dict[str, Any],
    device: torch.device,
) -> bool:
    """Rank 0 restores the TP=``world`` snapshot into a TP=1 cache of every head; each rank's
    page digests of its own heads must equal those of the same heads restored there."""
    mine = _page_digests(source.tensors, slice(None))
    gathered: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(gathered, mine)
    ok = True
    if rank == 0:
        layers, heads, dim = SHAPES[job["shape"]]
        full = allocate_cache(
            "vllm-nhd",
            num_layers=layers,
            num_blocks=source_blocks(path),
            block_size=BLOCK,
            num_kv_heads=heads,
            head_dim=dim,
            dtype=torch.bfloat16,
            device=device,
            fill="empty",
        )
        with Snapshot.open(path) as snapshot:
            snapshot.restore(full.layout, {"s": np.arange(snapshot.num_blocks)})
        torch.cuda.synchronize()
        per_rank = heads // world
        for other in range(world):
            heads_of = slice(other * per_rank, (other + 1) * per_rank)
            ok &= _page_digests(full.tensors, heads_of) == gathered[other]
    return _all_true(ok)


def source_blocks(path: Path) -> int:
    with Snapshot.open(path) as snapshot:
        return snapshot.num_blocks


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'shape':5} {'target':6} {'gpus':>4} {'GB/gpu':>7} {'d2h':>6} {'write':>6} "
        f"{'capture':>7} {'c/w':>5} {'read':>6} {'restore':>7} {'r/r':>5} exact"
    )
    for row in rows:
        print(
            f"{row['shape']:5} {row['target']:6} {row['gpus']:>4} "
            f"{row['bytes_per_gpu'] / 1e9:7.2f} {row['pinned_d2h_gbs']:6.1f} "
            f"{row['raw_write_gbs']:6.2f} {row['capture_gbs']:7.2f} "
            f"{row['capture_over_write']:5.2f} {row['read_cached_gbs']:6.1f} "
            f"{row['restore_cached_gbs']:7.2f} {row['restore_over_read']:5.2f} "
            f"{row['bit_exact_tp_same']}/{row.get('bit_exact_tp1', '-')}"
        )


if __name__ == "__main__":
    main()
