"""Writers start no thread of their own: hashing and writes run on process-wide pools, each
writer's writes in order through its serial lane, and a writer waits for (or cancels) only its
own work."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvsnap import format as fmt
from kvsnap.pipeline import Pipeline
from kvsnap.snapshot import SequenceBlocks
from kvsnap.store import SnapshotReader, SnapshotWriter
from kvsnap.store.write import local_file
from kvsnap.store.write.lanes import SerialLane, TaskGroup
from kvsnap.testing.caches import make_cache, random_content
from tests.support.store_helpers import GEOMETRIES, SOURCE, make_metadata, random_pages


@pytest.fixture
def started_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads started from now on, in order."""
    names: list[str] = []
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        names.append(thread.name)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    return names


def test_fifty_captures_in_a_row_start_no_thread(
    tmp_path: Path, started_threads: list[str]
) -> None:
    cache = make_cache(
        "vllm-nhd", num_layers=4, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8
    )
    content = random_content(cache.layout.geometry, 16, torch.Generator().manual_seed(0))
    cache.fill(content)
    pipeline = Pipeline([cache.layout])
    tokens = np.arange(4 * 8)
    sequences = [SequenceBlocks("prefix", tokens, np.arange(8) + 3)]
    pipeline.capture(sequences, tmp_path / "warm.safetensors", source=SOURCE)  # the pools start
    before = len(threading.enumerate())
    started_threads.clear()
    for index in range(50):
        pipeline.capture(sequences, tmp_path / f"c{index % 3}.safetensors", source=SOURCE)
    assert started_threads == []
    assert len(threading.enumerate()) == before
    with SnapshotReader(tmp_path / "c1.safetensors") as reader:
        assert reader.verify() == []


