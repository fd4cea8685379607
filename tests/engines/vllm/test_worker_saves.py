"""The connector's saves without vLLM: background writes through the warm pipeline, vLLM's async
save contract (``request_finished`` / ``get_finished`` / preemptions), the pipeline's ``after=``
hook, and the worker benchmark run quick on CPU.

The worker is driven with a random ``FLASH_ATTN``-shaped cache registered through
:func:`registered_cache`, the function the connector's ``register_kv_caches`` ends in
(``tests/support/vllm_worker_helpers.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvsnap.engines.vllm import (
    CacheIdentity,
    ChunkChecker,
    ConnectorOptions,
    EventLog,
    KVSnapConnectorMetadata,
    PrefixStore,
    read_events,
    store_bytes,
    store_key_chain,
    vllm_layout,
)
from kvsnap.engines.vllm import scheduler as scheduler_module
from kvsnap.engines.vllm.capacity import capacity_lock
from kvsnap.engines.vllm.scheduler import KVSnapScheduler
from kvsnap.pipeline import Pipeline, TransferOptions
from kvsnap.snapshot import SequenceBlocks, Snapshot
from tests.support.vllm_worker_helpers import (
    BLOCK,
    BLOCKS,
    CHUNK_BLOCKS,
    FINGERPRINT,
    HEAD_DIM,
    HEADS,
    LAYERS,
    SOURCE,
    cache_blocks,
    chunk_saves,
    distinct_chunk_saves,
    gate_captures,
    load_saves,
    make_cache,
    make_worker,
    scheduled_request,
    scheduler_step,
    stored_chunks,
)

ROOT = Path(__file__).resolve().parents[3]


def test_saves_run_behind_the_engine_and_blocks_free_once_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = make_worker(tmp_path)
    gate = gate_captures(worker, monkeypatch)
    saves = chunk_saves(worker, "r1", [3, 4, 5, 6])
    computed = cache_blocks(worker, [3, 4, 5, 6])
    worker.wait_for_save(KVSnapConnectorMetadata(saves=saves))  # returns with captures held
    other = chunk_saves(worker, "r2", [7, 8])
    worker.wait_for_save(KVSnapConnectorMetadata(saves=other))
    assert not any(Path(spec.path).exists() for spec in saves)
    # r1 finished, but its blocks are still being copied: not reported.
    assert worker.get_finished({"r1"}) == (None, None)
    gate.set()
    worker.wait_for_writes()
    # Reported once its copies are done (remembered from the earlier call), then never again;
    # r2 has not finished, so it is not reported although its copy is done.
    assert worker.get_finished(set()) == ({"r1"}, None)
    assert worker.get_finished({"r1"}) == (None, None)
    assert worker.get_finished({"r2"}) == ({"r2"}, None)
    # vLLM may now reuse the blocks: overwriting them changes nothing stored.
    assert worker.cache is not None
    for cache in worker.cache.caches:
        cache[[3, 4, 5, 6]] = 0
    load_saves(worker, saves, [10, 11, 12, 13])
    for wrote, loaded in zip(computed, cache_blocks(worker, [10, 11, 12, 13]), strict=True):
        assert torch.equal(wrote.view(torch.int16), loaded.view(torch.int16))
    written = [
        event for event in read_events(tmp_path / "events.jsonl") if event["event"] == "save"
    ]
    assert sorted(event["path"] for event in written) == sorted(spec.path for spec in saves + other)
    worker.shutdown()


def test_a_stored_chunk_is_never_copied_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = make_worker(tmp_path)
    first = stored_chunks(worker, "r1", [1, 2, 3, 4])
    gate = gate_captures(worker, monkeypatch)
    gate.set()
    again = chunk_saves(worker, "r2", [1, 2, 3, 4])  # the same prompt, same chunk names
    assert [spec.path for spec in again] == [spec.path for spec in first]
    worker.wait_for_save(KVSnapConnectorMetadata(saves=again))
    worker.wait_for_writes()
    assert worker.captures == 0  # type: ignore[attr-defined]
    assert worker.get_finished({"r1", "r2"}) == ({"r1", "r2"}, None)
    saves = [event for event in read_events(tmp_path / "events.jsonl") if event["event"] == "save"]
    assert len(saves) == len(first)
    worker.shutdown()


def test_a_preempted_request_waits_for_its_copies_before_the_next_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = make_worker(tmp_path)
    gate = gate_captures(worker, monkeypatch)
    worker.wait_for_save(KVSnapConnectorMetadata(saves=chunk_saves(worker, "r1", [2, 3])))
    worker.handle_preemptions(KVSnapConnectorMetadata(preempted=["other"]))  # nothing to wait for
    waiter = threading.Thread(
        target=worker.handle_preemptions, args=(KVSnapConnectorMetadata(preempted=["r1"]),)
    )
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()  # the copy has not run: the blocks must not be reused yet
    gate.set()
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    worker.shutdown()


def test_a_step_waits_only_when_earlier_steps_fill_the_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = make_worker(tmp_path, max_pending_writes=2)
    gate = gate_captures(worker, monkeypatch)
    # Two saves in one step: queued at once, however many (only earlier steps count).
    worker.wait_for_save(KVSnapConnectorMetadata(saves=chunk_saves(worker, "r1", [1, 2, 3])))
    second = threading.Thread(
        target=worker.wait_for_save,
        args=(KVSnapConnectorMetadata(saves=chunk_saves(worker, "r2", [5, 6])),),
    )
    second.start()
    time.sleep(0.3)
    assert second.is_alive()  # 2 saves of the first step still queued: the disk is behind
    gate.set()
    second.join(timeout=30)
    assert not second.is_alive()
    worker.shutdown()


def test_a_failed_save_is_logged_and_still_frees_the_blocks(tmp_path: Path) -> None:
    worker = make_worker(tmp_path)
    saves = chunk_saves(worker, "r1", [2, 3])
    Path(saves[0].path).parent.parent.mkdir(parents=True, exist_ok=True)
    Path(saves[0].path).parent.write_text("a file where the chunk's directory goes")
    worker.wait_for_save(KVSnapConnectorMetadata(saves=saves))
    worker.wait_for_writes()
    assert worker.get_finished({"r1"}) == ({"r1"}, None)
    (failed,) = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "save_failed"]
    assert failed["request"] == "r1" and failed["path"] == saves[0].path
    worker.shutdown()


def test_the_scheduler_holds_the_blocks_of_requests_with_saves(tmp_path: Path) -> None:
    options = ConnectorOptions.from_extra_config(
        {"path": str(tmp_path), "chunk_blocks": CHUNK_BLOCKS, "min_blocks": 2}
    )
    geometry = {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": HEAD_DIM}
    scheduler = KVSnapScheduler(
        options,
        PrefixStore(tmp_path, "ns", chunk_blocks=CHUNK_BLOCKS),
        EventLog(None, "scheduler", 0),
        block_size=BLOCK,
        checker=ChunkChecker(FINGERPRINT, geometry, BLOCK, verify=True),
        block_ids_of=lambda request_id: list(range(BLOCKS)),
    )
    saved, short = (
        scheduled_request("saved", list(range(1, 14))),
        scheduled_request("short", [1, 2, 3, 4, 5]),
    )
    for request in (saved, short):
        scheduler.update_state_after_alloc(request, None, 0)  # type: ignore[arg-type]
    meta = scheduler.build_connector_meta(scheduler_step({"saved": 13, "short": 5}))  # type: ignore[arg-type]
    assert {spec.request_id for spec in meta.saves} == {"saved"} and meta.preempted == []
    # Preempted with saves planned: the workers wait for the copies before the next pass.
    meta = scheduler.build_connector_meta(scheduler_step({}, {"saved", "short"}))  # type: ignore[arg-type]
    assert meta.preempted == ["saved"]
    assert scheduler.request_finished(saved) is True  # type: ignore[arg-type]
    assert scheduler.request_finished(short) is False  # type: ignore[arg-type]


def test_a_request_s_store_keys_are_worked_out_once_and_dropped_when_it_finishes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The match and the save plan of one prompt use one computation of its store keys; a
    finished request's keys are not served to a later request that reuses its id."""
    store = PrefixStore(tmp_path, "ns", chunk_blocks=CHUNK_BLOCKS)
    geometry = {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": HEAD_DIM}
    scheduler = KVSnapScheduler(
        ConnectorOptions.from_extra_config({"path": str(tmp_path), "chunk_blocks": CHUNK_BLOCKS}),
        store,
        EventLog(None, "scheduler", 0),
        block_size=BLOCK,
        checker=ChunkChecker(FINGERPRINT, geometry, BLOCK, verify=True),
        block_ids_of=lambda request_id: list(range(BLOCKS)),
    )
    computed: list[list[str]] = []

    def counted(*args, **kwargs):
        computed.append(store_key_chain(*args, **kwargs))
        return computed[-1]

    monkeypatch.setattr(scheduler_module, "store_key_chain", counted)
    for prompt in (list(range(1, 4 * BLOCK + 2)), list(range(50, 50 + 4 * BLOCK + 1))):
        request = scheduled_request("r", prompt)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)  # type: ignore[arg-type]
        scheduler.update_state_after_alloc(request, None, 0)  # type: ignore[arg-type]
        meta = scheduler.build_connector_meta(scheduler_step({"r": len(prompt)}))  # type: ignore[arg-type]
        keys = store_key_chain(np.asarray(prompt[: 4 * BLOCK]), BLOCK, CacheIdentity())
        assert computed[-1] == keys
        spans = store.chunk_spans(4)
        assert [spec.path for spec in meta.saves] == [
            str(store.chunk_path(keys[end - 1])) for _, end in spans
        ]
        scheduler.request_finished(request)  # type: ignore[arg-type]
    assert len(computed) == 2  # one per request, not one for the match and one for the plan


