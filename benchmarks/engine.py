"""Per-request costs on an engine's path, side by side in one run (CUDA machine).

``python -m benchmarks.engine --json-out out/engine.json`` measures:

* **restore vs recompute**: a Llama-3-8B-shaped model with random bf16 weights (32 layers, 8 KV
  heads x 128) through transformers: prefill of N tokens (the recompute an engine would do)
  against ``kvsnap.engines.transformers.restore_dynamic_cache`` of the same KV from a
  memory-backed file (warm page cache) and from the disk with the page cache dropped, against
  ``torch.load`` of the same tensors; capture against ``torch.save``. Restores are checked
  bit-exact against the prefilled cache.
* **fixed cost per call**: warm ``capture`` and ``Snapshot.open`` + ``restore`` of 16 and 128
  tokens for vLLM-shaped caches of 32 layers x 8 heads, 80 x 8, 80 layers x 8 TP ranks x 1 head
  held in one process, and MLA (61 layers, latent 576), to a memory-backed file.
* **the medium's ceilings**: per target (a memory-backed directory, and the disk), a raw write
  from pinned memory, a 16-thread ``preadv`` of the page-cached file into pinned memory, and a
  cold O_DIRECT read, next to kvsnap's capture and restore of the same bytes.

Prints tables; ``--json-out`` writes every figure. ``--sizes`` picks the prefix lengths,
``--skip-model`` / ``--skip-fixed`` / ``--skip-media`` leave sections out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from kvsnap.format import SourceInfo
from kvsnap.layout.allocate import allocate_cache
from kvsnap.snapshot import SequenceBlocks, Snapshot, capture
from kvsnap.transfer.pinned import PinnedPool

SOURCE = SourceInfo(engine="benchmark", model_id="synthetic")
BLOCK = 16


def median_ms(run: Callable[[], object], repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def drop_cache(path: Path) -> None:
    """Evict ``path`` (and its shards) from the page cache."""
    for file in [path, *path.parent.glob(path.stem + "-*")]:
        if file.exists():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ---------------------------------------------------------------------------------------------
# restore vs recompute


def kv_shaped_llama(device: str = "cpu") -> torch.nn.Module:
    """A small random bf16 Llama whose KV has the 8B shape (32 layers, 8 KV heads x 128) and
    little else: for timing the host's share of cache calls, not a forward pass."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=32,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=1000,
    )
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()


def capture_prefill(model: torch.nn.Module, tokens: int, path: Path) -> object:
    """Prefill ``tokens`` random token ids through ``model`` into a new ``DynamicCache``,
    capture it to ``path`` (``capture_dynamic_cache``, the model's fingerprint recorded) and
    return the cache."""
    from transformers import DynamicCache

    from kvsnap.engines import transformers as kt

    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache, use_cache=True)
    kt.capture_dynamic_cache(cache, [ids[0].tolist()], path, model=model)
    return cache


def build_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=65536,
        rope_theta=500000.0,
    )
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def prefill(model: torch.nn.Module, ids: torch.Tensor):
    from transformers import DynamicCache

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def kv_tensors(cache) -> list[torch.Tensor]:
    from kvsnap.engines import transformers as kt

    return [tensor for pair in kt.dynamic_cache_states(cache) for tensor in pair]


def restore_vs_recompute(sizes: list[int], directory: Path, disk: Path) -> list[dict]:
    model = build_model()
    rows = []
    for tokens in sizes:
        row = _one_prefix(model, tokens, directory, disk)
        rows.append(row)
        torch.cuda.empty_cache()
        print(
            f"{tokens:>7} prefill {row['prefill_ms']:8.2f} ms | restore warm "
            f"{row['restore_warm_ms']:8.2f} cold {row['restore_cold_disk_ms']:8.2f} | torch.load "
            f"{row['torch_load_ms']:8.2f} | capture {row['capture_ms']:8.2f} | torch.save "
            f"{row['torch_save_ms']:8.2f} | x{row['recompute_over_restore']:.1f} "
            f"exact={row['restore_bit_exact']}",
            flush=True,
        )
    return rows


