"""The order of work in capture and restore, a caller's staging pool, and the trace hook.

Real CPU caches of random bytes and real files; the transfer handler, the writer and the
reader are wrapped only to record (or hold) their calls.
"""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kvsnap import layout as L
from kvsnap.errors import RestoreIncompleteError, SnapshotCorruptError, TransferFailedError
from kvsnap.pipeline import StagingOptions, TransferOptions
from kvsnap.pipeline.fused import FusedMover
from kvsnap.pipeline.slots import slot_loads
from kvsnap.pipeline.staging import StagingRing
from kvsnap.snapshot import SequenceBlocks, Snapshot, capture
from kvsnap.store import SnapshotReader, SnapshotWriter, TraceHook
from kvsnap.store.base import tuning
from kvsnap.store.read import slot_reads
from kvsnap.store.read.head_parts import open_snapshot
from kvsnap.transfer import TransferHandler
from kvsnap.transfer.pinned import PinnedPool
from tests.support.snapshot_layouts import LAYERS, SOURCE, FailingCopies, sequences_for, split_nhd

#: Staging of 16 pages of 256 bytes per slot (slots are 4096-aligned); the caches below need
#: several slots per tensor.
SLOT_BYTES = 16 * 256


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


def _slots(num_blocks: int, num_slots_bytes: int) -> list:
    return list(slot_loads(2 * LAYERS, num_blocks, 256, num_slots_bytes))


def test_capture_keeps_every_slot_copying_and_hands_each_over_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache
) -> None:
    layout, _, sequences = cache
    log: list[str] = []
    record_calls(monkeypatch, log, FusedMover, "submit")
    record_calls(monkeypatch, log, SnapshotWriter, "write_slot")
    progress: list[int] = []
    result = capture(
        layout,
        sequences,
        tmp_path / "snap.safetensors",
        source=SOURCE,
        staging=StagingOptions(slot_bytes=SLOT_BYTES, num_slots=4),
        progress=lambda done, total: progress.append(done),
    )
    plans = _slots(result.num_blocks, SLOT_BYTES)
    assert len(plans) > 8
    # One copy and one writer call per slot whatever the tensors in it; all four slots copying
    # before the first hand-over; slot k handed over only after its copy, and no more than
    # four slots copied ahead of the writer.
    assert log[:4] == ["submit"] * 4
    assert log.count("submit") == log.count("write_slot") == len(plans)
    submitted = handed = 0
    for entry in log:
        if entry == "submit":
            submitted += 1
            assert submitted <= handed + 4
        else:
            handed += 1
            assert handed <= submitted
    assert progress == [SLOT_BYTES * (i + 1) for i in range(len(plans) - 1)] + [progress[-1]]


def test_a_slot_spans_tensors_so_a_short_prefix_is_one_copy(tmp_path: Path, cache) -> None:
    layout, view, sequences = cache
    short = [SequenceBlocks("short", sequences[0].token_ids[:5], sequences[0].block_ids[:2])]
    calls: list[int] = []
    real = FusedMover.submit

    def recorded(self, plan, *args, **kwargs):
        calls.append(len(plan.segments))
        return real(self, plan, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FusedMover, "submit", recorded)
        capture(layout, short, tmp_path / "snap.safetensors", source=SOURCE)
        target_layout, target_view = split_nhd(40, 0, 1, torch.Generator().manual_seed(3))
        with Snapshot.open(tmp_path / "snap.safetensors") as snap:
            snap.restore(target_layout, {"short": [7, 9]})
    assert calls == [2 * LAYERS, 2 * LAYERS]  # every layer's K and V in one slot, each way
    assert_same_kv(view, target_view, [(short[0].block_ids, np.array([7, 9]))])


