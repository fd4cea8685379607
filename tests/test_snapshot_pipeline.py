"""The order of work in capture and restore, a caller's staging pool, and the trace hook.

Real CPU caches of random bytes and real files; the transfer handler, the writer and the
reader are wrapped only to record (or hold) their calls.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from test_snapshot import LAYERS, SOURCE, FailingCopies, sequences_for, split_nhd

from kvsnap import layout as L
from kvsnap.errors import SnapshotCorruptError
from kvsnap.pinned import PinnedPool
from kvsnap.snapshot import SequenceBlocks, Snapshot, TransferFailedError, capture
from kvsnap.store import SnapshotReader, SnapshotWriter
from kvsnap.transfer import TransferHandler

#: Staging of 8 pages of 256 bytes per slot; the caches below need several slots per tensor.
SLOT_BYTES = 8 * 256


def assert_same_kv(source_view, target_view, pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for source_blocks, target_blocks in pairs:
        for layer in range(LAYERS):
            for part in L.KV_PARTS:
                want = source_view(layer, part)[torch.from_numpy(source_blocks)]
                got = target_view(layer, part)[torch.from_numpy(target_blocks)]
                assert torch.equal(want.view(torch.int16), got.view(torch.int16)), (layer, part)


@pytest.fixture
def cache() -> tuple[L.CacheLayout, object, list[SequenceBlocks]]:
    layout, view = split_nhd(40, 0, 1, torch.Generator().manual_seed(20))
    sequences = sequences_for(40, [37, 40, 50], np.random.default_rng(21))
    return layout, view, sequences


def record_calls(monkeypatch: pytest.MonkeyPatch, log: list[str], owner: type, method: str) -> None:
    real = getattr(owner, method)

    def recorded(self, *args, **kwargs):
        log.append(method)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(owner, method, recorded)


def test_capture_hands_each_slot_to_the_writer_as_soon_as_its_copy_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache
) -> None:
    layout, _, sequences = cache
    log: list[str] = []
    record_calls(monkeypatch, log, TransferHandler, "submit")
    record_calls(monkeypatch, log, SnapshotWriter, "write_pages")
    first_progress: list[int] = []
    capture(
        layout,
        sequences,
        tmp_path / "snap.safetensors",
        source=SOURCE,
        staging_bytes=4 * SLOT_BYTES,
        staging_slots=4,
        progress=lambda done, total: first_progress.append(log.count("submit")),
    )
    slots = log.count("submit")
    assert slots > 8
    assert log == ["submit", "write_pages"] * slots
    assert first_progress[0] == 1  # the first byte waits for one copy, not one per slot


def test_restore_keeps_a_read_queued_in_every_slot_but_the_one_being_scattered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache
) -> None:
    layout, view, sequences = cache
    path = tmp_path / "snap.safetensors"
    capture(layout, sequences, path, source=SOURCE)
    log: list[str] = []
    record_calls(monkeypatch, log, SnapshotReader, "read_pages_async")
    record_calls(monkeypatch, log, TransferHandler, "submit")
    target_layout, target_view = split_nhd(40, 0, 1, torch.Generator().manual_seed(22))
    with Snapshot.open(path) as snap:
        snap.restore(
            target_layout,
            {s.id: s.block_ids for s in sequences},
            staging_bytes=3 * SLOT_BYTES,
            staging_slots=3,
        )
    slots = log.count("submit")
    assert slots > 8
    # Three reads queued before the first scatter; then each scatter frees a slot for the next
    # read, until the last reads drain.
    read, scatter = "read_pages_async", "submit"
    assert log == [read] * 3 + [scatter] + [read, scatter] * (slots - 3) + [scatter] * 2
    assert_same_kv(view, target_view, [(s.block_ids, s.block_ids) for s in sequences])


def test_a_staging_pool_of_the_caller_serves_captures_and_restores(tmp_path: Path, cache) -> None:
    layout, view, sequences = cache
    path = tmp_path / "snap.safetensors"
    with PinnedPool(SLOT_BYTES, 3, pin=False) as pool:
        for _ in range(2):
            capture(layout, sequences, path, source=SOURCE, staging=pool)
            assert pool.num_free == 3
            target_layout, target_view = split_nhd(40, 0, 1, torch.Generator().manual_seed(23))
            with Snapshot.open(path) as snap:
                snap.restore(target_layout, {s.id: s.block_ids for s in sequences}, staging=pool)
            assert pool.num_free == 3
            assert_same_kv(view, target_view, [(s.block_ids, s.block_ids) for s in sequences])
        pool.release(pool.acquire(timeout=1))  # still open


def test_a_staging_pool_too_small_for_one_page_is_refused(tmp_path: Path) -> None:
    # 16 tokens x 8 heads x 32 bfloat16: 8 KiB pages, larger than the pool's 4 KiB slots.
    caches = [torch.zeros(4, 2, 16, 8, 32, dtype=torch.bfloat16) for _ in range(2)]
    layout = L.vllm_split_layout(caches)
    sequence = SequenceBlocks("s", np.arange(20), np.array([2, 0]))
    with (
        PinnedPool(4096, 2, pin=False) as pool,
        pytest.raises(ValueError, match="cannot hold one 8192-byte page"),
    ):
        capture(layout, [sequence], tmp_path / "snap.safetensors", source=SOURCE, staging=pool)
    assert list(tmp_path.iterdir()) == []


def test_failures_give_every_slot_back_to_the_callers_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache
) -> None:
    layout, _, sequences = cache
    path = tmp_path / "snap.safetensors"
    capture(layout, sequences, path, source=SOURCE)
    before = path.read_bytes()
    with PinnedPool(SLOT_BYTES, 3, pin=False) as pool:
        FailingCopies.jobs_seen = 0
        with monkeypatch.context() as patch:
            patch.setattr(
                "kvsnap.snapshot.TransferHandler",
                lambda rank, direction, backend: TransferHandler(
                    rank, direction, backend=FailingCopies(rank, direction)
                ),
            )
            with pytest.raises(TransferFailedError, match="injected copy failure"):
                capture(layout, sequences, path, source=SOURCE, staging=pool)
        assert pool.num_free == 3
        assert path.read_bytes() == before

        with open(path, "r+b") as handle:  # corrupt the last byte of the first layer tensor
            with SnapshotReader(path) as reader:
                _, entry = reader.locate("layers.0.key")
            handle.seek(entry.end - 1)
            byte = handle.read(1)
            handle.seek(entry.end - 1)
            handle.write(bytes([byte[0] ^ 1]))
        target_layout, _ = split_nhd(40, 0, 1, torch.Generator().manual_seed(24))
        with Snapshot.open(path) as snap, pytest.raises(SnapshotCorruptError):
            snap.restore(target_layout, {s.id: s.block_ids for s in sequences}, staging=pool)
        assert pool.num_free == 3


def test_two_restores_sharing_a_pool_do_not_wait_for_each_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache
) -> None:
    """Each restore takes one slot, then both look for a second one: neither may wait for it
    while its own read is queued, or each would wait for the other's slot forever."""
    layout, view, sequences = cache
    path = tmp_path / "snap.safetensors"
    capture(layout, sequences, path, source=SOURCE)
    both_hold_a_slot = threading.Barrier(2)
    real = SnapshotReader.read_pages_async
    first_call = threading.local()

    def read_after_the_other_took_a_slot(self, *args, **kwargs):
        if not getattr(first_call, "done", False):
            first_call.done = True
            both_hold_a_slot.wait(10)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SnapshotReader, "read_pages_async", read_after_the_other_took_a_slot)
    targets = [split_nhd(40, 0, 1, torch.Generator().manual_seed(25 + i)) for i in range(2)]
    errors: list[BaseException] = []

    def restore(target_layout: L.CacheLayout) -> None:
        try:
            with Snapshot.open(path) as snap:
                snap.restore(target_layout, {s.id: s.block_ids for s in sequences}, staging=pool)
        except BaseException as error:
            errors.append(error)

    with PinnedPool(SLOT_BYTES, 2, pin=False) as pool:
        threads = [
            threading.Thread(target=restore, args=(target,), daemon=True) for target, _ in targets
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads), "the restores deadlocked"
    assert errors == []
    for _, target_view in targets:
        assert_same_kv(view, target_view, [(s.block_ids, s.block_ids) for s in sequences])


