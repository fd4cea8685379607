"""The connector's scheduler side: match prompts against the store, plan loads and saves.

:class:`KVSnapScheduler` runs in vLLM's scheduler process. It finds the longest stored prefix
of a prompt, checks the snapshot header (model fingerprint, geometry, token ids) and plans,
per step, the blocks every worker loads before the forward pass and saves or dumps after it
(:class:`~kvsnap.engines.vllm.specs.KVSnapConnectorMetadata`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsnap import format as fmt
from kvsnap.engines.vllm.events import EventLog
from kvsnap.engines.vllm.options import ConnectorOptions
from kvsnap.engines.vllm.specs import (
    KVSnapConnectorMetadata,
    LoadSpec,
    SaveSpec,
    external_request_id,
)
from kvsnap.engines.vllm.store import PrefixStore, StoreMatch, safe_name
from kvsnap.errors import KVSnapError
from kvsnap.store import SnapshotReader

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
    #: The load planned for it (snapshot path, target blocks), until it is known to have failed.
    load: tuple[str, frozenset[int]] | None = None
    #: Its load failed: persist it again once recomputed, replacing the snapshot that failed.
    load_failed: bool = False


def _file_key(path: str) -> tuple[int, int] | None:
    """What identifies one version of a file: its mtime and size (``None``: no such file)."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_mtime_ns, status.st_size


