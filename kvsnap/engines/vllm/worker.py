"""The connector's worker side: load planned blocks before a step, save blocks after it.

:class:`KVSnapWorker` runs in every vLLM worker process. It takes the registered caches
(:func:`~kvsnap.engines.vllm.registration.register_caches`, or :meth:`KVSnapWorker.attach`
with a :class:`~kvsnap.engines.vllm.registration.RegisteredCache` built without vLLM), loads
the blocks the scheduler planned before the forward pass (every block checksum verified;
blocks it could not load are reported so vLLM recomputes them) and, after the forward pass,
hands the step's saves to :class:`~kvsnap.engines.vllm.worker_saves.WorkerSaves`, which
queues them on a background thread (:class:`~kvsnap.engines.vllm.saves.SaveQueue`) without
waiting for anything. The load path is this module; the save path is ``worker_saves.py``, and
the connector API methods of both stay here (vLLM calls them), delegating.

The code that moves KV is :meth:`KVSnapWorker._load` (a request's stored chunks, or the part of
them vLLM's own prefix cache lacks, into the cache as one job of the worker's warm
:class:`~kvsnap.pipeline.Pipeline`: one slot spans every layer) and
:meth:`WorkerSaves._capture <kvsnap.engines.vllm.worker_saves.WorkerSaves._capture>` (one
snapshot straight from the cache through the same pipeline, on the background thread, its
copies ordered after a CUDA event recorded when the forward pass was enqueued: device ->
pinned staging slots -> writer, checksums on the device).
vLLM keeps the blocks of a request with saves until :meth:`KVSnapWorker.get_finished` reports
their copies done. With ``store_capacity_bytes`` a chunk is written under a staged name and
committed once the store, measured and pruned under its lock, has room for it
(:func:`~kvsnap.engines.vllm.eviction.commit_within_capacity`). Each step the worker reports
which requests' loads ran (:meth:`KVSnapWorker.build_connector_worker_meta`), so that the
scheduler plans no save of a request before it knows how its load went.

Tensor parallelism: every rank saves its own heads, in parallel, on its own background thread
(:func:`kvsnap.distributed.capture`): a chunk becomes a parted snapshot, one part per rank and
the index rank 0 publishes once every part is durable. Only control messages cross between
ranks, over a gloo group of the TP ranks made for kvsnap at registration (vLLM's own groups
are used by its threads; the saves run on another). Loads need no collective: every rank reads
the parts holding its heads, whatever TP size stored the chunk.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvsnap import format as fmt
from kvsnap.encoded.device_restore import fp8_restorable, restore_fp8_blocks
from kvsnap.engines.open_snapshots import OpenSnapshots
from kvsnap.engines.vllm.events import EventLog
from kvsnap.engines.vllm.open_chunks import CHECKED_CHUNKS
from kvsnap.engines.vllm.options import ConnectorOptions
from kvsnap.engines.vllm.prefix_store import PrefixStore
from kvsnap.engines.vllm.quarantine import Quarantine
from kvsnap.engines.vllm.registration import RegisteredCache, register_caches
from kvsnap.engines.vllm.remote_tier import remote_uploader
from kvsnap.engines.vllm.specs import (
    ChunkLoad,
    KVSnapConnectorMetadata,
    KVSnapWorkerMetadata,
    LoadSpec,
)
from kvsnap.engines.vllm.store_guard import StoreGuard
from kvsnap.engines.vllm.worker_saves import WorkerSaves
from kvsnap.errors import (
    IncompatibleSnapshotError,
    NotASnapshotError,
    RestoreIncompleteError,
    SignatureError,
    SnapshotCorruptError,
    SnapshotIOError,
    UnsupportedVersionError,
)
from kvsnap.format.fit import check_fits
from kvsnap.format.signing import KeyRing
from kvsnap.layout import KVGeometry
from kvsnap.pipeline import Pipeline
from kvsnap.snapshot import Snapshot
from kvsnap.store.files.location import locate
from kvsnap.store.files.resolve import open_retrying
from kvsnap.store.hot.spare_files import drop_spare_files

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: Load errors that mean the chunk file is at fault (quarantined), not the engine.
_FILE_ERRORS = (
    SignatureError,
    SnapshotCorruptError,
    NotASnapshotError,
    UnsupportedVersionError,
    IncompatibleSnapshotError,
    SnapshotIOError,
    OSError,
)


class KVSnapWorker:
    """The worker side of :class:`~kvsnap.engines.vllm.KVSnapConnector`.

    :meth:`register_kv_caches` (or :meth:`attach`) takes the cache; :meth:`start_load_kv`
    loads, verifying every block checksum, and collects the blocks it could not load for
    :meth:`get_block_ids_with_load_errors`; :meth:`wait_for_save` queues the step's saves;
    :meth:`get_finished` names the finished requests whose blocks vLLM may free;
    :meth:`handle_preemptions` waits for the copies of preempted requests.
    ``vllm_config`` is needed by :meth:`register_kv_caches` only.
    """

    def __init__(
        self,
        options: ConnectorOptions,
        store: PrefixStore,
        events: EventLog,
        *,
        vllm_config: VllmConfig | None,
        fingerprint: str,
        source: fmt.SourceInfo | None,
        keys: KeyRing | None = None,
        guard: StoreGuard | None = None,
    ) -> None:
        self.options = options
        self.store = store
        self.events = events
        #: The store's mode and owner, checked again before saves (:class:`StoreGuard`).
        self.guard = guard
        self._quarantined = Quarantine(store, events)
        self.fingerprint = fingerprint
        #: Signs every save, and every chunk loaded must be signed by one of them.
        self.keys = keys
        self._vllm_config = vllm_config
        self._source = source
        self.cache: RegisteredCache | None = None
        self._load_errors: set[int] = set()
        #: Requests whose loads ran since the last :meth:`build_connector_worker_meta`.
        self._loaded: set[str] = set()
        self._pipeline: Pipeline | None = None
        self._saves: WorkerSaves | None = None
        #: The chunks it loaded, open for their next load (a hot prefix is loaded by request
        #: after request); each chunk's scheduler touches it on every hit, so a moved change
        #: time alone is the same version.
        self._kept = OpenSnapshots(KEPT_CHUNKS, change_time=False)

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Build the cache layout from the registered tensors, or refuse them (LayoutError)."""
        assert self._vllm_config is not None, "register_kv_caches needs the VllmConfig"
        cache = register_caches(self._vllm_config, kv_caches)
        self.attach(cache, group=_tp_control_group(cache.layout.tp_size))

    def attach(self, cache: RegisteredCache, *, group: Any = None) -> None:
        """Load into and save from ``cache``: make the warm pipeline and the save queue.

        At TP > 1, ``group`` is the ``torch.distributed`` group of the TP ranks (rank =
        ``tp_rank``) that the saves' control messages use; no other thread may use it."""
        if cache.layout.tp_size > 1 and group is None:
            raise ValueError("a cache of TP > 1 saves through a process group of its TP ranks")
        self.cache = cache
        # Kept for the engine's life: page table, staging and kernels stay warm across calls.
        self._pipeline = Pipeline(cache.layout)
        uploader = None
        if self.options.remote_writes and cache.layout.tp_size == 1:
            uploader = remote_uploader(self.options, self.store, self.events)
        self._saves = WorkerSaves(
            self.options,
            self.store,
            self.events,
            cache=cache,
            pipeline=self._pipeline,
            group=group,
            source=self._source,
            keys=self.keys,
            guard=self.guard,
            uploader=uploader,
        )
        self.events.emit(
            "registered",
            layout=cache.layout.describe(),
            encoding=cache.layout.encoding,
            kv_cache_layout=cache.kv_cache_layout,
        )

    # -- loads -------------------------------------------------------------------------------

    def start_load_kv(self, meta: KVSnapConnectorMetadata) -> None:
        """Load this step's planned blocks before the forward pass (checksums verified).

        A request's chunks load as one job (:meth:`_load`). A chunk that fails to load ends
        its request's load: its blocks and those of the request's later chunks are reported
        (:meth:`get_block_ids_with_load_errors`) for vLLM to recompute, and a chunk whose file
        is at fault is quarantined.
        """
        for spec in meta.loads:
            started = time.perf_counter()
            self._loaded.add(spec.request_id)
            failure = self._load(spec)
            if failure is not None:
                self._load_failed(spec, *failure)
                continue
            self.events.emit(
                "load",
                request=spec.request_id,
                paths=[chunk.path for chunk in spec.chunks],
                tokens=spec.num_tokens,
                blocks=len(spec.target_blocks),
                seconds=round(time.perf_counter() - started, 6),
            )

    def _load(self, spec: LoadSpec) -> tuple[int, Exception] | None:
        """Read ``spec``'s chunks (checksums verified) and scatter them into the cache as one
        job of the worker's warm :class:`~kvsnap.pipeline.Pipeline` (the reads of a chunk
        overlap the moves of the one before). Returns ``None``, or the first chunk that failed
        and why (the chunks before it are loaded). The chunks of a load that worked are kept
        open for their next load (:attr:`_kept`)."""
        assert self.cache is not None and self._pipeline is not None
        geometry = self.cache.layout.geometry
        opened: list[Snapshot] = []
        jobs = []
        failure: tuple[int, Exception] | None = None
        loaded = False
        try:
            for position, chunk in enumerate(spec.chunks):
                try:
                    snapshot = _open_chunk(chunk.path, self.keys, self._kept)
                    opened.append(snapshot)
                    _check_fits(snapshot.metadata, geometry, self.fingerprint, chunk.path)
                    _check_is_the_checked_chunk(snapshot.metadata, chunk)
                except Exception as error:  # any failure: the blocks from here on are recomputed
                    failure = (position, error)
                    break
                jobs.append((snapshot, chunk.snapshot_blocks, chunk.target_blocks))
            try:
                self._restore(jobs)
            except Exception as error:
                return (_failed_chunk(spec, error), error)
            loaded = True
            return failure
        finally:
            for position, snapshot in enumerate(opened):
                restored = loaded and position < len(jobs)
                if not (restored and self._keep(spec.chunks[position], snapshot)):
                    snapshot.close()

    def _restore(self, jobs: list[tuple[Snapshot, np.ndarray, np.ndarray]]) -> None:
        """Restore ``jobs`` (snapshot, its blocks, the target blocks): fp8 chunks opened by
        pages go to the device path as they are stored (half the bytes over PCIe, checked and
        dequantized on the GPU), every other chunk through the warm pipeline as one job."""
        assert self.cache is not None and self._pipeline is not None
        layouts = [self.cache.layout]
        ordinary = []
        for snapshot, snapshot_blocks, target_blocks in jobs:
            if fp8_restorable(snapshot.encoded, layouts):
                restore_fp8_blocks(snapshot, layouts, snapshot_blocks, target_blocks)
            else:
                ordinary.append((snapshot, snapshot_blocks, target_blocks))
        if ordinary:
            self._pipeline.restore_chunks(ordinary)

    def _keep(self, chunk: ChunkLoad, snapshot: Snapshot) -> bool:
        """Keep ``snapshot``, just loaded, open for the next load of ``chunk`` (whether it was
        kept). A chunk held in memory whole (the scheduler's hand-over of a small chunk) goes
        back to the hand-over (:data:`~kvsnap.engines.vllm.open_chunks.CHECKED_CHUNKS`, at
        most 8: the worker does not hold such bytes, up to :data:`~kvsnap.store.base.tuning.
        WHOLE_READ_MAX_BYTES` each, for longer), whose scheduler then offers the chunk again
        from those verified bytes without reading the file."""
        if snapshot.encoded is not None:
            # Encoded chunks are not kept: keeping one asks for its ordinary form (a decode),
            # and its open reads a few KiB, checked once per process (kvsnap/encoded/fp8_open).
            return False
        if any(part.reader.held_file() is not None for part in snapshot.parts):
            return CHECKED_CHUNKS.give_back(chunk.path, snapshot, self.keys)
        return self._kept.keep(chunk.path, snapshot, self.keys)

    def _load_failed(self, spec: LoadSpec, position: int, error: Exception) -> None:
        """Report the blocks of ``spec`` from chunk ``position`` on; quarantine a bad file.

        A chunk whose file holds another sequence than the one the scheduler checked (renamed
        over its name since) is a ``miss``: recomputed, never loaded, and left where it is
        (the scheduler's next check of the name quarantines a file that does not belong
        there; a valid replacement stays)."""
        failed = spec.chunks[position]
        blocks = np.concatenate([chunk.target_blocks for chunk in spec.chunks[position:]])
        self._load_errors.update(int(block) for block in blocks)
        if isinstance(error, NotTheCheckedChunkError):
            self.events.emit(
                "miss",
                logging.WARNING,
                request=spec.request_id,
                path=failed.path,
                blocks=len(blocks),
                reason=str(error),
            )
            return
        message = f"{type(error).__name__}: {error}"
        self.events.emit(
            "load_failed",
            logging.ERROR,
            request=spec.request_id,
            path=failed.path,
            blocks=len(blocks),
            error=message,
        )
        if isinstance(error, _FILE_ERRORS):
            self._quarantined(request=spec.request_id, path=failed.path, reason=message)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call; vLLM recomputes them."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVSnapWorkerMetadata | None:
        """The requests whose loads ran in this step (``None``: none did), for the scheduler,
        which plans no save of a request until it knows how its load went."""
        if not self._loaded:
            return None
        loaded, self._loaded = frozenset(self._loaded), set()
        return KVSnapWorkerMetadata(loaded)

    # -- saves -------------------------------------------------------------------------------

    def wait_for_save(self, meta: KVSnapConnectorMetadata) -> None:
        """Queue this step's saves; the forward pass waits for nothing.

        Records a CUDA event on the current (compute) stream after the forward pass and hands
        the saves to the background thread, which captures each one straight from the cache
        (at TP > 1 every rank its own heads), its copies ordered after that event
        (:meth:`~kvsnap.engines.vllm.worker_saves.WorkerSaves.submit`). A request's blocks
        stay allocated until :meth:`get_finished` reports its copies done.
        """
        if not meta.saves:
            return
        assert self._saves is not None
        self._saves.submit(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, None]:
        """vLLM's async save contract: the finished requests (``finished_req_ids``, of this
        step or an earlier one) that had saves and whose blocks no save reads any more, so
        vLLM may free them; nothing is ever received asynchronously."""
        if self._saves is None:
            return None, None
        return self._saves.finished(finished_req_ids) or None, None

    def handle_preemptions(self, meta: KVSnapConnectorMetadata) -> None:
        """Before the forward pass: wait until no save reads the blocks of the requests vLLM
        preempted (their blocks were freed and may be written by this very step)."""
        if self._saves is not None and meta.preempted:
            self._saves.wait_copied(meta.preempted)

    def wait_for_writes(self) -> None:
        """Block until every queued save is written (or has failed and been logged)."""
        if self._saves is not None:
            self._saves.drain()

    def shutdown(self) -> None:
        """Finish the queued snapshot writes within the drain bound, abandon the rest
        (``save_abandoned``: nothing of them is published), log a ``shutdown`` event, then
        drop the pipeline and the spare capture files its DMA saves left in the store's
        directories (``store/hot/spare_files.py``).

        The bound is ``shutdown_drain_s``, else the window vLLM gives its workers to exit
        (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``), so that the worker ends before vLLM kills
        it; the save in progress when the bound passes still finishes its current slot or
        its publish.
        """
        if self._saves is not None:
            self._saves.shutdown(self.options.drain_bound_s(os.environ))
            self._saves = None
        self._pipeline = None
        self._kept.clear()
        drop_spare_files(str(self.store.root))


