"""Encoded snapshot files (issue 39, phase 2): sizes, and the time they add or save, side by side.

``python -m benchmarks.encoded_files --json-out out/encoded_files.json`` (any machine) captures
the bf16 KV of a prefill of ``--tokens`` tokens of

* the built-in model over fixed English text (benchmarks/encodings.py's ``fixed_text``), and
* the 8B shape with random weights (``kv_shaped_llama``: 32 layers, 8 KV heads x 128) over
  random token ids,

from a vLLM-shaped cache into a snapshot file, then encodes it (``kvsnap.encoded``) and reports
per encoding: the file ratio and the KV ratio (pages, and for fp8 their scales, over the bf16
pages), the seconds to encode (fp8: with the error report), to open (which decodes) and to
restore into a CPU cache, and fp8's worst errors.

``--gpu`` (a CUDA machine) instead, for the 8B shape at ``--tokens`` (8192 for issue 39's
target), files in ``--dir`` (default ``/dev/shm``: page-cached, as hot as a file gets), each the
median of ``--repeat`` runs and checked:

* ``capture_bf16_ms`` / ``capture_fp8_ms``: ``kvsnap.capture`` of the whole cache, plain and
  with ``compression="fp8"`` (the target: fp8 at most 1.1x bf16);
* ``restore_bf16_ms`` (hot tier off) and ``restore_bf16_hot_ms`` (hot tier on, the file
  registered): ``Pipeline.restore`` with the snapshot opened per call, as an engine calls it
  (benchmarks/pcie_floor.py's ``engine_path``), checked bit-exact; ``restore_bf16_hot_facade_ms``
  the same through ``Snapshot.restore`` (a pipeline made per call, as the fp8 path is);
* ``restore_fp8_hot_ms``: ``Snapshot.open`` + ``Snapshot.restore`` of the fp8 file per call,
  hot tier on (its e4m3 pages DMA'd out of the registered file, checked and dequantized on the
  device), checked bit for bit against the host decode; ``restore_fp8_open_ms`` the restore of
  a snapshot kept open; ``open_fp8_ms`` the open alone (header, scales and page checks; no page
  read); the target: ``restore_fp8_hot_ms`` at most 0.65x ``restore_bf16_hot_ms``;
* with ``--cold-dir DIR`` (a directory on a real disk), both files written there and each
  restore a first touch (``posix_fadvise(DONTNEED)`` before every open, hot tier off):
  ``cold_bf16_ms`` / ``cold_fp8_ms`` (the target: fp8 at most 0.6x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from benchmarks.profiling import timed_runs

BLOCK = 16


def median_s(run: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    return statistics.median(timed_runs(run, repeat, warmup))


def prefill_pages(model_name: str, tokens: int, device: str) -> dict[str, torch.Tensor]:
    """bf16 KV of a prefill of ``tokens`` tokens, as pages per layer tensor."""
    from benchmarks.encodings import cache_pages, fixed_text
    from benchmarks.engine import kv_shaped_llama
    from kvsnap.engines import transformers as kt

    if model_name == "built-in":
        from kvsnap.engines.default_model import load_model

        model = load_model(dtype=torch.bfloat16)
        ids = model.encode(fixed_text())[:tokens]
    else:
        model = kv_shaped_llama(device=device)
        ids = torch.randint(0, 1000, (tokens,), generator=torch.Generator().manual_seed(0))
        ids = ids.tolist()
    with torch.no_grad():
        # The 8B shape's random model has 2,048 positions; its KV past them is KV all the same.
        [(cache, _)] = kt.prefill_token_ids(model, [ids], force=True)
        return {name: pages.to(device) for name, pages in cache_pages(cache).items()}


def filled_cache(pages: dict[str, torch.Tensor], device: str):
    """A vLLM-shaped (split NHD) cache holding ``pages`` in blocks ``0 ..``."""
    from kvsnap.layout.allocate import allocate_cache

    blocks, _, heads, head_dim = next(iter(pages.values())).shape
    cache = allocate_cache(
        "vllm-nhd",
        num_layers=len(pages) // 2,
        num_blocks=blocks,
        block_size=BLOCK,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        device=device,
    )
    for name, tensor in pages.items():
        cache.views[name].copy_(tensor)
    return cache


def cpu_case(model_name: str, tokens: int, directory: Path, repeat: int) -> dict:
    import kvsnap
    from kvsnap.encoded.read import read_encoded
    from kvsnap.encoded.write import encode_file

    pages = prefill_pages(model_name, tokens, "cpu")
    cache = filled_cache(pages, "cpu")
    blocks = next(iter(pages.values())).shape[0]
    ids = np.arange(blocks)
    source = directory / f"{model_name}.safetensors"
    kvsnap.capture(
        cache.layout, [kvsnap.SequenceBlocks("s", np.arange(blocks * BLOCK), ids)], source
    )
    kv_bytes = sum(t.numel() * 2 for t in pages.values())
    row: dict = {
        "tokens": blocks * BLOCK,
        "kv_mib": kv_bytes / 2**20,
        "file_bytes": source.stat().st_size,
    }
    target_cache = filled_cache({n: torch.zeros_like(t) for n, t in pages.items()}, "cpu")
    for encoding in ("lossless", "fp8"):
        target = directory / f"{model_name}.{encoding}.safetensors"
        result = None

        def encode(target=target, encoding=encoding) -> None:
            nonlocal result
            result = encode_file(source, target, encoding)

        encode_s = median_s(encode, repeat, warmup=0)
        stored = read_encoded(target).layout.by_name
        kv_stored = sum(
            stored[name].nbytes
            + (stored[name + ".scales"].nbytes if encoding == "fp8" else 0)
            + (stored[name + ".chunks"].nbytes if name + ".chunks" in stored else 0)
            for name in pages
        )

        def open_and_restore(target=target) -> None:
            with kvsnap.Snapshot.open(target) as snapshot:
                snapshot.restore(target_cache.layout, {"s": ids})

        def open_only(target=target) -> None:
            kvsnap.Snapshot.open(target).close()

        row[encoding] = {
            "file_ratio": result.ratio,
            "kv_ratio": kv_bytes / kv_stored,
            "encode_s": encode_s,
            "encode_gbs": kv_bytes / encode_s / 1e9,
            "open_s": median_s(open_only, repeat),
            "open_and_restore_s": median_s(open_and_restore, repeat),
            "error": None if result.error is None else result.error.worst,
        }

    def plain_restore() -> None:
        with kvsnap.Snapshot.open(source) as snapshot:
            snapshot.restore(target_cache.layout, {"s": ids})

    row["none_open_and_restore_s"] = median_s(plain_restore, repeat)
    return row


def fp8_restore_figures(encoded: Path, target, ids: np.ndarray, names: list, repeat: int) -> dict:
    """The fp8 file opened and restored into the CUDA cache ``target`` per call (hot tier on),
    and kept open, checked against the host decode."""
    import kvsnap

    def open_and_restore() -> str:
        with kvsnap.Snapshot.open(encoded) as snapshot:
            return snapshot.restore(target.layout, {"s": ids}).backend

    figures: dict = {"restore_fp8_backend": open_and_restore()}
    figures["open_fp8_ms"] = 1e3 * median_s(lambda: kvsnap.Snapshot.open(encoded).close(), repeat)
    figures["restore_fp8_hot_ms"] = 1e3 * median_s(open_and_restore, repeat)
    with kvsnap.Snapshot.open(encoded) as snapshot:
        figures["restore_fp8_open_ms"] = 1e3 * median_s(
            lambda: snapshot.restore(target.layout, {"s": ids}), repeat
        )
        for view in target.views.values():
            view.zero_()
        snapshot.restore(target.layout, {"s": ids})
        figures["restore_fp8_exact"] = all(
            torch.equal(
                target.views[n].cpu().view(torch.int16), snapshot.read_tensor(n).view(torch.int16)
            )
            for n in names
        )
        figures["fp8_error"] = snapshot.encoded.error.worst
    return figures


def _dropped(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (a first touch reads the disk again)."""
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cold_figures(source, sequence, target, ids: np.ndarray, directory: Path, repeat: int) -> dict:
    """bf16 and fp8 files on a real disk, each restore a first touch (hot tier off)."""
    import kvsnap
    from kvsnap.store.hot import configure_hot_tier

    plain, encoded = directory / "cold-bf16.safetensors", directory / "cold-fp8.safetensors"
    kvsnap.capture(source.layout, [sequence], plain)
    kvsnap.capture(source.layout, [sequence], encoded, compression="fp8")
    configure_hot_tier(0)

    def first_touch(path: Path) -> Callable[[], None]:
        def run() -> None:
            _dropped(path)
            with kvsnap.Snapshot.open(path) as snapshot:
                snapshot.restore(target.layout, {"s": ids})

        return run

    figures = {
        "cold_bf16_ms": 1e3 * median_s(first_touch(plain), repeat),
        "cold_fp8_ms": 1e3 * median_s(first_touch(encoded), repeat),
        "cold_bf16_bytes": plain.stat().st_size,
        "cold_fp8_bytes": encoded.stat().st_size,
    }
    figures["cold_fp8_vs_bf16"] = figures["cold_fp8_ms"] / figures["cold_bf16_ms"]
    plain.unlink()
    encoded.unlink()
    return figures


