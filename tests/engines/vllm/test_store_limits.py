"""A full disk and a read-only store, on real size-limited and read-only filesystems.

The store lives on a tmpfs mounted for the test (a real ``ENOSPC``, a real ``EROFS``); where the
test may not mount one, a full disk is injected into the writer's ``pwrite`` instead, and the
read-only case (which needs a mount when running as root) is skipped.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from kvsnap.engines.vllm import (
    ChunkChecker,
    ConnectorOptions,
    EventLog,
    KVSnapConnectorMetadata,
    PrefixStore,
    SaveSpec,
    read_events,
    store_namespace,
)
from kvsnap.engines.vllm.scheduler import KVSnapScheduler
from kvsnap.snapshot import Snapshot
from kvsnap.store.write import local_file
from tests.support.vllm_worker_helpers import (
    BLOCK,
    BLOCKS,
    CHUNK_BLOCKS,
    FINGERPRINT,
    HEADS,
    LAYERS,
    cache_blocks,
    chunk_saves,
    load_saves,
    make_worker,
    scheduled_request,
    scheduler_step,
    stored_chunks,
)

#: Room for a few of the test's chunks (each a few KiB: a 4 KiB header and small pages).
SMALL_DISK = "40k"


def _mount(directory: Path, options: str) -> bool:
    """Mount a tmpfs with ``options`` at ``directory``; whether it could be."""
    directory.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


def _unmount(directory: Path) -> None:
    # Lazily: a file this process still holds open there (a pooled reader) must not keep
    # the mount, and pytest then removes the empty directory.
    subprocess.run(["umount", "--lazy", str(directory)], capture_output=True, check=False)


@pytest.fixture
def small_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``tmp_path / "store"`` on a full-able disk: a tmpfs of :data:`SMALL_DISK`, or (no
    mount) a ``pwrite`` that fails with ``ENOSPC`` once that many bytes were written."""
    store = tmp_path / "store"
    if _mount(store, f"size={SMALL_DISK},mode=0700"):
        yield "tmpfs"
        _unmount(store)
        return
    budget = [40 * 1024]
    real = local_file._pwrite_all

    def filling(fd: int, view: memoryview, offset: int) -> None:
        budget[0] -= len(view)
        if budget[0] < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, view, offset)

    monkeypatch.setattr(local_file, "_pwrite_all", filling)
    yield "injected"


def test_a_full_disk_skips_saves_says_so_once_and_keeps_the_store_whole(
    tmp_path: Path, small_store: str
) -> None:
    worker = make_worker(tmp_path)
    requests = {f"r{index}": [2 * index, 2 * index + 1] for index in range(8)}
    planned = {rid: chunk_saves(worker, rid, blocks) for rid, blocks in requests.items()}
    for specs in planned.values():
        worker.wait_for_save(KVSnapConnectorMetadata(saves=specs))
    worker.wait_for_writes()
    events = read_events(tmp_path / "events.jsonl")
    kinds = [event["event"] for event in events]
    assert kinds.count("store_full") == 1, (small_store, kinds)
    assert "save_failed" not in kinds
    written = [event["path"] for event in events if event["event"] == "save"]
    assert 0 < len(written) < len(requests)
    # Every request is served: its blocks are freed once its (skipped) save is done.
    assert worker.get_finished(set(requests)) == (set(requests), None)
    # The store holds whole chunks only: no temporary or staged file, every chunk intact.
    store = Path(worker.store.root)
    assert sorted(p.name for p in store.rglob(".*")) == [], list(store.rglob(".*"))
    for path in written:
        with Snapshot.open(path) as snapshot:
            assert snapshot.verify() == []
    # A stored chunk still loads bit-exact.
    first = next(rid for rid, specs in planned.items() if specs[0].path in written)
    expected = cache_blocks(worker, requests[first])
    load_saves(worker, planned[first], [14, 15])
    assert all(
        torch.equal(got, want)
        for got, want in zip(cache_blocks(worker, [14, 15]), expected, strict=True)
    )
    worker.shutdown()


