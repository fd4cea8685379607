"""The worker's uploads: each saved chunk, once published locally, copied to the remote tier.

A save is published in the local store first (the request and the node's next requests need
nothing more), then offered to :class:`RemoteUploader` (``remote_mode: read-write``), whose
``remote_max_uploads`` threads upload it in the background: the chunk's file read back (by
name in its directory, opened without following a link below the store root: a link planted
in the store never uploads a file from elsewhere), then one conditional create
(:meth:`~kvsnap.engines.vllm.remote_store.RemoteStore.create`): an object of that name is never
replaced, and one already there counts as done (``upload`` with ``created: false``). An object
store shows an upload only once it is complete, so a worker killed mid-upload leaves nothing.

Uploads never hold anything up: :meth:`RemoteUploader.offer` only queues. A chunk that would
take the bytes queued or in flight past ``remote_max_upload_bytes``, or offered while the
remote is paused after failures, is not uploaded (``upload_skipped``; it stays in the local
store, and another node that computes it uploads it). A failed upload is counted and said once
per kind (:class:`~kvsnap.engines.vllm.remote_health.RemoteHealth`). At shutdown the uploads
queued get what is left of the worker's drain bound; those still queued past it are dropped.

Nothing here needs vLLM.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from pathlib import Path

from kvsnap.engines.vllm.events import EventLog
from kvsnap.engines.vllm.prefix_store import CHUNK_SUFFIX, PrefixStore
from kvsnap.engines.vllm.remote_health import RemoteHealth, failure_kind
from kvsnap.engines.vllm.remote_store import RemoteStore
from kvsnap.engines.vllm.store_directories import directory_fd, relative_parts

#: How a chunk is opened to be uploaded: never through a link, never blocking on a pipe.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class RemoteUploader:
    """Background uploads of one worker's saved chunks (module notes)."""

    def __init__(
        self,
        remote: RemoteStore,
        store: PrefixStore,
        events: EventLog,
        *,
        max_in_flight: int,
        max_bytes: int,
    ) -> None:
        self.remote = remote
        self.store = store
        self.events = events
        self.max_bytes = max_bytes
        self.health = RemoteHealth(events, remote.url)
        self._pool = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="kvsnap-up")
        self._lock = threading.Lock()
        #: Bytes of the uploads queued or running.
        self._queued_bytes = 0
        self._futures: set[Future[None]] = set()

    @property
    def queued_bytes(self) -> int:
        """Bytes of the uploads queued or running now."""
        return self._queued_bytes

    def offer(self, path: str, request_id: str) -> bool:
        """Queue the upload of the chunk just published at ``path`` (``HASH.safetensors``);
        whether it was queued. Never waits."""
        try:
            size = os.stat(path, follow_symlinks=False).st_size
        except OSError:
            self._skipped(path, request_id, "the chunk is gone (evicted)")
            return False
        if not self.health.available():
            self._skipped(path, request_id, "the remote is paused after failures")
            return False
        with self._lock:
            if self._queued_bytes + size > self.max_bytes:
                full = True
            else:
                full = False
                self._queued_bytes += size
        if full:
            self._skipped(
                path, request_id, f"uploads queued hold {self._queued_bytes} bytes already"
            )
            return False
        future = self._pool.submit(self._upload, path, request_id, size)
        with self._lock:
            self._futures.add(future)
        future.add_done_callback(self._done)
        return True

    def _done(self, future: Future[None]) -> None:
        with self._lock:
            self._futures.discard(future)

    def _upload(self, path: str, request_id: str, size: int) -> None:
        started = time.perf_counter()
        try:
            data = self._read(Path(path))
            if data is None:
                self._skipped(path, request_id, "the chunk is gone (evicted)")
                return
            key = Path(path).name[: -len(CHUNK_SUFFIX)]
            created = self.remote.create(key, data)
        except Exception as error:
            kind = failure_kind(error)
            self.health.failed(kind, error, path=path)
            self._skipped(path, request_id, f"the upload failed ({kind})")
            return
        finally:
            with self._lock:
                self._queued_bytes -= size
        self.health.succeeded()
        self.events.emit(
            "upload",
            request=request_id,
            path=path,
            bytes=len(data),
            created=created,
            seconds=round(time.perf_counter() - started, 6),
        )

    def _read(self, path: Path) -> bytes | None:
        """The chunk file at ``path`` (a regular file, reached without following a link below
        the store root), or ``None`` when it is gone."""
        try:
            with directory_fd(self.store.root, relative_parts(self.store.root, path.parent)) as d:
                fd = os.open(path.name, _READ_FLAGS, dir_fd=d)
        except FileNotFoundError:
            return None
        try:
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode):
                raise OSError(f"{path} is not a regular file")
            chunks = []
            while True:
                chunk = os.read(fd, 1 << 22)
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)
        finally:
            os.close(fd)

    def _skipped(self, path: str, request_id: str, reason: str) -> None:
        self.events.emit(
            "upload_skipped", logging.DEBUG, request=request_id, path=path, reason=reason
        )

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait for the uploads queued now (at most ``timeout_s``); whether they are done."""
        with self._lock:
            futures = list(self._futures)
        _, not_done = wait_for_futures(futures, timeout=timeout_s)
        return not not_done

    def shutdown(self, bound_s: float) -> int:
        """Wait up to ``bound_s`` seconds for the uploads queued, drop those not begun by then;
        how many were dropped or unfinished."""
        with self._lock:
            futures = list(self._futures)
        _, not_done = wait_for_futures(futures, timeout=max(bound_s, 0.0))
        self._pool.shutdown(wait=False, cancel_futures=True)
        if not_done:
            self.events.emit(
                "upload_abandoned",
                logging.WARNING,
                uploads=len(not_done),
                bound_s=bound_s,
                message="uploads still queued when the worker's drain bound passed; their "
                "chunks stay in the local store",
            )
        return len(not_done)
