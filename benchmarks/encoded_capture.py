"""An fp8 capture straight from the caches against one through the ordinary file, and where its
time goes.

``python -m benchmarks.encoded_capture [--gpu] [--tokens N] [--layers L] [--repeat R]
[--dir DIR] [--torch-threads T] [--json-out PATH]`` fills a vLLM split NHD cache of the 8B
shape's pages (8 KV heads of 128, blocks of 16, bf16; ``--layers`` layers, default 32) with
normal samples for ``--tokens`` tokens (default 8192 with ``--gpu``, on CUDA; 1024 on the CPU)
and reports, each the median of ``--repeat`` reproducible captures into ``--dir`` (default
``/dev/shm``):

* ``capture_bf16_ms``: ``kvsnap.capture`` of the ordinary file;
* ``capture_fp8_ms``: ``kvsnap.capture(..., compression="fp8")``, which gathers, hashes,
  quantizes and measures each layer tensor where the cache lies and writes only the encoded
  file (``kvsnap/encoded/capture.py``);
* ``capture_fp8_via_file_ms``: the ordinary file captured to a temporary file, read back,
  checked, encoded and removed (``kvsnap.encoded.write.capture_encoded``: how every fp8 capture
  went before, and how one still goes where the fused page copy cannot gather the caches);
* ``fp8_vs_bf16`` and ``via_file_vs_bf16`` (issue 39's target: an fp8 capture at most 1.1x a
  bf16 capture), ``same_file`` (the two fp8 captures wrote the same bytes), and ``spans_ms``:
  the direct capture's trace spans summed by kind in its median run (``encoded.setup``: the
  gather's table; ``encoded.tensor``: each tensor gathered, hashed, quantized, brought to the
  host and, a layer at a time, measured; ``encoded.digests``; ``encoded.write``: the container
  built and written).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

import kvsnap
from benchmarks.profiling import timed_runs
from kvsnap.encoded.write import capture_encoded

BLOCK, HEADS, HEAD_DIM = 16, 8, 128


def _cache(layers: int, tokens: int, device: str) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(39)
    shape = (tokens // BLOCK, 2, BLOCK, HEADS, HEAD_DIM)
    return [
        torch.randn(shape, generator=generator).to(torch.bfloat16).to(device) for _ in range(layers)
    ]


def encoded_capture(
    layers: int, tokens: int, device: str, directory: Path, repeat: int
) -> dict[str, object]:
    """The figures of the module's docstring for one cache."""
    layout = kvsnap.vllm_split_layout(_cache(layers, tokens, device))
    sequence = [kvsnap.SequenceBlocks("s", np.arange(tokens), np.arange(tokens // BLOCK))]
    plain, direct, via = (directory / f"{n}.safetensors" for n in ("bf16", "fp8", "via"))
    spans: list[dict[str, float]] = []

    def trace(kind: str, started: float, finished: float, _nbytes: int) -> None:
        spans[-1][kind] += 1e3 * (finished - started)

    def fp8() -> None:
        spans.append(defaultdict(float))
        kvsnap.capture(layout, sequence, direct, compression="fp8", reproducible=True, trace=trace)

    def fp8_via_file() -> None:
        capture_encoded(
            lambda written: kvsnap.capture(layout, sequence, written, reproducible=True),
            via,
            "fp8",
            keys=None,
            refused=False,
        )

    bf16 = timed_runs(lambda: kvsnap.capture(layout, sequence, plain, reproducible=True), repeat)
    direct_s, via_s = timed_runs(fp8, repeat), timed_runs(fp8_via_file, repeat)
    median_run = sorted(range(repeat), key=direct_s.__getitem__)[repeat // 2]
    bf16_ms, fp8_ms, via_ms = (1e3 * statistics.median(t) for t in (bf16, direct_s, via_s))
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "tokens": tokens,
        "layers": layers,
        "kv_mib": 2 * layers * tokens * HEADS * HEAD_DIM * 2 / 2**20,
        "torch_threads": torch.get_num_threads(),
        "capture_bf16_ms": bf16_ms,
        "capture_fp8_ms": fp8_ms,
        "capture_fp8_via_file_ms": via_ms,
        "fp8_vs_bf16": fp8_ms / bf16_ms,
        "via_file_vs_bf16": via_ms / bf16_ms,
        "same_file": direct.read_bytes() == via.read_bytes(),
        # spans[0] is the warm-up's.
        "spans_ms": dict(spans[1 + median_run]),
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="torch's CPU threads (on a shared 2-core VM, OpenMP threads busy-waiting against "
        "other processes slow the CPU's quantization and error report many times over)",
    )
    args = parser.parse_args(argv)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    tokens = args.tokens or (8192 if args.gpu else 1024)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvsnap-encoded-capture-") as scratch:
        results = encoded_capture(
            args.layers, tokens, "cuda" if args.gpu else "cpu", Path(scratch), args.repeat
        )
    text = json.dumps(results, indent=1)
    print(text)
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(text)
    return results


if __name__ == "__main__":
    main()
