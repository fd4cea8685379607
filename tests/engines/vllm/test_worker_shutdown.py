"""The worker's shutdown with saves still queued, on a disk made slow (every ``fsync`` waits):
the saves finish within the drain bound, the ones left when it passes are abandoned without a
trace in the store (no chunk, no temporary file), and the events say which.

vLLM kills a worker that has not exited some seconds after it told it to (docs/vllm.md,
"Shutting down"); the bound keeps the worker's shutdown inside that window.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvsnap.engines.vllm import (
    ConnectorOptions,
    KVSnapConnectorMetadata,
    PrefixStore,
    SaveSpec,
    read_events,
)
from kvsnap.engines.vllm.worker import KVSnapWorker
from kvsnap.snapshot import Snapshot
from tests.support.distributed_child import run_ranks
from tests.support.slow_fsync import delayed_fsync
from tests.support.vllm_worker_helpers import chunk_saves, gate_captures, make_worker


def _queue_requests(worker: KVSnapWorker, count: int) -> list[SaveSpec]:
    """``count`` requests of two chunks each, one step each, as vLLM queues them."""
    queued: list[SaveSpec] = []
    for index in range(count):
        saves = chunk_saves(worker, f"r{index}", [4 * index, 4 * index + 1, 4 * index + 2, 13])
        worker.wait_for_save(KVSnapConnectorMetadata(saves=saves))
        queued += saves
    return queued


def _wait_until(condition: Callable[[], bool], timeout_s: float = 30) -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def _files_in(store: Path) -> list[Path]:
    return sorted(path for path in store.rglob("*") if path.is_file())


def _outcomes(events_path: Path) -> tuple[dict[str, str], dict[str, dict]]:
    """Each save's path -> ``save`` or ``save_abandoned``; the ``shutdown`` event."""
    events = read_events(events_path)
    ended = {
        event["path"]: event["event"]
        for event in events
        if event["event"] in ("save", "save_abandoned", "save_failed")
    }
    (shutdown,) = [event for event in events if event["event"] == "shutdown"]
    return ended, shutdown


def test_shutdown_finishes_the_queued_saves_within_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = make_worker(tmp_path, shutdown_drain_s=120)
    monkeypatch.setattr(os, "fsync", delayed_fsync(0.1, tmp_path))
    queued = _queue_requests(worker, 3)
    worker.shutdown()  # at once: the slow disk has written at most the first chunk or two
    ended, shutdown = _outcomes(tmp_path / "events.jsonl")
    assert ended == {spec.path: "save" for spec in queued}
    # The second step at least was still queued (each step's two chunks fsync four times).
    assert shutdown["abandoned"] == 0 and shutdown["pending"] >= 4 and shutdown["bound_s"] == 120
    for spec in queued:
        with Snapshot.open(spec.path) as snapshot:
            assert snapshot.verify() == []
            (record,) = snapshot.sequences
            assert record.id == spec.sequence_id


def test_saves_left_when_the_bound_passes_are_abandoned_without_a_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = make_worker(tmp_path, shutdown_drain_s=0.2)
    committing = threading.Event()
    # Two fsyncs per chunk (the file, then its directory): 0.8 s a save.
    monkeypatch.setattr(os, "fsync", delayed_fsync(0.4, tmp_path, committing))
    queued = _queue_requests(worker, 3)
    assert committing.wait(timeout=30)  # the first save is copied, and publishing
    worker.shutdown()
    ended, shutdown = _outcomes(tmp_path / "events.jsonl")
    assert set(ended) == {spec.path for spec in queued}
    saved = [path for path, event in ended.items() if event == "save"]
    abandoned = [path for path, event in ended.items() if event == "save_abandoned"]
    # The save publishing when the bound passed finished; every one after it stopped.
    assert saved == [queued[0].path] and len(abandoned) == len(queued) - 1
    assert shutdown["abandoned"] == len(abandoned) and shutdown["pending"] == len(queued)
    for path in saved:
        with Snapshot.open(path) as snapshot:
            assert snapshot.verify() == []
    # The store holds the saved chunks and nothing else: no temporary file, no partial chunk,
    # so the scheduler finds the abandoned ones missing and plans them again.
    assert _files_in(tmp_path / "store") == sorted(Path(path) for path in saved)
    assert not any(worker.store.has_chunk(path) for path in abandoned)


