"""On CUDA (skipped without it): an encoded capture from CUDA caches gathers the pages, hashes
them, quantizes them and measures the error on the device, and writes

* byte for byte the file ``recode_file`` writes from a plain capture of those caches, and the
  file the same capture from host caches writes (those pages gathered and hashed on the host,
  then quantized on the GPU): the device's gather, its xxh3-64 of the ordinary pages and of the
  fp8 pages and its BLAKE3 of the fp8 pages are the host's, bit for bit;
* for ``lossless``, in every layout and dtype, the same three files byte for byte;
* the e4m3 values, scales, page checks and every other tensor of the capture made with CUDA
  hidden (a child process: quantized and measured on the CPU), the error report within float
  rounding of it (sums in another order).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kvsnap
from kvsnap.encoded.capture import capture_compressed
from kvsnap.encoded.write import recode_file
from kvsnap.format import encoded as enc
from kvsnap.format.signing import KeyRing
from tests.support.encoded_files import content_named, filled_caches, real_sequences

pytestmark = pytest.mark.gpu

KEY = KeyRing([bytes(range(32))])
REPOSITORY = Path(__file__).resolve().parents[2]
#: Layouts, with the TP sizes each is captured at.
TP_SIZES = {
    "vllm-nhd": (1, 2),
    "vllm-hnd": (1, 2),
    "vllm-legacy": (1,),
    "packed": (1, 2),
    "cross-layer": (1,),
    "flat-paged": (1,),
    "contiguous": (1,),
    "mla": (1, 2),
}


def _capture(caches, path: Path, compression: str, keys, **options) -> list[str]:
    """An encoded, reproducible capture of ``caches`` to ``path``: the trace's span kinds."""
    spans: list[str] = []
    kvsnap.capture(
        [cache.layout for cache in caches],
        real_sequences(),
        path,
        reproducible=True,
        keys=keys,
        compression=compression,
        trace=lambda kind, *_: spans.append(kind),
        **options,
    )
    return spans


def _three_ways(tmp_path: Path, content, kind: str, tp_size: int, compression: str, keys):
    """The encoded capture from CUDA caches, the same from host caches, and a plain capture
    of the CUDA caches recoded: their bytes, the first checked to have taken the device
    path."""
    cuda = filled_caches(content, kind, tp_size, "cuda")
    host = filled_caches(content, kind, tp_size, "cpu")
    paths = [tmp_path / f"{name}.safetensors" for name in ("cuda", "host", "plain", "recoded")]
    spans = _capture(cuda, paths[0], compression, keys)
    assert "encoded.tensor" in spans and "setup.writer" not in spans
    _capture(host, paths[1], compression, keys)
    kvsnap.capture([cache.layout for cache in cuda], real_sequences(), paths[2], reproducible=True)
    recode_file(paths[2], paths[3], compression, keys=keys)
    return paths[0].read_bytes(), paths[1].read_bytes(), paths[3].read_bytes()