def bf16_restore_figures(plain: Path, pages: dict, target, ids: np.ndarray, repeat: int) -> dict:
    """The bf16 file opened and restored per call: hot tier off, on, and through the facade."""
    import kvsnap
    from kvsnap.pipeline import Pipeline
    from kvsnap.store.hot import configure_hot_tier

    pipeline = Pipeline(target.layout)

    def restore_plain() -> None:
        with kvsnap.Snapshot.open(plain) as snapshot:
            pipeline.restore(snapshot, {"s": ids})

    def restore_facade() -> None:
        with kvsnap.Snapshot.open(plain) as snapshot:
            snapshot.restore(target.layout, {"s": ids})

    def exact() -> bool:
        for view in target.views.values():
            view.zero_()
        restore_plain()
        torch.cuda.synchronize()
        return all(
            torch.equal(target.views[n].view(torch.int16), pages[n].view(torch.int16))
            for n in pages
        )

    figures: dict = {}
    configure_hot_tier(0)
    figures["restore_bf16_exact"] = exact()
    figures["restore_bf16_ms"] = 1e3 * median_s(restore_plain, repeat)
    configure_hot_tier(8 << 30, register_after=1)
    figures["restore_bf16_hot_exact"] = exact()
    figures["restore_bf16_hot_ms"] = 1e3 * median_s(restore_plain, repeat)
    figures["restore_bf16_hot_facade_ms"] = 1e3 * median_s(restore_facade, repeat)
    return figures


