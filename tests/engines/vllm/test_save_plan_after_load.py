"""The save plan of a prompt the connector just loaded from the store.

The scheduler plans, once a prompt is computed, the save of every chunk the store does not
hold. A request whose chunks the store served (matched and checked at the match, loaded by
the workers with every page checked, no block failed) needs no lookup of those chunks again;
one whose load failed must have its chunks looked up and the damaged one saved anew.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from kvsnap.engines.vllm import ChunkChecker, EventLog
from kvsnap.engines.vllm.open_chunks import CHECKED_CHUNKS
from kvsnap.engines.vllm.scheduler import KVSnapScheduler
from kvsnap.engines.vllm.specs import KVSnapWorkerMetadata
from tests.support.vllm_worker_helpers import (
    BLOCK,
    FINGERPRINT,
    HEAD_DIM,
    HEADS,
    LAYERS,
    cache_blocks,
    make_worker,
    scheduled_request,
    scheduler_step,
    stored_chunks,
)

GEOMETRY = {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": HEAD_DIM}
TARGET = [9, 10, 11, 12, 13]


def _after_load(tmp_path: Path, damage: bool, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """A stored 4-block prompt (+ 1 token) matched, its load planned and run, the outcome
    reported: the save plan after its step, the chunk paths it looked up (``stat``), the
    blocks whose load failed, and the worker. ``damage``: a page of the second chunk is
    flipped in the bytes handed over after the check."""
    worker = make_worker(tmp_path)
    saves = stored_chunks(worker, "writer", [1, 2, 3, 4])
    prompt = [int(token) for spec in saves for token in spec.token_ids] + [7]
    CHECKED_CHUNKS.clear()
    scheduler = KVSnapScheduler(
        worker.options,
        worker.store,
        EventLog(None, "scheduler", 0),
        block_size=BLOCK,
        checker=ChunkChecker(FINGERPRINT, GEOMETRY, BLOCK, verify=True, hand_over=True),
        block_ids_of=lambda request_id: TARGET,
    )
    request = scheduled_request("reader", prompt)
    matched, _ = scheduler.get_num_new_matched_tokens(request, 0)  # type: ignore[arg-type]
    assert matched == 4 * BLOCK
    blocks = type("Blocks", (), {"get_block_ids": lambda self: [TARGET]})()
    scheduler.update_state_after_alloc(request, blocks, matched)  # type: ignore[arg-type]
    meta = scheduler.build_connector_meta(scheduler_step({"reader": len(prompt) - matched}))  # type: ignore[arg-type]
    if damage:
        reader = CHECKED_CHUNKS._open[saves[1].path][0].parts[0].reader
        entry = reader.open_files[0].layout.by_name["layers.0.key"]
        reader.open_files[0].source._whole[entry.begin + 3] ^= 0x10
    worker.start_load_kv(meta)
    failed = worker.get_block_ids_with_load_errors()
    report = type("Output", (), {})()
    report.finished_sending = None
    report.kv_connector_worker_meta = worker.build_connector_worker_meta()
    report.invalid_block_ids = failed
    assert isinstance(report.kv_connector_worker_meta, KVSnapWorkerMetadata)
    scheduler.update_connector_output(report)  # type: ignore[arg-type]
    looked_up = _stats_of(monkeypatch, {spec.path for spec in saves})
    step = scheduler_step({})
    step.scheduled_cached_reqs.req_ids = ["reader"]
    step.scheduled_cached_reqs.num_computed_tokens = [matched if not failed else 0]
    step.num_scheduled_tokens = {"reader": len(prompt) - matched if not failed else len(prompt)}
    after = scheduler.build_connector_meta(step)  # type: ignore[arg-type]
    return after, looked_up, failed, worker, saves


def _stats_of(monkeypatch: pytest.MonkeyPatch, paths: set[str]) -> list[str]:
    """From now on, the ``stat`` calls made on ``paths`` (their text), in order."""
    seen: list[str] = []
    real = os.stat

    def stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if os.fspath(path) in paths:  # type: ignore[arg-type]
            seen.append(os.fspath(path))  # type: ignore[arg-type]
        return real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", stat)
    return seen


def test_the_save_plan_of_a_prompt_just_loaded_looks_none_of_its_chunks_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    after, looked_up, failed, worker, _ = _after_load(tmp_path, False, monkeypatch)
    assert failed == set()
    assert after.saves == [] and looked_up == []
    for loaded, saved in zip(
        cache_blocks(worker, TARGET[:4]), cache_blocks(worker, [1, 2, 3, 4]), strict=True
    ):
        assert torch.equal(loaded.view(torch.int16), saved.view(torch.int16))
    worker.shutdown()


def test_the_save_plan_after_a_failed_load_looks_the_chunks_up_and_saves_the_bad_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    after, looked_up, failed, worker, saves = _after_load(tmp_path, True, monkeypatch)
    assert failed == set(TARGET[2:4])  # the second chunk's blocks
    assert not Path(saves[1].path).exists()  # quarantined by the worker
    assert looked_up  # the plan asked the store again
    assert [spec.path for spec in after.saves] == [saves[1].path]
    assert np.array_equal(after.saves[0].token_ids, saves[1].token_ids)
    worker.shutdown()
