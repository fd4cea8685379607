"""The vLLM prefix store without vLLM: chunks, checks, quarantine, LRU eviction, `kvsnap store`.

Chunks are real kvsnap snapshots captured from a random ``FLASH_ATTN``-shaped cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvsnap import format as fmt
from kvsnap.cli.store import app as store_app
from kvsnap.engines.open_snapshots import OpenSnapshots
from kvsnap.engines.vllm import (
    CacheIdentity,
    ChunkChecker,
    ConnectorOptions,
    PrefixStore,
    chunk_check,
    chunk_sequence_id,
    eviction,
    prune_store,
    store_bytes,
    store_entries,
    store_key_chain,
    vllm_layout,
)
from kvsnap.engines.vllm import worker as worker_module
from kvsnap.engines.vllm.open_chunks import CHECKED_CHUNKS
from kvsnap.engines.vllm.prefix_store import committed_file, index_path
from kvsnap.engines.vllm.specs import KVSnapConnectorMetadata, LoadSpec
from kvsnap.format.signing import KeyRing
from kvsnap.snapshot import SequenceBlocks, Snapshot, capture
from kvsnap.store.base import tuning
from kvsnap.store.files import publish
from kvsnap.store.hot import tier as hot
from kvsnap.store.hot.tier import HotTier
from tests.support.reads import record_preadv
from tests.support.vllm_worker_helpers import (
    cache_blocks,
    chunk_load,
    load_saves,
    make_worker,
    stored_chunks,
)

BLOCK = 4
HEADS, HEAD_DIM, LAYERS = 2, 8, 2
FINGERPRINT = "ab" * 16
GEOMETRY = {
    "num_layers": LAYERS,
    "num_kv_heads": HEADS,
    "head_dim": HEAD_DIM,
    "block_size": BLOCK,
    "dtype": "bfloat16",
}


def _cache(num_blocks: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (num_blocks, HEADS, BLOCK, 2 * HEAD_DIM)
    return [torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in range(LAYERS)]


def test_a_chunk_the_scheduler_touches_on_every_hit_stays_one_hot_tier_entry(
    tmp_path: Path,
) -> None:
    # The scheduler records every hit's use of a chunk (PrefixStore.touch: its access time,
    # which moves the file's change time). The hot tier must still see one version of the
    # file: registered on its second use, then hit, not a new version counted once per hit.
    tier = HotTier(1 << 30, 2, register=False, serve_unregistered=True)
    store = PrefixStore(tmp_path, "ns", chunk_blocks=1)
    path = _write_chunk(store, _prompt(1, seed=40), 0, 1)
    path.read_bytes()  # written with O_DIRECT: loaded once, through the page cache
    served = []
    for _ in range(4):
        assert store.touch(path)
        fd = os.open(path, os.O_RDONLY)  # each hit's load opens the chunk anew
        try:
            entry = tier.lookup(str(path), fd, os.fstat(fd))
        finally:
            os.close(fd)
        served.append(entry is not None)
        if entry is not None:
            tier.release(entry)
    assert served == [False, True, True, True]
    stats = tier.stats()
    assert (stats.files, stats.registrations, stats.hits, stats.invalidations) == (1, 1, 2, 0)


def _write_chunk(
    store: PrefixStore,
    prompt: np.ndarray,
    start: int,
    end: int,
    *,
    fingerprint: str = FINGERPRINT,
    path: Path | None = None,
    tokens: np.ndarray | None = None,
) -> Path:
    """Capture blocks ``[start, end)`` of ``prompt`` as the store's chunk (what the worker does);
    ``tokens`` records other token ids under the prompt's sequence id (a forged chunk)."""
    chain = store_key_chain(prompt[: end * BLOCK], BLOCK, CacheIdentity())
    target = path or store.chunk_path(chain[end - 1])
    target.parent.mkdir(parents=True, exist_ok=True)
    layout = vllm_layout(
        _cache(end - start, seed=start),
        backend="FLASH_ATTN",
        kv_cache_layout="LBHNC",
        head_size=HEAD_DIM,
        num_kv_heads=HEADS,
    )
    sequence = SequenceBlocks(
        chunk_sequence_id(start, chain[start - 1] if start else None, chain[end - 1]),
        (prompt if tokens is None else tokens)[start * BLOCK : end * BLOCK],
        np.arange(end - start),
    )
    source = fmt.SourceInfo("vllm", "test", "synthetic", None, fingerprint)
    capture(layout, [sequence], target, source=source)
    return target


