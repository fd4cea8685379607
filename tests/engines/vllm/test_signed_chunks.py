"""A signed store serves only chunks whose pages are bound by BLAKE3, and ``kvsnap store
verify`` with the store's key checks every page against its signed digest.

An older signed chunk (``"hmac-sha256"``: pages bound by xxh3-64 only) is a miss for a checker
holding the key, recomputed and saved anew; a chunk whose page changed after signing is a
miss naming the page; ``store verify --key-file`` tells them apart from a good chunk. Chunks
are real snapshots captured from a random cache and signed with a real key; the older form is
written by tests/support/signed_v1.py (what the older kvsnap wrote, byte for byte).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvsnap import format as fmt
from kvsnap.cli.store import app as store_app
from kvsnap.engines.vllm import (
    CacheIdentity,
    ChunkChecker,
    PrefixStore,
    chunk_sequence_id,
    store_key_chain,
    vllm_layout,
)
from kvsnap.format.signing import KeyRing
from kvsnap.snapshot import SequenceBlocks, Snapshot, capture
from kvsnap.store.files.keys import new_key_text
from tests.support.signed_v1 import rewrite_as_v1_signed
from tests.support.tamper import RawSnapshot

BLOCK, HEADS, HEAD_DIM, LAYERS = 4, 2, 8, 2
FINGERPRINT = "ab" * 16
GEOMETRY = {
    "num_layers": LAYERS,
    "num_kv_heads": HEADS,
    "head_dim": HEAD_DIM,
    "block_size": BLOCK,
    "dtype": "bfloat16",
}


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "store.key"
    path.write_text(new_key_text() + "\n")
    path.chmod(0o600)
    return path


def _keys(key_file: Path) -> KeyRing:
    return KeyRing([bytes.fromhex(key_file.read_text().strip())])


def _signed_chunk(
    store: PrefixStore, prompt: np.ndarray, keys: KeyRing, compression: str = "none"
) -> Path:
    """Blocks 0..1 of ``prompt`` captured as the store's chunk, signed with ``keys`` (stored
    as ``compression``: the connector's option)."""
    chain = store_key_chain(prompt[: 2 * BLOCK], BLOCK, CacheIdentity())
    target = store.chunk_path(chain[1])
    target.parent.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(int(prompt[0]))
    shape = (2, HEADS, BLOCK, 2 * HEAD_DIM)
    caches = [torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(LAYERS)]
    layout = vllm_layout(
        caches,
        backend="FLASH_ATTN",
        kv_cache_layout="LBHNC",
        head_size=HEAD_DIM,
        num_kv_heads=HEADS,
    )
    sequence = SequenceBlocks(chunk_sequence_id(0, None, chain[1]), prompt[: 2 * BLOCK], [0, 1])
    source = fmt.SourceInfo("vllm", "test", "synthetic", None, FINGERPRINT)
    capture(layout, [sequence], target, source=source, keys=keys, compression=compression)
    return target


def _as_older_form(path: Path, keys: KeyRing) -> None:
    """Rewrite the signed chunk at ``path`` as the older kvsnap signed it."""
    rewrite_as_v1_signed(path, keys)


def _check(store: PrefixStore, prompt: np.ndarray, keys: KeyRing) -> object:
    chain = store_key_chain(prompt[: 2 * BLOCK], BLOCK, CacheIdentity())
    (chunk,) = store.longest_prefix(chain).chunks
    checker = ChunkChecker(FINGERPRINT, GEOMETRY, BLOCK, verify=True, keys=keys)
    return checker.check(chunk, prompt, chain)


def test_a_keyed_checker_serves_only_chunks_bound_by_blake3(tmp_path: Path, key_file: Path) -> None:
    keys = _keys(key_file)
    store = PrefixStore(tmp_path / "store", "ns", chunk_blocks=2)
    prompt = np.random.default_rng(3).integers(1, 1000, size=2 * BLOCK)
    path = _signed_chunk(store, prompt, keys)
    record = _check(store, prompt, keys)
    assert not isinstance(record, str), record
    _as_older_form(path, keys)
    with Snapshot.open(path, keys=keys) as snapshot:  # a valid, older signature
        assert snapshot.page_binding == "xxh3-64" and snapshot.verify() == []
    reason = _check(store, prompt, keys)
    assert isinstance(reason, str)
    assert "hmac-sha256" in reason and "xxh3-64 only" in reason
    # Without a key the store trusts no signature: the older chunk serves as any chunk does.
    chain = store_key_chain(prompt, BLOCK, CacheIdentity())
    (chunk,) = store.longest_prefix(chain).chunks
    unkeyed = ChunkChecker(FINGERPRINT, GEOMETRY, BLOCK, verify=True)
    assert not isinstance(unkeyed.check(chunk, prompt, chain), str)


