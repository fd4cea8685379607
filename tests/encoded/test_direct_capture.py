"""An encoded capture straight from the caches (kvsnap/encoded/capture.py) on real KV (the
built-in model's prefill) in caches of every layout, dtype and TP size: the file is byte for
byte what ``recode_file`` writes from a plain capture of the same KV, signed or not; the
ordinary file's writer never runs; progress, errors and what is left on disk are a capture's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvsnap
from kvsnap.encoded.write import recode_file
from kvsnap.format.signing import KeyRing
from kvsnap.pipeline import TransferOptions
from kvsnap.testing.caches import random_content, same_bytes
from tests.support.encoded_files import filled_caches, real_caches, real_sequences

KEY = KeyRing([bytes(range(32))])
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _case(kind: str, tp_size: int, dtype: torch.dtype, signed: bool, slow: bool = False):
    name = f"{kind}-tp{tp_size}-{str(dtype).split('.')[1]}-{'signed' if signed else 'unsigned'}"
    marks = (pytest.mark.slow,) if slow else ()
    return pytest.param(kind, tp_size, dtype, signed, marks=marks, id=name)


#: (layout, TP size, dtype, signed): every layout in bf16 signed and unsigned; fp16 and fp32
#: and TP ranks on a few; the rest of the grid with --run-slow.
FP8_CASES = [
    *(_case(kind, 1, BF16, signed) for kind in ("vllm-nhd", "mla") for signed in (False, True)),
    _case("vllm-hnd", 1, BF16, True),
    _case("packed", 1, BF16, False),
    _case("cross-layer", 1, BF16, True),
    _case("flat-paged", 1, BF16, False),
    _case("vllm-nhd", 1, F16, True),
    _case("mla", 1, F32, False),
    _case("vllm-hnd", 2, F32, True),
    _case("vllm-nhd", 4, BF16, False),  # more ranks than heads: one elected writer a block
    *(
        _case(kind, 1, dtype, signed, slow=True)
        for kind in ("vllm-hnd", "packed", "cross-layer", "flat-paged", "contiguous")
        for dtype in (BF16, F16, F32)
        for signed in (False, True)
    ),
    _case("packed", 2, F16, True, slow=True),
    _case("mla", 2, BF16, True, slow=True),
]


def _both_ways(
    tmp_path, caches, compression: str, keys, sequences=None, **options
) -> tuple[bytes, bytes]:
    """The encoded capture of ``sequences`` (default :func:`real_sequences`) from ``caches``,
    and a plain capture of them recoded: their bytes."""
    layouts = [cache.layout for cache in caches]
    sequences = sequences or real_sequences()
    direct, plain, recoded = (tmp_path / f"{n}.safetensors" for n in ("direct", "plain", "re"))
    kvsnap.capture(
        layouts,
        sequences,
        direct,
        reproducible=True,
        keys=keys,
        compression=compression,
        **options,
    )
    kvsnap.capture(layouts, sequences, plain, reproducible=True)
    recode_file(plain, recoded, compression, keys=keys)
    return direct.read_bytes(), recoded.read_bytes()


@pytest.mark.parametrize(("kind", "tp_size", "dtype", "signed"), FP8_CASES)
def test_an_fp8_capture_is_the_recoded_plain_capture(tmp_path, kind, tp_size, dtype, signed):
    caches = real_caches(kind, dtype, tp_size=tp_size)
    direct, recoded = _both_ways(tmp_path, caches, "fp8", KEY if signed else None)
    assert direct == recoded


@pytest.mark.parametrize(
    ("kind", "dtype", "signed"),
    [("vllm-nhd", BF16, False), ("vllm-hnd", F32, True), ("mla", F16, True)],
)
def test_a_lossless_capture_is_the_recoded_plain_capture(tmp_path, kind, dtype, signed):
    caches = real_caches(kind, dtype)
    direct, recoded = _both_ways(tmp_path, caches, "lossless", KEY if signed else None)
    assert direct == recoded


@pytest.mark.parametrize(
    ("compression", "dtype"), [("fp8", torch.float8_e4m3fn), ("lossless", BF16)]
)
def test_tensors_stored_raw_are_the_recoded_ones(tmp_path, compression, dtype):
    # An fp8 cache is stored as it is; random bytes do not shrink by the 5% lossless asks.
    geometry = kvsnap.KVGeometry(
        num_layers=3,
        block_size=16,
        dtype=str(dtype).split(".")[1],
        num_kv_heads=2,
        head_dim=32,
        attention_types=("full",) * 3,
    )
    content = random_content(geometry, 8, torch.Generator().manual_seed(5))
    blocks = [6, 1, 4, 3, 0, 2, 5, 7]  # each once: a page repeated would shrink
    sequence = kvsnap.SequenceBlocks("r", np.arange(8 * 16), np.array(blocks))
    caches = filled_caches(content, "vllm-nhd")
    direct, recoded = _both_ways(tmp_path, caches, compression, KEY, [sequence])
    assert direct == recoded
    with kvsnap.Snapshot.open(tmp_path / "direct.safetensors", keys=KEY) as snapshot:
        assert set(snapshot.encoded.encoding["tensors"].values()) == {"raw"}
        for name, pages in content.pages.items():
            assert same_bytes(snapshot.read_tensor(name), pages[blocks])


@pytest.mark.parametrize(("kind", "tp_size"), [("vllm-hnd", 2), ("packed", 1)])
def test_the_gather_kernel_interpreted_gives_the_same_file(monkeypatch, tmp_path, kind, tp_size):
    # The CUDA path's gather (one kernel table, a launch per tensor over its range of pages),
    # run by Triton's interpreter on the host caches.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    caches = real_caches(kind, BF16, tp_size=tp_size)
    direct, recoded = _both_ways(tmp_path, caches, "fp8", KEY)
    assert direct == recoded


def test_the_ordinary_file_is_never_written_and_progress_counts_its_pages(tmp_path):
    (cache,) = real_caches("vllm-nhd", BF16)
    spans, reports = [], []
    path = tmp_path / "kv.safetensors"
    result = kvsnap.capture(
        cache.layout,
        real_sequences(),
        path,
        compression="fp8",
        trace=lambda kind, *_: spans.append(kind),
        progress=lambda done, total: reports.append((done, total)),
    )
    names = cache.layout.geometry.tensor_names()
    # No writer of an ordinary file was set up, no slot staged: each tensor encoded, one write.
    assert spans.count("encoded.tensor") == len(names) and spans.count("encoded.write") == 1
    assert not [kind for kind in spans if kind.startswith(("setup.writer", "writer.", "staging"))]
    assert sorted(tmp_path.iterdir()) == [path]
    assert result.path == str(path) and result.num_bytes == path.stat().st_size
    assert (result.num_blocks, result.num_tokens) == (10, 166)
    page_bytes = cache.layout.geometry.canonical_page_size_bytes
    total = page_bytes * result.num_blocks * len(names)
    assert reports == [(total * (i + 1) // len(names), total) for i in range(len(names))]
    plain = []
    kvsnap.capture(
        cache.layout,
        real_sequences(),
        tmp_path / "plain.safetensors",
        progress=lambda done, total: plain.append(total),
    )
    assert set(plain) == {total}


def test_a_named_backend_takes_the_ordinary_file_and_writes_the_same_bytes(tmp_path):
    (cache,) = real_caches("vllm-hnd", F16)
    spans = []
    direct, recoded = _both_ways(
        tmp_path,
        [cache],
        "fp8",
        KEY,
        transfer=TransferOptions(backend="cpu"),
        trace=lambda kind, *_: spans.append(kind),
    )
    assert direct == recoded
    assert "setup.writer" in spans and "encoded.tensor" not in spans


def test_refusals_are_a_captures(tmp_path):
    (cache,) = real_caches("vllm-nhd", BF16)
    path = tmp_path / "kv.safetensors"
    with pytest.raises(ValueError, match="compression 'zip': none, lossless or fp8"):
        kvsnap.capture(cache.layout, real_sequences(), path, compression="zip")
    for options in ({"max_shard_bytes": 1 << 20}, {"per_rank_parts": True}):
        with pytest.raises(ValueError, match="one local file: no shards, parts or URLs"):
            kvsnap.capture(cache.layout, real_sequences(), path, compression="fp8", **options)
    with pytest.raises(ValueError, match="one local file"):
        kvsnap.capture(cache.layout, real_sequences(), "memory://kv", compression="fp8")
    with pytest.raises(ValueError, match="has no tokens"):
        empty = kvsnap.SequenceBlocks("e", np.arange(0), np.arange(0))
        kvsnap.capture(cache.layout, [empty], path, compression="fp8")
    with pytest.raises(ValueError, match="block id 9 is outside the cache's 8 blocks"):
        outside = kvsnap.SequenceBlocks("o", np.arange(20), np.array([2, 9]))
        kvsnap.capture(cache.layout, [outside], path, compression="fp8")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("backend", ["auto", "cpu"])
def test_a_capture_stopped_midway_leaves_the_previous_file_and_nothing_else(tmp_path, backend):
    (cache,) = real_caches("vllm-nhd", BF16)
    path = tmp_path / "kv.safetensors"
    path.write_bytes(b"the previous snapshot")

    def stop(done: int, total: int) -> None:
        if done * 2 >= total:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        kvsnap.capture(
            cache.layout,
            real_sequences(),
            path,
            compression="fp8",
            progress=stop,
            transfer=TransferOptions(backend=backend),
        )
    assert sorted(tmp_path.iterdir()) == [path]
    assert path.read_bytes() == b"the previous snapshot"