def _one_prefix(model: torch.nn.Module, tokens: int, directory: Path, disk: Path) -> dict:
    """Prefill, capture, save, restore and load one prefix of ``tokens`` tokens."""
    from kvsnap.engines import transformers as kt

    ids = torch.randint(0, 128000, (1, tokens), device="cuda")
    repeat = 5 if tokens <= 8192 else 3
    row: dict[str, float | int] = {"tokens": tokens}
    row["prefill_ms"] = median_ms(lambda: prefill(model, ids), repeat)
    cache = prefill(model, ids)
    reference = kv_tensors(cache)
    row["kv_bytes"] = sum(t.numel() * t.element_size() for t in reference)
    token_list = ids[0].tolist()
    shm = directory / f"prefix-{tokens}.safetensors"
    on_disk = disk / f"prefix-{tokens}.safetensors"
    pt = directory / f"prefix-{tokens}.pt"
    row["capture_ms"] = median_ms(
        lambda: kt.capture_dynamic_cache(cache, [token_list], shm, model=model), repeat
    )
    row["torch_save_ms"] = median_ms(lambda: torch.save(reference, pt), repeat, warmup=1)

    def restore(path: Path = shm):
        return kt.restore_dynamic_cache(path, device="cuda", model=model)

    restored, _ = restore()
    torch.cuda.synchronize()
    row["restore_bit_exact"] = int(
        all(
            torch.equal(a.view(torch.int16), b.view(torch.int16))
            for a, b in zip(reference, kv_tensors(restored), strict=True)
        )
    )
    row["restore_warm_ms"] = median_ms(restore, repeat)
    row["torch_load_ms"] = median_ms(lambda: torch.load(pt, map_location="cuda"), repeat)
    kt.capture_dynamic_cache(cache, [token_list], on_disk, model=model)
    cold = []
    for _ in range(2):
        drop_cache(on_disk)
        torch.cuda.synchronize()
        started = time.perf_counter()
        restore(on_disk)
        torch.cuda.synchronize()
        cold.append(time.perf_counter() - started)
    row["restore_cold_disk_ms"] = statistics.median(cold) * 1e3
    row["recompute_over_restore"] = row["prefill_ms"] / row["restore_warm_ms"]
    for path in (shm, on_disk, pt):
        path.unlink(missing_ok=True)
    return row


# ---------------------------------------------------------------------------------------------
# fixed cost per call

FIXED_CASES = [
    # label, layout kind, layers, kv heads, head dim / latent, tp ranks held in the process
    ("32L x 8H", "vllm-nhd", 32, 8, 128, 1),
    ("80L x 8H", "vllm-nhd", 80, 8, 128, 1),
    ("80L x 8TP x 1H", "vllm-nhd", 80, 8, 128, 8),
    ("MLA 61L x 576", "mla", 61, 0, 576, 1),
]


def case_layouts(
    kind: str,
    layers: int,
    heads: int,
    dim: int,
    tp_size: int,
    *,
    num_blocks: int = 64,
    device: str = "cuda",
    fill: str = "empty",
) -> list:
    """One bf16 cache layout per TP rank of a :data:`FIXED_CASES` case (``dim`` is the latent
    width of an MLA case, the head width otherwise)."""
    geometry = {"latent_dim": dim} if kind == "mla" else {"num_kv_heads": heads, "head_dim": dim}
    return [
        allocate_cache(
            kind,
            num_layers=layers,
            num_blocks=num_blocks,
            block_size=BLOCK,
            tp_rank=rank,
            tp_size=tp_size,
            dtype=torch.bfloat16,
            device=device,
            fill=fill,
            **geometry,
        ).layout
        for rank in range(tp_size)
    ]


def fixed_costs(directory: Path, repeat: int) -> list[dict]:
    rows = []
    for label, kind, layers, heads, dim, tp_size in FIXED_CASES:
        source = case_layouts(kind, layers, heads, dim, tp_size)
        target = case_layouts(kind, layers, heads, dim, tp_size)
        for tokens in (16, 128):
            row = _fixed_case(source, target, tokens, directory / "fixed.safetensors", repeat)
            row["case"] = label
            rows.append(row)
            print(
                f"{label:>16} {tokens:>4} tokens {row['kv_bytes'] / 1e6:7.1f} MB: capture "
                f"{row['capture_ms']:6.2f} ms, restore {row['restore_ms']:6.2f} ms "
                f"(open {row['open_ms']:5.2f})",
                flush=True,
            )
        del source, target
        torch.cuda.empty_cache()
    return rows


