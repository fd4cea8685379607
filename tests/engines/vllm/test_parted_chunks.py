"""Parted chunks in the vLLM prefix store (TP > 1: every rank wrote its own heads).

A parted chunk is an index ``HASH.safetensors.index.json`` and its parts, with no
``HASH.safetensors``; every store operation must treat it as one entry. Chunks here are real
parted snapshots captured from two ``vllm-nhd`` TP ranks of random bytes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvsnap import format as fmt
from kvsnap.cli.app import app as main_app
from kvsnap.cli.store import app as store_app
from kvsnap.engines.vllm import (
    CacheIdentity,
    ChunkChecker,
    PrefixStore,
    chunk_sequence_id,
    eviction,
    prune_store,
    store_bytes,
    store_entries,
    store_key_chain,
)
from kvsnap.engines.vllm.chunk_check import file_key
from kvsnap.engines.vllm.eviction import ORPHAN_GRACE_S
from kvsnap.layout import KVGeometry
from kvsnap.snapshot import SequenceBlocks, Snapshot, capture
from kvsnap.testing.caches import make_cache, random_content

BLOCK, HEADS, HEAD_DIM, LAYERS, TP = 4, 4, 8, 2, 2
FINGERPRINT = "ab" * 16
GEOMETRY = {
    "num_layers": LAYERS,
    "num_kv_heads": HEADS,
    "head_dim": HEAD_DIM,
    "block_size": BLOCK,
    "dtype": "float16",
}
SOURCE = fmt.SourceInfo("vllm", "test", "synthetic", None, FINGERPRINT)


def _prompt(num_blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 1000, size=num_blocks * BLOCK)


def _chain(prompt: np.ndarray) -> list[str]:
    return store_key_chain(prompt[: len(prompt) // BLOCK * BLOCK], BLOCK, CacheIdentity())


def _write_chunk(
    store: PrefixStore, prompt: np.ndarray, start: int, end: int, *, parted: bool = True
) -> Path:
    """Blocks ``[start, end)`` of ``prompt`` as the store's chunk, captured from two TP ranks:
    parted (each rank's heads in its own part) or as one file. Returns ``HASH.safetensors``."""
    chain = _chain(prompt[: end * BLOCK])
    target = store.chunk_path(chain[end - 1])
    target.parent.mkdir(parents=True, exist_ok=True)
    geometry = KVGeometry(
        num_layers=LAYERS,
        block_size=BLOCK,
        dtype="float16",
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
    )
    content = random_content(geometry, end - start, torch.Generator().manual_seed(start + 7))
    ranks = []
    for rank in range(TP):
        cache = make_cache(
            "vllm-nhd",
            num_layers=LAYERS,
            num_blocks=end - start,
            block_size=BLOCK,
            num_kv_heads=HEADS,
            head_dim=HEAD_DIM,
            tp_rank=rank,
            tp_size=TP,
        )
        cache.fill(content)
        ranks.append(cache.layout)
    sequence = SequenceBlocks(
        chunk_sequence_id(start, chain[start - 1] if start else None, chain[end - 1]),
        prompt[start * BLOCK : end * BLOCK],
        np.arange(end - start),
    )
    capture(ranks, [sequence], target, source=SOURCE, per_rank_parts=parted)
    return target


def _index(path: Path) -> Path:
    return Path(f"{path}.index.json")


def _parts(path: Path) -> list[Path]:
    """The part files beside the chunk ``path`` (any generation), in name order."""
    stem = path.name.removesuffix(".safetensors")
    return sorted(item for item in path.parent.iterdir() if fmt.is_part_of(stem, item.name))


def _files(root: Path) -> set[Path]:
    return {item for item in root.rglob("*") if item.is_file()}


def _flip_kv_byte(path: Path) -> None:
    """Flip one byte in the middle of the first layer tensor's data of the file ``path``."""
    data = bytearray(path.read_bytes())
    header_size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_size])
    begin, end = header["layers.0.key"]["data_offsets"]
    data[8 + header_size + (begin + end) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def _aged(files: list[Path], seconds_ago: float) -> None:
    moment = time.time() - seconds_ago
    for file in files:
        os.utime(file, (moment, moment))


def test_longest_prefix_finds_parted_chunks(tmp_path: Path) -> None:
    store = PrefixStore(tmp_path, "ns", chunk_blocks=2)
    prompt = _prompt(5, seed=1)
    first = _write_chunk(store, prompt, 0, 2)
    second = _write_chunk(store, prompt, 2, 4, parted=False)
    last = _write_chunk(store, prompt, 4, 5)
    assert not first.exists() and _index(first).is_file() and len(_parts(first)) == TP
    assert second.is_file() and not _index(second).exists()
    match = store.longest_prefix(_chain(prompt))
    assert match is not None and match.num_blocks == 5
    assert [chunk.path for chunk in match.chunks] == [str(first), str(second), str(last)]
    assert store.has_chunk(first) and store.has_chunk(second)
    # The chunk's path opens the parted snapshot as one (all heads).
    with Snapshot.open(match.chunks[0].path) as snapshot:
        assert snapshot.geometry.num_kv_heads == HEADS
    # The index is the commit point: without it the chunk is not stored, parts or not.
    _index(last).unlink()
    assert not store.has_chunk(last)
    assert store.longest_prefix(_chain(prompt)).num_blocks == 4


def test_touch_records_use_on_the_index(tmp_path: Path) -> None:
    store = PrefixStore(tmp_path, "ns", chunk_blocks=1)
    older, newer = (_write_chunk(store, _prompt(1, seed=10 + i), 0, 1) for i in range(2))
    _aged([_index(older), *_parts(older)], 400)
    _aged([_index(newer), *_parts(newer)], 200)
    modified = _index(older).stat().st_mtime_ns
    assert [entry.path for entry in store_entries(tmp_path)] == [_index(older), _index(newer)]
    store.touch(older)
    status = _index(older).stat()
    assert time.time() - status.st_atime < 60 and status.st_mtime_ns == modified
    # The touched chunk is now the most recently used: LRU pruning takes the other, whole.
    assert [entry.path for entry in store_entries(tmp_path)] == [_index(newer), _index(older)]
    (removed,) = prune_store(tmp_path, store_bytes(tmp_path) - 1)
    assert removed.path == _index(newer)
    assert not _index(newer).exists() and _parts(newer) == []
    assert store.has_chunk(older) and len(_parts(older)) == TP


def test_quarantine_moves_a_parted_chunk_whole(tmp_path: Path) -> None:
    store = PrefixStore(tmp_path, "ns", chunk_blocks=2)
    prompt = _prompt(2, seed=6)
    path = _write_chunk(store, prompt, 0, 2)
    parts = _parts(path)
    moved = store.quarantine(path)
    assert moved is not None and moved.name == _index(path).name
    assert moved.parent.parent == store.quarantined
    assert moved.parent.name.startswith(path.name.removesuffix(".safetensors") + ".")
    # Nothing of it is left where chunks are matched, and every file is in its new directory.
    assert list(path.parent.iterdir()) == []
    assert store.longest_prefix(_chain(prompt)) is None
    assert sorted(item.name for item in moved.parent.iterdir()) == sorted(
        [moved.name, *(part.name for part in parts)]
    )
    # It can still be inspected as one snapshot, through the CLI too.
    with Snapshot.open(moved.parent / path.name) as snapshot:
        assert snapshot.verify() == [] and len(snapshot.part_files()) == TP
    result = CliRunner().invoke(main_app, ["inspect", str(moved.parent / path.name), "--json"])
    assert result.exit_code == 0, result.output
    assert store.quarantine(path) is None  # another process got there first
    (entry,) = store_entries(tmp_path)
    assert entry.quarantined and entry.path == moved and len(entry.parts) == TP
    # Pruning takes it whole, its directory too.
    assert prune_store(tmp_path, 0) == [entry]
    assert list(store.quarantined.iterdir()) == []


def test_entries_and_prune_take_parted_chunks_whole(tmp_path: Path) -> None:
    store = PrefixStore(tmp_path, "ns", chunk_blocks=1)
    single = _write_chunk(store, _prompt(1, seed=30), 0, 1, parted=False)
    oldest, newest = (_write_chunk(store, _prompt(1, seed=31 + i), 0, 1) for i in range(2))
    _aged([single], 300)
    _aged([_index(oldest), *_parts(oldest)], 500)
    # A failed write's leftover: parts no index names (its index never got published).
    orphan = _write_chunk(store, _prompt(1, seed=40), 0, 1)
    _index(orphan).unlink()
    _aged(_parts(orphan), ORPHAN_GRACE_S + 60)
    young_orphan = _write_chunk(store, _prompt(1, seed=41), 0, 1)
    _index(young_orphan).unlink()
    on_disk = sum(item.stat().st_size for item in _files(tmp_path))
    assert store_bytes(tmp_path) == on_disk
    entries = store_entries(tmp_path)
    chunks = {entry.path: entry for entry in entries if not entry.orphan}
    assert set(chunks) == {single, _index(oldest), _index(newest)}
    parted = chunks[_index(oldest)]
    assert parted.parts == tuple(_parts(oldest)) and parted.size == sum(
        item.stat().st_size for item in (_index(oldest), *_parts(oldest))
    )
    assert {entry.path for entry in entries if entry.orphan} == {
        *_parts(orphan),
        *_parts(young_orphan),
    }
    # Pruning to what the single file and the newest chunk hold: the old orphans go first,
    # then the least recently used chunk, whole; the young orphans (a write in progress?) stay.
    young = sum(part.stat().st_size for part in _parts(young_orphan))
    keep = single.stat().st_size + chunks[_index(newest)].size + young
    orphan_parts = _parts(orphan)
    removed = prune_store(tmp_path, keep)
    assert [entry.path for entry in removed] == [*orphan_parts, _index(oldest)]
    assert _parts(orphan) == [] and not _index(oldest).exists() and _parts(oldest) == []
    assert store_bytes(tmp_path) == keep and len(_parts(young_orphan)) == TP
    # What is left: every index with all its parts, and no part of a live index deleted.
    assert store.has_chunk(newest) and len(_parts(newest)) == TP and single.is_file()
    with Snapshot.open(newest) as snapshot:
        assert snapshot.verify() == []


def test_prune_leaves_a_chunk_another_process_moved_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PrefixStore(tmp_path, "ns", chunk_blocks=1)
    path = _write_chunk(store, _prompt(1, seed=70), 0, 1)
    listed = store_entries(tmp_path)
    moved = store.quarantine(path)  # between this pruner's listing and its deletions
    assert moved is not None
    monkeypatch.setattr(eviction, "store_entries", lambda root, **_: listed)
    # The index is gone from where it was listed: its parts are the mover's, not deleted.
    assert prune_store(tmp_path, 0) == []
    with Snapshot.open(moved) as snapshot:
        assert snapshot.verify() == []


def test_checker_reads_parted_chunks_through_their_index(tmp_path: Path) -> None:
    store = PrefixStore(tmp_path, "ns", chunk_blocks=2)
    prompt = _prompt(2, seed=50)
    path = _write_chunk(store, prompt, 0, 2)
    (chunk,) = store.longest_prefix(_chain(prompt)).chunks
    index_status = _index(path).stat()
    assert file_key(chunk.path) == (
        index_status.st_dev,
        index_status.st_ino,
        index_status.st_size,
        index_status.st_mtime_ns,
        index_status.st_ctime_ns,
        True,  # a parted chunk's index
    )
    checker = ChunkChecker(FINGERPRINT, GEOMETRY, BLOCK, verify=True)
    record = checker.check(chunk, prompt, _chain(prompt))
    assert not isinstance(record, str), record
    assert record.id == chunk_sequence_id(0, None, _chain(prompt)[1])
    # The chunk is written anew (a new index and parts) with one KV byte flipped in part 2:
    # the index's identity changed, so the checker reads it again and finds the damage.
    _write_chunk(store, prompt, 0, 2)
    second = _parts(path)[1]
    assert "-part-00002-of-00002" in second.name
    _flip_kv_byte(second)
    reason = checker.check(chunk, prompt, _chain(prompt))
    assert isinstance(reason, str) and "failed verification" in reason
    assert "layers.0.key" in reason
    # Without verify only the headers (every part's, against the index) are read.
    lenient = ChunkChecker(FINGERPRINT, GEOMETRY, BLOCK, verify=False)
    assert not isinstance(lenient.check(chunk, prompt, _chain(prompt)), str)
    # A pass is remembered by the index's identity; once forgotten (a load of the chunk
    # failed), a missing part makes the chunk unreadable. A missing index makes it gone.
    second.unlink()
    lenient.forget(chunk.path)
    assert "unreadable chunk" in lenient.check(chunk, prompt, _chain(prompt))
    _index(path).unlink()
    assert checker.check(chunk, prompt, _chain(prompt)) == "the chunk is gone"


def _invoke(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(store_app, [*args, "--json"])
    return result.exit_code, json.loads(result.stdout)


def test_store_cli_takes_parted_chunks_as_one_entry(tmp_path: Path) -> None:
    store = PrefixStore(tmp_path, "ns", chunk_blocks=2)
    prompt = _prompt(4, seed=60)
    first, second = (_write_chunk(store, prompt, start, end) for start, end in ((0, 2), (2, 4)))
    _aged([_index(first), *_parts(first)], 500)
    code, listing = _invoke("list", str(tmp_path))
    assert code == 0 and listing["count"] == 2
    assert listing["bytes"] == sum(item.stat().st_size for item in _files(tmp_path))
    oldest = listing["entries"][0]
    assert oldest["path"] == str(_index(first).relative_to(tmp_path))
    assert oldest["parts"] == TP and not oldest["orphan"] and oldest["age_s"] >= 500
    table = CliRunner().invoke(store_app, ["list", str(tmp_path)])
    assert table.exit_code == 0 and "2 entries" in table.output
    code, report = _invoke("verify", str(tmp_path))
    assert (code, report["ok"], report["checked"]) == (0, True, 2)
    # Verifying read every file but is no use: the LRU order stays.
    code, listing = _invoke("list", str(tmp_path))
    assert listing["entries"][0]["path"] == oldest["path"]
    assert listing["entries"][0]["age_s"] >= 500
    _flip_kv_byte(_parts(second)[1])
    code, report = _invoke("verify", str(tmp_path))
    assert code == 1 and not report["ok"] and report["bad"] == 1
    (bad,) = [entry for entry in report["entries"] if not entry["ok"]]
    assert bad["path"] == str(_index(second).relative_to(tmp_path))
    assert "layers.0.key" in bad["problems"][0]
    second_bytes = sum(item.stat().st_size for item in (_index(second), *_parts(second)))
    code, pruned = _invoke("prune", str(tmp_path), "--max-bytes", str(second_bytes))
    assert code == 0 and pruned["fits"] and pruned["bytes"] == second_bytes
    assert [entry["path"] for entry in pruned["removed"]] == [oldest["path"]]
    assert pruned["removed"][0]["parts"] == TP
    assert _files(tmp_path) == {_index(second), *_parts(second)}
    # Parts no index names: listed as orphans, kept while young, pruned after the grace.
    _index(second).unlink()
    code, listing = _invoke("list", str(tmp_path))
    assert [(entry["orphan"], entry["parts"]) for entry in listing["entries"]] == [(True, 0)] * TP
    code, report = _invoke("verify", str(tmp_path))
    assert (code, report["checked"]) == (0, 0)
    code, pruned = _invoke("prune", str(tmp_path), "--max-bytes", "0")
    assert pruned["removed"] == [] and not pruned["fits"]
    code, pruned = _invoke("prune", str(tmp_path), "--max-bytes", "0", "--orphan-grace-s", "0")
    assert code == 0 and pruned["fits"] and len(pruned["removed"]) == TP
    assert _files(tmp_path) == set()