def test_capture_copies_after_the_given_event(tmp_path: Path) -> None:
    cache = make_cache(seed=1)
    layout = vllm_layout(
        cache.caches,
        backend="FLASH_ATTN",
        kv_cache_layout="LBNHC",
        head_size=HEAD_DIM,
        num_kv_heads=HEADS,
    )
    computed = [torch.full_like(layer[[5, 9]], 3.0) for layer in cache.caches]

    class ForwardPassDone:
        """Stands in for the CUDA event after a forward pass: the pass writes the blocks."""

        def synchronize(self) -> None:
            for layer, values in zip(cache.caches, computed, strict=True):
                layer[[5, 9]] = values

    pipeline = Pipeline(layout, transfer=TransferOptions(backend="cpu"))  # copies on the host
    tokens = np.arange(2 * BLOCK)
    path = tmp_path / "after.safetensors"
    pipeline.capture(
        [SequenceBlocks("s", tokens, np.asarray([5, 9]))],
        path,
        source=SOURCE,
        after=ForwardPassDone(),  # type: ignore[arg-type]
    )
    with Snapshot.open(path) as snapshot:
        keys = snapshot.sequence_kv("s", "layers.1.key")
    assert torch.equal(keys, torch.full_like(keys, 3.0))


def test_the_worker_benchmark_runs_quick_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "vllm_worker.json"
    command = [sys.executable, "-m", "benchmarks.vllm_worker", "--quick", "--device", "cpu"]
    command.append("--load-variants")
    result = subprocess.run(
        [*command, "--out", str(out), "--dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [row["model"] for row in report["results"]] == ["tiny-4l", "tiny-8l-1h"]
    for row in report["results"]:
        saves = row["with_saves"]
        assert saves["prompts_saved"] == 4 and saves["save_host"]["count"] == 4
        # Warm-up 2 prompts, measured 4, each 512 tokens in chunks of 16 blocks of 16.
        assert row["saves_written"] == 6 * 2 and row["saves_failed"] == 0
        assert row["load_bit_exact"] is True and row["load_failed_blocks"] == 0
        assert row["raw_read"]["bytes"] > row["prompt_tokens"] * row["kv_bytes_per_token"]
        variants = row["load_variants"]
        assert len(variants) > 10 and all(figures["bit_exact"] for figures in variants.values())
    assert "start_load_kv" in result.stdout and "tiny-8l-1h/cells" in result.stdout


def test_engines_sharing_a_store_hold_its_bound(tmp_path: Path) -> None:
    """Item 6: four engines writing to one store at once keep it within its bound at every
    sample: it is measured from the store, not from each engine's writes."""
    probe = make_worker(tmp_path)
    probe.wait_for_save(KVSnapConnectorMetadata(saves=distinct_chunk_saves(probe, "p", 0)))
    probe.wait_for_writes()
    probe.shutdown()
    (chunk,) = (tmp_path / "store").glob("ns/chunks/*/*.safetensors")
    chunk_bytes = chunk.stat().st_size
    capacity = 10 * chunk_bytes
    workers = [
        make_worker(tmp_path, store_capacity_bytes=capacity, store_min_idle_s=0) for _ in range(4)
    ]
    samples: list[int] = []
    writing = threading.Event()
    writing.set()

    def sample() -> None:
        # Under the lock every commit and eviction takes, a listing sees the store between two
        # of them, never halfway through one: what it counts is what the store held.
        while writing.is_set():
            with capacity_lock(tmp_path / "store"):
                samples.append(store_bytes(tmp_path / "store"))
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for step in range(8):
            for index, worker in enumerate(workers):
                saves = distinct_chunk_saves(worker, f"w{index}", 1 + step * 10 + index)
                worker.wait_for_save(KVSnapConnectorMetadata(saves=saves))
        for worker in workers:
            worker.wait_for_writes()
    finally:
        writing.clear()
        sampler.join()
        for worker in workers:
            worker.shutdown()
    events = read_events(tmp_path / "events.jsonl")
    assert sum(event["event"] == "save" for event in events) == 1 + 32
    assert sum(event["event"] == "evict" for event in events) >= 33 - 10
    # Each sample waits for the lock behind the engines' commits: about 20 of them in a run.
    assert len(samples) >= 5 and max(samples) <= capacity
    assert store_bytes(tmp_path / "store") <= capacity


@pytest.mark.usefixtures("spare_capture_files")
def test_shutdown_drops_the_spare_capture_files_in_the_store(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DMA save leaves a spare file in its chunk's directory (store/spare_files.py); the
    worker's shutdown removes the spares under its store, and only those."""
    from kvsnap.store import tuning
    from tests.support.store_helpers import build, spare_names, write_mapped

    monkeypatch.setattr(tuning, "MAPPED_WRITE_MIN_BYTES", 0)
    worker = make_worker(shm_dir)
    chunk_directory = shm_dir / "store" / "ns" / "chunks" / "ab"
    chunk_directory.mkdir(parents=True)
    elsewhere = shm_dir / "elsewhere"
    elsewhere.mkdir()
    # What a save by DMA leaves (CPU caches never map: the mapped write stands in for it).
    write_mapped(chunk_directory / "chunk.safetensors", *build("f16-32k", seed=75))
    write_mapped(elsewhere / "snap.safetensors", *build("f16-32k", seed=76))
    assert len(spare_names(chunk_directory)) == 1 and len(spare_names(elsewhere)) == 1
    worker.shutdown()
    assert spare_names(chunk_directory) == []
    assert sorted(p.name for p in chunk_directory.iterdir()) == ["chunk.safetensors"]
    assert len(spare_names(elsewhere)) == 1
