"""The connector's scheduler side: match prompts against the store, plan loads and saves.

:class:`KVSnapScheduler` runs in vLLM's scheduler process. It finds the longest run of stored
chunks of a prompt, checks each (:class:`~kvsnap.engines.vllm.chunk_check.ChunkChecker`:
model fingerprint, geometry, token ids and, with ``verify_before_load``, every checksum),
quarantines a chunk that fails, and plans, per step, the blocks every worker loads before the
forward pass and the chunks and dumps it saves after it
(:class:`~kvsnap.engines.vllm.specs.KVSnapConnectorMetadata`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvsnap import format as fmt
from kvsnap.engines.vllm.chunk_check import CHECKED_CHUNKS, ChunkChecker
from kvsnap.engines.vllm.events import EventLog
from kvsnap.engines.vllm.identity import identity_of, store_key_chain
from kvsnap.engines.vllm.options import ConnectorOptions
from kvsnap.engines.vllm.prefix_store import ChunkRef, PrefixStore, chunk_sequence_id, safe_name
from kvsnap.engines.vllm.quarantine import Quarantine
from kvsnap.engines.vllm.remote_fetch import RemoteFetcher
from kvsnap.engines.vllm.specs import (
    ChunkLoad,
    KVSnapConnectorMetadata,
    KVSnapWorkerMetadata,
    LoadSpec,
    SaveSpec,
    external_request_id,
)
from kvsnap.engines.vllm.store_guard import StoreGuard

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

#: ``block_ids_of(request_id)``: the engine blocks vLLM allocated to a request, in order.
BlockIdsOf = Callable[[str], Sequence[int]]


@dataclass
class _Tracked:
    """Scheduler-side state of one request the connector may save or dump."""

    request: Request
    persisted: bool = False
    dumped: bool = False
    #: The load planned for it (chunk paths, target blocks), until it is known to have failed.
    load: tuple[tuple[str, ...], frozenset[int]] | None = None
    #: A load was planned and the workers have not yet said how it went: nothing of the
    #: request is saved meanwhile (under vLLM's AsyncScheduler the next step is planned
    #: before the step that loads has run, and a failed load leaves its blocks, and what is
    #: computed on top of them, wrong until vLLM recomputes them).
    load_pending: bool = False
    #: The chunks its load brought in (the workers said the load ran, no block failed): the
    #: store holds them, checked at the match, so the save plan does not look them up again.
    loaded: frozenset[str] = frozenset()


#: A chunk planned for saving is not planned again for this long unless it appeared (the
#: write is queued behind the engine; a failed write is retried after it).
_REPLAN_AFTER_S = 60.0


class KVSnapScheduler:
    """The scheduler side of :class:`~kvsnap.engines.vllm.KVSnapConnector`.

    :meth:`get_num_new_matched_tokens` finds and checks the stored chunks of a prompt;
    :meth:`update_state_after_alloc` plans their load into the allocated blocks;
    :meth:`build_connector_meta` adds the chunk saves and dumps each step completes;
    :meth:`update_connector_output` learns of failed loads.
    """

    def __init__(
        self,
        options: ConnectorOptions,
        store: PrefixStore,
        events: EventLog,
        *,
        block_size: int,
        checker: ChunkChecker,
        block_ids_of: BlockIdsOf,
        guard: StoreGuard | None = None,
        remote: RemoteFetcher | None = None,
    ) -> None:
        self.options = options
        self.store = store
        self.events = events
        self.block_size = block_size
        self.checker = checker
        self._quarantined = Quarantine(store, events)
        #: The store's mode and owner, checked again while the engine runs: while the store
        #: fails the check nothing is matched in it or planned for saving to it.
        self.guard = guard
        #: The remote tier's lookups (``remote_url``): a local miss is looked up there while
        #: vLLM is answered "not yet".
        self.remote = remote
        self._block_ids_of = block_ids_of
        self._matches: dict[str, tuple[int, list[tuple[ChunkRef, fmt.SequenceRecord]]]] = {}
        self._pending_loads: list[LoadSpec] = []
        self._tracked: dict[str, _Tracked] = {}
        self._planned: dict[str, float] = {}
        #: Requests a save was planned for: vLLM holds their blocks after they finish until
        #: the workers report the copies done (``get_finished``).
        self._saving: set[str] = set()
        #: Finished requests whose blocks vLLM holds for their saves, until the workers report
        #: them (``finished_sending``): blocks that will be free soon.
        self._held: set[str] = set()
        #: Per request, the store keys :meth:`_chain` worked out and for how many blocks: the
        #: match and the save plan of one prompt ask for the same keys (a SHA-256 per block).
        self._chains: dict[str, tuple[int, list[str]]] = {}

    def _chain(self, request: Request, prompt: np.ndarray, num_blocks: int) -> list[str] | None:
        """The store keys of the prompt's first ``num_blocks`` blocks under the request's cache
        identity (LoRA adapter, ``cache_salt``, multimodal inputs), or ``None`` when the
        identity cannot be known (a LoRA adapter whose files cannot be read, or prompt
        embeddings): such a prompt is neither matched nor stored. Worked out once per request
        and number of blocks."""
        known = self._chains.get(request.request_id)
        if known is not None and known[0] == num_blocks:
            return known[1]
        if getattr(request, "prompt_embeds", None) is not None:
            # The model reads these positions' embeddings, not their token ids (placeholders,
            # alike for any embedding): keyed on the ids, two prompts with other embeddings
            # would share KV. vLLM's own cache hashes the embeddings; the store does not.
            self.events.emit(
                "miss",
                request=request.request_id,
                path=None,
                reason="prompt embeddings are not part of a store key",
            )
            return None
        try:
            identity = identity_of(request)
        except OSError as error:
            self.events.emit(
                "miss",
                logging.WARNING,
                request=request.request_id,
                path=None,
                reason=f"cache identity unknown: {error}",
            )
            return None
        tokens = prompt[: num_blocks * self.block_size]
        chain = store_key_chain(tokens, self.block_size, identity)
        self._chains[request.request_id] = (num_blocks, chain)
        return chain

    def _usable_chunks(
        self, request_id: str, prompt: np.ndarray, chain: list[str]
    ) -> list[tuple[ChunkRef, fmt.SequenceRecord]]:
        """The stored chunks of ``prompt`` that pass their checks, from its first block on.

        The first chunk that fails is a logged miss and is quarantined; the match ends there.
        """
        match = self.store.longest_prefix(chain)
        usable: list[tuple[ChunkRef, fmt.SequenceRecord]] = []
        for chunk in match.chunks if match is not None else ():
            record = self.checker.check(chunk, prompt, chain, before_hit=True)
            if isinstance(record, str):
                self.events.emit(
                    "miss", logging.WARNING, request=request_id, path=chunk.path, reason=record
                )
                self._quarantine(request_id, chunk.path, record)
                break
            usable.append((chunk, record))
        return usable

    def _quarantine(self, request_id: str, path: str, reason: str) -> None:
        """Move the chunk at ``path`` aside so it is never matched again, and log it."""
        self._quarantined(request=request_id, path=path, reason=reason)
        self.checker.forget(path)

    def _stored_and_sound(
        self, request_id: str, prompt: np.ndarray, chain: list[str], span: tuple[int, int]
    ) -> bool:
        """Whether the store holds the chunk ``span`` of ``prompt`` and it passes its checks.

        A chunk that fails is quarantined (so it is saved anew): a prompt whose stored prefix
        failed early never matched its later chunks, and they must not outlive the damage.
        Each version of a file is checked once (the checker remembers it).
        """
        start, end = span
        path = self.store.chunk_path(chain[end - 1])
        if not self.store.has_chunk(path):
            return False
        chunk = ChunkRef(str(path), start, end - start)
        record = self.checker.check(chunk, prompt, chain)
        if isinstance(record, str):
            self._quarantine(request_id, str(path), record)
            return False
        return True

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` this connector can load for ``request``.

        Only whole blocks, and never the prompt's last token (vLLM must compute at least one).
        Apart from quarantining chunks that fail their checks and recording the use of the
        matched ones, it only remembers the answer for :meth:`update_state_after_alloc`.
        """
        self._matches.pop(request.request_id, None)
        if not self.options.persist or not self._store_allowed():
            return 0, False
        prompt = np.asarray(request.prompt_token_ids or [], dtype=np.int64)
        loadable_blocks = max(len(prompt) - 1, 0) // self.block_size
        if loadable_blocks * self.block_size <= num_computed_tokens:
            return 0, False
        chain = self._chain(request, prompt, loadable_blocks)
        if chain is None:
            return 0, False
        if self._remote_pending(request.request_id, prompt, chain, num_computed_tokens):
            return None, False  # vLLM asks again on a later step
        usable = self._touched(self._usable_chunks(request.request_id, prompt, chain))
        matched = sum(chunk.num_blocks for chunk, _ in usable) * self.block_size
        if matched <= num_computed_tokens:
            return 0, False
        self._matches[request.request_id] = (num_computed_tokens, usable)
        remote = {}
        if self.remote is not None:
            fetched = self.remote.fetched_paths(request.request_id)
            blocks = sum(chunk.num_blocks for chunk, _ in usable if chunk.path in fetched)
            remote["remote_tokens"] = blocks * self.block_size
        self.events.emit(
            "hit",
            request=request.request_id,
            paths=[chunk.path for chunk, _ in usable],
            tokens=matched - num_computed_tokens,
            local_tokens=num_computed_tokens,
            **remote,
        )
        return matched - num_computed_tokens, False

    def _remote_pending(
        self, request_id: str, prompt: np.ndarray, chain: list[str], num_computed_tokens: int
    ) -> bool:
        """Whether the request waits for its remote lookup (vLLM is answered "not yet").

        A request whose stored prefix is shorter than its loadable blocks starts one lookup
        (:class:`~kvsnap.engines.vllm.remote_fetch.RemoteFetcher`) of the chunks from the first
        one the local store lacks, beyond vLLM's own hit; it waits until they are fetched into
        the local store, one of them is a miss, or its deadline passes. Nothing here waits."""
        remote = self.remote
        if remote is None:
            return False
        if remote.consulted(request_id):
            return remote.pending(request_id)
        local = self.store.longest_prefix(chain)
        local_blocks = 0 if local is None else local.num_blocks
        if local_blocks >= len(chain):
            return False
        spans = [
            (start, end)
            for start, end in self.store.chunk_spans(len(chain))
            if end > local_blocks and end * self.block_size > num_computed_tokens
        ]
        return remote.start(request_id, prompt, chain, spans, self.block_size) and remote.pending(
            request_id
        )

    def _store_allowed(self) -> bool:
        """Whether the store may be used: it still passes the start-up check of its mode and
        owner (:class:`~kvsnap.engines.vllm.store_guard.StoreGuard`)."""
        return self.guard is None or self.guard.allows()

    def _touched(
        self, usable: list[tuple[ChunkRef, fmt.SequenceRecord]]
    ) -> list[tuple[ChunkRef, fmt.SequenceRecord]]:
        """``usable`` up to the first chunk that could not be touched (gone: evicted or set
        aside by a pruner), recording the use of the others so pruning keeps them."""
        for position, (chunk, _) in enumerate(usable):
            if not self.store.touch(chunk.path):
                return usable[:position]
            self.checker.touched(chunk.path)
            if self.checker.hand_over:
                CHECKED_CHUNKS.touched(chunk.path)
        return usable

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Remember the request; plan the load of its matched blocks into the allocated ones."""
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request))
        found = self._matches.pop(request.request_id, None)
        if num_external_tokens <= 0 or found is None:
            return
        local_tokens, usable = found
        first = local_tokens // self.block_size
        end = first + num_external_tokens // self.block_size
        block_ids = blocks.get_block_ids()[0]
        loads = []
        for chunk, record in usable:
            low = max(first, chunk.first_block)
            high = min(end, chunk.first_block + chunk.num_blocks)
            if low >= high:
                continue
            inside = slice(low - chunk.first_block, high - chunk.first_block)
            loads.append(
                ChunkLoad(
                    path=chunk.path,
                    snapshot_blocks=np.asarray(record.block_ids[inside], dtype=np.int64),
                    target_blocks=np.asarray(block_ids[low:high], dtype=np.int64),
                    checked=record,
                )
            )
        spec = LoadSpec(request.request_id, tuple(loads), (end - first) * self.block_size)
        tracked.load = (
            tuple(load.path for load in loads),
            frozenset(int(block) for block in spec.target_blocks),
        )
        tracked.load_pending = True
        self._pending_loads.append(spec)

    def _selected_for_dump(self, request: Request) -> bool:
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        if extra.get("kvsnap_dump"):
            return True
        wanted = self.options.dump_requests
        if wanted is None:
            return True
        return request.request_id in wanted or external_request_id(request.request_id) in wanted

    def _block_ids(self, request_id: str) -> list[int]:
        return list(self._block_ids_of(request_id))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVSnapConnectorMetadata:
        """This step's loads (planned at allocation) and the saves and dumps it completes."""
        meta = KVSnapConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
        meta.preempted = [request_id for request_id in preempted if request_id in self._saving]
        progress: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            progress[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            progress[request_id] = cached.num_computed_tokens[index]
        for request_id, computed_before in progress.items():
            tracked = self._tracked.get(request_id)
            # A request whose load's outcome is unknown saves nothing yet (_Tracked.load_pending).
            if tracked is None or tracked.load_pending:
                continue
            computed = computed_before + scheduler_output.num_scheduled_tokens.get(request_id, 0)
            if self.options.persist and not tracked.persisted:
                self._plan_persist(tracked, computed, meta)
            if self.options.dump and not tracked.dumped:
                self._plan_dump(tracked, computed, meta)
        self._saving.update(spec.request_id for spec in meta.saves)
        return meta

    def _plan_persist(
        self, tracked: _Tracked, computed: int, meta: KVSnapConnectorMetadata
    ) -> None:
        """Once the prompt is computed: save each of its chunks the store does not hold
        (none into a read-only store)."""
        request = tracked.request
        prompt = np.asarray(request.prompt_token_ids or [], dtype=np.int64)
        # The blocks a later prompt can load: never the one holding the last prompt token.
        num_blocks = max(len(prompt) - 1, 0) // self.block_size
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        unwanted = (
            extra.get("kvsnap_persist") is False
            or self.store.read_only
            or not self._store_allowed()
        )
        if num_blocks < self.options.min_blocks or unwanted:
            tracked.persisted = True
            return
        if computed < num_blocks * self.block_size:
            return
        tracked.persisted = True
        chain = self._chain(request, prompt, num_blocks)
        if chain is None:
            return
        engine_blocks = np.asarray(self._block_ids(request.request_id)[:num_blocks], np.int64)
        now = time.monotonic()
        self._forget_old_plans(now)
        for start, end in self.store.chunk_spans(num_blocks):
            path = self.store.chunk_path(chain[end - 1])
            planned = self._planned.get(str(path))
            if planned is not None and now - planned < _REPLAN_AFTER_S:
                continue
            if str(path) in tracked.loaded:
                continue  # this request loaded it from the store a step ago
            if self._stored_and_sound(request.request_id, prompt, chain, (start, end)):
                continue
            self._planned[str(path)] = now
            meta.saves.append(
                SaveSpec(
                    request_id=request.request_id,
                    kind="persist",
                    path=str(path),
                    token_ids=prompt[start * self.block_size : end * self.block_size],
                    block_ids=engine_blocks[start:end],
                    sequence_id=chunk_sequence_id(
                        start, chain[start - 1] if start else None, chain[end - 1]
                    ),
                )
            )

    def _forget_old_plans(self, now: float) -> None:
        """Drop planned saves older than the replan delay once they pile up."""
        if len(self._planned) > 4096:
            self._planned = {
                path: when for path, when in self._planned.items() if now - when < _REPLAN_AFTER_S
            }

    def _plan_dump(self, tracked: _Tracked, computed: int, meta: KVSnapConnectorMetadata) -> None:
        request = tracked.request
        if not self._selected_for_dump(request):
            tracked.dumped = True
            return
        target = len(request.prompt_token_ids or []) + self.options.dump_decode_step
        tokens = list(request.all_token_ids)
        if computed < target or len(tokens) < target:
            return
        tracked.dumped = True
        num_blocks = -(-target // self.block_size)
        name = safe_name(external_request_id(request.request_id))
        meta.saves.append(
            SaveSpec(
                request_id=request.request_id,
                kind="dump",
                path=str(Path(self.options.dump_path or self.options.path) / f"{name}.safetensors"),
                token_ids=np.asarray(tokens[:target], dtype=np.int64),
                block_ids=np.asarray(
                    self._block_ids(request.request_id)[:num_blocks], dtype=np.int64
                ),
                sequence_id=external_request_id(request.request_id),
            )
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Learn how this step's loads went, and which held blocks the workers released.

        The workers name the requests whose loads ran (:class:`KVSnapWorkerMetadata`); the
        blocks that failed are in ``invalid_block_ids`` (vLLM recomputes them). A request
        whose load worked may now be saved; one whose load failed has its chunks checked
        again when next matched (the worker quarantined a chunk whose file was at fault) and
        is persisted (the chunks the store no longer holds) and dumped again once recomputed.
        """
        for request_id in connector_output.finished_sending or ():
            self._held.discard(request_id)
        report = connector_output.kv_connector_worker_meta
        loaded = report.loaded if isinstance(report, KVSnapWorkerMetadata) else frozenset()
        invalid = connector_output.invalid_block_ids or set()
        for request_id, tracked in self._tracked.items():
            if tracked.load is None:
                continue
            failed = bool(tracked.load[1] & invalid)
            if failed:
                for path in tracked.load[0]:
                    self.checker.forget(path)
                tracked.persisted = tracked.dumped = False
            if failed or request_id in loaded:
                if not failed:
                    tracked.loaded = frozenset(tracked.load[0])
                tracked.load = None
                tracked.load_pending = False

    def shutdown(self) -> None:
        """Stop the remote lookups' threads (fetches not yet begun are dropped)."""
        if self.remote is not None:
            self.remote.shutdown()

    def has_pending_block_frees(self) -> bool:
        """Whether finished requests' blocks are held for their saves (vLLM's contract: such
        blocks will be released, so the scheduler waits for them rather than preempting)."""
        return bool(self._held)

    def request_finished(self, request: Request) -> bool:
        """Forget the request; whether vLLM must hold its blocks until the workers report its
        saves' copies done (``get_finished``): true for every request a save was planned for."""
        self._tracked.pop(request.request_id, None)
        self._matches.pop(request.request_id, None)
        self._chains.pop(request.request_id, None)
        if self.remote is not None:
            self.remote.forget(request.request_id)
        if request.request_id in self._saving:
            self._saving.discard(request.request_id)
            self._held.add(request.request_id)
            return True
        return False
