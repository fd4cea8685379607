"""The encodings on real KV: sizes, speeds on this CPU, fp8's error against its baselines, and
what fp8 KV does to greedy decoding (``kvsnap.encoding``; issue 39).

``python -m benchmarks.encodings --json-out out/encodings.json`` measures, on the KV of a
prefill of ``--tokens`` tokens (bf16) of

* the built-in model (``kvsnap/engines/default_model.py``: 4 layers, 2 KV heads x 32) over
  English text that does not change with this repository (:func:`fixed_text`), and
* the 8B shape with random weights (``benchmarks/engine.py``'s ``kv_shaped_llama``: 32 layers,
  8 KV heads x 128) over random token ids,

as canonical pages of 16 tokens:

* **lossless**: the size ratio (raw / stored), and encode and decode rates (GB/s of raw KV)
  with 1 and 2 threads, best of ``--repeat``, by the wall clock and per CPU-second (this
  machine is shared: the CPU-time rate is what a core gives when it is not taken away);
  the zstd parameters against plain level 1 on the exponent planes;
* **fp8**: the error report's worst values (and the layers past issue 39's bounds) for scales
  per (block, head) (kvsnap's: the nearest of three candidates; and ``amax / 448`` alone, its
  first rule), per head and per tensor, with the attention check's queries drawn from the keys
  and from a normal distribution with the keys' statistics, and the CPU seconds of quantizing
  and decoding;
* **greedy agreement**: 64 greedy tokens after each of 8 prefills of 512 tokens, from the
  prefilled cache and from the same cache with its KV through an fp8 round trip (scales per
  block and head, and per tensor), on the built-in model and a tiny Qwen2 built from a config
  (random weights): tokens that agree free-running and where they first differ, next-token
  choices that agree teacher-forced, and how close the original's choices were to a tie.

``--gpu`` runs the device part instead (benchmarks/encodings_gpu.py, on a CUDA machine; it
needs no zstandard).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from kvsnap.encoding import fp8, lossless, measure

BLOCK = 16


def fixed_text() -> str:
    """English prose with code examples that does not change with this repository: the
    docstrings of a few standard-library modules (about 14 KB on Python 3.11)."""
    import argparse
    import csv
    import difflib
    import heapq
    import json as json_module
    import pickle
    import subprocess
    import unittest

    modules = (argparse, json_module, csv, difflib, heapq, subprocess, unittest, pickle)
    return "\n".join(module.__doc__ or "" for module in modules)


def built_in_pages(tokens: int) -> dict[str, torch.Tensor]:
    """The built-in model's bf16 KV of ``tokens`` byte tokens of :func:`fixed_text`."""
    from kvsnap.engines.default_model import load_model

    model = load_model(dtype=torch.bfloat16)
    text = fixed_text()
    return prefill_pages(model.model, model.encode(text * (1 + tokens // len(text)))[:tokens])


def eight_b_pages(tokens: int) -> dict[str, torch.Tensor]:
    """The 8B shape's bf16 KV (random weights) of ``tokens`` random token ids."""
    from benchmarks.engine import kv_shaped_llama

    model = kv_shaped_llama()
    ids = torch.randint(0, 1000, (tokens,), generator=torch.Generator().manual_seed(0))
    return prefill_pages(model, ids.tolist())


def prefill_pages(model: torch.nn.Module, ids: list[int]) -> dict[str, torch.Tensor]:
    """Pages ``(blocks, 16, heads, head_dim)`` per layer tensor of a prefill of ``ids``."""
    from kvsnap.engines import transformers as kt

    [(cache, _)] = kt.prefill_token_ids(model, [ids])
    return cache_pages(cache)


def cache_pages(cache) -> dict[str, torch.Tensor]:
    """A DynamicCache's KV as pages per layer tensor (whole blocks only)."""
    from kvsnap.engines.transformers.dynamic import dynamic_cache_states

    pages = {}
    for layer, (keys, values) in enumerate(dynamic_cache_states(cache)):
        for part, states in (("key", keys), ("value", values)):
            token_major = states[0].transpose(0, 1).contiguous()
            blocks = token_major.shape[0] // BLOCK
            pages[f"layers.{layer}.{part}"] = token_major[: blocks * BLOCK].reshape(
                blocks, BLOCK, *token_major.shape[1:]
            )
    return pages


def _best(run: Callable[[], object], repeat: int) -> tuple[float, float]:
    """The best wall and process CPU seconds of ``repeat`` runs."""
    walls, cpus = [], []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus)


def lossless_figures(pages: dict[str, torch.Tensor], repeat: int) -> dict:
    arrays = [p.view(torch.uint8).numpy().reshape(p.shape[0], -1) for p in pages.values()]
    raw = sum(a.nbytes for a in arrays)
    encoded = [lossless.encode_pages(a, 2) for a in arrays]
    stored = sum(
        a.nbytes if e is None else e.stored_bytes for a, e in zip(arrays, encoded, strict=True)
    )
    outs = [np.empty_like(a) for a in arrays]
    figures: dict = {"raw_mib": raw / 2**20, "ratio": raw / stored}
    for threads in (1, 2):
        with ThreadPoolExecutor(threads) as pool:

            def encode(pool=pool) -> None:
                list(pool.map(lambda a: lossless.encode_pages(a, 2), arrays))

            def decode(pool=pool) -> None:
                list(pool.map(lambda p: lossless.decode_pages(*p), zip(encoded, outs, strict=True)))

            for name, run in (("encode", encode), ("decode", decode)):
                wall, cpu = _best(run, repeat)
                figures[f"{name}_gbs_{threads}t"] = raw / wall / 1e9
                figures[f"{name}_gbs_per_cpu_s_{threads}t"] = raw / cpu / 1e9
    for got, want in zip(outs, arrays, strict=True):
        assert np.array_equal(got, want), "lossless round trip differs"
    figures["zstd_planes"] = zstd_parameters(arrays, repeat)
    return figures


def zstd_parameters(arrays: list[np.ndarray], repeat: int) -> dict:
    """Ratio and single-thread rate (GB/s of plane) on the exponent planes: kvsnap's
    parameters against zstd's level 1."""
    import zstandard

    planes = [lossless.split_planes(a.reshape(-1), 2)[1] for a in arrays]
    step = lossless.CHUNK_BYTES // 2
    pieces = [p[i : i + step] for p in planes for i in range(0, len(p), step)]
    size = sum(len(p) for p in pieces)
    ours = zstandard.ZstdCompressionParameters(**lossless.ZSTD_PARAMETERS)
    result = {}
    for name, compressor in (
        ("kvsnap", zstandard.ZstdCompressor(compression_params=ours)),
        ("level1", zstandard.ZstdCompressor(level=1)),
    ):
        stored = sum(len(compressor.compress(p)) for p in pieces)
        wall, _ = _best(lambda c=compressor: [c.compress(p) for p in pieces], repeat)
        result[name] = {"ratio": size / stored, "gbs": size / wall / 1e9}
    return result


#: The fp8 quantizers measured: kvsnap's (per (block, head), the nearest of three scales), its
#: first rule (per (block, head), ``amax / 448`` alone), and the per-head and per-tensor
#: baselines.
FP8_VARIANTS = {
    "block-head": {"granularity": "block-head"},
    "block-head-amax": {"granularity": "block-head", "scale_factors": (1.0,)},
    "head": {"granularity": "head"},
    "tensor": {"granularity": "tensor"},
}


def fp8_figures(pages: dict[str, torch.Tensor]) -> dict:
    figures = {}
    raw = sum(tensor.numel() * tensor.element_size() for tensor in pages.values())
    for variant, options in FP8_VARIANTS.items():
        decoded, stored = {}, 0
        started = time.process_time()
        for name, tensor in pages.items():
            quantized = fp8.quantize(tensor, **options)
            decoded[name] = fp8.dequantize(quantized.values, quantized.scales, tensor.dtype)
            stored += quantized.stored_bytes
        figures[f"{variant}/quantize_and_decode_cpu_s"] = time.process_time() - started
        figures[f"{variant}/size_vs_bf16"] = stored / raw
        for source in ("keys", "gaussian"):
            report = measure.error_report(
                pages,
                decoded,
                encoding=fp8.NAME,
                granularity=str(options["granularity"]),
                query_source=source,
            )
            figures[f"{variant}/{source}"] = {**report.worst, "exceeds": report.exceeds()}
    return figures


def round_trip_cache(cache, granularity: str = "block-head") -> None:
    """Replace a DynamicCache's KV, in place, by its fp8 round trip."""
    from kvsnap.engines.transformers.dynamic import dynamic_cache_states

    for keys, values in dynamic_cache_states(cache):
        for states in (keys, values):
            token_major = states[0].transpose(0, 1)  # (tokens, heads, dim)
            tokens = token_major.shape[0]
            blocks = -(-tokens // BLOCK)
            padded = torch.zeros((blocks * BLOCK, *token_major.shape[1:]), dtype=states.dtype)
            padded[:tokens] = token_major
            pages = padded.reshape(blocks, BLOCK, *token_major.shape[1:])
            counts = torch.full((blocks,), BLOCK)
            counts[-1] = tokens - (blocks - 1) * BLOCK
            quantized = fp8.quantize(pages, granularity=granularity, token_counts=counts)
            decoded = fp8.dequantize(quantized.values, quantized.scales, states.dtype)
            states[0].copy_(decoded.reshape(-1, *token_major.shape[1:])[:tokens].transpose(0, 1))


def greedy_agreement(
    model: torch.nn.Module, prompts: list[list[int]], new_tokens: int = 64
) -> dict:
    """Greedy decoding from each prompt's prefilled cache against the same cache through fp8,
    per granularity: free-running (tokens equal position by position, and the first that is
    not; 64 when none) and teacher-forced (the original continuation fed to both: next-token
    choices that agree, each unaffected by the ones before), as shares over the prompts; and
    the median gap between the original's two best logits (how near a tie each choice is).
    Tokens and logits are compared as ``benchmarks/encoded_agreement.py`` compares a restored
    encoded snapshot's (imported here: the lossless figures need no model code)."""
    from benchmarks.encoded_agreement import agreement, logits_after
    from kvsnap.engines import transformers as kt

    totals: dict = {
        g: {"agree": 0, "first_difference": 0, "forced": 0} for g in ("block-head", "tensor")
    }
    margins = []
    for ids in prompts:
        [(cache, _)] = kt.prefill_token_ids(model, [ids])
        cache.crop(-1)  # what continue_generation does: the last prompt token runs again
        want = kt.continue_generation(model, copy.deepcopy(cache), ids, new_tokens)
        fed = [ids[-1], *want[:-1]]
        logits = logits_after(model, copy.deepcopy(cache), fed)
        top = logits.topk(2, dim=-1).values
        margins.extend((top[:, 0] - top[:, 1]).tolist())
        for granularity, total in totals.items():
            encoded = copy.deepcopy(cache)
            round_trip_cache(encoded, granularity)
            got = kt.continue_generation(model, copy.deepcopy(encoded), ids, new_tokens)
            agree, first = agreement(want, got)
            total["agree"] += agree
            total["first_difference"] += new_tokens if first is None else first
            forced = logits_after(model, encoded, fed).argmax(-1)
            total["forced"] += int((forced == logits.argmax(-1)).sum())
    count = len(prompts) * new_tokens
    return {
        granularity: {
            "free_running_agree": total["agree"] / count,
            "mean_first_difference": total["first_difference"] / len(prompts),
            "teacher_forced_agree": total["forced"] / count,
        }
        for granularity, total in totals.items()
    } | {
        "prompts": len(prompts),
        "tokens": new_tokens,
        "median_logit_margin": float(np.median(margins)),
    }


def tiny_qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=259,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    return Qwen2ForCausalLM(config).to(torch.bfloat16).eval()


def agreement_figures(prompts: int = 8) -> dict:
    """Greedy agreement on the built-in model and a tiny Qwen2, over ``prompts`` prompts of
    512 tokens of :func:`fixed_text` (at offsets 1,600 tokens apart)."""
    from kvsnap.engines.default_model import load_model

    built_in = load_model(dtype=torch.bfloat16)
    ids = built_in.encode(fixed_text())
    texts = [ids[start : start + 512] for start in range(0, prompts * 1600, 1600)]
    assert all(len(text) == 512 for text in texts), "the text is too short for the prompts"
    return {
        "built-in": greedy_agreement(built_in.model, texts),
        "qwen2-tiny": greedy_agreement(tiny_qwen2(), texts),
    }


def cpu_figures(tokens: int, repeat: int, skip_8b: bool, lossless_only: bool = False) -> dict:
    # One thread per torch op: the machine's cores are the lossless part's to share.
    torch.set_num_threads(1)
    results: dict = {"tokens": tokens}
    models = {"built-in": built_in_pages}
    if not skip_8b:
        models["8B shape"] = eight_b_pages
    for name, make in models.items():
        with torch.no_grad():
            pages = make(tokens)
        results[name] = {"lossless": lossless_figures(pages, repeat)}
        if not lossless_only:
            results[name]["fp8"] = fp8_figures(pages)
        print(name, json.dumps(results[name], indent=1))
    if lossless_only:
        return results
    with torch.no_grad():
        results["greedy_agreement"] = agreement_figures()
    print("greedy agreement", results["greedy_agreement"])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--skip-8b", action="store_true", help="the built-in model only")
    parser.add_argument(
        "--lossless-only", action="store_true", help="the lossless figures only (no fp8)"
    )
    parser.add_argument("--gpu", action="store_true", help="the device part only (CUDA)")
    parser.add_argument("--gpu-tokens", type=int, default=8192)
    args = parser.parse_args()
    if args.gpu:
        from benchmarks import encodings_gpu

        results: dict = {"gpu": encodings_gpu.run(args.gpu_tokens, args.repeat)}
    else:
        results = cpu_figures(args.tokens, args.repeat, args.skip_8b, args.lossless_only)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
