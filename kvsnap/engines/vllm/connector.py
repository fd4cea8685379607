"""The vLLM v1 KV connector :class:`KVSnapConnector`: a facade over its two sides.

vLLM creates one connector object per process and role. In the scheduler process every call
goes to a :class:`~kvsnap.engines.vllm.scheduler.KVSnapScheduler`, in each worker process to a
:class:`~kvsnap.engines.vllm.worker.KVSnapWorker`; this class only builds the right one from
``kv_connector_extra_config`` (:class:`~kvsnap.engines.vllm.options.ConnectorOptions`) and
delegates.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from kvsnap.engines.vllm.chunk_check import ChunkChecker
from kvsnap.engines.vllm.compat import (
    DISK_HIT_SOURCE,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from kvsnap.engines.vllm.engine_config import (
    expected_geometry,
    model_fingerprint,
    source_info,
    tp_rank,
)
from kvsnap.engines.vllm.events import EventLog
from kvsnap.engines.vllm.options import ConnectorOptions
from kvsnap.engines.vllm.prefix_store import PrefixStore, check_store_directory, store_namespace
from kvsnap.engines.vllm.registration import refuse_dropping_caches
from kvsnap.engines.vllm.remote_tier import check_remote_options, remote_fetcher
from kvsnap.engines.vllm.scheduler import KVSnapScheduler
from kvsnap.engines.vllm.specs import KVSnapConnectorMetadata, KVSnapWorkerMetadata
from kvsnap.engines.vllm.store_guard import StoreGuard
from kvsnap.engines.vllm.worker import KVSnapWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KVSnapConnector(KVConnectorBase_V1):
    """A vLLM v1 KV connector that persists prompt prefixes to a kvsnap store and dumps KV.

    Scheduler-side calls go to :attr:`connector_scheduler`, worker-side calls to
    :attr:`connector_worker` (the other one is ``None``); docs/vllm.md says what each does.
    """

    #: vLLM's metrics label the tokens this connector loads as disk hits.
    _cache_hit_source = DISK_HIT_SOURCE

    @property
    def requires_kv_delivery(self) -> bool:
        """``False``: a best-effort cache. A save vLLM's preemption cuts short is a later miss,
        so vLLM need not drop and resample a preempted request's in-flight output."""
        return False

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("KVSnapConnector does not support pipeline parallelism")
        refuse_dropping_caches(kv_cache_config)
        transfer = self._kv_transfer_config
        self.options = ConnectorOptions.from_extra_config(transfer.kv_connector_extra_config or {})
        block_size = vllm_config.cache_config.block_size
        fingerprint = model_fingerprint(vllm_config)
        geometry = expected_geometry(vllm_config)
        keys = self.options.key_ring()
        check_remote_options(self.options, keys)
        if self.options.persist:
            check_store_directory(
                self.options.path, shared=self.options.shared_store, signed=keys is not None
            )
        store = PrefixStore(
            self.options.path,
            store_namespace(fingerprint, geometry, self.options.chunk_blocks),
            chunk_blocks=self.options.chunk_blocks,
        )
        self.connector_scheduler: KVSnapScheduler | None = None
        self.connector_worker: KVSnapWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            policy = str(transfer.kv_load_failure_policy)
            verify = self.options.verifies_before_load(policy)
            events = EventLog(self.options.event_log, "scheduler", 0)
            # vLLM's "uni" executor runs the one worker in this process: a chunk the checker
            # opened is handed to it rather than opened again.
            parallel = vllm_config.parallel_config
            hand_over = parallel.world_size == 1 and parallel.distributed_executor_backend == "uni"
            checker = ChunkChecker(
                fingerprint, geometry, block_size, verify=verify, keys=keys, hand_over=hand_over
            )
            remote = remote_fetcher(self.options, store, checker, events)
            self.connector_scheduler = KVSnapScheduler(
                self.options,
                store,
                events,
                block_size=block_size,
                checker=checker,
                block_ids_of=self._block_ids_of,
                guard=self._guard(events, keys is not None),
                remote=remote,
            )
            self._warn_of_settings(events, store, policy, verify)
            if remote is not None:
                remote.probe()  # says whether the remote answers; the start never waits
        else:
            events = EventLog(self.options.event_log, "worker", tp_rank())
            self.connector_worker = KVSnapWorker(
                self.options,
                store,
                events,
                vllm_config=vllm_config,
                fingerprint=fingerprint,
                source=source_info(vllm_config, fingerprint),
                keys=keys,
                guard=self._guard(events, keys is not None),
            )

    def _guard(self, events: EventLog, signed: bool) -> StoreGuard | None:
        """The check of the store's mode and owner repeated while the engine runs (none
        without a store: ``dump`` alone)."""
        if not self.options.persist:
            return None
        return StoreGuard(
            self.options.path, events, shared=self.options.shared_store, signed=signed
        )

    def _warn_of_settings(
        self, events: EventLog, store: PrefixStore, policy: str, verify: bool
    ) -> None:
        """One ``config`` warning at start-up for each setting that limits what the connector
        can do: a read-only store (no saves), and failed loads that fail requests."""
        if store.read_only and self.options.persist:
            events.emit(
                "config",
                logging.WARNING,
                message=f"the store {self.options.path} is read-only for this engine: "
                "stored chunks are loaded, no chunk is saved",
            )
        if (
            self.options.remote_writes
            and self._vllm_config.parallel_config.tensor_parallel_size > 1
        ):
            events.emit(
                "config",
                logging.WARNING,
                message="chunks saved at TP > 1 are parted and stay in the local store: this "
                "engine fetches from the remote tier and uploads nothing",
            )
        if policy != "recompute" and not verify:
            events.emit(
                "config",
                logging.WARNING,
                message="kv_load_failure_policy is not 'recompute' and verify_before_load "
                "is off: a stored block that fails its checksum while loading fails the "
                "request instead of being recomputed",
            )

    def _block_ids_of(self, request_id: str) -> list[int]:
        assert self._kv_cache_manager is not None, "vLLM did not bind its KV cache manager"
        return list(self._kv_cache_manager.get_block_ids(request_id)[0])

    def _scheduler(self) -> KVSnapScheduler:
        assert self.connector_scheduler is not None, "a scheduler call reached a worker"
        return self.connector_scheduler

    def _worker(self) -> KVSnapWorker:
        assert self.connector_worker is not None, "a worker call reached the scheduler"
        return self.connector_worker

    def _metadata(self) -> KVSnapConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVSnapConnectorMetadata)
        return meta

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` loadable from the store (whole blocks)."""
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Plan the load of the request's matched blocks into the allocated ones."""
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads and the saves and dumps it completes."""
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Learn which loads failed (vLLM recomputes their blocks)."""
        self._scheduler().update_connector_output(connector_output)

    def has_pending_block_frees(self) -> bool:
        """Whether finished requests' blocks are held for their saves: vLLM waits for them
        instead of preempting a running request when it runs out of blocks."""
        return self._scheduler().has_pending_block_frees()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; hold its blocks (``True``) if a save was planned for it, until
        the workers report its copies done through :meth:`get_finished`."""
        return self._scheduler().request_finished(request), None

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build the cache layout from the registered tensors, or refuse them (LayoutError)."""
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Load this step's planned blocks before the forward pass (checksums verified)."""
        self._worker().start_load_kv(self._metadata())

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

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward pass: wait for the copies of requests vLLM preempted."""
        assert isinstance(kv_connector_metadata, KVSnapConnectorMetadata)
        self._worker().handle_preemptions(kv_connector_metadata)

    def wait_for_save(self) -> None:
        """Queue this step's saves on the background thread; the forward pass waits for
        nothing (a CUDA event orders the copies after it)."""
        if self.has_connector_metadata():
            self._worker().wait_for_save(self._metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The finished requests whose saves no longer read their blocks (vLLM frees them)."""
        return self._worker().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call; vLLM recomputes them."""
        return self._worker().get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVSnapWorkerMetadata | None:
        """The requests whose loads ran in this step, for the scheduler side."""
        return self._worker().build_connector_worker_meta()

    def shutdown(self) -> None:
        """Finish every queued snapshot write (and upload, within the drain bound) and release
        the worker's memory; stop the scheduler's remote lookups."""
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
