"""What the store-trust checks cost per call, side by side with the calls they sit in.

* weights fingerprint of a loaded model: the first call (reads samples of every tensor) and a
  remembered call (what every ``restore_dynamic_cache`` / capture with ``model=`` pays);
* store keys (SHA-256 under the request's identity) of a prompt, against the xxh3-128 prefix
  hashes they replaced, for 128 / 2,048 / 8,192 tokens at vLLM's block size of 16;
* a signed snapshot: ``Snapshot.open`` with and without the key check, and a capture with and
  without signing, on a chunk-sized snapshot (a 2k-token prefix of 2 layers of 8 heads).

Usage::

    python -m benchmarks.trust_cost [--layers 32] [--gpu-8b] [--json-out FILE]

Prints one line per figure (median of repeats, milliseconds); ``--json-out`` writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import kvsnap
from kvsnap import format as fmt
from kvsnap.engines.vllm.identity import CacheIdentity, store_key_chain
from kvsnap.engines.weights import loaded_model_fingerprint
from kvsnap.format.signing import KeyRing


def _median_ms(call: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def fingerprint_costs(layers: int, gpu_8b: bool) -> dict[str, float]:
    """First and remembered weights fingerprint of a Llama with ``layers`` layers: small
    matrices on the CPU (the walk over the module tree, not the sampling, is what scales with
    layers), or with ``gpu_8b`` the Llama-3-8B shape in bfloat16 on the GPU, the model
    ``benchmarks/engine.py`` prefills."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if gpu_8b:
        from benchmarks.engine import build_model

        model = build_model()
    else:
        config = LlamaConfig(
            vocab_size=1024,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        model = LlamaForCausalLM(config)
    started = time.perf_counter()
    loaded_model_fingerprint(model)
    first = (time.perf_counter() - started) * 1e3
    warm = _median_ms(lambda: loaded_model_fingerprint(model), 50)
    return {"fingerprint_first_ms": first, "fingerprint_remembered_ms": warm}


def key_costs() -> dict[str, float]:
    """Store keys against the old xxh3 prefix hashes, per prompt length."""
    figures = {}
    identity = CacheIdentity(lora_name="adapter", lora_digest="0" * 64, cache_salt="tenant")
    for tokens in (128, 2048, 8192):
        prompt = np.arange(tokens)
        figures[f"keys_sha256_{tokens}_ms"] = _median_ms(
            lambda p=prompt: store_key_chain(p, 16, identity), 20
        )
        figures[f"keys_xxh3_{tokens}_ms"] = _median_ms(
            lambda p=prompt: fmt.prefix_hash_chain(p, 16), 20
        )
    return figures


def signing_costs(directory: Path) -> dict[str, float]:
    """Open and capture a 2k-token, 2-layer chunk with and without a key."""
    caches = [torch.randn(160, 2, 16, 8, 128, dtype=torch.bfloat16) for _ in range(2)]
    layout = kvsnap.vllm_split_layout(caches)
    sequence = kvsnap.SequenceBlocks("prefix", np.arange(2048), np.arange(128))
    keys = KeyRing([bytes(range(32))])
    plain, signed = directory / "plain.safetensors", directory / "signed.safetensors"
    pipeline = kvsnap.Pipeline(layout)
    pipeline.capture([sequence], plain)  # warm: staging, page table, pools
    figures = {
        "capture_ms": _median_ms(lambda: pipeline.capture([sequence], plain), 7),
        "capture_signed_ms": _median_ms(lambda: pipeline.capture([sequence], signed, keys=keys), 7),
    }

    # The signature itself: an HMAC over a chunk's header (4 KiB) and trailer (16 B a tensor).
    header, trailer = signed.read_bytes()[:4096], bytes(16 * (2 * 2 + 6))
    figures["sign_one_file_ms"] = _median_ms(lambda: keys.sign(header, trailer), 200)

    def opened(path: Path, ring: KeyRing | None) -> None:
        kvsnap.Snapshot.open(path, keys=ring).close()

    figures["open_ms"] = _median_ms(lambda: opened(plain, None), 50)
    figures["open_checking_signature_ms"] = _median_ms(lambda: opened(signed, keys), 50)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument(
        "--gpu-8b", action="store_true", help="fingerprint the Llama-3-8B shape on the GPU"
    )
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    figures = {**fingerprint_costs(args.layers, args.gpu_8b), **key_costs()}
    with tempfile.TemporaryDirectory(prefix="kvsnap-trust-") as scratch:
        figures.update(signing_costs(Path(scratch)))
    for name, value in figures.items():
        print(f"{name:36s} {value:9.3f}")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
