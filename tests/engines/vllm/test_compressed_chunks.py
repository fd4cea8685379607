"""The connector's ``compression`` option (no vLLM: a worker on a registered bf16 cache of 32
KiB pages, as tests/engines/vllm/test_worker_saves.py drives one): fp8 chunks are encoded
snapshots of about half the bytes, so one bound holds about twice the chunks; the scheduler's
check passes them, a load writes what their host decode gives, and ``kvsnap store list`` shows
the encoding and ratio."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import kvsnap
from kvsnap import format as fmt
from kvsnap.cli.store import app as store_app
from kvsnap.encoded.original import check_original, parse_original
from kvsnap.encoded.read import decode, read_encoded
from kvsnap.encoded.write import recode_file
from kvsnap.engines.vllm import (
    CacheIdentity,
    ChunkChecker,
    ConnectorOptions,
    EventLog,
    KVSnapConnectorMetadata,
    PrefixStore,
    store_key_chain,
)
from kvsnap.engines.vllm.prefix_store import chunk_sequence_id
from kvsnap.engines.vllm.registration import registered_cache
from kvsnap.engines.vllm.specs import ChunkLoad, LoadSpec, SaveSpec
from kvsnap.engines.vllm.worker import KVSnapWorker
from kvsnap.format.signing import KeyRing
from kvsnap.store.files.keys import new_key_text

BLOCK, HEADS, HEAD_DIM, LAYERS, BLOCKS, CHUNK_BLOCKS = 16, 8, 128, 2, 8, 2
FINGERPRINT = "ab" * 16
SOURCE = fmt.SourceInfo("vllm", "test", "synthetic", None, FINGERPRINT)


def _worker(tmp_path: Path, name: str, keys: KeyRing | None = None, **extra) -> KVSnapWorker:
    options = ConnectorOptions.from_extra_config(
        {"path": str(tmp_path / name), "chunk_blocks": CHUNK_BLOCKS, **extra}
    )
    store = PrefixStore(options.path, "ns", chunk_blocks=CHUNK_BLOCKS)
    worker = KVSnapWorker(
        options,
        store,
        EventLog(None, "worker", 0),
        vllm_config=None,
        fingerprint=FINGERPRINT,
        source=SOURCE,
        keys=keys,
    )
    generator = torch.Generator().manual_seed(0)
    physical = [
        torch.randn((BLOCKS, BLOCK, HEADS, 2 * HEAD_DIM), generator=generator).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    worker.attach(
        registered_cache(
            [tensor.permute(0, 2, 1, 3) for tensor in physical],
            backend="FLASH_ATTN",
            kv_cache_layout="LBNHC",
            head_size=HEAD_DIM,
            num_kv_heads=HEADS,
        )
    )
    return worker


def _save(worker: KVSnapWorker, seed: int) -> SaveSpec:
    """One chunk (blocks 0 and 1) of a prompt of its own, saved and written."""
    tokens = np.random.default_rng(seed).integers(1, 500, size=CHUNK_BLOCKS * BLOCK)
    chain = store_key_chain(tokens, BLOCK, CacheIdentity())
    spec = SaveSpec(
        request_id=f"r{seed}",
        kind="persist",
        path=str(worker.store.chunk_path(chain[-1])),
        token_ids=tokens,
        block_ids=np.arange(CHUNK_BLOCKS, dtype=np.int64),
        sequence_id=chunk_sequence_id(0, None, chain[-1]),
    )
    worker.wait_for_save(KVSnapConnectorMetadata(saves=[spec]))
    worker.wait_for_writes()
    return spec


def test_the_option_is_checked():
    assert (
        ConnectorOptions.from_extra_config({"path": "x", "compression": "fp8"}).compression == "fp8"
    )
    assert ConnectorOptions.from_extra_config({"path": "x"}).compression == "none"
    with pytest.raises(ValueError, match="compression must be one of"):
        ConnectorOptions.from_extra_config({"path": "x", "compression": "zip"})


def test_fp8_chunks_are_half_the_bytes_so_a_bound_holds_twice_as_many(tmp_path):
    plain = _worker(tmp_path, "plain")
    chunk_bytes = Path(_save(plain, 0).path).stat().st_size
    plain.shutdown()
    capacity = 6 * chunk_bytes
    counts = {}
    for compression in ("none", "fp8"):
        worker = _worker(
            tmp_path,
            compression,
            compression=compression,
            store_capacity_bytes=capacity,
            store_min_idle_s=0,
        )
        for seed in range(1, 16):
            _save(worker, seed)
        worker.shutdown()
        counts[compression] = len(list((tmp_path / compression).glob("ns/chunks/*/*.safetensors")))
    assert counts["none"] == 6
    assert 11 <= counts["fp8"] <= 12, counts  # about twice: each fp8 chunk is 0.51-0.52 of one


def _checked(tmp_path, spec, *, verify: bool, keys=None):
    """The scheduler's check of the one chunk ``spec`` saved: its record, or why it is a miss."""
    store = PrefixStore(tmp_path / "store", "ns", chunk_blocks=CHUNK_BLOCKS)
    chain = store_key_chain(spec.token_ids, BLOCK, CacheIdentity())
    (chunk,) = store.longest_prefix(chain).chunks
    geometry = {
        "num_layers": LAYERS,
        "num_kv_heads": HEADS,
        "head_dim": HEAD_DIM,
        "latent_dim": 0,
        "dtype": "bfloat16",
    }
    checker = ChunkChecker(FINGERPRINT, geometry, BLOCK, verify=verify, keys=keys)
    return checker.check(chunk, spec.token_ids, chain)