@pytest.mark.parametrize("kind", list(TP_SIZES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_on_cuda_an_fp8_capture_is_the_host_caches_and_the_recoded_plain_one(tmp_path, kind, dtype):
    content = content_named("built-in", dtype, kind)
    for tp_size in TP_SIZES[kind]:
        for keys in (None, KEY):
            files = _three_ways(tmp_path, content, kind, tp_size, "fp8", keys)
            assert files[0] == files[1] == files[2], (tp_size, keys is not None)


@pytest.mark.parametrize("kind", list(TP_SIZES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_on_cuda_a_lossless_capture_is_the_host_caches_and_the_recoded_plain_one(
    tmp_path, kind, dtype
):
    # Lossless pages are gathered on the device and coded on the host: every layout, TP split
    # and dtype gives the bytes a host capture and a recoded plain capture give.
    content = content_named("built-in", dtype, kind)
    for tp_size in TP_SIZES[kind]:
        for keys in (None, KEY):
            files = _three_ways(tmp_path, content, kind, tp_size, "lossless", keys)
            assert files[0] == files[1] == files[2], (tp_size, keys is not None)


@pytest.mark.parametrize(
    ("content", "compression"),
    [("wide", "fp8"), ("wide", "lossless"), ("built-in", "lossless")],
)
def test_on_cuda_pages_of_the_8b_shape_and_lossless_are_the_same_three_ways(
    tmp_path, content, compression
):
    pages = content_named(content, torch.bfloat16, "vllm-hnd")
    for keys in (None, KEY):
        files = _three_ways(tmp_path, pages, "vllm-hnd", 1, compression, keys)
        assert files[0] == files[1] == files[2], keys is not None


def _cpu_capture(tmp_path: Path, case: dict) -> Path:
    """The capture of ``case`` made by a child process that sees no GPU."""
    out = tmp_path / "cpu.safetensors"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.support.cpu_encoded_capture_child",
            json.dumps({**case, "out": str(out)}),
        ],
        cwd=REPOSITORY,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": _child_path()},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"cuda": False}
    return out


def _parts(path: Path) -> tuple[dict, dict[str, bytes]]:
    """An encoded file's kvsnap document and its tensors' bytes by name."""
    data = np.fromfile(path, dtype=np.uint8)
    length = enc.header_length(data[:8].tobytes(), len(data))
    layout = enc.parse_header(data[: 8 + length].tobytes(), len(data))
    tensors = {t.name: data[t.begin : t.end].tobytes() for t in layout.tensors}
    return copy.deepcopy(layout.document), tensors  # parsed layouts are shared: not changed


@pytest.mark.parametrize(
    ("content", "kind", "tp_size", "dtype", "signed"),
    [
        ("built-in", "vllm-nhd", 1, "bfloat16", False),
        ("built-in", "mla", 1, "float16", True),
        ("built-in", "packed", 2, "float32", True),
        ("wide", "vllm-hnd", 1, "bfloat16", True),
        ("wide", "vllm-nhd", 1, "float16", False),
        # Infinities and NaNs planted in real KV, and random bits (values up to 3.4e38).
        ("planted", "vllm-nhd", 1, "bfloat16", True),
        ("random-bits", "vllm-hnd", 1, "bfloat16", False),
        ("random-bits", "packed", 2, "float32", True),
    ],
)
def test_on_cuda_the_stored_tensors_are_the_cpus(tmp_path, content, kind, tp_size, dtype, signed):
    case = {"content": content, "kind": kind, "tp_size": tp_size, "dtype": dtype}
    case.update(signed=signed, compression="fp8")
    cpu = _cpu_capture(tmp_path, case)
    pages = content_named(content, getattr(torch, dtype), kind)
    caches = filled_caches(pages, kind, tp_size, "cuda")
    cuda = tmp_path / "cuda.safetensors"
    _capture(caches, cuda, "fp8", KEY if signed else None)
    (cpu_document, cpu_tensors), (cuda_document, cuda_tensors) = _parts(cpu), _parts(cuda)
    # The checksums and the signature cover the header, whose error report may differ.
    covering = {enc.ENCODED_CHECKSUMS_TENSOR, "kvsnap.signature"}
    assert cpu_tensors.keys() == cuda_tensors.keys()
    for name in cpu_tensors.keys() - covering:
        assert cpu_tensors[name] == cuda_tensors[name], name
    cpu_error = cpu_document["encoding"].pop("error")
    cuda_error = cuda_document["encoding"].pop("error")
    assert cpu_document == cuda_document
    for part in ("tensors", "attention"):
        for on_cpu, on_cuda in zip(cpu_error[part], cuda_error[part], strict=True):
            assert on_cpu.keys() == on_cuda.keys()
            for key, value in on_cpu.items():
                if isinstance(value, float):  # sums and means: in another order on the GPU
                    assert on_cuda[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
                else:  # names, counts
                    assert on_cuda[key] == value, key


def test_on_cuda_the_capture_follows_the_event_it_is_given(tmp_path):
    content = content_named("wide", torch.bfloat16, "vllm-nhd")
    (filled,) = filled_caches(content, "vllm-nhd", 1, "cuda")
    (cache,) = filled_caches(content, "vllm-nhd", 1, "cuda")
    for view in cache.views.values():
        view.zero_()
    torch.cuda.synchronize()
    # The KV written on another stream, device to device, well after the capture is called:
    # its copies follow the event, not the calling thread's stream (which holds nothing).
    writer = torch.cuda.Stream()
    with torch.cuda.stream(writer):
        torch.cuda._sleep(1_000_000_000)
        for name, view in cache.views.items():
            view.copy_(filled.views[name])
        written = torch.cuda.Event()
        written.record(writer)
    path = tmp_path / "after.safetensors"
    capture_compressed(
        cache.layout, real_sequences(), path, "fp8", reproducible=True, after=written
    )
    host = tmp_path / "host.safetensors"
    _capture(filled_caches(content, "vllm-nhd", 1, "cpu"), host, "fp8", None)
    assert path.read_bytes() == host.read_bytes()


def _child_path() -> str:
    """The repository first, then the caller's own path (where its dependencies may sit in a
    ``--target`` folder, as on the GPU machines)."""
    inherited = os.environ.get("PYTHONPATH")
    return os.pathsep.join([str(REPOSITORY), *([inherited] if inherited else [])])