def _prompt(num_blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 1000, size=num_blocks * BLOCK)


def _chain(prompt: np.ndarray) -> list[str]:
    return store_key_chain(prompt[: len(prompt) // BLOCK * BLOCK], BLOCK, CacheIdentity())


def _flip_kv_byte(path: Path) -> None:
    """Flip one byte in the middle of the first layer tensor's data."""
    data = bytearray(path.read_bytes())
    header_size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_size])
    begin, end = header["layers.0.key"]["data_offsets"]
    data[8 + header_size + (begin + end) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def test_prompts_sharing_a_prefix_share_its_chunks(tmp_path: Path) -> None:
    store = PrefixStore(tmp_path, "ns", chunk_blocks=2)
    first = _prompt(5, seed=1)
    for start, end in store.chunk_spans(5):  # [0,2) [2,4) [4,5)
        _write_chunk(store, first, start, end)
    assert store.chunk_spans(5) == [(0, 2), (2, 4), (4, 5)]
    match = store.longest_prefix(_chain(first))
    assert match is not None and match.num_blocks == 5
    assert [(c.first_block, c.num_blocks) for c in match.chunks] == [(0, 2), (2, 2), (4, 1)]
    # A longer prompt with the same first 5 blocks finds them all, including the short chunk.
    longer = np.concatenate([first, _prompt(2, seed=2)])
    assert store.longest_prefix(_chain(longer)).num_blocks == 5
    # One that shares 3 blocks only gets the whole chunks it shares: a chunk is the unit.
    diverging = np.concatenate([first[: 3 * BLOCK], _prompt(3, seed=3)])
    assert store.longest_prefix(_chain(diverging)).num_blocks == 2
    # Chunks are named by content: the same prefix maps to the same file from any prompt.
    assert store.longest_prefix(_chain(diverging)).chunks[0].path == match.chunks[0].path
    # A missing chunk ends the match there.
    Path(match.chunks[1].path).unlink()
    assert store.longest_prefix(_chain(first)).num_blocks == 2
    assert store.longest_prefix(_chain(_prompt(5, seed=9))) is None


def test_checker_refuses_damaged_foreign_and_misplaced_chunks(tmp_path: Path) -> None:
    store = PrefixStore(tmp_path, "ns", chunk_blocks=2)
    prompt = _prompt(4, seed=4)
    chain = _chain(prompt)
    path = _write_chunk(store, prompt, 0, 2)
    (chunk,) = store.longest_prefix(chain[:2]).chunks
    checker = ChunkChecker(FINGERPRINT, GEOMETRY, BLOCK, verify=True)
    record = checker.check(chunk, prompt, chain)
    assert not isinstance(record, str) and record.id == chunk_sequence_id(0, None, chain[1])
    # The file changes on disk (same size): the remembered pass is not reused.
    _flip_kv_byte(path)
    reason = checker.check(chunk, prompt, chain)
    assert isinstance(reason, str) and "failed verification" in reason
    assert "layers.0.key" in reason
    # Without verify, only the header is read: the damage is found by the load instead.
    lenient = ChunkChecker(FINGERPRINT, GEOMETRY, BLOCK, verify=False)
    assert not isinstance(lenient.check(chunk, prompt, chain), str)
    # Another model's chunk, a chunk at another prefix's name, a truncated file.
    foreign = ChunkChecker("cd" * 16, GEOMETRY, BLOCK, verify=True)
    assert "model fingerprint abababababababab differs" in foreign.check(chunk, prompt, chain)
    other = _prompt(2, seed=5)
    _write_chunk(store, other, 0, 2, path=path)
    assert "is not this prompt's prefix" in checker.check(chunk, prompt, chain)
    _write_chunk(store, prompt, 0, 2, path=path, tokens=other)
    assert "token ids differ" in checker.check(chunk, prompt, chain)
    second = _write_chunk(store, prompt, 2, 4)
    (_, later) = store.longest_prefix(chain).chunks
    salted = store_key_chain(prompt, BLOCK, CacheIdentity(cache_salt="another tenant"))
    assert "is not this prompt's prefix" in checker.check(later, prompt, salted)
    second.write_bytes(second.read_bytes()[:200])
    assert "unreadable chunk" in checker.check(later, prompt, chain)


def test_a_checker_remembers_only_the_last_chunks_that_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A chunk remembered as passed is not read again while its file's version (device, inode,
    # size, modification and change times) is unchanged. Past the bound the least recently
    # matched chunk is forgotten and read again. A rewrite in place that put the size and the
    # modification time back still moves the change time: read again and refused.
    store = PrefixStore(tmp_path, "ns", chunk_blocks=2)
    prompts = [_prompt(2, seed=40 + number) for number in range(3)]
    paths = [_write_chunk(store, prompt, 0, 2) for prompt in prompts]
    chunks = [store.longest_prefix(_chain(prompt)).chunks[0] for prompt in prompts]
    opened = []
    real_open = chunk_check.open_snapshot
    monkeypatch.setattr(
        chunk_check,
        "open_snapshot",
        lambda path, **kw: opened.append(path) or real_open(path, **kw),
    )
    for remember, read_again in ((3, False), (2, True)):
        checker = ChunkChecker(FINGERPRINT, GEOMETRY, BLOCK, verify=True, remember=remember)
        for prompt, chunk in zip(prompts, chunks, strict=True):
            assert not isinstance(checker.check(chunk, prompt, _chain(prompt)), str)
        opened.clear()
        again = checker.check(chunks[0], prompts[0], _chain(prompts[0]))
        assert not isinstance(again, str), again
        assert opened == ([chunks[0].path] if read_again else [])
    status = paths[0].stat()
    time.sleep(0.02)  # past a tick of the coarse clock the kernel stamps change times from
    _flip_kv_byte(paths[0])
    os.utime(paths[0], ns=(status.st_atime_ns, status.st_mtime_ns))
    after = paths[0].stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        status.st_ino,
        status.st_size,
        status.st_mtime_ns,
    )
    reason = checker.check(chunks[0], prompts[0], _chain(prompts[0]))
    assert isinstance(reason, str) and "failed verification" in reason