def build(geometry: str, seed: int) -> tuple[fmt.SnapshotMetadata, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    metadata = make_metadata(GEOMETRIES[geometry], [rng.integers(0, 1000, 40)])
    return metadata, random_pages(rng, metadata)


def test_a_lane_runs_its_items_in_order_one_at_a_time() -> None:
    running = 0
    most = 0
    order: list[int] = []
    lock = threading.Lock()

    def item(number: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.0005 if number % 7 == 0 else 0)
        order.append(number)
        with lock:
            running -= 1
        return number * 2

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        lanes = [SerialLane(pool), SerialLane(pool)]
        futures = [lanes[n % 2].submit(lambda n=n: item(n)) for n in range(200)]
        assert [future.result(timeout=30) for future in futures] == [2 * n for n in range(200)]
        for lane in lanes:
            lane.shutdown()
    # Two lanes at once, never two items of one lane: each lane's items kept their order.
    assert [n for n in order if n % 2 == 0] == list(range(0, 200, 2))
    assert [n for n in order if n % 2 == 1] == list(range(1, 200, 2))
    assert most <= 2


def test_a_lane_shut_down_with_cancel_waits_for_its_running_item_only() -> None:
    release = threading.Event()
    began = threading.Event()

    def blocked() -> str:
        began.set()
        assert release.wait(10)
        return "done"

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        lane = SerialLane(pool)
        first = lane.submit(blocked)
        queued = [lane.submit(lambda: "never") for _ in range(4)]
        assert began.wait(10)
        stopper = threading.Thread(target=lambda: lane.shutdown(cancel_futures=True))
        stopper.start()
        stopper.join(0.2)
        assert stopper.is_alive()  # the running item has not finished
        assert pool.submit(lambda: "other work").result(timeout=10) == "other work"
        release.set()
        stopper.join(10)
        assert not stopper.is_alive()
        assert first.result() == "done"
        assert all(future.cancelled() for future in queued)
        with pytest.raises(RuntimeError, match="shut down"):
            lane.submit(lambda: None)


def test_a_failing_item_fails_its_future_and_the_lane_goes_on() -> None:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        lane = SerialLane(pool)
        failing = lane.submit(lambda: 1 / 0)
        after = lane.submit(lambda: "next")
        with pytest.raises(ZeroDivisionError):
            failing.result(timeout=10)
        assert after.result(timeout=10) == "next"


def test_a_task_group_waits_for_its_own_tasks_only() -> None:
    release = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        other = pool.submit(release.wait, 10)  # another group's task, still running
        group = TaskGroup(pool)
        results = [group.submit(lambda n=n: n) for n in range(20)]
        group.shutdown()
        assert [future.result(timeout=0) for future in results] == list(range(20))
        assert not other.done()
        release.set()


def test_an_abort_removes_the_file_at_once_waits_for_its_pending_write_and_spares_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    metadata, pages = build("f16-32k", seed=31)
    path = tmp_path / "aborted.safetensors"
    release = threading.Event()
    blocked = threading.Event()
    files_seen_by_the_write: list[list[str]] = []
    real = local_file._pwrite_all

    def slow_for_one_writer(fd: int, view: memoryview, offset: int) -> None:
        if fd in held_fds:
            blocked.set()
            assert release.wait(10)
            files_seen_by_the_write.append(os.listdir(tmp_path))
        real(fd, view, offset)

    writer = SnapshotWriter(path, metadata, direct_io=False)
    held_fds = {file.fd for file in writer._target.files}
    monkeypatch.setattr(local_file, "_pwrite_all", slow_for_one_writer)
    writer.write_pages("layers.0.key", pages["layers.0.key"])
    assert blocked.wait(10)
    # Another writer on the same shared pools commits while this one's write is stuck.
    other, other_pages = build("bf16", seed=32)
    with SnapshotWriter(tmp_path / "other.safetensors", other, direct_io=False) as second:
        for name in second.tensor_order():
            second.write_pages(name, other_pages[name])
    aborter = threading.Thread(target=writer.abort)
    aborter.start()
    aborter.join(0.2)
    assert aborter.is_alive()  # waits for the write in flight (it reads the caller's buffer)
    # ... but the temporary file is gone already: a Ctrl-C during that wait leaves nothing.
    assert os.listdir(tmp_path) == ["other.safetensors"]
    release.set()
    aborter.join(10)
    assert not aborter.is_alive()
    # The stuck write ran to its end on the open (unlinked) file, naming nothing.
    assert files_seen_by_the_write == [["other.safetensors"]]
    assert os.listdir(tmp_path) == ["other.safetensors"]
    with SnapshotReader(tmp_path / "other.safetensors") as reader:
        assert reader.verify() == []


def _write_in_child(path: str) -> None:
    metadata, pages = build("bf16", seed=33)
    with SnapshotWriter(path, metadata, direct_io=False) as writer:
        for name in writer.tensor_order():
            writer.write_pages(name, pages[name])


def test_a_forked_child_writes_with_pools_of_its_own(tmp_path: Path) -> None:
    # The parent's shared pools exist and have idle workers when the child is forked.
    metadata, pages = build("bf16", seed=34)
    with SnapshotWriter(tmp_path / "parent.safetensors", metadata, direct_io=False) as writer:
        for name in writer.tensor_order():
            writer.write_pages(name, pages[name])
    child = multiprocessing.get_context("fork").Process(
        target=_write_in_child, args=(str(tmp_path / "child.safetensors"),)
    )
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        child.join()
    assert child.exitcode == 0
    with SnapshotReader(tmp_path / "child.safetensors") as reader:
        assert reader.verify() == []


def test_streamed_snapshots_start_no_thread(started_threads: list[str]) -> None:
    metadata, pages = build("bf16", seed=35)
    urls = [f"memory://kvsnap-threads/s{index}.safetensors" for index in range(6)]
    for url in urls:
        if url == urls[1]:
            started_threads.clear()  # the first write started the shared pools
        with SnapshotWriter(url, metadata) as writer:
            for name in writer.tensor_order():
                writer.write_pages(name, pages[name])
    assert started_threads == []
    with SnapshotReader(urls[-1]) as reader:
        assert reader.verify() == []


# What a Ctrl-C between a pool starting a worker and registering it leaves behind (CPython's
# ``ThreadPoolExecutor._adjust_thread_count``): a live worker that ``concurrent.futures`` does
# not know of, so its exit hook never wakes it. The process must still exit.
_ORPHANED_WORKER = """
import concurrent.futures.thread as pool_threads
from kvsnap.store.base.pools import shared_executor

pools = [shared_executor("write", 2), shared_executor("read", 3)]
for executor in pools:
    for _ in range(6):
        executor.submit(sum, range(1000)).result()
    for worker in list(executor._threads):
        pool_threads._threads_queues.pop(worker, None)
print("exiting", flush=True)
"""


def test_a_process_exits_when_a_ctrl_c_orphaned_a_pool_worker() -> None:
    child = subprocess.run(
        [sys.executable, "-c", _ORPHANED_WORKER],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])),
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "exiting"
