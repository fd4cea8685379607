"""The connector's two sides driven as vLLM drives them, without vLLM: requests stored and served.

:func:`make_connector` builds a :class:`~kvsnap.engines.vllm.scheduler.KVSnapScheduler` and a
:class:`~kvsnap.engines.vllm.worker.KVSnapWorker` (on the random ``FLASH_ATTN``-shaped cache of
``vllm_worker_helpers``) over one store, as one engine has them (``hand_over``: vLLM's ``uni``
executor, the worker in the scheduler's process; without it, the worker opens every chunk by
its path as a worker in another process does). :meth:`Connector.store` runs a request whose
prompt is computed into given blocks and saves its chunks; :meth:`Connector.serve` runs one
whose prefix the store may hold: the match, the load plan, the worker's load, the outcome
reported, and says which blocks were loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvsnap.engines.vllm import ChunkChecker, ConnectorOptions, EventLog, PrefixStore
from kvsnap.engines.vllm.open_chunks import CHECKED_CHUNKS
from kvsnap.engines.vllm.scheduler import KVSnapScheduler
from kvsnap.engines.vllm.worker import KVSnapWorker
from kvsnap.format.signing import KeyRing
from tests.support.vllm_worker_helpers import (
    BLOCK,
    CHUNK_BLOCKS,
    FINGERPRINT,
    HEAD_DIM,
    HEADS,
    LAYERS,
    SOURCE,
    make_cache,
    scheduler_step,
)

GEOMETRY = {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": HEAD_DIM}


@dataclass
class Served:
    """One served request: the tokens matched, the engine blocks planned for loading, and
    those whose load failed (recomputed by vLLM)."""

    matched: int
    planned: list[int]
    failed: set[int]

    @property
    def loaded(self) -> list[int]:
        """The blocks the store filled."""
        return [block for block in self.planned if block not in self.failed]


@dataclass
class Connector:
    """One engine's connector: its scheduler and worker on one store."""

    scheduler: KVSnapScheduler
    worker: KVSnapWorker
    events_path: Path
    blocks_of: dict[str, list[int]] = field(default_factory=dict)

    def request(self, request_id: str, prompt: list[int], salt: str | None) -> SimpleNamespace:
        """What the scheduler reads of a vLLM ``Request``."""
        return SimpleNamespace(
            request_id=request_id,
            prompt_token_ids=prompt,
            all_token_ids=prompt,
            cache_salt=salt,
            sampling_params=SimpleNamespace(extra_args=None),
        )

    def store(
        self, request_id: str, prompt: list[int], blocks: list[int], salt: str | None = None
    ) -> None:
        """A request whose prompt was computed into engine ``blocks``: its chunks saved."""
        request = self.request(request_id, prompt, salt)
        self.blocks_of[request_id] = blocks
        matched, _ = self.scheduler.get_num_new_matched_tokens(request, 0)  # type: ignore[arg-type]
        assert matched == 0, matched
        self.scheduler.update_state_after_alloc(request, _blocks(blocks), 0)  # type: ignore[arg-type]
        meta = self.scheduler.build_connector_meta(scheduler_step({request_id: len(prompt)}))  # type: ignore[arg-type]
        self.worker.wait_for_save(meta)
        self.worker.wait_for_writes()
        self.scheduler.request_finished(request)  # type: ignore[arg-type]

    def serve(
        self, request_id: str, prompt: list[int], target: list[int], salt: str | None = None
    ) -> Served:
        """A request matched against the store and loaded into engine blocks ``target``, its
        outcome reported to the scheduler; no save is planned (its saves are not run)."""
        request = self.request(request_id, prompt, salt)
        self.blocks_of[request_id] = target
        matched, _ = self.scheduler.get_num_new_matched_tokens(request, 0)  # type: ignore[arg-type]
        self.scheduler.update_state_after_alloc(request, _blocks(target), matched)  # type: ignore[arg-type]
        meta = self.scheduler.build_connector_meta(scheduler_step({request_id: len(prompt)}))  # type: ignore[arg-type]
        planned = [int(block) for spec in meta.loads for block in spec.target_blocks]
        self.worker.start_load_kv(meta)
        failed = self.worker.get_block_ids_with_load_errors()
        self.scheduler.update_connector_output(
            SimpleNamespace(  # type: ignore[arg-type]
                finished_sending=None,
                kv_connector_worker_meta=self.worker.build_connector_worker_meta(),
                invalid_block_ids=failed,
            )
        )
        self.scheduler.request_finished(request)  # type: ignore[arg-type]
        return Served(matched, planned, failed)

    def blocks(self, blocks: list[int]) -> list[torch.Tensor]:
        """Copies of engine ``blocks`` of every layer."""
        assert self.worker.cache is not None
        return [cache[blocks].clone() for cache in self.worker.cache.caches]

    def scrub(self, blocks: list[int]) -> None:
        """Zero engine ``blocks`` of every layer (what a load must fill)."""
        assert self.worker.cache is not None
        for cache in self.worker.cache.caches:
            cache[blocks] = 0

    def shutdown(self) -> None:
        self.worker.shutdown()
        CHECKED_CHUNKS.clear()