def test_quarantined_chunks_are_never_matched_again(tmp_path: Path) -> None:
    store = PrefixStore(tmp_path, "ns", chunk_blocks=2)
    prompt = _prompt(2, seed=6)
    path = _write_chunk(store, prompt, 0, 2)
    moved = store.quarantine(path)
    assert moved is not None and moved.parent == store.quarantined and moved.exists()
    assert not path.exists() and store.longest_prefix(_chain(prompt)) is None
    assert store.quarantine(path) is None  # another process got there first
    (entry,) = store_entries(tmp_path)
    assert entry.quarantined and entry.path == moved


def _aged(path: Path, seconds_ago: float) -> None:
    moment = time.time() - seconds_ago
    os.utime(path, (moment, moment))


def test_prune_evicts_quarantined_then_least_recently_used(tmp_path: Path) -> None:
    store = PrefixStore(tmp_path, "ns", chunk_blocks=1)
    paths = [_write_chunk(store, _prompt(1, seed=10 + i), 0, 1) for i in range(4)]
    for age, path in zip((400, 300, 200, 100), paths, strict=True):
        _aged(path, age)
    bad = store.quarantine(paths[3])
    assert bad is not None
    size = paths[0].stat().st_size
    assert store_bytes(tmp_path) == 4 * size
    store.touch(paths[0])  # the oldest is used now: it becomes the most recently used
    removed = prune_store(tmp_path, 2 * size)
    assert [entry.path for entry in removed] == [bad, paths[1]]
    assert store_bytes(tmp_path) == 2 * size
    # Chunks used within min_idle_s are kept even when the store stays above the bound.
    assert [entry.path for entry in prune_store(tmp_path, 0, min_idle_s=60)] == [paths[2]]
    assert [entry.path for entry in store_entries(tmp_path)] == [paths[0]]
    assert [entry.path for entry in prune_store(tmp_path, 0)] == [paths[0]]
    assert store_entries(tmp_path) == []