def test_the_trace_shows_every_step_of_capture_and_restore(tmp_path: Path, cache) -> None:
    layout, _, sequences = cache
    path = tmp_path / "snap.safetensors"
    captured: list[tuple[str, float, float, int]] = []
    result = capture(
        layout,
        sequences,
        path,
        source=SOURCE,
        staging_bytes=4 * SLOT_BYTES,
        trace=lambda *span: captured.append(span),
    )
    kv_bytes = result.num_blocks * 2 * LAYERS * 256
    kinds = {kind for kind, *_ in captured}
    assert {
        "setup.handlers",
        "setup.pool",
        "setup.writer",
        "staging.wait",
        "transfer",
        "writer.enqueue",
        "hash",
        "write",
        "commit.drain",
        "commit.fsync",
        "commit.publish",
        "teardown",
    } <= kinds
    for kind in ("transfer", "hash", "write"):
        assert sum(n for k, _, _, n in captured if k == kind) == kv_bytes, kind

    restored: list[tuple[str, float, float, int]] = []
    target_layout, _ = split_nhd(40, 0, 1, torch.Generator().manual_seed(26))
    with Snapshot.open(path) as snap:
        snap.restore(
            target_layout,
            {s.id: s.block_ids for s in sequences},
            staging_bytes=4 * SLOT_BYTES,
            trace=lambda *span: restored.append(span),
        )
    kinds = {kind for kind, *_ in restored}
    assert {"setup.handlers", "setup.pool", "read.wait", "transfer", "teardown"} <= kinds
    for kind in ("read", "verify", "transfer"):
        assert sum(n for k, _, _, n in restored if k == kind) == kv_bytes, kind
