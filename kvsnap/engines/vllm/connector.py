"""The vLLM v1 KV connector: :class:`KVSnapConnector`, its options, metadata and event log.

The scheduler side matches prompts against the :class:`~kvsnap.engines.vllm.store.PrefixStore`
and plans, per step, the blocks each worker loads before the forward pass and saves or dumps
after it (:class:`KVSnapConnectorMetadata` of :class:`LoadSpec` and :class:`SaveSpec`). The
worker side builds the cache layout with :func:`~kvsnap.engines.vllm.layout.vllm_layout`,
loads snapshot pages into the cache, and copies saved blocks to host memory for a background
snapshot write. :class:`ConnectorOptions` checks ``kv_connector_extra_config``;
:class:`EventLog` records hits, misses, loads, saves and dumps as JSON lines
(:func:`read_events` and :func:`count_events` read them back).

Tensor parallelism: each rank copies the saved blocks of its own heads to host memory and the
TP group's CPU (gloo) group gathers them on rank 0, which builds one layout per rank over the
gathered copies and lets :func:`kvsnap.snapshot.capture` take from each rank the canonical
fragments it is elected for. Loads need no collective: every rank reads its own heads out of
the same canonical pages.

This module imports without vLLM (the options, specs and event helpers work anywhere);
constructing :class:`KVSnapConnector` needs it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvsnap import format as fmt
from kvsnap.engines.vllm.layout import (
    BACKEND_KV_PACKING,
    KV_PLANES,
    BlockOrder,
    probe_block_order,
    vllm_layout,
)
from kvsnap.engines.vllm.store import PrefixStore, StoreMatch, _safe_name, store_namespace
from kvsnap.errors import IncompatibleSnapshotError, KVSnapError
from kvsnap.layout import CacheLayout, KVGeometry, LayoutError, check_tiling, dtype_name
from kvsnap.pinned import PinnedPool
from kvsnap.plan import Direction, HostPages, PageCopy
from kvsnap.snapshot import SequenceBlocks, capture
from kvsnap.store import SnapshotReader
from kvsnap.transfer import TransferHandler

try:  # Only constructing the connector needs vLLM; importing this module does not.
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    VLLM_IMPORT_ERROR: str | None = None
except ImportError as _error:  # pragma: no cover - exercised only where vLLM is missing
    VLLM_IMPORT_ERROR = f"{type(_error).__name__}: {_error}"

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in so this module imports without vLLM; the connector refuses to start."""

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        """Stand-in so this module imports without vLLM; constructing it raises."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ImportError(f"KVSnapConnector needs vLLM ({VLLM_IMPORT_ERROR})")

    KVConnectorRole = None  # type: ignore[assignment,misc]

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# The package's name, not this submodule's: the events have always gone to this logger.
logger = logging.getLogger("kvsnap.engines.vllm")

# --------------------------------------------------------------------------------------------
# Configuration


MODES = ("persist", "dump", "persist+dump")


@dataclass(frozen=True)
class ConnectorOptions:
    """``kv_connector_extra_config`` of :class:`KVSnapConnector`, checked.

    * ``path`` (required): the prefix store directory (``persist``) or dump directory (``dump``).
    * ``mode``: ``persist`` (default), ``dump`` or ``persist+dump``.
    * ``dump_requests``: ``"all"`` (default) or a list of request ids (the id given to vLLM;
      vLLM's internal id with its random suffix is accepted too). A request whose
      ``SamplingParams.extra_args`` holds ``{"kvsnap_dump": true}`` is dumped as well.
    * ``dump_decode_step``: 0 (default) dumps at the end of prefill; ``k`` once the cache holds
      the prompt and ``k`` generated tokens.
    * ``dump_path``: where dumps go (default: ``path``, or ``path/dumps`` in ``persist+dump``).
    * ``min_blocks``: prompts with fewer full blocks are not persisted (default 1). A request
      whose ``SamplingParams.extra_args`` holds ``{"kvsnap_persist": false}`` is not persisted.
    * ``event_log``: a JSON-lines file every process appends its hits, misses, loads, load
      failures, saves and dumps to (default: none; vLLM's log gets them either way).
    * ``max_pending_writes``: snapshot writes queued behind the engine before a save waits
      (default 4); bounds the host memory that saved blocks hold.
    """

    path: str
    mode: str = "persist"
    dump_requests: tuple[str, ...] | None = None  # None: all requests
    dump_decode_step: int = 0
    dump_path: str | None = None
    min_blocks: int = 1
    event_log: str | None = None
    max_pending_writes: int = 4

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ConnectorOptions:
        """Parse and check ``kv_connector_extra_config``; raise ``ValueError`` naming the key."""
        known = {
            "path",
            "mode",
            "dump_requests",
            "dump_decode_step",
            "dump_path",
            "min_blocks",
            "event_log",
            "max_pending_writes",
        }
        unknown = set(extra) - known
        if unknown:
            raise ValueError(
                f"KVSnapConnector: unknown option(s) {sorted(unknown)}; known: {sorted(known)}"
            )
        if not extra.get("path"):
            raise ValueError("KVSnapConnector needs kv_connector_extra_config['path']")
        mode = str(extra.get("mode", "persist"))
        if mode not in MODES:
            raise ValueError(f"KVSnapConnector: mode must be one of {MODES}, got {mode!r}")
        requests = extra.get("dump_requests", "all")
        if requests == "all":
            selected = None
        elif isinstance(requests, list | tuple) and all(isinstance(r, str) for r in requests):
            selected = tuple(requests)
        else:
            raise ValueError(
                f"KVSnapConnector: dump_requests must be 'all' or a list of ids, got {requests!r}"
            )
        step = int(extra.get("dump_decode_step", 0))
        min_blocks = int(extra.get("min_blocks", 1))
        pending = int(extra.get("max_pending_writes", 4))
        if step < 0 or min_blocks < 1 or pending < 1:
            raise ValueError(
                "KVSnapConnector: dump_decode_step must be >= 0, min_blocks and "
                f"max_pending_writes >= 1 (got {step}, {min_blocks}, {pending})"
            )
        dump_path = extra.get("dump_path")
        if dump_path is None:
            dump_path = (
                str(Path(extra["path"]) / "dumps") if mode == "persist+dump" else extra["path"]
            )
        return cls(
            path=str(extra["path"]),
            mode=mode,
            dump_requests=selected,
            dump_decode_step=step,
            dump_path=str(dump_path),
            min_blocks=min_blocks,
            event_log=extra.get("event_log"),
            max_pending_writes=pending,
        )

    @property
    def persist(self) -> bool:
        return self.mode in ("persist", "persist+dump")

    @property
    def dump(self) -> bool:
        return self.mode in ("dump", "persist+dump")


_INTERNAL_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def external_request_id(request_id: str) -> str:
    """The id a client gave vLLM: vLLM appends ``-`` and 8 hex digits to make its internal id."""
    return _INTERNAL_SUFFIX.sub("", request_id)


class EventLog:
    """Appends one JSON object per line to a file shared by the scheduler and every worker.

    Each event is one ``write`` on a file opened with ``O_APPEND``, so lines from several
    processes never interleave. Events also go to the ``kvsnap.engines.vllm`` logger.
    """

    def __init__(self, path: str | None, role: str, rank: int) -> None:
        self.path = path
        self.role = role
        self.rank = rank
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: str, level: int = logging.INFO, **fields: Any) -> None:
        """Record ``event`` with ``fields`` (JSON-serializable values)."""
        record = {
            "time": time.time(),
            "event": event,
            "role": self.role,
            "rank": self.rank,
            **fields,
        }
        logger.log(level, "kvsnap %s %s", event, json.dumps(fields, default=str))
        if not self.path:
            return
        line = (json.dumps(record, default=str) + "\n").encode()
        descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(descriptor, line)
        finally:
            os.close(descriptor)


# --------------------------------------------------------------------------------------------
# Scheduler → worker metadata


@dataclass(frozen=True)
class LoadSpec:
    """Load snapshot blocks ``snapshot_blocks`` of ``path`` into engine blocks ``target_blocks``."""

    request_id: str
    path: str
    sequence_id: str
    snapshot_blocks: np.ndarray
    target_blocks: np.ndarray
    num_tokens: int


@dataclass(frozen=True)
class SaveSpec:
    """Capture engine blocks ``block_ids`` holding ``token_ids`` into a snapshot at ``path``.

    ``kind`` is ``persist`` (a prefix for the store; ``chain`` its prefix hashes, indexed once
    the file is published) or ``dump``. ``replace`` overwrites a stored snapshot that failed
    to load (otherwise an existing one is kept).
    """

    request_id: str
    kind: str
    path: str
    token_ids: np.ndarray
    block_ids: np.ndarray
    chain: tuple[str, ...] = ()
    replace: bool = False


@dataclass
class KVSnapConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells every worker for one step: loads before it, saves after it."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Helpers that read vLLM objects


def _model_fingerprint(vllm_config: VllmConfig) -> str:
    return fmt.model_fingerprint(vllm_config.model_config.hf_config.to_dict())


def _kv_dtype(vllm_config: VllmConfig) -> str:
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto":
        raise LayoutError(
            f"KVSnapConnector supports unquantized KV caches only (cache_dtype 'auto'), "
            f"got {cache_dtype!r}"
        )
    return dtype_name(vllm_config.model_config.dtype)


def _source_info(vllm_config: VllmConfig, fingerprint: str) -> fmt.SourceInfo:
    import vllm

    model = vllm_config.model_config
    return fmt.SourceInfo(
        engine="vllm",
        engine_version=str(vllm.__version__),
        model_id=str(model.model),
        model_revision=model.revision,
        model_fingerprint=fingerprint,
    )


def _expected_geometry(vllm_config: VllmConfig) -> dict[str, Any]:
    """The KV geometry fields the scheduler can know from the config alone."""
    model = vllm_config.model_config
    return {
        "num_layers": model.get_total_num_hidden_layers(),
        "num_kv_heads": model.get_total_num_kv_heads(),
        "head_dim": model.get_head_size(),
        "block_size": vllm_config.cache_config.block_size,
        "dtype": _kv_dtype(vllm_config),
    }


def _layer_index(name: str) -> int:
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    if not numbers:
        raise LayoutError(f"cannot tell the layer index of KV cache {name!r}")
    return int(numbers[0])


# --------------------------------------------------------------------------------------------
# The connector


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


class KVSnapConnector(KVConnectorBase_V1):
    """A vLLM v1 KV connector that persists prompt prefixes to a kvsnap store and dumps KV.

    Scheduler side: :meth:`get_num_new_matched_tokens` finds the longest stored prefix of a
    prompt and checks its snapshot's header (model fingerprint, geometry, token ids);
    :meth:`build_connector_meta` tells the workers which blocks to load before the step and
    which to save or dump after it. Worker side: :meth:`register_kv_caches` builds the
    :class:`CacheLayout` (or refuses the cache); :meth:`start_load_kv` loads, verifying every
    block checksum, and reports blocks it could not load through
    :meth:`get_block_ids_with_load_errors`; :meth:`wait_for_save` copies the saved blocks to
    host memory (gathering TP ranks on rank 0) and hands the snapshot write to a background
    thread, so the forward pass waits only for that copy.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("KVSnapConnector does not support pipeline parallelism")
        self.options = ConnectorOptions.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config or {}
        )
        self.block_size = vllm_config.cache_config.block_size
        self.fingerprint = _model_fingerprint(vllm_config)
        self.kv_dtype = _kv_dtype(vllm_config)
        self.store = PrefixStore(
            self.options.path, store_namespace(self.fingerprint, self.kv_dtype, self.block_size)
        )
        self.is_scheduler = role == KVConnectorRole.SCHEDULER
        rank = 0 if self.is_scheduler else _tp_rank()
        self.events = EventLog(
            self.options.event_log, "scheduler" if self.is_scheduler else "worker", rank
        )
        # Scheduler state.
        self._matches: dict[str, tuple[int, StoreMatch, fmt.SequenceRecord]] = {}
        self._pending_loads: list[LoadSpec] = []
        self._tracked: dict[str, _Tracked] = {}
        self._header_cache: dict[str, tuple[tuple[int, int], fmt.SnapshotMetadata | str]] = {}
        self._failed_paths: dict[str, tuple[int, int] | None] = {}
        # Worker state.
        self.layout: CacheLayout | None = None
        self._caches: list[torch.Tensor] = []
        self._backend = ""
        self._block_order: BlockOrder | None = None
        self._load_errors: set[int] = set()
        self._loader: TransferHandler | None = None
        self._staging: PinnedPool | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._writes: list[tuple[SaveSpec, Future[None]]] = []
        self._next_job = 0
        if self.is_scheduler:
            self.expected_geometry = _expected_geometry(vllm_config)
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                self.events.emit(
                    "config",
                    logging.WARNING,
                    message="kv_load_failure_policy is not 'recompute': a snapshot block that "
                    "fails its checksum while loading fails the request instead of being "
                    "recomputed",
                )

    # -- scheduler side ----------------------------------------------------------------------

    def _full_chain(self, token_ids: Sequence[int], num_blocks: int) -> list[str]:
        tokens = np.asarray(token_ids[: num_blocks * self.block_size], dtype=np.int64)
        return fmt.prefix_hash_chain(tokens, self.block_size)

    @staticmethod
    def _file_key(path: str) -> tuple[int, int] | None:
        try:
            status = os.stat(path)
        except OSError:
            return None
        return status.st_mtime_ns, status.st_size

    def _snapshot_header(self, path: str) -> fmt.SnapshotMetadata | str:
        """The metadata of the snapshot at ``path``, or why it cannot be used (cached by mtime)."""
        key = self._file_key(path)
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
        assert self._kv_cache_manager is not None, "vLLM did not bind its KV cache manager"
        return list(self._kv_cache_manager.get_block_ids(request_id)[0])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
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
        name = _safe_name(external_request_id(request.request_id))
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
            self._failed_paths[path] = self._file_key(path)
            tracked.load, tracked.load_failed = None, True
            tracked.persisted = tracked.dumped = False

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; saves copy their blocks during the step, so blocks free now."""
        self._tracked.pop(request.request_id, None)
        self._matches.pop(request.request_id, None)
        return False, None

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build the cache layout from the registered tensors, or refuse them (LayoutError)."""
        config = self._vllm_config
        context = config.compilation_config.static_forward_context
        names = sorted(kv_caches, key=_layer_index)
        backends, heads, head_sizes, attention_types = set(), set(), set(), []
        for name in names:
            layer = context.get(name)
            if layer is None or not hasattr(layer, "attn_backend"):
                raise LayoutError(f"KV cache {name!r} does not belong to an attention layer")
            backends.add(layer.attn_backend.get_name())
            heads.add(layer.num_kv_heads)
            head_sizes.add(layer.head_size)
            attention_types.append("sliding" if getattr(layer, "sliding_window", None) else "full")
        if len(backends) != 1 or len(head_sizes) != 1:
            raise LayoutError(
                f"KVSnapConnector needs one attention backend and head size for all layers, got "
                f"backends {sorted(backends)}, head sizes {sorted(head_sizes)}"
            )
        tensors = [kv_caches[name] for name in names]
        if len({tensor.data_ptr() for tensor in tensors}) != len(tensors):
            raise LayoutError(
                "layers share KV cache tensors (KV sharing); kvsnap does not support it"
            )
        layout_name = config.cache_config.kv_cache_layout
        if layout_name is None:
            raise LayoutError("vLLM has not resolved its KV cache layout")
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        self._backend = backends.pop()
        head_size = head_sizes.pop()
        self._block_order = None
        if BACKEND_KV_PACKING.get(self._backend) == KV_PLANES:
            self._block_order = _probe_layer(context, names, tensors[0], head_size)
        self.layout = vllm_layout(
            tensors,
            backend=self._backend,
            kv_cache_layout=str(layout_name),
            head_size=head_size,
            num_kv_heads=config.model_config.get_total_num_kv_heads(),
            tp_rank=group.rank_in_group,
            tp_size=group.world_size,
            attention_types=attention_types,
            block_order=self._block_order,
        )
        self._caches = tensors
        self._layout_name = str(layout_name)
        if tensors[0].device.type == "cpu":
            _request_amx_permission()
        self._loader = TransferHandler(self.layout, Direction.HOST_TO_DEVICE)
        page_bytes = self.layout.geometry.canonical_page_size_bytes
        self._staging = PinnedPool(max(page_bytes, _STAGING_BYTES), 1)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsnap-writer")
        self.events.emit(
            "registered",
            layout=self.layout.describe(),
            encoding=self.layout.encoding,
            kv_cache_layout=self._layout_name,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Load this step's planned blocks before the forward pass (checksums verified)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVSnapConnectorMetadata)
        for spec in meta.loads:
            started = time.perf_counter()
            try:
                self._load(spec)
            except Exception as error:  # any failure: report the blocks, vLLM recomputes them
                self._load_errors.update(int(block) for block in spec.target_blocks)
                self.events.emit(
                    "load_failed",
                    logging.ERROR,
                    request=spec.request_id,
                    path=spec.path,
                    blocks=len(spec.target_blocks),
                    error=f"{type(error).__name__}: {error}",
                )
            else:
                self.events.emit(
                    "load",
                    request=spec.request_id,
                    path=spec.path,
                    tokens=spec.num_tokens,
                    blocks=len(spec.target_blocks),
                    seconds=round(time.perf_counter() - started, 6),
                )

    def _load(self, spec: LoadSpec) -> None:
        layout, loader, staging = self.layout, self._loader, self._staging
        assert layout is not None and loader is not None and staging is not None
        geometry = layout.geometry
        with SnapshotReader(spec.path, verify=True) as reader:
            metadata = reader.metadata
            _check_fits(metadata, geometry, self.fingerprint, spec.path)
            page_bytes = geometry.canonical_page_size_bytes
            per_chunk = staging.slot_bytes // page_bytes
            slot = staging.acquire()
            try:
                for name in geometry.tensor_names():
                    for start in range(0, len(spec.snapshot_blocks), per_chunk):
                        source = spec.snapshot_blocks[start : start + per_chunk]
                        count = len(source)
                        reader.read_pages(name, source, slot.as_numpy(count * page_bytes))
                        copy = PageCopy(
                            name=name,
                            device_block_ids=spec.target_blocks[start : start + per_chunk],
                            host=HostPages.contiguous(slot.data_ptr, count, page_bytes),
                            host_chunk_ids=np.arange(count, dtype=np.int64),
                        )
                        job = self._next_job
                        self._next_job += 1
                        if not loader.submit(job, [copy]):
                            raise KVSnapError(f"the transfer handler refused loading {name}")
                        for result in loader.wait([job]):
                            if not result.success:
                                raise KVSnapError(f"copying {name} failed: {result.error}")
            finally:
                staging.release(slot)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in :meth:`start_load_kv`; nothing to wait for per layer."""
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Saves happen in :meth:`wait_for_save`, once every layer of the step is written."""
        return

    def wait_for_save(self) -> None:
        """Copy this step's saved blocks to host memory and queue their snapshot writes.

        The forward pass waits for the copy (and, at TP > 1, the gather on rank 0) only; the
        checksumming and writing run on a background thread, at most
        ``max_pending_writes`` snapshots behind.
        """
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVSnapConnectorMetadata)
        self._reap_writes(block=False)
        if not meta.saves:
            return
        layout = self.layout
        assert layout is not None and self._writer is not None
        all_blocks = np.concatenate([spec.block_ids for spec in meta.saves])
        index = torch.from_numpy(all_blocks).to(self._caches[0].device)
        # One host copy per layer, [n, H, N, C], contiguous: the bytes the snapshot is made of.
        copies = torch.stack([cache.index_select(0, index) for cache in self._caches]).cpu()
        per_rank = _gather_on_first_rank(copies, layout.tp_size)
        if per_rank is None:  # not the writing rank
            return
        offset = 0
        for spec in meta.saves:
            count = len(spec.block_ids)
            parts = [rank_copy[:, offset : offset + count] for rank_copy in per_rank]
            offset += count
            while len(self._writes) >= self.options.max_pending_writes:
                self._reap_writes(block=True)
            self._writes.append((spec, self._writer.submit(self._write, spec, parts)))

    def _host_layouts(self, parts: Sequence[torch.Tensor]) -> list[CacheLayout]:
        """One layout per TP rank over the host copies of that rank's blocks."""
        layout = self.layout
        assert layout is not None
        geometry = layout.geometry
        layouts = [
            vllm_layout(
                list(rank_part),
                backend=self._backend,
                kv_cache_layout="LBHNC",  # index_select returns contiguous [n, H, N, C] copies
                head_size=geometry.head_dim,
                num_kv_heads=geometry.num_kv_heads,
                tp_rank=rank,
                tp_size=layout.tp_size,
                attention_types=geometry.attention_types,
                block_order=self._block_order,  # the copies keep each block's bytes as they were
            )
            for rank, rank_part in enumerate(parts)
        ]
        check_tiling(layouts)
        return layouts

    def _write(self, spec: SaveSpec, parts: Sequence[torch.Tensor]) -> None:
        started = time.perf_counter()
        path = Path(spec.path)
        if spec.kind == "persist" and path.exists() and not spec.replace:
            self.store.publish_index(spec.chain, path)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        sequence = SequenceBlocks(
            id=external_request_id(spec.request_id),
            token_ids=spec.token_ids,
            block_ids=np.arange(len(spec.block_ids), dtype=np.int64),
        )
        result = capture(
            self._host_layouts(parts),
            [sequence],
            path,
            source=_source_info(self._vllm_config, self.fingerprint),
        )
        if spec.kind == "persist":
            self.store.publish_index(spec.chain, path)
        self.events.emit(
            "save" if spec.kind == "persist" else "dump",
            request=spec.request_id,
            path=str(path),
            tokens=len(spec.token_ids),
            blocks=result.num_blocks,
            bytes=result.num_bytes,
            seconds=round(time.perf_counter() - started, 6),
        )

    def _reap_writes(self, block: bool) -> None:
        """Collect finished writes (all of the oldest one when ``block``); log failures."""
        remaining = []
        for position, (spec, future) in enumerate(self._writes):
            if block and position == 0:
                future.exception()
            if not future.done():
                remaining.append((spec, future))
                continue
            error = future.exception()
            if error is not None:
                self.events.emit(
                    "save_failed",
                    logging.ERROR,
                    request=spec.request_id,
                    path=spec.path,
                    error=f"{type(error).__name__}: {error}",
                )
        self._writes = remaining

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call; vLLM recomputes them."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Finish every queued snapshot write, then release the handler and staging memory."""
        while self._writes:
            self._reap_writes(block=True)
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
        if self._loader is not None:
            self._loader.shutdown()
            self._loader = None
        if self._staging is not None:
            self._staging.close()
            self._staging = None


#: Host staging for loads: snapshot pages are read into it, then scattered into the cache.
_STAGING_BYTES = 16 << 20


def _check_fits(
    metadata: fmt.SnapshotMetadata, geometry: KVGeometry, fingerprint: str, path: str
) -> None:
    """Refuse a snapshot whose geometry or model fingerprint differs from the engine's."""
    mine = metadata.geometry
    fields = ("num_layers", "num_kv_heads", "head_dim", "latent_dim", "block_size", "dtype")
    differences = [
        f"{name}: snapshot {getattr(mine, name)!r}, engine {getattr(geometry, name)!r}"
        for name in fields
        if getattr(mine, name) != getattr(geometry, name)
    ]
    if differences:
        raise IncompatibleSnapshotError(
            f"{path} does not fit the engine's cache: {'; '.join(differences)}"
        )
    if metadata.source.model_fingerprint != fingerprint:
        raise IncompatibleSnapshotError(
            f"{path} was captured from model fingerprint {metadata.source.model_fingerprint[:16]}, "
            f"the engine's is {fingerprint[:16]}"
        )


def _probe_layer(
    context: Mapping[str, Any], names: Sequence[str], cache: torch.Tensor, head_size: int
) -> BlockOrder:
    """The block order of the CPU backend's kernel, learned by calling it on a scratch block.

    Every layer must use the same kernel variant (``isa``: ``amx``, ``vec``, ...), since one
    order is learned for all of them.
    """
    layers = [context[name] for name in names]
    variants = {getattr(layer, "isa", None) for layer in layers}
    if len(variants) != 1:
        raise LayoutError(
            f"the CPU attention layers use different kernels: {sorted(map(str, variants))}"
        )
    first = layers[0]
    _, heads, block_size, _ = cache.shape
    slots = torch.arange(block_size, dtype=torch.int64)

    def write(key: torch.Tensor, value: torch.Tensor, block: torch.Tensor) -> None:
        first.impl.do_kv_cache_update(first, key, value, block, slots)

    if cache.device.type == "cpu":
        _request_amx_permission()
    return probe_block_order(
        write, heads=heads, block_size=block_size, head_size=head_size, dtype=cache.dtype
    )


def _request_amx_permission() -> None:
    """Ask Linux for AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``) where the CPU has AMX.

    vLLM's CPU attention kernel runs on AMX tiles, and a process that uses them without this
    permission dies of SIGILL. vLLM 0.32 only obtains it on paths a normal prefill takes first;
    an engine whose first forward pass attends over KV loaded by a connector (a prompt prefix
    restored right after start-up) reaches the kernel without it.
    """
    if torch.cpu._is_amx_tile_supported() and not torch.cpu._init_amx():
        logger.warning("the CPU has AMX, but Linux refused the AMX tile permission")


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return get_tp_group().rank_in_group
    except (ImportError, AssertionError):
        return 0


def _gather_on_first_rank(copies: torch.Tensor, tp_size: int) -> list[torch.Tensor] | None:
    """Every TP rank's ``copies`` on rank 0 (in rank order); ``None`` on the other ranks.

    Runs over the TP group's CPU (gloo) group as raw bytes, so any KV dtype travels unchanged.
    """
    if tp_size == 1:
        return [copies]
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    raw = copies.contiguous().view(torch.uint8)
    gathered = (
        [torch.empty_like(raw) for _ in range(group.world_size)]
        if group.rank_in_group == 0
        else None
    )
    dist.gather(raw, gathered, dst=group.ranks[0], group=group.cpu_group)
    if gathered is None:
        return None
    return [part.view(copies.dtype).view(copies.shape) for part in gathered]


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The events an :class:`EventLog` wrote to ``path``, in order (none if it does not exist)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def count_events(events: Iterable[Mapping[str, Any]], name: str, **fields: Any) -> int:
    """How many ``events`` are called ``name`` and carry every ``fields`` value."""
    return sum(
        1
        for event in events
        if event.get("event") == name and all(event.get(k) == v for k, v in fields.items())
    )
