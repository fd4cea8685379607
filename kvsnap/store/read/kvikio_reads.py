"""Reads of local snapshot files into host memory by kvikio's C++ thread pool (optional).

A first touch of a page-cached file reads a slot's pages on many threads while the restoring
thread enqueues the device's copies. Python read threads take the GIL back after every
``preadv``, and the restoring thread, which needs it for every launch, then waits for them:
on the H200 a 2,048-token first touch spent 5-5.7 ms enqueueing four slots' copies against
2.5 ms when nothing is read (docs/benchmarks.md). kvikio's pool reads without the GIL. It is
used only where the host checks nothing (the device verifies every page, or the caller turned
checks off): hashing on the host stays on the Python read threads.

kvikio is an optional dependency (the ``kvikio`` extra, ``kvikio-cu13``); without it, or with
``tuning.KVIKIO_READS = False``, slot reads keep the Python threads. Only host buffers are
read here: kvikio then reads with POSIX ``pread`` through the page cache (never GDS). kvsnap
sets kvikio's process-wide thread count (to :func:`~kvsnap.store.read.slot_reads.read_threads`) and
compatibility mode only where ``KVIKIO_NTHREADS`` and ``KVIKIO_COMPAT_MODE`` leave them unset.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvsnap.errors import SnapshotCorruptError
from kvsnap.store.base import tuning
from kvsnap.store.base.tracing import TraceHook

#: Bytes per task of kvikio's pool: a 64 MiB slot is 16 tasks, one per thread of 16.
TASK_BYTES = 4 << 20
#: The smallest piece a slot's read is cut into: a 2 MB slot is 8 pieces on 8 threads, not one.
MIN_PIECE_BYTES = 256 << 10

_STATE: dict[str, Any] = {}
_STATE_LOCK = threading.Lock()


def _kvikio(threads: int) -> Any | None:
    """The configured kvikio module, or ``None`` where it is off or not installed."""
    if not tuning.KVIKIO_READS:
        return None
    with _STATE_LOCK:
        if "module" not in _STATE:
            _STATE["module"] = _import_and_configure(threads)
        return _STATE["module"]


def _import_and_configure(threads: int) -> Any | None:
    try:
        import kvikio
        import kvikio.defaults
    except Exception:  # not installed, or its CUDA libraries are missing
        return None
    settings: dict[str, Any] = {"task_size": TASK_BYTES}
    if "KVIKIO_NTHREADS" not in os.environ:
        settings["num_threads"] = threads
    if "KVIKIO_COMPAT_MODE" not in os.environ:
        settings["compat_mode"] = kvikio.CompatMode.ON
    kvikio.defaults.set(settings)
    try:  # what the pool has: KVIKIO_NTHREADS, where set, wins over ``threads``
        _STATE["threads"] = int(kvikio.defaults.get("num_threads"))
    except Exception:  # an older kvikio without ``defaults.get``
        _STATE["threads"] = settings.get("num_threads", threads)
    return kvikio


def available(threads: int) -> bool:
    """Whether slot reads may go through kvikio (installed, and ``tuning.KVIKIO_READS``)."""
    return _kvikio(threads) is not None


class KvikioFile:
    """kvikio's handle on an open local file, opened through ``/proc/self/fd``: the very file
    (inode) the descriptor holds, even if its path now names another one."""

    def __init__(self, fd: int, threads: int) -> None:
        kvikio = _kvikio(threads)
        if kvikio is None:
            raise RuntimeError("kvikio is not available")
        self._handle = kvikio.CuFile(f"/proc/self/fd/{fd}", "r")

    def read_async(self, out: np.ndarray, file_offset: int) -> Any:
        """Start reading ``out.nbytes`` bytes at ``file_offset`` into ``out`` (contiguous host
        memory): kvikio's future."""
        return self._handle.pread(out, out.nbytes, file_offset)

    def close(self) -> None:
        self._handle.close()


def read_runs_async(
    files: Sequence[tuple[KvikioFile, str]],
    runs: Sequence[tuple[int, int, np.ndarray]],
    executor: concurrent.futures.Executor,
    trace: TraceHook | None = None,
) -> concurrent.futures.Future[np.ndarray]:
    """Read each run ``(file index, file offset, out view)`` of ``files`` (handle, url) on
    kvikio's pool. The future completes once kvikio touches no ``out`` any more: with no failed
    pages (the host checks nothing here), or the first error (a short file is a
    :class:`SnapshotCorruptError`). One thread of ``executor`` waits for kvikio (its ``get``
    lets the GIL go while it blocks: measured on the H200 host, another thread ran as fast
    during a wait as after it); ``trace`` gets one ``read`` span, from the start to the wait for
    the last piece returning. Runs are read in pieces of :func:`read_piece_bytes`."""
    begun = time.perf_counter()
    started = []
    threads = _STATE.get("threads", 1)  # set when the first KvikioFile configured the pool
    piece_bytes = read_piece_bytes(sum(out.nbytes for _, _, out in runs), threads)
    for file, file_offset, out in runs:
        handle, url = files[file]
        for start in range(0, out.nbytes, piece_bytes):
            piece = out[start : start + piece_bytes]
            pending = handle.read_async(piece, file_offset + start)
            started.append((pending, piece.nbytes, file_offset + start, url))
    result: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()

    def wait() -> None:
        error: BaseException | None = None
        read_bytes = 0
        for pending, wanted, file_offset, url in started:
            try:
                got = pending.get()  # every read is waited for, failed or not
            except BaseException as failure:  # kvikio raises RuntimeError on an I/O error
                error = error or SnapshotCorruptError(
                    f"reading {wanted} bytes at {file_offset} failed: {failure}", file=url
                )
                continue
            read_bytes += got
            if got < wanted and error is None:
                error = SnapshotCorruptError(
                    f"file ended at byte {file_offset + got}, {wanted - got} bytes short "
                    "(truncated?)",
                    file=url,
                )
        if trace is not None:
            trace("read", begun, time.perf_counter(), read_bytes)
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(np.empty(0, dtype=np.int64))

    executor.submit(wait)
    return result


def read_piece_bytes(slot_bytes: int, threads: int) -> int:
    """The bytes of each read a slot of ``slot_bytes`` is cut into, for a kvikio pool of
    ``threads``: a share per thread, in whole 64 KiB and at least :data:`MIN_PIECE_BYTES`,
    where that share is smaller than one task of the pool (:data:`TASK_BYTES`); otherwise the
    slot's whole runs (kvikio cuts each into tasks itself).

    kvikio cuts a read into tasks of ``TASK_BYTES``, so a small slot (a 16-token prefix of 32
    layers: 2 MB) was one task on one thread; cut over the threads it reads in a fraction of
    the time (on the H200 host a 16-token restore's first touch 2.32 -> 2.03 ms, 80 layers
    2.86 -> 2.19; docs/benchmarks.md). A large slot is not cut finer: the pool completes
    the slots of a restore together whatever the cut (measured with 1, 2 and 4 MiB pieces
    and with kvikio's own: no cut made them complete in the order they were queued), so
    more pieces only add calls on the restoring thread.
    """
    share = -(-slot_bytes // max(threads, 1))
    if share >= TASK_BYTES:
        return max(slot_bytes, 1)
    share = -(-share // (64 << 10)) * (64 << 10)
    return max(MIN_PIECE_BYTES, share)