#: Chunks a worker keeps open after loading them (:class:`~kvsnap.engines.open_snapshots.
#: OpenSnapshots`): a descriptor each, and the checked header, trailer and metadata of a file.
KEPT_CHUNKS = 64

#: How often, and how long apart, a chunk found missing is opened again: a pruner that sets a
#: chunk aside puts it back within microseconds when it was just used (matched).
_OPEN_ATTEMPTS, _OPEN_RETRY_S = 4, 0.005


def _open_chunk(path: str, keys: KeyRing | None, kept: OpenSnapshots | None = None) -> Snapshot:
    """The chunk at ``path``, open: taken from this process's scheduler, which just checked
    that version of the file (:data:`~kvsnap.engines.vllm.open_chunks.CHECKED_CHUNKS`), or
    from ``kept`` (the chunks a worker loaded before), else opened (every file signed by one of
    ``keys``, when given), again a few times if it is missing for an instant."""
    taken = CHECKED_CHUNKS.take(path, keys)
    if taken is None and kept is not None:
        taken = kept.take(path, keys)
    if taken is not None:
        return taken
    return open_retrying(
        locate(path, None),
        lambda _: Snapshot.open(path, keys=keys),
        attempts=_OPEN_ATTEMPTS,
        pause_s=_OPEN_RETRY_S,
        missing=_is_missing,
    )