class KVSnapScheduler:
    """The scheduler side of :class:`~kvsnap.engines.vllm.KVSnapConnector`.

    :meth:`get_num_new_matched_tokens` finds the longest stored prefix of a prompt and checks
    its snapshot's header; :meth:`update_state_after_alloc` plans its load into the allocated
    blocks; :meth:`build_connector_meta` adds the saves and dumps each step completes;
    :meth:`update_connector_output` learns of failed loads.
    """

    def __init__(
        self,
        options: ConnectorOptions,
        store: PrefixStore,
        events: EventLog,
        *,
        block_size: int,
        fingerprint: str,
        expected_geometry: dict[str, Any],
        block_ids_of: BlockIdsOf,
    ) -> None:
        self.options = options
        self.store = store
        self.events = events
        self.block_size = block_size
        self.fingerprint = fingerprint
        self.expected_geometry = expected_geometry
        self._block_ids_of = block_ids_of
        self._matches: dict[str, tuple[int, StoreMatch, fmt.SequenceRecord]] = {}
        self._pending_loads: list[LoadSpec] = []
        self._tracked: dict[str, _Tracked] = {}
        self._header_cache: dict[str, tuple[tuple[int, int], fmt.SnapshotMetadata | str]] = {}
        self._failed_paths: dict[str, tuple[int, int] | None] = {}

    def _full_chain(self, token_ids: Sequence[int], num_blocks: int) -> list[str]:
        tokens = np.asarray(token_ids[: num_blocks * self.block_size], dtype=np.int64)
        return fmt.prefix_hash_chain(tokens, self.block_size)

    def _snapshot_header(self, path: str) -> fmt.SnapshotMetadata | str:
        """The metadata of the snapshot at ``path``, or why it cannot be used (cached by mtime)."""
        key = _file_key(path)
        if key is None:
            return "snapshot missing"
        if path in self._failed_paths and self._failed_paths[path] == key:
            return "the snapshot failed to load before (it is replaced when next persisted)"
        cached = self._header_cache.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        result: fmt.SnapshotMetadata | str
        try:
            with SnapshotReader(path, verify=False) as reader:
                result = reader.metadata
        except (KVSnapError, OSError, ValueError) as error:
            result = f"unreadable snapshot header: {error}"
        self._header_cache[path] = (key, result)
        return result

    def _usable(
        self, metadata: fmt.SnapshotMetadata, match: StoreMatch, prompt: np.ndarray
    ) -> fmt.SequenceRecord | str:
        """The record holding the matched prefix, or why the snapshot does not fit this engine."""
        if metadata.source.model_fingerprint != self.fingerprint:
            return (
                f"model fingerprint {metadata.source.model_fingerprint[:16]} differs from the "
                f"engine's {self.fingerprint[:16]}"
            )
        geometry = metadata.geometry
        for name, expected in self.expected_geometry.items():
            if getattr(geometry, name) != expected:
                return f"{name} is {getattr(geometry, name)!r} in the snapshot, {expected!r} here"
        length = match.num_blocks * self.block_size
        for record in metadata.sequences:
            if (
                len(record.prefix_hashes) >= match.num_blocks
                and record.prefix_hashes[match.num_blocks - 1] == match.last_hash
                and len(record.token_ids) >= length
            ):
                if not np.array_equal(record.token_ids[:length], prompt[:length]):
                    return "the snapshot's token ids differ from the prompt (hash collision?)"
                return record
        return "no sequence in the snapshot holds the indexed prefix"

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` this connector can load for ``request``.

        Only whole blocks, and never the prompt's last token (vLLM must compute at least one).
        Side-effect free apart from remembering the answer for :meth:`update_state_after_alloc`.
        """
        self._matches.pop(request.request_id, None)
        if not self.options.persist:
            return 0, False
        prompt = np.asarray(request.prompt_token_ids or [], dtype=np.int64)
        loadable_blocks = max(len(prompt) - 1, 0) // self.block_size
        if loadable_blocks * self.block_size <= num_computed_tokens:
            return 0, False
        chain = self._full_chain(prompt, loadable_blocks)
        match = self.store.longest_prefix(chain)
        if match is None:
            return 0, False
        header = self._snapshot_header(match.path)
        record = header if isinstance(header, str) else self._usable(header, match, prompt)
        if isinstance(record, str):
            self.events.emit(
                "miss", logging.WARNING, request=request.request_id, path=match.path, reason=record
            )
            return 0, False
        matched = match.num_blocks * self.block_size
        if matched <= num_computed_tokens:
            return 0, False
        self._matches[request.request_id] = (num_computed_tokens, match, record)
        self.events.emit(
            "hit",
            request=request.request_id,
            path=match.path,
            tokens=matched - num_computed_tokens,
            local_tokens=num_computed_tokens,
        )
        return matched - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Remember the request; plan the load of its matched blocks into the allocated ones."""
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request))
        found = self._matches.pop(request.request_id, None)
        if num_external_tokens <= 0 or found is None:
            return
        local_tokens, match, record = found
        first = local_tokens // self.block_size
        count = num_external_tokens // self.block_size
        block_ids = blocks.get_block_ids()[0]
        tracked.load = (match.path, frozenset(int(b) for b in block_ids[first : first + count]))
        self._pending_loads.append(
            LoadSpec(
                request_id=request.request_id,
                path=match.path,
                sequence_id=record.id,
                snapshot_blocks=np.asarray(record.block_ids[first : first + count], dtype=np.int64),
                target_blocks=np.asarray(block_ids[first : first + count], dtype=np.int64),
                num_tokens=count * self.block_size,
            )
        )

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
        # A request loading in this step saves nothing before the load is known to have
        # worked: a failed load leaves its blocks wrong until vLLM recomputes them.
        loading = {spec.request_id for spec in meta.loads}
        progress: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            progress[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            progress[request_id] = cached.num_computed_tokens[index]
        for request_id, computed_before in progress.items():
            tracked = self._tracked.get(request_id)
            if tracked is None or request_id in loading:
                continue
            computed = computed_before + scheduler_output.num_scheduled_tokens.get(request_id, 0)
            if self.options.persist and not tracked.persisted:
                self._plan_persist(tracked, computed, meta)
            if self.options.dump and not tracked.dumped:
                self._plan_dump(tracked, computed, meta)
        return meta

    def _plan_persist(
        self, tracked: _Tracked, computed: int, meta: KVSnapConnectorMetadata
    ) -> None:
        request = tracked.request
        prompt = request.prompt_token_ids or []
        num_blocks = len(prompt) // self.block_size
        extra = getattr(request.sampling_params, "extra_args", None) or {}
        if num_blocks < self.options.min_blocks or extra.get("kvsnap_persist") is False:
            tracked.persisted = True
            return
        tokens = num_blocks * self.block_size
        if computed < tokens:
            return
        tracked.persisted = True
        chain = self._full_chain(prompt, num_blocks)
        stored = self.store.indexed_snapshot(chain[-1])
        replace = tracked.load_failed or (stored is not None and str(stored) in self._failed_paths)
        if stored is not None and stored.exists() and not replace:
            return
        meta.saves.append(
            SaveSpec(
                request_id=request.request_id,
                kind="persist",
                path=str(self.store.snapshot_path(chain[-1])),
                token_ids=np.asarray(prompt[:tokens], dtype=np.int64),
                block_ids=np.asarray(
                    self._block_ids(request.request_id)[:num_blocks], dtype=np.int64
                ),
                chain=tuple(chain),
                replace=replace,
            )
        )

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
            )
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Learn which loads failed (vLLM recomputes their blocks) and plan their saves anew.

        A request whose loaded blocks come back invalid is persisted again (replacing the
        snapshot that failed) and dumped again once recomputed; the failed snapshot is not
        offered to other requests until its file changes.
        """
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        for tracked in self._tracked.values():
            if tracked.load is None or not tracked.load[1] & invalid:
                continue
            path = tracked.load[0]
            self._failed_paths[path] = _file_key(path)
            tracked.load, tracked.load_failed = None, True
            tracked.persisted = tracked.dumped = False

    def request_finished(self, request: Request) -> None:
        """Forget the request."""
        self._tracked.pop(request.request_id, None)
        self._matches.pop(request.request_id, None)
