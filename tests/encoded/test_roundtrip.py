"""Encoded snapshots of real KV (the built-in model's prefill), captured from one layout and
restored into every other (every layout and TP split of the pipeline's tests), each dtype
(bfloat16, float16, float32, and fp8 caches, which both encodings store as they are), on the CPU
and (marked ``gpu``) into CUDA caches: ``lossless`` gives back the original file byte for byte
and restores exactly what was captured; ``fp8`` restores exactly what its host decode says (an
fp8 cache: exactly what was captured), and the error recorded at encoding is the error measured
again from the two files (tests/encoded/test_format_doc.py measures it without kvsnap)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import kvsnap
from kvsnap.encoded.read import decode, read_encoded
from kvsnap.encoded.write import encode_file
from kvsnap.encoding import lossless, measure
from kvsnap.encoding.report import ErrorBounds
from kvsnap.testing.caches import KVContent, make_cache, same_bytes
from tests.support.encoded_files import (
    BLOCK_ORDER,
    FP8_CACHE_DTYPES,
    capture_mixed,
    capture_real,
    real_content,
)
from tests.support.pipeline_caches import LAYOUTS

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
#: The cache dtypes a restore is checked in: fp8 pages decode into the first three, an fp8
#: cache is stored as it is (e5m2 with --run-slow: stored and restored alike).
CACHE_DTYPES = [
    *DTYPES,
    torch.float8_e4m3fn,
    pytest.param(torch.float8_e5m2, marks=pytest.mark.slow),
]
#: Where the caches restored into live: the CUDA ones on a GPU machine only.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _encoded(tmp_path, kind: str, dtype: torch.dtype, encoding: str):
    source = tmp_path / "original.safetensors"
    capture_real(source, "mla" if kind == "mla" else "vllm-nhd", dtype)
    target = tmp_path / f"{encoding}.safetensors"
    return source, target, encode_file(source, target, encoding)


def _restore_everywhere(snapshot, kind: str, tp_size: int, dtype: torch.dtype, device: str = "cpu"):
    """Restore both sequences into fresh caches of ``kind`` (one per TP rank, on ``device``),
    blocks reversed, and return the caches and the target blocks per snapshot block."""
    geometry = snapshot.geometry
    shape = (
        {"latent_dim": geometry.latent_dim}
        if geometry.is_mla
        else {"num_kv_heads": geometry.num_kv_heads, "head_dim": geometry.head_dim}
    )
    caches = [
        make_cache(
            kind,
            num_layers=geometry.num_layers,
            num_blocks=snapshot.num_blocks + 2,
            block_size=geometry.block_size,
            dtype=dtype,
            device=device,
            tp_rank=rank,
            tp_size=tp_size,
            **shape,
        )
        for rank in range(tp_size)
    ]
    targets, block_ids = {}, {}
    for record in snapshot.sequences:
        ids = [snapshot.num_blocks + 1 - int(block) for block in record.block_ids]
        block_ids[record.id] = ids
        targets.update(dict(zip(record.block_ids.tolist(), ids, strict=True)))
    snapshot.restore([cache.layout for cache in caches], block_ids)
    return caches, targets


def _check_restored(snapshot, caches, targets) -> None:
    source = torch.tensor(list(targets))
    target = torch.tensor(list(targets.values()))
    content = KVContent(
        snapshot.geometry,
        {name: snapshot.read_tensor(name) for name in snapshot.geometry.tensor_names()},
    )
    for cache in caches:
        for name in cache.views:
            want = cache.expected(content, name, source)
            assert same_bytes(cache.logical(name)[target], want), (cache.kind, name)


#: Every layout and TP split of the pipeline's tests (the cases are small: about 30 ms each).
RESTORE_CASES = [pytest.param(*case, id=f"{case[0]}-tp{case[1]}") for case in LAYOUTS]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize(("kind", "tp_size", "heads"), RESTORE_CASES)
@pytest.mark.parametrize("encoding", ["lossless", "fp8"])
def test_an_encoded_snapshot_restores_into_every_layout(
    tmp_path, kind, tp_size, heads, encoding, dtype, device
):
    source, target, _ = _encoded(tmp_path, kind, dtype, encoding)
    with kvsnap.Snapshot.open(source) as original, kvsnap.Snapshot.open(target) as snapshot:
        assert snapshot.encoded is not None and snapshot.verify() == []
        kinds = set(snapshot.encoded.encoding["tensors"].values())
        exact = encoding == "lossless" or dtype in FP8_CACHE_DTYPES
        if dtype in FP8_CACHE_DTYPES:
            assert kinds == {"raw"}  # one-byte values: stored as they are either way
        else:
            assert kinds == {encoding}  # real KV: every tensor encoded
        caches, targets = _restore_everywhere(snapshot, kind, tp_size, dtype, device)
        _check_restored(snapshot, caches, targets)
        if exact:
            _check_restored(original, caches, targets)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["vllm-nhd", "mla"])
def test_lossless_gives_back_the_original_file_byte_for_byte(tmp_path, dtype, kind):
    source, target, result = _encoded(tmp_path, kind, dtype, "lossless")
    assert result.stored_bytes == target.stat().st_size < result.decoded_bytes
    decoded = decode(read_encoded(target))
    assert np.array_equal(decoded, np.fromfile(source, dtype=np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_lossless_chunks_decode_to_the_same_file_on_threads(tmp_path, dtype, monkeypatch):
    # Chunks of 2 pages (a writer's choice, recorded in each table): 4 chunks a tensor, decoded
    # as tasks of the whole file on 2 threads, each checked against the original's pages.
    monkeypatch.setitem(lossless.encode_pages.__kwdefaults__, "chunk_bytes", 8192)
    source, target, _ = _encoded(tmp_path, "vllm-nhd", dtype, "lossless")
    encoded = read_encoded(target)
    with kvsnap.Snapshot.open(source) as original:
        blocks, page_bytes = original.num_blocks, original.geometry.canonical_page_size_bytes
    table = encoded.layout.by_name["layers.0.key.chunks"]
    assert table.shape[0] == -(-blocks // lossless.chunk_pages(page_bytes, 8192)) >= 3
    want = np.fromfile(source, dtype=np.uint8)
    assert np.array_equal(decode(encoded), want)
    with ThreadPoolExecutor(2) as pool:
        assert np.array_equal(decode(encoded, pool), want)


def test_a_lossless_file_of_coded_and_raw_tensors_decodes_byte_for_byte(tmp_path):
    source, target = tmp_path / "kv.safetensors", tmp_path / "kv.lossless.safetensors"
    content = capture_mixed(source)
    encode_file(source, target, "lossless")
    encoded = read_encoded(target)
    assert sorted(set(encoded.encoding["tensors"].values())) == ["lossless", "raw"]
    want = np.fromfile(source, dtype=np.uint8)
    with ThreadPoolExecutor(2) as pool:
        assert np.array_equal(decode(encoded, pool), want)
    with kvsnap.Snapshot.open(target) as snapshot:
        assert snapshot.verify() == []
        for name, pages in content.pages.items():
            assert same_bytes(snapshot.read_tensor(name), pages[BLOCK_ORDER]), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["vllm-nhd", "mla"])
def test_fp8_records_the_error_measured_again_from_the_two_files(tmp_path, dtype, kind):
    source, target, result = _encoded(tmp_path, kind, dtype, "fp8")
    # Issue 39's size target, on the KV itself: fp8 pages and scales at most 0.52 of the pages.
    stored = read_encoded(target).layout.by_name
    with kvsnap.Snapshot.open(source) as original:
        names = original.geometry.tensor_names()
        kv_bytes = original.kv_bytes
    fp8_bytes = sum(stored[n].nbytes + stored[n + ".scales"].nbytes for n in names)
    assert fp8_bytes <= (0.52 if dtype != torch.float32 else 0.27) * kv_bytes
    assert result.stored_bytes < result.decoded_bytes
    with kvsnap.Snapshot.open(source) as original, kvsnap.Snapshot.open(target) as snapshot:
        recorded = snapshot.encoded.error
        names = original.geometry.tensor_names()
        measured = measure.error_report(
            {name: original.read_tensor(name) for name in names},
            {name: snapshot.read_tensor(name) for name in names},
            encoding=recorded.encoding,
            granularity="block-head",
            token_counts=torch.from_numpy(original.valid_tokens_per_block()),
        )
    assert measured.to_dict() == recorded.to_dict() == result.error.to_dict()
    if dtype != torch.float32:  # real bf16/fp16 KV keeps issue 39's bounds but attention's
        bounds = ErrorBounds(attention_rel_l2=0.05)
        assert recorded.exceeds(bounds) == []
    worst = recorded.worst
    assert worst["max_abs_rel_block"] <= 1 / 16 and worst["min_cosine"] >= 0.998


@pytest.mark.parametrize("compression", ["lossless", "fp8"])
def test_capture_writes_an_encoded_snapshot_and_leaves_nothing_else(tmp_path, compression):
    content = real_content(torch.float16)
    geometry = content.geometry
    cache = make_cache(
        "vllm-hnd",
        num_layers=geometry.num_layers,
        num_blocks=8,
        block_size=geometry.block_size,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        dtype=torch.float16,
    )
    cache.fill(content)
    prompt = kvsnap.SequenceBlocks("p", np.arange(40), np.array([3, 5, 1]))
    path = tmp_path / "kv.safetensors"
    result = kvsnap.capture(cache.layout, [prompt], path, compression=compression)
    assert result.path == str(path) and sorted(tmp_path.iterdir()) == [path]
    with kvsnap.Snapshot.open(path) as snapshot:
        assert snapshot.encoded.encoding["name"] == compression
        pages = snapshot.read_tensor("layers.1.value")
    want = content.pages["layers.1.value"][[3, 5, 1]]
    if compression == "lossless":
        assert same_bytes(pages, want)
    else:  # the 40 tokens held (the rest of the last block is not quantized for)
        error = (pages.float() - want.float()).flatten(0, 1)[:40].abs().amax()
        assert error <= want.float().abs().max() / 16
    with pytest.raises(ValueError, match="one local file"):
        kvsnap.capture(cache.layout, [prompt], path, compression="fp8", max_shard_bytes=1 << 20)