def gpu_run(tokens: int, directory: Path, repeat: int, cold_dir: Path | None) -> dict:
    import kvsnap
    from kvsnap.store.hot import configure_hot_tier

    pages = prefill_pages("8b-shape", tokens, "cuda")
    source = filled_cache(pages, "cuda")
    target = filled_cache({n: torch.zeros_like(t) for n, t in pages.items()}, "cuda")
    blocks = next(iter(pages.values())).shape[0]
    ids = np.arange(blocks)
    sequence = kvsnap.SequenceBlocks("s", np.arange(blocks * BLOCK), ids)
    plain, encoded = directory / "kv-bf16.safetensors", directory / "kv-fp8.safetensors"
    results: dict = {"device": torch.cuda.get_device_name(), "tokens": blocks * BLOCK}
    results["kv_mib"] = sum(t.numel() * 2 for t in pages.values()) / 2**20
    results["capture_bf16_ms"] = 1e3 * median_s(
        lambda: kvsnap.capture(source.layout, [sequence], plain), repeat
    )
    results["capture_fp8_ms"] = 1e3 * median_s(
        lambda: kvsnap.capture(source.layout, [sequence], encoded, compression="fp8"), repeat
    )
    results["file_bf16_bytes"], results["file_fp8_bytes"] = (
        plain.stat().st_size,
        encoded.stat().st_size,
    )
    results.update(bf16_restore_figures(plain, pages, target, ids, repeat))
    # The same tier for fp8 as for the bf16 hot restore: files registered on first use.
    configure_hot_tier(8 << 30, register_after=1)
    results.update(fp8_restore_figures(encoded, target, ids, list(pages), repeat))
    configure_hot_tier(0)
    hot = results["restore_bf16_hot_ms"]
    results["restore_fp8_hot_vs_bf16_hot"] = results["restore_fp8_hot_ms"] / hot
    results["capture_fp8_vs_bf16"] = results["capture_fp8_ms"] / results["capture_bf16_ms"]
    if cold_dir is not None:
        cold_dir.mkdir(parents=True, exist_ok=True)
        results.update(cold_figures(source, sequence, target, ids, cold_dir, max(3, repeat // 2)))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--cold-dir", type=Path, default=None, help="a directory on a real disk")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch's CPU threads (on a shared 2-core VM, 2 OpenMP threads busy-waiting against "
        "other processes made the fp8 encode 40x slower than 1)",
    )
    args = parser.parse_args()
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    base = args.dir or (Path("/dev/shm") if args.gpu else None)
    with tempfile.TemporaryDirectory(dir=base, prefix="kvsnap-encoded-") as scratch:
        directory = Path(scratch)
        if args.gpu:
            results = {"gpu": gpu_run(args.tokens or 8192, directory, args.repeat, args.cold_dir)}
        else:
            tokens = args.tokens or 2048
            results = {
                name: cpu_case(name, tokens, directory, args.repeat)
                for name in ("built-in", "8b-shape")
            }
            results["torch_threads"] = torch.get_num_threads()
    text = json.dumps(results, indent=1, default=float)
    print(text)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(text)


if __name__ == "__main__":
    main()