def test_a_page_changed_after_signing_is_a_miss_naming_the_page(
    tmp_path: Path, key_file: Path
) -> None:
    keys = _keys(key_file)
    store = PrefixStore(tmp_path / "store", "ns", chunk_blocks=2)
    prompt = np.random.default_rng(4).integers(1, 1000, size=2 * BLOCK)
    path = _signed_chunk(store, prompt, keys)
    raw = RawSnapshot(path)
    raw.page("layers.1.key", 1)[:4] ^= 0x7F
    raw.save()
    reason = _check(store, prompt, keys)
    assert isinstance(reason, str) and "failed verification" in reason
    assert "layers.1.key block 1" in reason and "BLAKE3" in reason


def _store_verify(root: Path, key_file: Path) -> tuple[int, dict]:
    result = CliRunner().invoke(store_app, ["verify", str(root), "--key-file", str(key_file)])
    return result.exit_code, json.loads(
        CliRunner()
        .invoke(store_app, ["verify", str(root), "--key-file", str(key_file), "--json"])
        .stdout
    )


def test_store_verify_with_the_key_checks_every_page_against_its_digest(
    tmp_path: Path, key_file: Path
) -> None:
    keys = _keys(key_file)
    root = tmp_path / "store"
    store = PrefixStore(root, "ns", chunk_blocks=2)
    prompts = [np.random.default_rng(seed).integers(1, 1000, size=2 * BLOCK) for seed in (5, 6, 7)]
    good, changed, older = (_signed_chunk(store, prompt, keys) for prompt in prompts)
    code, report = _store_verify(root, key_file)
    assert code == 0 and report["ok"] and report["checked"] == 3
    raw = RawSnapshot(changed)
    raw.page("layers.0.value", 0)[:4] ^= 0x7F
    raw.save()
    _as_older_form(older, keys)
    code, report = _store_verify(root, key_file)
    assert code == 1 and report["bad"] == 2
    states = {entry["path"]: entry for entry in report["entries"]}
    assert states[str(good.relative_to(root))]["state"] == "ok"
    bad = states[str(changed.relative_to(root))]
    assert bad["state"] == "corrupt" and "layers.0.value block 0" in bad["problems"][0]
    assert "BLAKE3" in bad["problems"][0]
    weak = states[str(older.relative_to(root))]
    assert weak["state"] == "weak signature" and "xxh3-64 only" in weak["problems"][0]


@pytest.mark.parametrize("compression", ["fp8", "lossless"])
def test_store_verify_with_the_key_finds_a_signed_encoded_chunk_bound_by_blake3(
    tmp_path: Path, key_file: Path, compression: str
) -> None:
    """An encoded chunk's signature is its encoded file's own (over BLAKE3 of its stored
    tensors, or of each fp8 page): not the weak, older signature its unsigned decoded file
    would suggest."""
    keys = _keys(key_file)
    root = tmp_path / "store"
    store = PrefixStore(root, "ns", chunk_blocks=2)
    prompt = np.random.default_rng(8).integers(1, 1000, size=2 * BLOCK)
    _signed_chunk(store, prompt, keys, compression)
    code, report = _store_verify(root, key_file)
    assert code == 0 and [entry["state"] for entry in report["entries"]] == ["ok"]
    assert not isinstance(_check(store, prompt, keys), str)  # and a keyed engine serves it
    other = tmp_path / "other.key"
    other.write_text(new_key_text() + "\n")
    other.chmod(0o600)
    code, report = _store_verify(root, other)
    (entry,) = report["entries"]
    assert code == 1 and entry["state"] == "bad signature"
    assert "not one of ours" in entry["problems"][0]
