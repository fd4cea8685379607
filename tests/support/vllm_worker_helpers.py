"""The connector's worker driven without vLLM: a random ``FLASH_ATTN``-shaped cache registered
through :func:`~kvsnap.engines.vllm.registration.registered_cache` (the function the
connector's ``register_kv_caches`` ends in), a worker over a store in a test's directory, and
chunk saves as the scheduler plans them."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvsnap import format as fmt
from kvsnap.engines.vllm import (
    CacheIdentity,
    ChunkLoad,
    ConnectorOptions,
    EventLog,
    KVSnapConnectorMetadata,
    LoadSpec,
    PrefixStore,
    SaveSpec,
    chunk_sequence_id,
    store_key_chain,
)
from kvsnap.engines.vllm.registration import RegisteredCache, registered_cache
from kvsnap.engines.vllm.worker import KVSnapWorker

BLOCK, HEADS, HEAD_DIM, LAYERS, BLOCKS = 4, 2, 8, 2, 16
CHUNK_BLOCKS = 2
FINGERPRINT = "ab" * 16
SOURCE = fmt.SourceInfo("vllm", "test", "synthetic", None, FINGERPRINT)


def make_cache(seed: int = 0) -> RegisteredCache:
    """A random bf16 cache of ``LAYERS`` layers as vLLM's FlashAttention backend registers it
    (``BLOCKS`` blocks of ``BLOCK`` tokens, ``HEADS`` heads of ``HEAD_DIM``)."""
    generator = torch.Generator().manual_seed(seed)
    physical = [
        torch.randn((BLOCKS, BLOCK, HEADS, 2 * HEAD_DIM), generator=generator).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    return registered_cache(
        [tensor.permute(0, 2, 1, 3) for tensor in physical],
        backend="FLASH_ATTN",
        kv_cache_layout="LBNHC",
        head_size=HEAD_DIM,
        num_kv_heads=HEADS,
    )


def make_worker(tmp_path: Path, namespace: str = "ns", **extra: Any) -> KVSnapWorker:
    """A worker on :func:`make_cache`'s cache with its store at ``tmp_path / "store"`` (in
    ``namespace``) and its events in ``tmp_path / "events.jsonl"``; ``extra``: more connector
    options."""
    options = ConnectorOptions.from_extra_config(
        {
            "path": str(tmp_path / "store"),
            "chunk_blocks": CHUNK_BLOCKS,
            "event_log": str(tmp_path / "events.jsonl"),
            **extra,
        }
    )
    store = PrefixStore(options.path, namespace, chunk_blocks=options.chunk_blocks)
    worker = KVSnapWorker(
        options,
        store,
        EventLog(options.event_log, "worker", 0),
        vllm_config=None,
        fingerprint=FINGERPRINT,
        source=SOURCE,
    )
    worker.attach(make_cache())
    return worker


def chunk_saves(worker: KVSnapWorker, request: str, blocks: list[int]) -> list[SaveSpec]:
    """A prompt's chunk saves as the scheduler plans them (its tokens drawn from ``blocks``)."""
    tokens = np.random.default_rng(sum(blocks)).integers(1, 500, size=len(blocks) * BLOCK)
    chain = store_key_chain(tokens, BLOCK, CacheIdentity())
    block_ids = np.asarray(blocks, dtype=np.int64)
    return [
        SaveSpec(
            request_id=request,
            kind="persist",
            path=str(worker.store.chunk_path(chain[end - 1])),
            token_ids=tokens[start * BLOCK : end * BLOCK],
            block_ids=block_ids[start:end],
            sequence_id=chunk_sequence_id(
                start, chain[start - 1] if start else None, chain[end - 1]
            ),
        )
        for start, end in worker.store.chunk_spans(len(blocks))
    ]