def test_restore_keeps_a_read_queued_in_every_slot_but_the_one_being_moved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache
) -> None:
    layout, view, sequences = cache
    path = tmp_path / "snap.safetensors"
    num_blocks = capture(layout, sequences, path, source=SOURCE).num_blocks
    log: list[str] = []
    record_calls(monkeypatch, log, SnapshotReader, "read_slot_async")
    record_calls(monkeypatch, log, FusedMover, "submit")
    target_layout, target_view = split_nhd(40, 0, 1, torch.Generator().manual_seed(22))
    with Snapshot.open(path) as snap:
        snap.restore(
            target_layout,
            {s.id: s.block_ids for s in sequences},
            staging=StagingOptions(slot_bytes=SLOT_BYTES, num_slots=3),
        )
    plans = _slots(num_blocks, SLOT_BYTES)
    assert len(plans) > 8
    # One read (one call, whatever the tensors in a slot) and one move per slot; three slots'
    # reads queued before the first move, and never more than the three slots in flight.
    assert log[:3] == ["read_slot_async"] * 3
    assert log.count("read_slot_async") == log.count("submit") == len(plans)
    in_flight = 0
    for entry in log:
        in_flight += 1 if entry == "read_slot_async" else -1
        assert 0 <= in_flight <= 3
    assert_same_kv(view, target_view, [(s.block_ids, s.block_ids) for s in sequences])


def test_restore_takes_one_slot_per_plan_and_none_once_every_plan_is_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache
) -> None:
    # Taking a slot waits for its last copy (often the one just enqueued): a slot taken only to
    # find no plan left made every move wait for its own copy.
    layout, view, sequences = cache
    path = tmp_path / "snap.safetensors"
    num_blocks = capture(layout, sequences, path, source=SOURCE).num_blocks
    taken: list[object] = []  # slot indices, and "acquire" per blocking take
    real = StagingRing.try_acquire

    def try_acquire(self):
        slot = real(self)
        if slot is not None:
            taken.append(slot.index)
        return slot

    monkeypatch.setattr(StagingRing, "try_acquire", try_acquire)
    record_calls(monkeypatch, taken, StagingRing, "acquire")
    target_layout, target_view = split_nhd(40, 0, 1, torch.Generator().manual_seed(24))
    with Snapshot.open(path) as snap:
        snap.restore(
            target_layout,
            {s.id: s.block_ids for s in sequences},
            staging=StagingOptions(slot_bytes=SLOT_BYTES, num_slots=3),
        )
    assert len(taken) == len(_slots(num_blocks, SLOT_BYTES))
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
                "kvsnap.pipeline.pipeline.TransferHandler",
                lambda rank, direction, backend: TransferHandler(
                    rank, direction, backend=FailingCopies(rank, direction)
                ),
            )
            with pytest.raises(TransferFailedError, match="injected copy failure"):
                capture(
                    layout,
                    sequences,
                    path,
                    source=SOURCE,
                    staging=pool,
                    transfer=TransferOptions(backend="cpu"),
                )
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
    real = SnapshotReader.read_slot_async
    first_call = threading.local()

    def read_after_the_other_took_a_slot(self, *args, **kwargs):
        if not getattr(first_call, "done", False):
            first_call.done = True
            both_hold_a_slot.wait(10)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SnapshotReader, "read_slot_async", read_after_the_other_took_a_slot)
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
        staging=StagingOptions(slot_bytes=SLOT_BYTES, num_slots=4),
        trace=lambda *span: captured.append(span),
    )
    kv_bytes = result.num_blocks * 2 * LAYERS * 256
    kinds = {kind for kind, *_ in captured}
    assert {
        "setup.staging",
        "setup.writer",
        "staging.wait",
        "transfer.submit",
        "transfer.wait",
        "writer.enqueue",
        "hash",
        "write",
        "commit.drain",
        "commit.fsync",
        "commit.publish",
        "teardown",
    } <= kinds
    for kind in ("transfer.submit", "transfer.wait", "hash", "write"):
        assert sum(n for k, _, _, n in captured if k == kind) == kv_bytes, kind

    restored: list[tuple[str, float, float, int]] = []
    target_layout, _ = split_nhd(40, 0, 1, torch.Generator().manual_seed(26))
    _restore_in_small_slots(path, target_layout, sequences, lambda *span: restored.append(span))
    kinds = {kind for kind, *_ in restored}
    assert {
        "setup.staging",
        "staging.wait",
        "read.enqueue",
        "read.wait",
        "transfer.prepare",
        "transfer.submit",
        "teardown",
    } <= kinds
    for kind in ("read", "verify", "transfer.submit"):
        assert sum(n for k, _, _, n in restored if k == kind) == kv_bytes, kind