def _blocks(block_ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: [block_ids])


def make_connector(
    root: Path,
    *,
    keys: KeyRing | None = None,
    hand_over: bool = True,
    verify: bool = True,
    guard_interval_s: float | None = None,
    seed: int = 0,
    **extra: Any,
) -> Connector:
    """A connector on the store ``root`` (its events beside it, ``events.jsonl``): scheduler
    and worker as one engine has them (see the module's notes); ``guard_interval_s``: the
    store's mode and owner checked again that often (none: not at all); ``extra``: more
    connector options."""
    events_path = root.parent / f"{root.name}.events.jsonl"
    options = ConnectorOptions.from_extra_config(
        {"path": str(root), "chunk_blocks": CHUNK_BLOCKS, "event_log": str(events_path), **extra}
    )
    root.mkdir(mode=0o700, exist_ok=True)
    store = PrefixStore(options.path, "ns", chunk_blocks=options.chunk_blocks)
    if guard_interval_s is not None:
        from kvsnap.engines.vllm.store_guard import StoreGuard
    guards = [
        None
        if guard_interval_s is None
        else StoreGuard(
            root,
            EventLog(options.event_log, role, 0),
            shared=options.shared_store,
            signed=keys is not None,
            interval_s=guard_interval_s,
        )
        for role in ("scheduler", "worker")
    ]
    worker = KVSnapWorker(
        options,
        store,
        EventLog(options.event_log, "worker", 0),
        vllm_config=None,
        fingerprint=FINGERPRINT,
        source=SOURCE,
        keys=keys,
        **({} if guards[1] is None else {"guard": guards[1]}),
    )
    worker.attach(make_cache(seed))
    connector = Connector(None, worker, events_path)  # type: ignore[arg-type]
    checker = ChunkChecker(
        FINGERPRINT, GEOMETRY, BLOCK, verify=verify, keys=keys, hand_over=hand_over
    )
    connector.scheduler = KVSnapScheduler(
        options,
        store,
        EventLog(options.event_log, "scheduler", 0),
        block_size=BLOCK,
        checker=checker,
        block_ids_of=lambda request_id: connector.blocks_of[request_id],
        **({} if guards[0] is None else {"guard": guards[0]}),
    )
    CHECKED_CHUNKS.clear()
    return connector


def random_prompt(seed: int, blocks: int = 4) -> list[int]:
    """``blocks`` full blocks of random tokens and one more token (vLLM computes the last)."""
    tokens = np.random.default_rng(seed).integers(1, 500, size=blocks * BLOCK + 1)
    return [int(token) for token in tokens]