def test_prune_puts_back_a_chunk_used_after_its_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 3: a pruner working from a listing taken before another engine matched (touched)
    a chunk re-reads its last use once it has set it aside, and puts it back."""
    store = PrefixStore(tmp_path, "ns", chunk_blocks=1)
    used, idle = (_write_chunk(store, _prompt(1, seed=90 + i), 0, 1) for i in range(2))
    for path in (used, idle):
        _aged(path, 100)
    listed = store_entries(tmp_path)
    assert store.touch(used)  # an engine matches it after the pruner listed the store
    monkeypatch.setattr(eviction, "store_entries", lambda root, **_: listed)
    removed = prune_store(tmp_path, 0, min_idle_s=10)
    assert [entry.path for entry in removed] == [idle]
    assert used.is_file() and not idle.exists()
    # Nothing is left aside: the store holds exactly the used chunk.
    assert sorted(p.name for p in used.parent.iterdir()) == [used.name]


def test_touch_of_a_chunk_gone_is_a_miss(tmp_path: Path) -> None:
    """Item 3: a chunk set aside by a pruner (or deleted) cannot be touched, and says so: the
    scheduler ends the match there instead of offering a chunk the worker cannot load."""
    store = PrefixStore(tmp_path, "ns", chunk_blocks=1)
    path = _write_chunk(store, _prompt(1, seed=95), 0, 1)
    assert store.touch(path) is True
    aside = path.with_name(publish.temp_name(path.name))
    os.rename(path, aside)
    assert store.touch(path) is False


def test_a_chunk_is_found_and_touched_by_either_of_its_names(tmp_path: Path) -> None:
    """``committed_file``, ``has_chunk`` and ``touch`` take a chunk's ``HASH.safetensors`` or
    its index name alike: a single-file chunk is found, and its use recorded on the file, by
    the name of the index it does not have."""
    store = PrefixStore(tmp_path, "ns", chunk_blocks=1)
    path = _write_chunk(store, _prompt(1, seed=96), 0, 1)
    by_index = index_path(path)
    assert by_index.name == path.name + ".index.json" and not by_index.exists()
    for name in (path, str(path), by_index, str(by_index)):
        assert committed_file(name) == path
        assert store.has_chunk(name)
    os.utime(path, ns=(1_000_000_000, path.stat().st_mtime_ns))
    modified = path.stat().st_mtime_ns
    assert store.touch(by_index) is True
    assert path.stat().st_atime_ns > 1_000_000_000 and path.stat().st_mtime_ns == modified
    path.unlink()
    for name in (path, by_index):
        assert committed_file(name) is None and not store.has_chunk(name)
        assert store.touch(name) is False


_DEAD_WRITER = """
import os, sys
from kvsnap.store.files import publish
fd, temp = publish.create_temp(sys.argv[1])
publish.write_all(fd, b"x" * 4096)
os._exit(0)  # killed mid-write: the temporary file stays, its lock dies with the process
"""


def test_dead_writers_temp_files_are_counted_and_pruned(tmp_path: Path) -> None:
    """Item 5: a dead writer's temporary file counts toward the store and is pruned; a live
    writer's (its lock held) is a write in progress, neither counted nor touched."""
    store = PrefixStore(tmp_path, "ns", chunk_blocks=1)
    chunk = _write_chunk(store, _prompt(1, seed=97), 0, 1)
    final = str(chunk.with_name("f" * len(chunk.stem) + ".safetensors"))
    subprocess.run(
        [sys.executable, "-c", _DEAD_WRITER, final],
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
    )
    live_fd, live = publish.create_temp(final)
    try:
        publish.write_all(live_fd, b"y" * 8192)
        (dead,) = [p for p in chunk.parent.iterdir() if p.name.startswith(".") and str(p) != live]
        entries = store_entries(tmp_path)
        assert sorted(e.path for e in entries) == sorted([chunk, dead])
        (leftover,) = [e for e in entries if e.temp]
        assert leftover.orphan and leftover.size == 4096
        assert store_bytes(tmp_path) == chunk.stat().st_size + 4096
        removed = prune_store(tmp_path, chunk.stat().st_size)
        assert [entry.path for entry in removed] == [dead]
        assert not dead.exists() and Path(live).exists() and chunk.exists()
    finally:
        os.close(live_fd)
        os.unlink(live)