def test_an_fp8_chunk_passes_the_check_and_loads_its_host_decode(tmp_path):
    worker = _worker(tmp_path, "store", compression="fp8")
    spec = _save(worker, 7)
    with kvsnap.Snapshot.open(spec.path) as snapshot:
        assert snapshot.encoded.encoding["name"] == "fp8"
        decoded = {name: snapshot.read_tensor(name) for name in snapshot.geometry.tensor_names()}
    record = _checked(tmp_path, spec, verify=True)
    assert not isinstance(record, str), record
    target = [5, 3]
    load = ChunkLoad(spec.path, np.arange(CHUNK_BLOCKS), np.asarray(target), record)
    worker.start_load_kv(KVSnapConnectorMetadata(loads=[LoadSpec("load", (load,), 0)]))
    assert worker.get_block_ids_with_load_errors() == set()
    for layer, cache in enumerate(worker.cache.caches):
        # FlashAttention's registered view: (blocks, heads, tokens, 2 x head_dim), K then V.
        got = cache[target].permute(0, 2, 1, 3)
        assert torch.equal(
            got[..., :HEAD_DIM].contiguous().view(torch.int16),
            decoded[f"layers.{layer}.key"].view(torch.int16),
        )
        assert torch.equal(
            got[..., HEAD_DIM:].contiguous().view(torch.int16),
            decoded[f"layers.{layer}.value"].view(torch.int16),
        )
    worker.shutdown()
    result = CliRunner().invoke(store_app, ["list", str(tmp_path / "store"), "--json"])
    (entry,) = json.loads(result.stdout)["entries"]
    assert entry["encoding"] == "fp8" and 1.8 < entry["ratio"] < 2.0


def _ordinary_file(chunk: str, worker: KVSnapWorker, blocks: list[int]) -> np.ndarray:
    """The ordinary snapshot the encoded ``chunk`` stands for: its header and metadata tensors
    as the chunk keeps them, its pages the cache's ``blocks``, its block checksums and trailer
    as the chunk recorded them, all of it checked (every page against those checksums)."""
    encoded = read_encoded(chunk)
    data = decode(encoded)
    original = parse_original(data)
    for layer, cache in enumerate(worker.cache.caches):
        # FlashAttention's registered view: (blocks, heads, tokens, 2 x head_dim), K then V.
        pages = cache[blocks].permute(0, 2, 1, 3)
        for part, half in (("key", pages[..., :HEAD_DIM]), ("value", pages[..., HEAD_DIM:])):
            entry = original.layout.by_name[f"layers.{layer}.{part}"]
            original.bytes_of(entry)[:] = half.contiguous().view(torch.uint8).reshape(-1).numpy()
    for name in (fmt.BLOCK_CHECKSUMS_TENSOR, fmt.CHECKSUMS_TENSOR):
        original.bytes_of(original.layout.by_name[name])[:] = encoded.tensor(name)
    check_original(original)
    return data


@pytest.mark.parametrize("compression", ["fp8", "lossless"])
def test_a_signed_encoded_chunk_is_the_recoded_capture_of_the_cache(tmp_path, compression):
    keys = KeyRing([bytes.fromhex(new_key_text())])
    worker = _worker(tmp_path, "store", keys, compression=compression)
    spec = _save(worker, 11)
    with kvsnap.Snapshot.open(spec.path, keys=keys) as snapshot:
        assert snapshot.encoded.encoding["name"] == compression and snapshot.verify() == []
    ordinary = tmp_path / "ordinary.safetensors"
    _ordinary_file(spec.path, worker, list(spec.block_ids)).tofile(ordinary)
    worker.shutdown()
    again = tmp_path / "again.safetensors"
    recode_file(ordinary, again, compression, keys=keys)
    assert again.read_bytes() == Path(spec.path).read_bytes()


@pytest.mark.parametrize("compression", ["fp8", "lossless"])
@pytest.mark.parametrize("verify", [False, True])
def test_a_signed_encoded_chunk_passes_a_keyed_check_and_loads(tmp_path, compression, verify):
    """With a key, the scheduler serves only chunks whose pages a signature binds by BLAKE3: an
    encoded chunk's own signature does (its decoded file is unsigned), and it loads."""
    keys = KeyRing([bytes.fromhex(new_key_text())])
    worker = _worker(tmp_path, "store", keys, compression=compression)
    spec = _save(worker, 5)
    record = _checked(tmp_path, spec, verify=verify, keys=keys)
    assert not isinstance(record, str), record
    other_key = KeyRing([bytes.fromhex(new_key_text())])
    assert isinstance(_checked(tmp_path, spec, verify=verify, keys=other_key), str)  # a miss
    load = ChunkLoad(spec.path, np.arange(CHUNK_BLOCKS), np.asarray([6, 1]), record)
    worker.start_load_kv(KVSnapConnectorMetadata(loads=[LoadSpec("load", (load,), 0)]))
    assert worker.get_block_ids_with_load_errors() == set()
    worker.shutdown()