@pytest.fixture
def read_only_store(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs at ``tmp_path / "store"`` that the test remounts read-only when asked."""
    store = tmp_path / "store"
    if not _mount(store, "size=1m,mode=0700"):
        pytest.skip("cannot mount a tmpfs here (a read-only store needs one when run as root)")
    yield store
    _unmount(store)


def _saved_prompt(
    tmp_path: Path, blocks: list[int], namespace: str = "ns"
) -> tuple[list[SaveSpec], list[int]]:
    """A prompt's chunks saved by a worker into ``tmp_path / "store"`` (``namespace``), its
    tokens drawn from ``blocks``; and the prompt, one token past its last chunk."""
    worker = make_worker(tmp_path, namespace=namespace)
    specs = stored_chunks(worker, "writer", blocks)
    worker.shutdown()
    return specs, np.concatenate([spec.token_ids for spec in specs] + [np.array([7])]).tolist()


def _scheduler(tmp_path: Path, store: PrefixStore) -> KVSnapScheduler:
    options = ConnectorOptions.from_extra_config(
        {"path": str(store.root), "chunk_blocks": store.chunk_blocks}
    )
    geometry = {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": 8}
    return KVSnapScheduler(
        options,
        store,
        EventLog(str(tmp_path / "scheduler.jsonl"), "scheduler", 0),
        block_size=BLOCK,
        checker=ChunkChecker(FINGERPRINT, geometry, BLOCK, verify=True),
        block_ids_of=lambda request_id: list(range(BLOCKS)),
    )


def test_a_read_only_store_serves_loads_and_plans_no_saves(
    tmp_path: Path, read_only_store: Path
) -> None:
    specs, prompt = _saved_prompt(tmp_path, [0, 1, 2, 3])
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_store)], check=True)
    store = PrefixStore(read_only_store, "ns", chunk_blocks=CHUNK_BLOCKS)
    assert store.read_only and not os.access(read_only_store, os.W_OK)
    scheduler = _scheduler(tmp_path, store)
    request = scheduled_request("reader", prompt)
    matched, _ = scheduler.get_num_new_matched_tokens(request, 0)  # type: ignore[arg-type]
    assert matched == 4 * BLOCK  # a hit, though its use cannot be recorded
    # A prompt computed here is not saved: nothing can be written.
    other = scheduled_request("other", list(range(100, 100 + 4 * BLOCK + 1)))
    scheduler.update_state_after_alloc(other, None, 0)  # type: ignore[arg-type]
    meta = scheduler.build_connector_meta(scheduler_step({"other": 4 * BLOCK + 1}))  # type: ignore[arg-type]
    assert meta.saves == []
    # A chunk that fails its check cannot be quarantined: it is a miss, and nothing raises.
    assert store.quarantine(specs[0].path) is None
    assert Path(specs[0].path).exists()


def test_engines_cutting_other_chunk_sizes_keep_each_other_s_chunks(tmp_path: Path) -> None:
    """A chunk is named by its last block's key, so an engine cutting chunks three times as
    long finds the other engine's third chunk where its first would end. In one namespace it
    failed the check as a chunk under a wrong name and was quarantined; each chunk size has
    its own namespace, so it is a plain miss, and nothing is set aside."""
    geometry = {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": 8}
    small = store_namespace(FINGERPRINT, geometry, CHUNK_BLOCKS)
    large = store_namespace(FINGERPRINT, geometry, 3 * CHUNK_BLOCKS)
    specs, prompt = _saved_prompt(tmp_path, list(range(3 * CHUNK_BLOCKS)), namespace=small)
    store = PrefixStore(tmp_path / "store", large, chunk_blocks=3 * CHUNK_BLOCKS)
    scheduler = _scheduler(tmp_path, store)
    matched, _ = scheduler.get_num_new_matched_tokens(
        scheduled_request("reader", prompt),  # type: ignore[arg-type]
        0,
    )
    assert matched == 0
    assert all(Path(spec.path).exists() for spec in specs)
    events = read_events(str(tmp_path / "scheduler.jsonl"))
    assert not [event for event in events if event["event"] == "quarantine"]


def test_a_prompt_given_as_embeddings_is_neither_matched_nor_stored(tmp_path: Path) -> None:
    """Positions fed as embeddings carry placeholder token ids, alike for any embedding: a
    prompt with embeddings must not be served the KV stored for its ids, nor store its own
    under them."""
    _, prompt = _saved_prompt(tmp_path, [0, 1, 2, 3])
    scheduler = _scheduler(
        tmp_path, PrefixStore(tmp_path / "store", "ns", chunk_blocks=CHUNK_BLOCKS)
    )
    plain = scheduled_request("plain", prompt)
    assert scheduler.get_num_new_matched_tokens(plain, 0)[0] == 4 * BLOCK  # type: ignore[arg-type]
    embedded = scheduled_request("embedded", prompt)
    embedded.prompt_embeds = torch.randn(len(prompt), 8)
    assert scheduler.get_num_new_matched_tokens(embedded, 0) == (0, False)  # type: ignore[arg-type]
    other = scheduled_request("other", list(range(100, 100 + 4 * BLOCK + 1)))
    other.prompt_embeds = torch.randn(4 * BLOCK + 1, 8)
    scheduler.update_state_after_alloc(other, None, 0)  # type: ignore[arg-type]
    meta = scheduler.build_connector_meta(scheduler_step({"other": 4 * BLOCK + 1}))  # type: ignore[arg-type]
    assert meta.saves == []
    events = read_events(str(tmp_path / "scheduler.jsonl"))
    assert [event["request"] for event in events if "embeddings" in str(event.get("reason"))] == [
        "embedded",
        "other",
    ]