@pytest.mark.parametrize(("pieces_per_slot", "read_threads"), [(1, None), (4, None), (None, 3)])
def test_a_slot_is_read_in_the_pieces_set_and_restores_exactly(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    cache,
    pieces_per_slot: int | None,
    read_threads: int | None,
) -> None:
    """The read path's tuning (what ``benchmarks/vllm_worker.py --load-variants`` varies): a
    slot's read is cut into ``PIECES_PER_SLOT`` pieces (one per read thread when ``None``)."""
    monkeypatch.setattr(tuning, "INLINE_READ_MAX_BYTES", 0)  # on the read threads, in pieces
    monkeypatch.setattr(slot_reads, "MIN_PIECE_BYTES", 256)  # one page: the slots here are small
    monkeypatch.setattr(slot_reads, "PIECES_PER_SLOT", pieces_per_slot)
    monkeypatch.setattr(slot_reads, "READ_THREADS", read_threads)
    layout, view, sequences = cache
    path = tmp_path / "snap.safetensors"
    capture(layout, sequences, path, source=SOURCE)
    reads: list[int] = []
    target_layout, target_view = split_nhd(40, 0, 1, torch.Generator().manual_seed(27))
    _restore_in_small_slots(
        path,
        target_layout,
        sequences,
        lambda kind, _start, _end, nbytes: kind == "read" and reads.append(nbytes),
    )
    pieces = pieces_per_slot if pieces_per_slot is not None else read_threads
    assert pieces is not None
    pages_per_piece = math.ceil(SLOT_BYTES // 256 / pieces)  # whole pages, a slot in `pieces`
    assert max(reads) == pages_per_piece * 256
    assert sum(reads) == sum(len(s.block_ids) for s in sequences) * 2 * LAYERS * 256
    assert_same_kv(view, target_view, [(s.block_ids, s.block_ids) for s in sequences])


def _restore_in_small_slots(
    path: Path, target_layout: L.CacheLayout, sequences: list[SequenceBlocks], trace: TraceHook
) -> None:
    """Restore every sequence of the snapshot at ``path`` into ``target_layout`` at the same
    blocks, through 4 slots of ``SLOT_BYTES``, traced by ``trace``."""
    with Snapshot.open(path) as snap:
        snap.restore(
            target_layout,
            {s.id: s.block_ids for s in sequences},
            staging=StagingOptions(slot_bytes=SLOT_BYTES, num_slots=4),
            trace=trace,
        )


def _reads_on_the_calling_thread(spans: list[tuple[str, bool]]) -> set[bool]:
    """Of ``(kind, on the calling thread)`` spans, where the reads and checks ran."""
    return {here for kind, here in spans if kind in ("read", "verify")}


@pytest.mark.parametrize("inline_max", [SLOT_BYTES, SLOT_BYTES - 256, 0])
def test_a_small_slot_of_a_host_cache_is_read_and_checked_on_the_calling_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache, inline_max: int
) -> None:
    """Slots of at most ``INLINE_READ_MAX_BYTES`` are read and checked by the thread that
    copies them into the host cache, bigger ones on the read threads; bit-exact either way."""
    monkeypatch.setattr(tuning, "INLINE_READ_MAX_BYTES", inline_max)
    monkeypatch.setattr(slot_reads, "MIN_PIECE_BYTES", 256)  # a threaded slot: several pieces
    layout, view, sequences = cache
    path = tmp_path / "snap.safetensors"
    capture(layout, sequences, path, source=SOURCE)
    caller = threading.get_ident()
    spans: list[tuple[str, bool]] = []
    slot_sizes: list[int] = []
    target_layout, target_view = split_nhd(40, 0, 1, torch.Generator().manual_seed(28))
    _restore_in_small_slots(
        path,
        target_layout,
        sequences,
        lambda kind, _start, _end, nbytes: (
            spans.append((kind, threading.get_ident() == caller)),
            kind == "transfer.submit" and slot_sizes.append(nbytes),
        ),
    )
    assert_same_kv(view, target_view, [(s.block_ids, s.block_ids) for s in sequences])
    expected = {size <= inline_max for size in slot_sizes}
    assert _reads_on_the_calling_thread(spans) == expected
    if inline_max == SLOT_BYTES - 256:  # full slots on the threads, the shorter last ones here
        assert expected == {True, False}