def test_a_writer_publishing_while_the_store_is_listed_is_no_leftover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live writer renames its temporary file into place, then lets its lock go. A listing
    that reaches the file in between (its name listed, then the file renamed and unlocked
    before the listing asks about it) must not count it as a dead writer's leftover of its
    full size: four engines on one store, sampled under its capacity lock, read one chunk
    over the bound that way."""
    store = PrefixStore(tmp_path, "ns", chunk_blocks=1)
    chunk = _write_chunk(store, _prompt(1, seed=96), 0, 1)
    final = str(chunk.with_name("e" * len(chunk.stem) + ".safetensors"))
    writer_fd, temp = publish.create_temp(final)
    publish.write_all(writer_fd, b"z" * 8192)
    real_open, real_stat = os.open, os.stat
    published: list[str] = []

    def publish_once(path: object) -> None:
        if os.fspath(path) == temp and not published:  # type: ignore[arg-type]
            os.replace(temp, final)  # the writer's publish: the rename, then the unlock
            os.close(writer_fd)
            published.append(final)

    def open_then_publish(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        descriptor = real_open(path, *args, **kwargs)
        publish_once(path)
        return descriptor

    def stat_then_publish(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        status = real_stat(path, *args, **kwargs)
        publish_once(path)
        return status

    monkeypatch.setattr(os, "open", open_then_publish)
    monkeypatch.setattr(os, "stat", stat_then_publish)
    entries = store_entries(tmp_path)
    monkeypatch.undo()
    assert published == [final]  # the listing met the file while it was being published
    assert [entry for entry in entries if entry.temp] == []
    assert {entry.path for entry in store_entries(tmp_path)} == {chunk, Path(final)}


def _invoke(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(store_app, [*args, "--json"])
    return result.exit_code, json.loads(result.stdout)


def test_store_cli_lists_verifies_and_prunes(tmp_path: Path) -> None:
    store = PrefixStore(tmp_path, "ns", chunk_blocks=2)
    prompt = _prompt(4, seed=20)
    first, second = (_write_chunk(store, prompt, start, end) for start, end in ((0, 2), (2, 4)))
    _aged(first, 500)
    code, listing = _invoke("list", str(tmp_path))
    assert code == 0 and listing["count"] == 2
    assert listing["bytes"] == first.stat().st_size + second.stat().st_size
    oldest = listing["entries"][0]
    assert oldest["path"] == str(first.relative_to(tmp_path)) and oldest["age_s"] >= 500
    assert oldest["namespace"] == "ns" and not oldest["quarantined"]
    code, report = _invoke("verify", str(tmp_path))
    assert (code, report["ok"], report["checked"]) == (0, True, 2)
    _flip_kv_byte(second)
    code, report = _invoke("verify", str(tmp_path))
    assert code == 1 and not report["ok"] and report["bad"] == 1
    (bad,) = [entry for entry in report["entries"] if not entry["ok"]]
    assert bad["path"] == str(second.relative_to(tmp_path)) and "layers.0.key" in bad["problems"][0]
    code, pruned = _invoke("prune", str(tmp_path), "--max-bytes", str(second.stat().st_size))
    assert code == 0 and pruned["fits"]
    assert [entry["path"] for entry in pruned["removed"]] == [oldest["path"]]
    assert not first.exists() and second.exists()
    result = CliRunner().invoke(store_app, ["list", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "no store directory" in result.output


def test_store_options_are_parsed_and_checked() -> None:
    options = ConnectorOptions.from_extra_config(
        {"path": "/s", "chunk_blocks": 4, "store_capacity_bytes": 1 << 30, "store_min_idle_s": 0}
    )
    assert (options.chunk_blocks, options.store_capacity_bytes, options.store_min_idle_s) == (
        4,
        1 << 30,
        0.0,
    )
    # verify_before_load "auto" follows vLLM's load failure policy.
    assert options.verifies_before_load("fail") and not options.verifies_before_load("recompute")
    forced = ConnectorOptions.from_extra_config({"path": "/s", "verify_before_load": True})
    assert forced.verifies_before_load("recompute")
    for bad, key in (
        ({"chunk_blocks": 0}, "chunk_blocks"),
        ({"store_capacity_bytes": -1}, "store_capacity_bytes"),
        ({"store_min_idle_s": "soon"}, "store_min_idle_s"),
        ({"verify_before_load": "yes"}, "verify_before_load"),
    ):
        with pytest.raises(ValueError, match=key):
            ConnectorOptions.from_extra_config({"path": "/s", **bad})


def test_a_dead_stagers_staged_chunk_is_a_leftover(tmp_path: Path) -> None:
    """Item 5: a chunk staged for a commit within the bound by a process that died before
    committing it is counted and pruned; one staged by a live process is a write in progress."""
    store = PrefixStore(tmp_path, "ns", chunk_blocks=1)
    chunk = _write_chunk(store, _prompt(1, seed=98), 0, 1)
    live = eviction.staged_path(chunk)
    live.write_bytes(b"s" * 1000)
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead = Path(str(live).replace(f"-{os.getpid()}-", f"-{int(finished.stdout)}-"))
    dead.write_bytes(b"d" * 2000)
    entries = store_entries(tmp_path)
    assert sorted(entry.path for entry in entries) == sorted([chunk, dead])
    assert prune_store(tmp_path, 10**9)[0].path == dead  # leftovers go whatever the bound
    assert live.exists() and not dead.exists() and chunk.exists()


def test_chunks_of_the_old_key_scheme_are_pruned_whatever_the_bound(tmp_path: Path) -> None:
    # What a store written before SHA-256 keys holds: chunks with 32-digit names. They are
    # never matched, and pruning removes them even under the bound.
    store = PrefixStore(tmp_path, "ns", chunk_blocks=2)
    prompt = _prompt(2, seed=30)
    current = _write_chunk(store, prompt, 0, 2)
    old_single = current.parent / ("ab" * 16 + ".safetensors")
    old_single.write_bytes(current.read_bytes())
    entries = {entry.path: entry for entry in store_entries(tmp_path)}
    assert entries[old_single].legacy and not entries[current].legacy
    assert store.longest_prefix(_chain(prompt)).chunks[0].path == str(current)
    removed = prune_store(tmp_path, 10 * current.stat().st_size, min_idle_s=0)
    assert [entry.path for entry in removed] == [old_single]
    assert [entry.path for entry in store_entries(tmp_path)] == [current]


def test_evicting_a_chunk_drops_it_from_the_hot_tier(tmp_path: Path, monkeypatch) -> None:
    # A tier that maps without CUDA (the bookkeeping is the same): an evicted chunk's mapping,
    # which holds its pages and (with CUDA) keeps them locked, goes with the file.
    tier = HotTier(1 << 30, 1, register=False, serve_unregistered=True)
    monkeypatch.setattr(hot, "_TIER", tier)
    store = PrefixStore(tmp_path, "ns", chunk_blocks=1)
    paths = [_write_chunk(store, _prompt(1, seed=30 + i), 0, 1) for i in range(2)]
    entries = []
    for path in paths:
        path.read_bytes()  # written with O_DIRECT: loaded once, through the page cache
        fd = os.open(path, os.O_RDONLY)
        try:
            entry = tier.lookup(str(path), fd, os.fstat(fd))
        finally:
            os.close(fd)
        assert entry is not None
        tier.release(entry)
        entries.append(entry)
    _aged(paths[0], 400)
    removed = prune_store(tmp_path, paths[1].stat().st_size)
    assert [entry.path for entry in removed] == [paths[0]]
    assert entries[0].host is None and entries[1].host is not None
    assert tier.stats().files == 1


def test_a_checked_chunk_is_handed_to_the_worker_of_the_process_as_it_was_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PrefixStore(tmp_path, "ns", chunk_blocks=2)
    prompt = _prompt(4, seed=11)
    chain = _chain(prompt)
    path = _write_chunk(store, prompt, 0, 2)
    _write_chunk(store, prompt, 2, 4)
    other = _write_chunk(store, _prompt(4, seed=12), 0, 2)  # another prompt's first chunk
    first, second = store.longest_prefix(chain).chunks
    CHECKED_CHUNKS.clear()
    # A checker whose worker runs elsewhere keeps nothing open.
    ChunkChecker(FINGERPRINT, GEOMETRY, BLOCK, verify=True).check(first, prompt, chain)
    assert CHECKED_CHUNKS.take(first.path, None) is None
    checker = ChunkChecker(FINGERPRINT, GEOMETRY, BLOCK, verify=True, hand_over=True)
    record = checker.check(first, prompt, chain)
    assert not isinstance(record, str)
    # The worker's open takes the checked snapshot itself, once; then opens as before.
    kept_open = CHECKED_CHUNKS._open[first.path][0]
    handed = worker_module._open_chunk(first.path, None)
    assert handed is kept_open
    with handed:
        assert handed.parts[0].reader.local_files() is not None
        assert handed.metadata.sequences[0] == record
    again = worker_module._open_chunk(first.path, None)
    assert again is not handed
    again.close()
    # Not for a worker with other keys.
    assert not isinstance(checker.check(second, prompt, chain), str)
    assert CHECKED_CHUNKS.take(second.path, KeyRing([b"k" * 32])) is None
    # A chunk read whole is handed over as checked whatever happens to its file since: a
    # byte flipped in place, or another prompt's chunk renamed over its name. The worker
    # loads the bytes the check verified, never the file's new ones.
    for change in ("rewritten in place", "replaced by a rename"):
        checker.forget(first.path)
        assert not isinstance(checker.check(first, prompt, chain), str)
        kept = CHECKED_CHUNKS._open[first.path][0]
        if change == "rewritten in place":
            _flip_kv_byte(path)
        else:
            replacement = tmp_path / "replacement.safetensors"
            replacement.write_bytes(other.read_bytes())
            os.replace(replacement, path)
        assert store.touch(first.path)
        CHECKED_CHUNKS.touched(first.path)
        taken = CHECKED_CHUNKS.take(first.path, None)
        assert taken is kept, change
        assert taken.metadata.sequences[0] == record and taken.verify() == [], change
        taken.close()
        _write_chunk(store, prompt, 0, 2, path=path)  # the chunk as it was
    # A chunk not read whole is served through the descriptor the check opened: a file renamed
    # over its name since does not matter, a change of the file itself (its modification time
    # moved by a rewrite) does: the snapshot is closed, never served.
    monkeypatch.setattr(tuning, "WHOLE_READ_MAX_BYTES", 0)
    for change in ("replaced by a rename", "rewritten in place"):
        checker.forget(first.path)
        assert not isinstance(checker.check(first, prompt, chain), str)
        kept = CHECKED_CHUNKS._open[first.path][0]
        assert kept.parts[0].reader.held_file() is None
        if change == "replaced by a rename":
            replacement = tmp_path / "replacement.safetensors"
            replacement.write_bytes(other.read_bytes())
            os.replace(replacement, path)
            taken = CHECKED_CHUNKS.take(first.path, None)
            assert taken is kept and taken.metadata.sequences[0] == record
            assert taken.verify() == []
            taken.close()
            _write_chunk(store, prompt, 0, 2, path=path)
        else:
            status = path.stat()
            os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns + 10**9))
            assert CHECKED_CHUNKS.take(first.path, None) is None
            assert kept.parts[0].reader.local_files() is None  # closed
    # The scheduler's record of the chunk's use moves its change time only: still handed over.
    # A chunk rewritten before the record is not.
    checker.forget(second.path)
    assert not isinstance(checker.check(second, prompt, chain), str)
    assert store.touch(second.path)
    CHECKED_CHUNKS.touched(second.path)
    taken = CHECKED_CHUNKS.take(second.path, None)
    assert taken is not None and taken.metadata.sequences[0].id == chunk_sequence_id(
        2, chain[1], chain[3]
    )
    taken.close()
    checker.forget(second.path)
    assert not isinstance(checker.check(second, prompt, chain), str)
    kept = CHECKED_CHUNKS._open[second.path][0]
    status = Path(second.path).stat()
    os.utime(second.path, ns=(status.st_atime_ns, status.st_mtime_ns + 10**9))  # a rewrite
    assert store.touch(second.path)
    CHECKED_CHUNKS.touched(second.path)
    assert second.path not in CHECKED_CHUNKS._open
    assert kept.parts[0].reader.local_files() is None
    # At most `capacity` are kept open: the oldest is closed.
    small = OpenSnapshots(capacity=1)
    snapshots = [Snapshot.open(chunk.path) for chunk in (first, second)]
    assert all(
        small.keep(chunk.path, snap, None)
        for chunk, snap in zip((first, second), snapshots, strict=True)
    )
    assert snapshots[0].parts[0].reader.local_files() is None
    assert small.take(second.path, None) is snapshots[1]
    snapshots[1].close()


def test_a_handed_over_chunk_is_read_once_and_every_page_it_loads_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``verify`` the scheduler's check reads a small chunk whole with one read, and the
    worker of its process loads the chunk it is handed from those bytes without reading the
    file again, bit-exact; a page whose bytes changed after the check (flipped in memory) is
    still refused as the worker copies it, and its blocks are reported for recomputing."""
    worker = make_worker(tmp_path)
    saves = stored_chunks(worker, "r1", [1, 2, 3, 4])
    prompt = np.concatenate([spec.token_ids for spec in saves])
    chain = store_key_chain(prompt, BLOCK, CacheIdentity())
    chunks = worker.store.longest_prefix(chain).chunks
    assert [chunk.path for chunk in chunks] == [spec.path for spec in saves]
    CHECKED_CHUNKS.clear()
    checker = ChunkChecker(FINGERPRINT, GEOMETRY, BLOCK, verify=True, hand_over=True)
    reads = record_preadv(monkeypatch)
    for chunk in chunks:
        assert not isinstance(checker.check(chunk, prompt, chain), str)
    assert reads == [(0, Path(chunk.path).stat().st_size) for chunk in chunks]
    reads.clear()
    load_saves(worker, saves, [9, 10, 11, 12])
    assert reads == []  # the worker copied the bytes the check read, checking every page
    for loaded, saved in zip(
        cache_blocks(worker, [9, 10, 11, 12]), cache_blocks(worker, [1, 2, 3, 4]), strict=True
    ):
        assert torch.equal(loaded.view(torch.int16), saved.view(torch.int16))
    # A byte of a page flipped in the kept bytes after the check: that chunk fails its load.
    checker.forget(chunks[1].path)
    assert not isinstance(checker.check(chunks[1], prompt, chain), str)
    reader = CHECKED_CHUNKS._open[chunks[1].path][0].parts[0].reader
    entry = reader.open_files[0].layout.by_name["layers.1.value"]
    reader.open_files[0].source._whole[entry.begin + 5] ^= 0x40
    reads.clear()
    load = chunk_load(saves[1], [13, 14])
    worker.start_load_kv(KVSnapConnectorMetadata(loads=[LoadSpec("again", (load,), 8)]))
    assert worker.get_block_ids_with_load_errors() == {13, 14}
    assert reads == []
    worker.shutdown()