def _fixed_case(source: list, target: list, tokens: int, path: Path, repeat: int) -> dict:
    """Warm capture, restore (open included) and open alone of one ``tokens`` prefix."""
    blocks = np.arange(tokens // BLOCK, dtype=np.int64)
    sequence = [SequenceBlocks("s", np.arange(tokens), blocks)]
    row: dict[str, float | int | str] = {"tokens": tokens}
    row["kv_bytes"] = capture(source, sequence, path, source=SOURCE).num_bytes
    row["capture_ms"] = median_ms(lambda: capture(source, sequence, path, source=SOURCE), repeat)
    targets = {"s": blocks[::-1].copy()}

    def restore() -> None:
        with Snapshot.open(path) as snap:
            snap.restore(target, targets)

    row["restore_ms"] = median_ms(restore, repeat)
    row["open_ms"] = median_ms(lambda: Snapshot.open(path).close(), repeat)
    return row


# ---------------------------------------------------------------------------------------------
# the medium's ceilings


def raw_write_gbs(path: Path, pinned: torch.Tensor, direct: bool) -> float:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    data = memoryview(pinned.numpy())
    chunk = 64 << 20
    started = time.perf_counter()
    fd = os.open(path, flags, 0o644)
    try:
        for offset in range(0, len(data), chunk):
            os.pwrite(fd, data[offset : offset + chunk], offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(data) / (time.perf_counter() - started) / 1e9


def parallel_read_gbs(path: Path, pinned: torch.Tensor, threads: int, direct: bool) -> float:
    data = pinned.numpy()
    size = path.stat().st_size
    chunk = 4 << 20
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(
                pool.map(
                    lambda offset: os.preadv(
                        fd, [memoryview(data[offset : offset + chunk])], offset
                    ),
                    range(0, size, chunk),
                )
            )
        seconds = time.perf_counter() - started
    finally:
        os.close(fd)
    return size / seconds / 1e9


def media(directories: dict[str, Path], size_bytes: int) -> dict[str, dict]:
    shape = {"block_size": BLOCK, "num_kv_heads": 8, "head_dim": 128, "dtype": torch.bfloat16}
    num_blocks = size_bytes // (32 * 2 * 32768)
    source = allocate_cache(
        "vllm-nhd", num_layers=32, num_blocks=num_blocks, device="cuda", fill="empty", **shape
    )
    target = allocate_cache(
        "vllm-nhd", num_layers=32, num_blocks=num_blocks, device="cuda", fill="empty", **shape
    )
    for tensor in source.tensors:
        tensor.view(torch.int16).random_()
    kv_bytes = num_blocks * 32 * 2 * 32768
    results = {}
    with PinnedPool(kv_bytes, 1) as pool:
        pinned = pool.slot(0).tensor
        pinned.random_()
        for medium, directory in directories.items():
            row = _medium(directory, medium == "disk", pinned, source.layout, target.layout)
            results[medium] = row
            print(medium, json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
    return results


def _medium(directory: Path, direct: bool, pinned: torch.Tensor, source, target) -> dict:
    """The medium's raw write and read ceilings, then kvsnap's capture and restore there."""
    kv_bytes = pinned.numel()
    raw = directory / "raw.bin"
    row: dict[str, float] = {"bytes": kv_bytes}
    row["raw_write_gbs"] = raw_write_gbs(raw, pinned, direct)
    row["read_16_threads_cached_gbs"] = parallel_read_gbs(raw, pinned, 16, False)
    if direct:
        row["read_direct_cold_gbs"] = parallel_read_gbs(raw, pinned, 16, True)
    raw.unlink()
    num_blocks = source.num_blocks
    sequence = [SequenceBlocks("s", np.arange(num_blocks * BLOCK), np.arange(num_blocks))]
    path = directory / "media.safetensors"
    row["capture_gbs"] = kv_bytes / capture(source, sequence, path, source=SOURCE).seconds / 1e9

    def restore() -> float:
        with Snapshot.open(path) as snap:
            result = snap.restore(target, {"s": np.arange(num_blocks)})
        torch.cuda.synchronize()
        return kv_bytes / result.seconds / 1e9

    restore()  # the page cache is warm from here on
    row["restore_cached_gbs"] = restore()
    row["capture_over_write"] = row["capture_gbs"] / row["raw_write_gbs"]
    row["restore_cached_over_read"] = row["restore_cached_gbs"] / row["read_16_threads_cached_gbs"]
    if direct:
        drop_cache(path)
        row["restore_cold_gbs"] = restore()
        row["restore_cold_over_read"] = row["restore_cold_gbs"] / row["read_direct_cold_gbs"]
    path.unlink()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--sizes", default="128,512,2048,8192,32768")
    parser.add_argument("--disk-dir", type=Path, default=Path("/tmp/kvsnap-engine-bench"))
    parser.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--media-gib", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=30, help="timed calls per fixed-cost case")
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--skip-fixed", action="store_true")
    parser.add_argument("--skip-media", action="store_true")
    args = parser.parse_args()
    args.disk_dir.mkdir(parents=True, exist_ok=True)
    shm = Path(tempfile.mkdtemp(dir=args.shm_dir))
    results: dict[str, object] = {"device": torch.cuda.get_device_name()}
    if not args.skip_fixed:
        results["fixed_cost"] = fixed_costs(shm, args.repeat)
    if not args.skip_model:
        sizes = [int(size) for size in args.sizes.split(",")]
        results["restore_vs_recompute"] = restore_vs_recompute(sizes, shm, args.disk_dir)
    if not args.skip_media:
        size = int(args.media_gib * (1 << 30))
        results["media"] = media({"memory": shm, "disk": args.disk_dir}, size)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