def test_a_file_cut_short_fails_the_restore_on_the_calling_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache
) -> None:
    """A read on the calling thread that meets the end of the file fails the restore as a
    threaded read does (naming the truncation), and every staging slot comes back."""
    monkeypatch.setattr(tuning, "INLINE_READ_MAX_BYTES", 1 << 20)
    layout, _, sequences = cache
    path = tmp_path / "snap.safetensors"
    capture(layout, sequences, path, source=SOURCE)
    target_layout, _ = split_nhd(40, 0, 1, torch.Generator().manual_seed(29))
    caller = threading.get_ident()
    spans: list[tuple[str, bool]] = []
    blocks = {s.id: s.block_ids for s in sequences}
    with PinnedPool(SLOT_BYTES, 3, pin=False) as pool, Snapshot.open(path) as snap:
        snap.restore(target_layout, blocks, staging=pool)  # the checksum rows read and kept
        _, entry = snap.reader.locate("layers.0.value")
        os.truncate(path, entry.begin + 256)  # opened whole; the page reads then find it short
        with pytest.raises(SnapshotCorruptError, match="truncated"):
            snap.restore(
                target_layout,
                blocks,
                staging=pool,
                trace=lambda kind, *_: spans.append((kind, threading.get_ident() == caller)),
            )
        assert pool.num_free == 3
    assert _reads_on_the_calling_thread(spans) == {True}


def test_a_file_read_whole_is_checked_and_copied_where_it_lies_into_a_host_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache
) -> None:
    """A snapshot file read whole as it opened (``read_whole_max_bytes``, as the vLLM
    connector's checked chunks are) restores into a host cache without staging slots or slot
    reads: every page checked against its stored xxh3-64 where it lies, bit-exact; a page
    whose bytes differ is refused and named, every other page written."""
    layout, view, sequences = cache
    path = tmp_path / "snap.safetensors"
    capture(layout, sequences, path, source=SOURCE)
    size = path.stat().st_size
    slot_reads_made: list[str] = []
    record_calls(monkeypatch, slot_reads_made, SnapshotReader, "read_slot_async")
    blocks = {s.id: s.block_ids for s in sequences}
    target_layout, target_view = split_nhd(40, 0, 1, torch.Generator().manual_seed(30))
    spans: list[str] = []
    with PinnedPool(SLOT_BYTES, 3, pin=False) as pool:
        with Snapshot(open_snapshot(path, read_whole_max_bytes=size), str(path)) as snap:
            snap.restore(target_layout, blocks, staging=pool, trace=lambda k, *_: spans.append(k))
        assert pool.num_free == 3
    assert slot_reads_made == [] and "read" not in spans and "verify" in spans
    assert_same_kv(view, target_view, [(s.block_ids, s.block_ids) for s in sequences])
    # One byte of one page changed: that block is refused, every other page is written.
    with Snapshot.open(path) as snap:
        _, entry = snap.parts[0].reader.placement("layers.1.key")
        stored = {record.id: record.block_ids for record in snap.sequences}
    damaged_block = int(stored[sequences[1].id][2])
    damaged = bytearray(path.read_bytes())
    damaged[entry.begin + damaged_block * 256 + 9] ^= 0x04
    path.write_bytes(bytes(damaged))
    refused = sorted(
        {
            int(target)
            for s in sequences
            for target, block in zip(s.block_ids, stored[s.id], strict=True)
            if block == damaged_block
        }
    )
    fresh_layout, fresh_view = split_nhd(40, 0, 1, torch.Generator().manual_seed(31))
    with Snapshot(open_snapshot(path, read_whole_max_bytes=size), str(path)) as snap:
        with pytest.raises(RestoreIncompleteError, match=r"layers\.1\.key") as caught:
            snap.restore(fresh_layout, blocks, staging=StagingOptions(slot_bytes=SLOT_BYTES))
    assert caught.value.failed_block_ids.tolist() == refused
    assert slot_reads_made == []
    kept = [(b, b) for b in (s.block_ids[~np.isin(s.block_ids, refused)] for s in sequences)]
    assert_same_kv(view, fresh_view, kept)
