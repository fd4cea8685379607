"""What the store-trust checks cost per call, side by side with the calls they sit in.

* weights fingerprint of a loaded model: the first call (reads samples of every tensor) and a
  remembered call (what every ``restore_dynamic_cache`` / capture with ``model=`` pays);
* store keys (SHA-256 under the request's identity) of a prompt, against the xxh3-128 prefix
  hashes they replaced, for 128 / 2,048 / 8,192 tokens at vLLM's block size of 16;
* a signed snapshot: ``Snapshot.open`` with and without the key check, and a capture with and
  without signing, on a chunk-sized snapshot (a 2k-token prefix of 2 layers of 8 heads);
* with ``--side-by-side``: a signed against an unsigned hot ``restore_dynamic_cache`` of a
  2k-token prefix of the Llama-3-8B KV shape (32 layers, 8 KV heads x 128, bf16: 256 MiB of
  KV), and a signed against an unsigned ``capture_dynamic_cache`` of the same cache, on
  ``--device`` (``cuda``: the GPU, whose kernels check and compute the BLAKE3 digests;
  ``cpu``: a cache in host memory, the host hashing), files on /dev/shm, the hot tier on.
  Each restore opens the file (``Snapshot.open``, with the key for the signed one: the
  signature checked, then every page against its BLAKE3 digest) and restores into new
  addresses; the two kinds alternate call by call, so the machine's drift hits both alike.
  Both restores are checked bit-exact against the prefilled cache.

Usage::

    python -m benchmarks.trust_cost [--layers 32] [--gpu-8b] [--json-out FILE]
    python -m benchmarks.trust_cost --side-by-side --device cuda [--tokens 2048] [--repeat 20]

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

    # The signature itself: an HMAC over a chunk's header and every tensor but its pages.
    with kvsnap.Snapshot.open(signed, keys=keys) as snapshot:
        (open_file,) = snapshot.reader.open_files
    layout = open_file.layout
    raw = signed.read_bytes()
    parts = [layout.header]
    parts += [raw[e.begin : e.end] for e in fmt.signed_entries(layout, fmt.SIGNATURE_ALGORITHM)]
    figures["signed_bytes_one_file"] = float(sum(map(len, parts)))
    figures["sign_one_file_ms"] = _median_ms(lambda: keys.sign(parts), 200)

    def opened(path: Path, ring: KeyRing | None) -> None:
        kvsnap.Snapshot.open(path, keys=ring).close()

    figures["open_ms"] = _median_ms(lambda: opened(plain, None), 50)
    figures["open_checking_signature_ms"] = _median_ms(lambda: opened(signed, keys), 50)
    return figures


def _timed_ms(call: Callable[[], object], device: str) -> float:
    """One call's wall time, the device's work included."""
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    call()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def side_by_side(device: str, tokens: int, repeat: int) -> dict[str, float]:
    """Signed against unsigned, alternating call by call: a hot ``restore_dynamic_cache`` of a
    ``tokens``-token prefix of the 8B KV shape (the file opened each call, with the key for the
    signed one) and a ``capture_dynamic_cache`` of it to another file. Medians, milliseconds."""
    from transformers import DynamicCache

    from benchmarks.engine import kv_shaped_llama
    from kvsnap.engines import transformers as kt
    from kvsnap.store.hot import configure_hot_tier

    model = kv_shaped_llama(device)
    keys = KeyRing([bytes(range(32))])
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache, use_cache=True)
    reference = [t for pair in kt.dynamic_cache_states(cache) for t in pair]
    directory = Path(tempfile.mkdtemp(prefix="kvsnap-trust-", dir="/dev/shm"))
    paths = {
        "unsigned": directory / "unsigned.safetensors",
        "signed": directory / "signed.safetensors",
    }
    # The timed captures write files of their own: rewriting a restored file would make its
    # next restore a first touch, not the hot restore this compares.
    capture_paths = {
        kind: path.with_suffix(".captured.safetensors") for kind, path in paths.items()
    }
    rings = {"unsigned": None, "signed": keys}
    token_ids = [ids[0].tolist()]

    def capture(kind: str, path: Path | None = None) -> None:
        target = capture_paths[kind] if path is None else path
        kt.capture_dynamic_cache(cache, token_ids, target, model=model, keys=rings[kind])

    held: list[object] = []

    def restore(kind: str) -> None:
        with kvsnap.Snapshot.open(paths[kind], keys=rings[kind]) as snapshot:
            restored, _ = kt.restore_dynamic_cache(snapshot, device=device, model=model)
        held[:] = [restored]  # the last one kept: the next restores into new addresses

    configure_hot_tier(8 << 30, register_after=1)
    times: dict[str, list[float]] = {}
    try:
        for kind in rings:
            capture(kind, paths[kind])
            for _ in range(3):  # warm: staging, page tables, the hot tier's registration
                restore(kind)
            exact = all(
                torch.equal(a.view(torch.int16), b.view(torch.int16))
                for a, b in zip(
                    reference,
                    [t for pair in kt.dynamic_cache_states(held[0]) for t in pair],
                    strict=True,
                )
            )
            if not exact:
                raise AssertionError(f"the {kind} restore is not bit-exact")
        for _ in range(repeat):
            for kind in rings:
                times.setdefault(f"restore_{kind}_ms", []).append(
                    _timed_ms(lambda k=kind: restore(k), device)
                )
                times.setdefault(f"capture_{kind}_ms", []).append(
                    _timed_ms(lambda k=kind: capture(k), device)
                )
    finally:
        configure_hot_tier(0)
        for path in [*paths.values(), *capture_paths.values()]:
            path.unlink(missing_ok=True)
        directory.rmdir()
    figures = {name: statistics.median(values) for name, values in times.items()}
    figures["restore_signed_over_unsigned"] = (
        figures["restore_signed_ms"] / figures["restore_unsigned_ms"]
    )
    figures["capture_signed_over_unsigned"] = (
        figures["capture_signed_ms"] / figures["capture_unsigned_ms"]
    )
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument(
        "--gpu-8b", action="store_true", help="fingerprint the Llama-3-8B shape on the GPU"
    )
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="only the signed against unsigned 8B-shaped restore and capture",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if args.side_by_side:
        figures = side_by_side(args.device, args.tokens, args.repeat)
    else:
        figures = {**fingerprint_costs(args.layers, args.gpu_8b), **key_costs()}
        with tempfile.TemporaryDirectory(prefix="kvsnap-trust-") as scratch:
            figures.update(signing_costs(Path(scratch)))
    for name, value in figures.items():
        print(f"{name:36s} {value:9.3f}")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
