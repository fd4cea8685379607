"""The worker's save side: each step's saves captured from the cache behind the forward pass.

:class:`WorkerSaves` is what :class:`~kvsnap.engines.vllm.worker.KVSnapWorker` hands its
saves to. :meth:`WorkerSaves.submit` records a CUDA event after the forward pass and queues
the step's saves on the :class:`~kvsnap.engines.vllm.saves.SaveQueue`'s background thread,
where each is one capture straight from the cache through the worker's warm
:class:`~kvsnap.pipeline.Pipeline` (at TP > 1 every rank its own heads,
:func:`kvsnap.distributed.capture`), its copies ordered after that event. A chunk the store
already holds is never copied again; with ``store_capacity_bytes`` a chunk is written under a
staged name and committed once the store has room for it
(:func:`~kvsnap.engines.vllm.capacity.commit_within_capacity`); a full disk is said once
(``store_full``) and the save skipped. A capacity lock another process keeps past
:data:`~kvsnap.engines.vllm.capacity.LOCK_WAIT_S` (or one that is a link, not a regular file,
another user's) is said once (``store_locked``) and the save skipped; while it stays so, each
later save asks for the lock once, without waiting, before it copies anything, and is skipped
at once if it cannot have it: the save thread never waits on another process for longer than
one save's wait, so neither does the engine's step behind a full queue.
:meth:`WorkerSaves.shutdown` waits for the queued saves up to a bound and abandons the rest.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvsnap import distributed
from kvsnap import format as fmt
from kvsnap.encoded.capture import capture_compressed
from kvsnap.engines.vllm.capacity import (
    LOCK_WAIT_S,
    CapacityLockError,
    commit_within_capacity,
    lock_is_free,
    prune_locked,
)
from kvsnap.engines.vllm.events import EventLog
from kvsnap.engines.vllm.eviction import StoreEntry, staged_path
from kvsnap.engines.vllm.options import ConnectorOptions
from kvsnap.engines.vllm.prefix_store import PrefixStore
from kvsnap.engines.vllm.registration import RegisteredCache
from kvsnap.engines.vllm.remote_upload import RemoteUploader
from kvsnap.engines.vllm.saves import PendingSave, SaveQueue
from kvsnap.engines.vllm.specs import SaveSpec
from kvsnap.engines.vllm.store_guard import StoreGuard
from kvsnap.errors import SaveAbandonedError, SnapshotIOError
from kvsnap.format.signing import KeyRing
from kvsnap.pipeline import CaptureResult, Pipeline, ProgressCallback
from kvsnap.snapshot import SequenceBlocks


class WorkerSaves:
    """The saves of one worker's cache: queued, captured, committed, drained at shutdown.

    Made by the worker when it attaches its cache; ``pipeline`` is the worker's warm pipeline
    (shared with its loads), ``group`` the TP ranks' control group (``None`` at TP 1),
    ``source`` and ``keys`` what every save records and is signed with.
    """

    def __init__(
        self,
        options: ConnectorOptions,
        store: PrefixStore,
        events: EventLog,
        *,
        cache: RegisteredCache,
        pipeline: Pipeline,
        group: Any,
        source: fmt.SourceInfo | None,
        keys: KeyRing | None,
        guard: StoreGuard | None = None,
        uploader: RemoteUploader | None = None,
    ) -> None:
        self.options = options
        #: Uploads each chunk saved (at TP 1) to the remote tier once it is published here.
        self.uploader = uploader
        #: The store's mode and owner, checked again while the engine runs (at TP 1: at
        #: TP > 1 the scheduler plans no save into a store that fails it, and every rank
        #: must meet the collectives of a save that was planned).
        self.guard = guard
        self.store = store
        self.events = events
        self.cache = cache
        self._pipeline = pipeline
        self._group = group
        self._source = source
        self._keys = keys
        self._queue = SaveQueue(events, options.max_pending_writes)
        #: Whether the last save met a full disk (said once, until a save fits again).
        self._store_full = False
        #: Whether the last commit could not have the capacity lock (said once, until one
        #: has it again); meanwhile a save that cannot have it at once is skipped at once.
        self._lock_unavailable = False
        #: How long a commit waits for the capacity lock.
        self.lock_wait_s = LOCK_WAIT_S

    @property
    def abandoning(self) -> threading.Event:
        """Set once a shutdown's bound has passed: the saves still to come stop unpublished."""
        return self._queue.abandoning

    def submit(self, specs: Sequence[SaveSpec]) -> None:
        """Queue the saves ``specs`` of this step; the forward pass waits for nothing.

        Records a CUDA event on the current (compute) stream after the forward pass and hands
        the saves to the queue's background thread, which captures each one straight from the
        cache, its copies ordered after that event.
        """
        after = _record_after_compute(self.cache.layout.device)
        saves = [PendingSave(spec) for spec in specs]
        self._queue.submit(saves, lambda save: self._capture_or_full(save, after))

    def finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """The finished requests (``finished_req_ids``, of this step or an earlier one) that
        had saves and whose blocks no save reads any more (:meth:`SaveQueue.finished`)."""
        return self._queue.finished(finished_req_ids)

    def wait_copied(self, request_ids: Iterable[str]) -> None:
        """Block until no save reads the blocks of ``request_ids`` (preempted requests)."""
        self._queue.wait_copied(request_ids)

    def drain(self) -> None:
        """Block until every queued save is written (or has failed and been logged)."""
        self._queue.drain()

    def shutdown(self, bound_s: float) -> None:
        """Finish the queued saves within ``bound_s`` seconds, abandon the rest
        (``save_abandoned``: nothing of them is published), give the uploads queued what is
        left of the bound, then log a ``shutdown`` event."""
        report = self._queue.shutdown(bound_s)
        if self.uploader is not None:  # the uploads queued get what is left of the bound
            self.uploader.shutdown(bound_s - report.seconds)
        self.events.emit(
            "shutdown",
            logging.WARNING if report.abandoned else logging.INFO,
            pending=report.pending,
            abandoned=report.abandoned,
            bound_s=bound_s,
            seconds=round(report.seconds, 6),
        )

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
        spec = save.spec
        persist = spec.kind == "persist"
        layout = self.cache.layout
        abandoning = self.abandoning
        if layout.tp_size == 1 and abandoning.is_set():
            # At TP > 1 every rank goes on into the capture's collectives, where this rank's
            # abandoned part stops every rank's write of the chunk (below).
            raise SaveAbandonedError("the worker is shutting down", file=spec.path)
        if layout.tp_size == 1 and persist and self.store.has_chunk(spec.path):
            return
        if layout.tp_size == 1 and persist and self.guard is not None and not self.guard.allows():
            return  # the store is open to others now (said once, by the guard)
        if layout.tp_size == 1 and persist and self._lock_still_unavailable():
            # Skipped before anything is copied (said once). At TP > 1 only rank 0's prune
            # after the commit takes the lock: every rank still meets the collectives.
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
            result = self._capture_chunk(sequences, target, copied, after)
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
            keys=self._keys,
        )
        if not whole.skipped and layout.tp_rank == 0:  # one event and one prune per chunk
            self._saved(spec, whole.path, whole.num_blocks, whole.num_bytes, started)

    def _capture_chunk(
        self,
        sequences: list[SequenceBlocks],
        target: str,
        copied: ProgressCallback,
        after: torch.cuda.Event | None,
    ) -> CaptureResult:
        """One chunk captured to ``target`` from the cache at TP 1: an ordinary snapshot, or
        with the ``compression`` option an encoded one, its pages encoded where they lie (fp8
        quantized on the device) and written once, never as the ordinary file; signed, it is
        the encoded file that is signed (as ``kvsnap.capture`` signs one)."""
        if self.options.compression == "none":
            return self._pipeline.capture(
                sequences,
                target,
                source=self._source,
                progress=copied,
                after=after,
                keys=self._keys,
            )
        return capture_compressed(
            self._pipeline,
            sequences,
            target,
            self.options.compression,
            source=self._source,
            keys=self._keys,
            progress=copied,
            after=after,
        )

    def _commit(self, staged: str, path: str, capacity: int) -> bool:
        """Commit the chunk staged at ``staged`` as ``path`` within the store's bound
        (:func:`~kvsnap.engines.vllm.eviction.commit_within_capacity`); log what pruning
        removed for it; whether it was committed."""
        try:
            committed, removed = commit_within_capacity(
                self.store.root,
                staged,
                path,
                capacity,
                min_idle_s=self.options.store_min_idle_s,
                wait_s=self.lock_wait_s,
                shared=self.options.shared_store,
            )
        except CapacityLockError as error:
            self._lock_failed(path, error)
            return False
        self._lock_unavailable = False
        self._evicted(removed)
        return committed

    def _lock_still_unavailable(self) -> bool:
        """While the capacity lock could not be had: whether it still cannot be had at once
        (asked without waiting). Only with a capacity bound, where commits take the lock."""
        if not self._lock_unavailable or self.options.store_capacity_bytes is None:
            return False
        if lock_is_free(self.store.root, shared=self.options.shared_store):
            self._lock_unavailable = False
            return False
        return True

    def _lock_failed(self, path: str, error: CapacityLockError) -> None:
        """A commit (or a prune) could not have the capacity lock: the save is skipped, said
        once until a commit has the lock again."""
        if not self._lock_unavailable:
            self.events.emit(
                "store_locked",
                logging.WARNING,
                path=path,
                error=str(error),
                message="saves are skipped while the store's capacity lock cannot be had",
            )
        self._lock_unavailable = True

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
        if spec.kind == "persist" and self.uploader is not None and self.cache.layout.tp_size == 1:
            self.uploader.offer(path, spec.request_id)
        capacity = self.options.store_capacity_bytes
        if spec.kind == "persist" and capacity is not None:
            if self.cache.layout.tp_size > 1:  # a parted chunk, committed by its index
                try:
                    removed = prune_locked(
                        self.store.root,
                        capacity,
                        min_idle_s=self.options.store_min_idle_s,
                        wait_s=self.lock_wait_s,
                        shared=self.options.shared_store,
                    )
                except CapacityLockError as error:
                    self._lock_failed(path, error)
                    return
                self._lock_unavailable = False
                self._evicted(removed)

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