def stored_chunks(worker: KVSnapWorker, request: str, blocks: list[int]) -> list[SaveSpec]:
    """:func:`chunk_saves` of ``blocks``, saved by ``worker`` and written before this returns."""
    saves = chunk_saves(worker, request, blocks)
    worker.wait_for_save(KVSnapConnectorMetadata(saves=saves))
    worker.wait_for_writes()
    return saves


def distinct_chunk_saves(worker: KVSnapWorker, request: str, seed: int) -> list[SaveSpec]:
    """One chunk (blocks 0 and 1 of the cache) of a prompt of its own (tokens from ``seed``)."""
    tokens = np.random.default_rng(seed).integers(1, 500, size=CHUNK_BLOCKS * BLOCK)
    chain = store_key_chain(tokens, BLOCK, CacheIdentity())
    return [
        SaveSpec(
            request_id=request,
            kind="persist",
            path=str(worker.store.chunk_path(chain[-1])),
            token_ids=tokens,
            block_ids=np.arange(CHUNK_BLOCKS, dtype=np.int64),
            sequence_id=chunk_sequence_id(0, None, chain[-1]),
        )
    ]


def cache_blocks(worker: KVSnapWorker, blocks: list[int]) -> list[torch.Tensor]:
    """Copies of ``blocks`` of every layer of the worker's cache."""
    assert worker.cache is not None
    return [cache[blocks].clone() for cache in worker.cache.caches]


def gate_captures(worker: KVSnapWorker, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold every capture of ``worker`` until the returned event is set; count the calls."""
    assert worker._pipeline is not None
    real = worker._pipeline.capture
    gate = threading.Event()
    worker.captures = 0  # type: ignore[attr-defined]

    def gated(*args: Any, **kwargs: Any) -> Any:
        worker.captures += 1  # type: ignore[attr-defined]
        gate.wait(timeout=20)  # never forever: a failing test must not hang the session
        return real(*args, **kwargs)

    monkeypatch.setattr(worker._pipeline, "capture", gated)
    return gate


def checked_sequence(spec: SaveSpec) -> fmt.SequenceRecord:
    """The one sequence of the chunk ``spec`` saves, as the scheduler's check reads it back
    (the chunk's blocks are numbered from 0)."""
    count = len(spec.block_ids)
    return fmt.SequenceRecord(spec.sequence_id, spec.token_ids, np.arange(count), ())


def chunk_load(spec: SaveSpec, target: list[int]) -> ChunkLoad:
    """The load of every block of the chunk ``spec`` saved into engine blocks ``target``, as
    the scheduler plans it after checking the chunk."""
    count = len(spec.block_ids)
    return ChunkLoad(spec.path, np.arange(count), np.asarray(target), checked_sequence(spec))


def load_saves(worker: KVSnapWorker, saves: list[SaveSpec], target: list[int]) -> None:
    """Load the chunks ``saves`` wrote into blocks ``target`` of the worker's cache, in order;
    every block must load."""
    chunks, offset = [], 0
    for spec in saves:
        count = len(spec.block_ids)
        chunks.append(chunk_load(spec, target[offset : offset + count]))
        offset += count
    worker.start_load_kv(KVSnapConnectorMetadata(loads=[LoadSpec("load", tuple(chunks), 0)]))
    assert worker.get_block_ids_with_load_errors() == set()


def scheduled_request(request_id: str, prompt: list[int]) -> SimpleNamespace:
    """What the scheduler side reads of a vLLM ``Request``: its id and prompt, no extra args."""
    return SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=prompt,
        all_token_ids=prompt,
        sampling_params=SimpleNamespace(extra_args=None),
    )


def scheduler_step(scheduled: dict[str, int], preempted: set[str] | None = None) -> SimpleNamespace:
    """What the scheduler side reads of a ``SchedulerOutput``: the new requests ``scheduled``
    (id -> tokens scheduled) and the ``preempted`` ones."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=rid, num_computed_tokens=0) for rid in scheduled
        ],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens=scheduled,
        preempted_req_ids=preempted,
    )
