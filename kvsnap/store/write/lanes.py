"""Serial lanes: one writer's ordered work on a process-wide pool, without a thread of its own.

A snapshot writer writes each file front to back with one write in flight (see
``tuning.WRITE_POOL_THREADS``), and streams every fsspec file through one ordered lane.
Creating an executor per writer cost three new threads per snapshot (~7 ms of a small capture,
holding the GIL the engine's thread needs). A :class:`SerialLane` keeps the order and the one
item in flight, but runs its items on a shared pool: the next item is handed to the pool when
the previous one completes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any


class SerialLane:
    """Runs submitted callables one at a time, in submission order, on ``executor``.

    :meth:`submit` returns a future like an executor's: it can be cancelled until its item
    starts. :meth:`shutdown` waits until no item of this lane runs or is queued (cancelling the
    queued ones with ``cancel_futures``); the shared executor itself is left running.
    """

    def __init__(self, executor: concurrent.futures.Executor) -> None:
        self._executor = executor
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[concurrent.futures.Future[Any], Callable[[], Any]]]
        self._queue = collections.deque()
        self._busy = False  # an item of this lane is on the executor (queued or running)
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False

    def submit(self, work: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Queue ``work`` after everything submitted before; returns its future."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit to a lane that was shut down")
            self._queue.append((future, work))
            start = not self._busy
            if start:
                self._busy = True
                self._idle.clear()
        if start:
            self._hand_over()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new work; with ``cancel_futures`` cancel the items not started; with ``wait``
        return once the item running (if any) and every queued one are done."""
        with self._lock:
            self._closed = True
            pending = list(self._queue) if cancel_futures else []
        for future, _ in pending:
            future.cancel()  # the runner skips cancelled items
        if wait:
            self._idle.wait()

    def _hand_over(self) -> None:
        """Give the executor one run of this lane's next item."""
        try:
            self._executor.submit(self._run_next)
        except BaseException as error:  # a pool shut down at interpreter exit
            self._fail_queued(error)
            raise

    def _run_next(self) -> None:
        """Run the next item not cancelled, then hand the following one to the executor."""
        while True:
            with self._lock:
                if not self._queue:
                    self._busy = False
                    self._idle.set()
                    return
                future, work = self._queue.popleft()
            if future.set_running_or_notify_cancel():
                break
        try:
            result = work()
        except BaseException as error:
            future.set_exception(error)
        else:
            future.set_result(result)
        with self._lock:
            more = bool(self._queue)
            if not more:
                self._busy = False
                self._idle.set()
        if more:
            # Through the pool again, not a loop here: lanes share the pool's threads fairly.
            self._hand_over()

    def _fail_queued(self, error: BaseException) -> None:
        with self._lock:
            pending = list(self._queue)
            self._queue.clear()
            self._busy = False
            self._idle.set()
        for future, _ in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(error)


class TaskGroup:
    """One writer's share of a shared pool: submits to ``executor`` and remembers what is not
    done yet, so :meth:`shutdown` waits for (or cancels) this writer's work only."""

    def __init__(self, executor: concurrent.futures.Executor) -> None:
        self._executor = executor
        self._lock = threading.Lock()
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._closed = False

    def submit(self, work: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``work`` on the pool; returns its future."""
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit to a task group that was shut down")
            future = self._executor.submit(work)
            self._pending.add(future)
        future.add_done_callback(self._forget)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new work; with ``cancel_futures`` cancel the tasks not started; with ``wait``
        return once every task of this group is done."""
        with self._lock:
            self._closed = True
            pending = list(self._pending)
        if cancel_futures:
            for future in pending:
                future.cancel()
        if wait:
            concurrent.futures.wait(pending)

    def _forget(self, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.discard(future)