def test_a_save_running_when_the_bound_passes_stops_at_its_next_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = make_worker(tmp_path, shutdown_drain_s=0.2)
    gate = gate_captures(worker, monkeypatch)  # the first capture starts, then waits
    queued = _queue_requests(worker, 1)
    queue = worker._saves
    assert queue is not None
    _wait_until(lambda: worker.captures == 1)  # type: ignore[attr-defined]
    shutting_down = threading.Thread(target=worker.shutdown)
    shutting_down.start()
    # The bound passes with the first capture under way (held at the gate).
    assert queue.abandoning.wait(timeout=30)
    assert worker.captures == 1  # type: ignore[attr-defined]
    gate.set()
    shutting_down.join(timeout=60)
    assert not shutting_down.is_alive()
    ended, shutdown = _outcomes(tmp_path / "events.jsonl")
    assert ended == {spec.path: "save_abandoned" for spec in queued}
    assert shutdown["abandoned"] == len(queued)
    # The running capture's temporary file went with it; the second never started one.
    assert worker.captures == 1  # type: ignore[attr-defined]
    assert _files_in(tmp_path / "store") == []


def test_ranks_abandoning_at_tp2_leave_whole_chunks_and_never_wait_for_each_other(
    tmp_path: Path,
) -> None:
    store, events_path = tmp_path / "store", tmp_path / "events.jsonl"
    # Three requests of two chunks; each chunk costs a rank at least two slow fsyncs (its part
    # and the directory), rank 0 two more (the index). Rank 0's bound passes early in the
    # queue, rank 1's a chunk or two later (ranks learn of a shutdown at their own moment):
    # rank 1 must still meet rank 0 in every chunk's collectives.
    reports = run_ranks(
        tmp_path,
        "worker-shutdown",
        2,
        store,
        requests=3,
        drain_s=[0.3, 1.5],
        fsync_delay_s=0.3,
        event_log=str(events_path),
    )  # run_ranks fails the test if a rank hangs
    assert [report.get("error") for report in reports] == [None, None], reports
    paths = reports[0]["paths"]
    events = read_events(events_path)
    shutdowns = {event["rank"]: event for event in events if event["event"] == "shutdown"}
    assert sorted(shutdowns) == [0, 1] and shutdowns[0]["abandoned"] >= 1, shutdowns
    saved = {event["path"] for event in events if event["event"] == "save"}  # rank 0 logs them
    assert saved < set(paths)
    # Rank 1 learnt of every chunk rank 0 abandoned through the chunk's status exchange (rank
    # 0 went on meeting it there), not by losing its peer once rank 0 had exited.
    ended = {
        event["path"]: event
        for event in events
        if event["rank"] == 1 and event["event"] in ("save_abandoned", "save_failed")
    }
    assert set(ended) == set(paths) - saved
    assert all("SaveAbandonedError" in event["error"] for event in ended.values()), ended
    # Each chunk is whole (its index and both parts, verified) or absent: no part, no index,
    # no temporary file of an abandoned chunk is left.
    expected_files = set()
    for path in paths:
        stored = PrefixStore(store, "ns", chunk_blocks=2).has_chunk(path)
        assert stored == (path in saved), path
        if stored:
            with Snapshot.open(path) as snapshot:
                assert snapshot.verify() == [] and len(snapshot.part_files()) == 2
                expected_files.update(Path(name) for name in snapshot.part_files())
            expected_files.add(Path(f"{path}.index.json"))
    assert set(_files_in(store)) == expected_files


def test_the_drain_bound_is_the_option_else_vllms_window_for_its_workers() -> None:
    default = ConnectorOptions.from_extra_config({"path": "/s"})
    assert default.shutdown_drain_s is None
    assert default.drain_bound_s({}) == 5.0  # vLLM's own default window
    assert default.drain_bound_s({"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "30"}) == 30.0
    assert default.drain_bound_s({"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "soon"}) == 5.0
    given = ConnectorOptions.from_extra_config({"path": "/s", "shutdown_drain_s": 2})
    assert given.drain_bound_s({"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "30"}) == 2.0
    for bad in (-1, "soon", float("nan")):
        with pytest.raises(ValueError, match="shutdown_drain_s"):
            ConnectorOptions.from_extra_config({"path": "/s", "shutdown_drain_s": bad})
