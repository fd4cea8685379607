"""Where an fp8 device restore's time goes (a CUDA machine), its parts timed alone beside it.

``python -m benchmarks.fp8_restore_parts --json-out out/fp8_parts.json`` captures ``--tokens``
(default 8,192) of the 8B shape (32 layers, 8 KV heads x 128, bf16, random values) from a
vLLM-shaped cache into an fp8 file on /dev/shm, then, hot tier on (the file registered), the
medians of ``--repeat`` calls of:

* ``restore_open_ms``: ``Snapshot.restore`` of the snapshot kept open, and the same cut into
  1, 2, 4, 8 and 16 pieces (``restore_pieces{N}_ms``; kvsnap's default is
  ``kvsnap.encoded.device_restore.PIECES``); ``open_ms``: ``Snapshot.open`` + ``close``;
* ``dma_ms``: the copies of every tensor's stored bytes out of the registered file into one
  device buffer, alone (and the rate);
* ``xxh3_checks_ms``: the device's page checks of all those pages;
* ``dequant_ms`` / ``dequant_exact_ms``: the dequantizing scatter of every page, with the
  one-multiplication product and with the exact one.

With ``--timeline``, one more restore runs under torch's profiler and ``timeline`` says what the
device did meanwhile (:mod:`benchmarks.device_timeline`): its copying, its kernels, how much of
those ran under the copies, its idle time and longest idle gaps.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import kvsnap
from benchmarks import device_timeline
from benchmarks.device_timeline import device_events
from benchmarks.profiling import timed_runs
from kvsnap.encoded import device_restore
from kvsnap.pipeline.page_checks import hash_constants
from kvsnap.store.hot import configure_hot_tier
from kvsnap.store.hot.tier import hot_tier
from kvsnap.testing.caches import make_cache
from kvsnap.transfer import page_dequant, page_hash
from kvsnap.transfer.page_table import PageTable

BLOCK, HEADS, HEAD_DIM, LAYERS = 16, 8, 128, 32


def median_ms(run: Callable[[], object], repeat: int) -> float:
    return 1e3 * float(np.median(timed_runs(run, repeat)))


def vllm_cache(blocks: int):
    return make_cache(
        "vllm-nhd",
        num_layers=LAYERS,
        num_blocks=blocks,
        block_size=BLOCK,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
        device="cuda",
    )


def parts(snapshot, target, blocks: int, repeat: int) -> dict:
    """The restore's parts alone: DMA, page checks, dequantizing scatter."""
    encoded = snapshot.encoded
    lease = hot_tier().lookup(encoded.path, encoded.fd, encoded.status, admit=True)
    assert lease is not None and lease.host is not None
    names = list(snapshot.geometry.tensor_names())
    page = BLOCK * HEADS * HEAD_DIM
    span = blocks * page
    values = torch.empty(len(names) * span, dtype=torch.uint8, device="cuda")

    def dma() -> None:
        for index, name in enumerate(names):
            begin = encoded.layout.by_name[name].begin
            values[index * span : (index + 1) * span].copy_(
                lease.host[begin : begin + span], non_blocking=True
            )

    figures = {"dma_ms": median_ms(dma, repeat)}
    figures["dma_gb_per_s"] = values.numel() / figures["dma_ms"] / 1e6
    words = torch.arange(len(names) * blocks, device="cuda", dtype=torch.int64) * (page // 8)
    expected = torch.zeros(len(words), dtype=torch.int64, device="cuda")
    page_ok = torch.zeros(len(words), dtype=torch.int64, device="cuda")
    constants = hash_constants(torch.device("cuda"), page)
    figures["xxh3_checks_ms"] = median_ms(
        lambda: page_hash.launch_page_checks_at_words(
            values, words, page, constants, expected, page_ok
        ),
        repeat,
    )
    table = PageTable([target.layout])
    page_tensors, device_blocks = np.divmod(np.arange(len(names) * blocks), blocks)
    scales = torch.ones((len(words), HEADS), dtype=torch.float32, device="cuda")
    for exact, key in ((False, "dequant_ms"), (True, "dequant_exact_ms")):
        figures[key] = median_ms(
            lambda exact=exact: page_dequant.dequant_scatter(
                table, page_tensors, device_blocks, values, scales, exact=exact
            ),
            repeat,
        )
    hot_tier().release(lease)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--timeline", action="store_true", help="a profiled restore's timeline")
    args = parser.parse_args()
    blocks = args.tokens // BLOCK
    source, target = vllm_cache(blocks), vllm_cache(blocks)
    for view in source.views.values():
        view.copy_(torch.randn(view.shape, device="cuda").to(torch.bfloat16))
    sequence = kvsnap.SequenceBlocks("s", np.arange(blocks * BLOCK), np.arange(blocks))
    path = Path("/dev/shm/kvsnap-fp8-parts.safetensors")
    kvsnap.capture(source.layout, [sequence], path, compression="fp8")
    configure_hot_tier(8 << 30, register_after=1)
    ids = {"s": np.arange(blocks)}
    results: dict = {"device": torch.cuda.get_device_name(), "tokens": blocks * BLOCK}
    try:
        with kvsnap.Snapshot.open(path) as snapshot:
            restore = lambda: snapshot.restore(target.layout, ids)  # noqa: E731
            results["restore_open_ms"] = median_ms(restore, args.repeat)
            if args.timeline:
                results["timeline"] = device_timeline.summary(device_events(restore))
            default = device_restore.PIECES
            for pieces in (1, 2, 4, 8, 16):
                device_restore.PIECES = pieces
                results[f"restore_pieces{pieces}_ms"] = median_ms(restore, args.repeat)
            device_restore.PIECES = default
            results["open_ms"] = median_ms(lambda: kvsnap.Snapshot.open(path).close(), args.repeat)
            results.update(parts(snapshot, target, blocks, args.repeat))
    finally:
        path.unlink(missing_ok=True)
    text = json.dumps(results, indent=1)
    print(text)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(text)


if __name__ == "__main__":
    main()
