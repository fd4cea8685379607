"""The connector's worker side: load planned blocks before a step, save blocks after it.

:class:`KVSnapWorker` runs in every vLLM worker process. It takes the registered caches
(:func:`~kvsnap.engines.vllm.registration.register_caches`, or :meth:`KVSnapWorker.attach`
with a :class:`~kvsnap.engines.vllm.registration.RegisteredCache` built without vLLM), loads
the blocks the scheduler planned before the forward pass (every block checksum verified;
blocks it could not load are reported so vLLM recomputes them) and, after the forward pass,
hands the step's saves to a background thread (:class:`~kvsnap.engines.vllm.saves.SaveQueue`)
without waiting for anything.

The code that moves KV is :meth:`KVSnapWorker._load` (a request's stored chunks, or the part of
them vLLM's own prefix cache lacks, into the cache as one job of the worker's warm
:class:`~kvsnap.pipeline.Pipeline`: one slot spans every layer) and
:meth:`KVSnapWorker._capture` (one snapshot straight from the cache through the same
pipeline, on the background thread, its copies ordered after a CUDA event recorded when the
forward pass was enqueued: device -> pinned staging slots -> writer, checksums on the device).
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

import contextlib
import errno
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvsnap import distributed
from kvsnap import format as fmt
from kvsnap.engines.vllm.chunk_check import CHECKED_CHUNKS
from kvsnap.engines.vllm.events import EventLog
from kvsnap.engines.vllm.eviction import (
    StoreEntry,
    commit_within_capacity,
    prune_locked,
    staged_path,
)
from kvsnap.engines.vllm.options import ConnectorOptions
from kvsnap.engines.vllm.prefix_store import PrefixStore
from kvsnap.engines.vllm.registration import RegisteredCache, register_caches
from kvsnap.engines.vllm.saves import PendingSave, SaveQueue
from kvsnap.engines.vllm.specs import (
    KVSnapConnectorMetadata,
    KVSnapWorkerMetadata,
    LoadSpec,
    SaveSpec,
)
from kvsnap.errors import (
    IncompatibleSnapshotError,
    NotASnapshotError,
    RestoreIncompleteError,
    SaveAbandonedError,
    SignatureError,
    SnapshotCorruptError,
    SnapshotIOError,
    UnsupportedVersionError,
)
from kvsnap.format.fit import check_fits
from kvsnap.format.signing import KeyRing
from kvsnap.layout import KVGeometry
from kvsnap.pipeline import Pipeline, ProgressCallback
from kvsnap.snapshot import SequenceBlocks, Snapshot
from kvsnap.store.spare_files import drop_spare_files

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
    ) -> None:
        self.options = options
        self.store = store
        self.events = events
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
        self._saves: SaveQueue | None = None
        self._group: Any = None
        #: Whether the last save met a full disk (said once, until a save fits again).
        self._store_full = False

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
        self._group = group
        # Kept for the engine's life: page table, staging and kernels stay warm across calls.
        self._pipeline = Pipeline(cache.layout)
        self._saves = SaveQueue(self.events, self.options.max_pending_writes)
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
        and why (the chunks before it are loaded)."""
        assert self.cache is not None and self._pipeline is not None
        geometry = self.cache.layout.geometry
        with contextlib.ExitStack() as stack:
            jobs = []
            failure: tuple[int, Exception] | None = None
            for position, chunk in enumerate(spec.chunks):
                try:
                    snapshot = stack.enter_context(_open_chunk(chunk.path, self.keys))
                    _check_fits(snapshot.metadata, geometry, self.fingerprint, chunk.path)
                except Exception as error:  # any failure: the blocks from here on are recomputed
                    failure = (position, error)
                    break
                jobs.append((snapshot, chunk.snapshot_blocks, chunk.target_blocks))
            try:
                if jobs:
                    self._pipeline.restore_chunks(jobs)
            except Exception as error:
                return (_failed_chunk(spec, error), error)
            return failure

    def _load_failed(self, spec: LoadSpec, position: int, error: Exception) -> None:
        """Report the blocks of ``spec`` from chunk ``position`` on; quarantine a bad file."""
        failed = spec.chunks[position]
        blocks = np.concatenate([chunk.target_blocks for chunk in spec.chunks[position:]])
        self._load_errors.update(int(block) for block in blocks)
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
            moved = self.store.quarantine(failed.path)
            if moved is not None:
                self.events.emit(
                    "quarantine",
                    logging.WARNING,
                    request=spec.request_id,
                    path=failed.path,
                    moved_to=str(moved),
                    reason=message,
                )

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
        (at TP > 1 every rank its own heads), its copies ordered after that event. A request's
        blocks stay allocated until :meth:`get_finished` reports its copies done.
        """
        if not meta.saves:
            return
        assert self.cache is not None and self._saves is not None
        after = _record_after_compute(self.cache.layout.device)
        saves = [PendingSave(spec) for spec in meta.saves]
        self._saves.submit(saves, lambda save: self._capture_or_full(save, after))

    def _capture_or_full(self, save: PendingSave, after: torch.cuda.Event | None) -> None:
        """:meth:`_capture`, with a full disk said once: the writer has already removed what
        it wrote (the store holds only whole chunks) and the request is served either way, so
        a save that meets ENOSPC is skipped with one ``store_full`` warning until a save
        succeeds again. Other failures are the save queue's ``save_failed``."""
        try:
            self._capture(save, after)
        except (OSError, SnapshotIOError) as error:
            if not _disk_full(error):
                raise
            if not self._store_full:
                self._store_full = True
                self.events.emit(
                    "store_full",
                    logging.WARNING,
                    request=save.spec.request_id,
                    path=save.spec.path,
                    error=f"{type(error).__name__}: {error}",
                    message="the store's disk is full: saves are skipped until one fits",
                )
            return
        self._store_full = False

    def _capture(self, save: PendingSave, after: torch.cuda.Event | None) -> None:
        """Write one save's snapshot straight from the cache, once ``after`` has passed (on
        the background thread); ``save.copied`` is set as soon as the last slot is copied.

        A chunk already stored (by another request or engine) is never copied again; at
        TP > 1 rank 0 decides that for every rank."""
        assert self.cache is not None and self._pipeline is not None and self._saves is not None
        spec = save.spec
        persist = spec.kind == "persist"
        layout = self.cache.layout
        abandoning = self._saves.abandoning
        if layout.tp_size == 1 and abandoning.is_set():
            # At TP > 1 every rank goes on into the capture's collectives, where this rank's
            # abandoned part stops every rank's write of the chunk (below).
            raise SaveAbandonedError("the worker is shutting down", file=spec.path)
        if layout.tp_size == 1 and persist and self.store.has_chunk(spec.path):
            return
        started = time.perf_counter()
        if persist:
            self.store.chunk_directory(spec.path)
        else:
            Path(spec.path).parent.mkdir(parents=True, exist_ok=True)

        copied = _copy_progress(save, abandoning)
        sequences = [_sequence(spec, spec.block_ids)]
        capacity = self.options.store_capacity_bytes
        if layout.tp_size == 1:
            # Within a bound the chunk is staged, then committed under the store's lock once
            # the store (every engine's chunks) has room for it.
            staged = persist and capacity is not None
            target = str(staged_path(spec.path)) if staged else spec.path
            result = self._pipeline.capture(
                sequences,
                target,
                source=self._source,
                progress=copied,
                after=after,
                keys=self.keys,
            )
            if staged and capacity is not None and not self._commit(target, spec.path, capacity):
                return  # another engine committed it, or chunks in use fill the store
            self._saved(spec, spec.path, result.num_blocks, result.num_bytes, started)
            return
        whole = distributed.capture(
            layout,
            sequences,
            spec.path,
            group=self._group,
            source=self._source,
            progress=copied,
            after=after,
            only_if_missing=persist,
            keys=self.keys,
        )
        if not whole.skipped and layout.tp_rank == 0:  # one event and one prune per chunk
            self._saved(spec, whole.path, whole.num_blocks, whole.num_bytes, started)

    def _commit(self, staged: str, path: str, capacity: int) -> bool:
        """Commit the chunk staged at ``staged`` as ``path`` within the store's bound
        (:func:`~kvsnap.engines.vllm.eviction.commit_within_capacity`); log what pruning
        removed for it; whether it was committed."""
        committed, removed = commit_within_capacity(
            self.store.root, staged, path, capacity, min_idle_s=self.options.store_min_idle_s
        )
        self._evicted(removed)
        return committed

    def _saved(
        self, spec: SaveSpec, path: str, num_blocks: int, num_bytes: int, started: float
    ) -> None:
        """Log a written save or dump; after a chunk, keep the store within its bound."""
        self.events.emit(
            "save" if spec.kind == "persist" else "dump",
            request=spec.request_id,
            path=path,
            tokens=len(spec.token_ids),
            blocks=num_blocks,
            bytes=num_bytes,
            seconds=round(time.perf_counter() - started, 6),
        )
        capacity = self.options.store_capacity_bytes
        if spec.kind == "persist" and capacity is not None and self.cache is not None:
            if self.cache.layout.tp_size > 1:  # a parted chunk, committed by its index
                self._evicted(
                    prune_locked(
                        self.store.root, capacity, min_idle_s=self.options.store_min_idle_s
                    )
                )

    def _evicted(self, removed: list[StoreEntry]) -> None:
        """Log the entries pruning removed."""
        for entry in removed:
            self.events.emit(
                "evict",
                path=str(entry.path),
                bytes=entry.size,
                idle_s=round(entry.age(), 3),
                quarantined=entry.quarantined,
            )

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
        directories (``store/spare_files.py``).

        The bound is ``shutdown_drain_s``, else the window vLLM gives its workers to exit
        (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``), so that the worker ends before vLLM kills
        it; the save in progress when the bound passes still finishes its current slot or
        its publish.
        """
        if self._saves is not None:
            bound = self.options.drain_bound_s(os.environ)
            report = self._saves.shutdown(bound)
            self._saves = None
            self.events.emit(
                "shutdown",
                logging.WARNING if report.abandoned else logging.INFO,
                pending=report.pending,
                abandoned=report.abandoned,
                bound_s=bound,
                seconds=round(report.seconds, 6),
            )
        self._pipeline = None
        drop_spare_files(str(self.store.root))


#: How often, and how long apart, a chunk found missing is opened again: a pruner that sets a
#: chunk aside puts it back within microseconds when it was just used (matched).
_OPEN_ATTEMPTS, _OPEN_RETRY_S = 4, 0.005


def _copy_progress(save: PendingSave, abandoning: threading.Event) -> ProgressCallback:
    """The ``progress`` of ``save``'s capture: sets ``save.copied`` once its last slot is
    copied, and stops the capture at its next slot (``SaveAbandonedError``, its writer
    removing its temporary file) once ``abandoning`` is set."""

    def progress(done_bytes: int, total_bytes: int) -> None:
        if done_bytes >= total_bytes:
            save.copied.set()
        # A rank with nothing to write (total 0) must still reach the ranks' status exchange.
        if total_bytes and abandoning.is_set():
            raise SaveAbandonedError("the worker is shutting down", file=save.spec.path)

    return progress


def _disk_full(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from, is a full disk or an exceeded
    quota."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _open_chunk(path: str, keys: KeyRing | None) -> Snapshot:
    """Open the chunk at ``path`` (every file signed by one of ``keys``, when given), again a
    few times if it is missing for an instant; or take it open from this process's scheduler,
    which just checked that version of the file (:data:`~kvsnap.engines.vllm.chunk_check.
    CHECKED_CHUNKS`)."""
    checked = CHECKED_CHUNKS.take(path, keys)
    if checked is not None:
        return checked
    for _ in range(_OPEN_ATTEMPTS - 1):
        try:
            return Snapshot.open(path, keys=keys)
        except (FileNotFoundError, SnapshotIOError) as error:
            if not _is_missing(error):
                raise
            time.sleep(_OPEN_RETRY_S)
    return Snapshot.open(path, keys=keys)


def _is_missing(error: Exception) -> bool:
    """Whether ``error`` from opening a snapshot says the file is not there."""
    if isinstance(error, FileNotFoundError):
        return True
    return isinstance(error.__cause__, FileNotFoundError) or "no such file" in str(error).lower()


def _sequence(spec: SaveSpec, block_ids: np.ndarray) -> SequenceBlocks:
    """The one sequence of ``spec``'s snapshot, its blocks read from ``block_ids``."""
    return SequenceBlocks(id=spec.sequence_id, token_ids=spec.token_ids, block_ids=block_ids)


def _record_after_compute(device: torch.device) -> torch.cuda.Event | None:
    """An event on ``device``'s current stream, after what was enqueued on it (the forward
    pass): the saves' copies follow it. ``None`` for a cache in host memory (its forward pass
    has finished when the engine's thread gets here)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


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