def _is_missing(error: Exception) -> bool:
    """Whether ``error`` from opening a snapshot says the file is not there."""
    if isinstance(error, FileNotFoundError):
        return True
    return isinstance(error.__cause__, FileNotFoundError) or "no such file" in str(error).lower()


def _failed_chunk(spec: LoadSpec, error: Exception) -> int:
    """The first chunk of ``spec`` that ``error`` (from loading its chunks as one job) hit: the
    first holding a block the restore reports failed, or the chunk of the file it names."""
    if isinstance(error, RestoreIncompleteError):
        for position, chunk in enumerate(spec.chunks):
            if np.isin(chunk.target_blocks, error.failed_block_ids).any():
                return position
    named = getattr(error, "file", None)
    for position, chunk in enumerate(spec.chunks):
        if named is not None and Path(named).name.startswith(Path(chunk.path).stem):
            return position
    return 0


class NotTheCheckedChunkError(Exception):
    """The file a worker opened for a planned load holds another sequence than the one the
    scheduler checked for the request (a file renamed over the chunk's name since the check,
    or another version of it): the load is a miss."""


def _check_is_the_checked_chunk(metadata: fmt.SnapshotMetadata, chunk: ChunkLoad) -> None:
    """Refuse (:class:`NotTheCheckedChunkError`) a chunk whose one sequence is not the one the
    scheduler checked (``chunk.checked``): another id (another span, prefix or identity: the
    name is anyone's to change who can write the store, the signed id is not), other token
    ids, or other block ids (which ``chunk.snapshot_blocks`` were taken from). With a key, the
    sequence is signed: only the key holder's chunk of this request's prefix passes."""
    checked = chunk.checked
    found = metadata.sequences[0] if len(metadata.sequences) == 1 else None
    if found is None or found.id != checked.id:
        name = None if found is None else found.id
        raise NotTheCheckedChunkError(
            f"the file now at {chunk.path} holds sequence {name!r}, not the {checked.id!r} "
            "the scheduler checked (replaced since the check)"
        )
    if not (
        np.array_equal(found.token_ids, checked.token_ids)
        and np.array_equal(found.block_ids, checked.block_ids)
    ):
        raise NotTheCheckedChunkError(
            f"the file now at {chunk.path} holds other token or block ids than the version "
            "the scheduler checked (replaced since the check)"
        )


def _check_fits(
    metadata: fmt.SnapshotMetadata, geometry: KVGeometry, fingerprint: str, path: str
) -> None:
    """Refuse a snapshot whose geometry or model fingerprint differs from the engine's (the
    restore contract's one check, :func:`kvsnap.format.fit.check_fits`)."""
    check_fits(metadata, geometry, path=path, model_fingerprint=fingerprint)


def _tp_control_group(tp_size: int) -> Any:
    """A gloo group of this worker's TP ranks for kvsnap's control messages (``None`` at TP 1).

    Made only by the TP group's members (``use_local_synchronization``), once, at registration;
    vLLM's own CPU group is not used because the saves run on a thread of their own.
    """
    if tp_size == 1:
        return None
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    return dist.new_group(
        ranks=get_tp_group().ranks, backend="gloo", use_local_synchronization=True
    )
