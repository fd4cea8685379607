"""The device part of benchmarks/encodings.py (CUDA machine): fp8 on the GPU, side by side in
one run.

``python -m benchmarks.encodings --gpu --gpu-tokens 8192 --json-out out/encodings_gpu.json``
prefills ``--gpu-tokens`` random token ids through the 8B shape (random weights, 32 layers, 8
KV heads x 128, bf16) on the GPU and measures, each the median of ``--repeat`` runs (CUDA
events):

* ``quantize``: every layer tensor to fp8 with per-(block, head) scales (what a capture adds:
  the nearest of three candidate scales), beside ``quantize_amax`` (``amax / 448`` alone, the
  quantizer's first rule: what the candidates cost), and the error report computed on the
  device;
* ``h2d_fp8`` / ``h2d_bf16``: one pinned host-to-device copy of the staged fp8 pages, and of
  the same pages in bf16 (the bytes a restore moves either way);
* ``dequant`` per cache layout (vLLM split NHD, HND): the fused dequantizing scatter of every
  staged page into the cache (one launch), checked bit for bit against the host twin;
  ``copy``: the plain fused page copy of the bf16 pages into the same cache.

What it should show: ``dequant`` well under ``h2d_fp8`` (the kernel keeps up with PCIe, so a
restore moving half the bytes is bound by the copy), and ``h2d_fp8`` about half ``h2d_bf16``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np
import torch

from kvsnap.encoding import fp8, measure
from kvsnap.layout.allocate import allocate_cache
from kvsnap.transfer import page_copy, page_dequant
from kvsnap.transfer.page_table import PageTable
from kvsnap.transfer.plan import Direction


def median_ms(run: Callable[[], object], repeat: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def device_pages(tokens: int) -> dict[str, torch.Tensor]:
    from benchmarks.encodings import cache_pages
    from benchmarks.engine import kv_shaped_llama
    from kvsnap.engines import transformers as kt

    model = kv_shaped_llama(device="cuda")
    ids = torch.randint(0, 1000, (tokens,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        [(cache, _)] = kt.prefill_token_ids(model, [ids.tolist()])
        return cache_pages(cache)


def quantize_figures(pages: dict[str, torch.Tensor], repeat: int) -> tuple[dict, dict]:
    """Quantize every tensor: its time, the error report's, and the quantized pages."""
    quantized = {name: fp8.quantize(tensor) for name, tensor in pages.items()}
    raw = sum(tensor.numel() * 2 for tensor in pages.values())
    quantize_ms = median_ms(lambda: [fp8.quantize(t) for t in pages.values()], repeat)
    amax_ms = median_ms(
        lambda: [fp8.quantize(t, scale_factors=(1.0,)) for t in pages.values()], repeat
    )

    def report() -> object:
        decoded = {
            name: fp8.dequantize(q.values, q.scales, torch.bfloat16)
            for name, q in quantized.items()
        }
        return measure.error_report(pages, decoded, encoding=fp8.NAME, granularity="block-head")

    report_ms = median_ms(report, max(1, repeat // 2), warmup=1)
    figures = {
        "kv_mib": raw / 2**20,
        "quantize_ms": quantize_ms,
        "quantize_gbs": raw / quantize_ms / 1e6,
        "quantize_amax_ms": amax_ms,
        "error_report_ms": report_ms,
        "error_report": report().worst,  # type: ignore[attr-defined]
    }
    return figures, quantized


def check_decoded(name: str, got: torch.Tensor, want: torch.Tensor, pages: fp8.Fp8Pages) -> None:
    """Raise, naming the first differing element (its code, scale and both words), unless the
    kernel wrote ``want`` bit for bit."""
    got_bits, want_bits = got.reshape(want.shape).view(torch.int16), want.view(torch.int16)
    differ = torch.nonzero(got_bits != want_bits)
    if len(differ):
        index = tuple(int(i) for i in differ[0])
        block, head = index[0], index[2] if len(index) == 4 else 0
        raise AssertionError(
            f"{name}: {len(differ)} elements differ, first {index}: code "
            f"{int(pages.values[index]):#04x}, scale {float(pages.scales[block, head])!r}, "
            f"kernel {int(got_bits[index]) & 0xFFFF:#06x}, "
            f"host {int(want_bits[index]) & 0xFFFF:#06x}"
        )


def scatter_figures(
    kind: str, pages: dict[str, torch.Tensor], quantized: dict, repeat: int
) -> dict:
    """The dequantizing scatter and the plain copy into a cache of ``kind``."""
    names = list(pages)
    blocks, block_size, heads, head_dim = next(iter(pages.values())).shape
    cache = allocate_cache(
        kind,
        num_layers=len(names) // 2,
        num_blocks=blocks,
        block_size=block_size,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=torch.bfloat16,
        device="cuda",
        fill="empty",
    )
    table = PageTable([cache.layout])
    order = [table.names.index(name) for name in names]
    page_tensors = np.repeat(np.array(order), blocks)
    device_blocks = np.tile(np.arange(blocks), len(names))
    staged = torch.stack([quantized[name].values for name in names]).reshape(len(page_tensors), -1)
    scales = torch.stack([quantized[name].scales for name in names]).reshape(len(page_tensors), -1)
    copies = page_dequant.dequant_copies(table, page_tensors, device_blocks)
    device_table = torch.from_numpy(page_copy.kernel_table(copies)).cuda()
    starts = torch.arange(len(page_tensors), dtype=torch.int64, device="cuda") * staged.shape[1]
    flat = staged.reshape(-1)

    def dequant() -> None:
        page_dequant.launch_dequant(copies, device_table, table, flat, starts, scales)

    dequant_ms = median_ms(dequant, repeat)
    for name in names:
        want = fp8.dequantize(quantized[name].values, quantized[name].scales, torch.bfloat16)
        check_decoded(name, cache.views[name], want, quantized[name])
    bf16 = torch.stack([pages[name] for name in names]).reshape(len(page_tensors), -1)
    page_bytes = bf16.shape[1] * 2
    addresses = bf16.data_ptr() + np.arange(len(page_tensors), dtype=np.int64) * page_bytes
    plain = table.copies(Direction.HOST_TO_DEVICE, page_tensors, device_blocks, addresses)
    plain_table = torch.from_numpy(page_copy.kernel_table(plain)).cuda()
    copy_ms = median_ms(
        lambda: page_copy.launch_kernel(plain, plain_table, torch.device("cuda")), repeat
    )
    for name in names:
        assert torch.equal(cache.views[name].view(torch.int16), pages[name].view(torch.int16))
    return {
        "dequant_ms": dequant_ms,
        "dequant_gbs_of_fp8": flat.numel() / dequant_ms / 1e6,
        "copy_ms": copy_ms,
    }


def run(tokens: int, repeat: int) -> dict:
    """Every figure of the device part, printed and returned."""
    pages = device_pages(tokens)
    results, quantized = quantize_figures(pages, repeat)
    staged = torch.cat([q.values.reshape(-1) for q in quantized.values()])
    bf16 = torch.cat([pages[name].reshape(-1) for name in quantized]).view(torch.uint8)
    for name, device_bytes in (("fp8", staged), ("bf16", bf16)):
        host = torch.empty(device_bytes.numel(), dtype=torch.uint8, pin_memory=True)
        host.copy_(device_bytes)
        target = torch.empty_like(device_bytes)
        results[f"h2d_{name}_ms"] = median_ms(
            lambda h=host, t=target: t.copy_(h, non_blocking=True), repeat
        )
        results[f"h2d_{name}_gbs"] = host.numel() / results[f"h2d_{name}_ms"] / 1e6
        del host
    for kind in ("vllm-nhd", "vllm-hnd"):
        results[kind] = scatter_figures(kind, pages, quantized, repeat)
        results[kind]["dequant_vs_h2d_fp8"] = results[kind]["dequant_ms"] / results["h2d_fp8_ms"]
    results["device"] = torch.cuda.get_device_name()
    for key, value in results.items():
        print(f"{key}: {value}")
    return results
