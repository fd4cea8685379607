"""One future for work split over several futures."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any


class Completion:
    """A future for work split over several futures: it completes once every watched future is
    done (so no thread touches the caller's buffer any more), with ``None`` or the first failure.

    The first failure cancels the watched futures that have not started; ``on_done`` runs before
    the future completes; ``cancelled`` makes the error a cancelled piece reports.
    """

    def __init__(
        self,
        count: int,
        *,
        on_done: Callable[[], None] | None = None,
        cancelled: Callable[[], BaseException],
    ) -> None:
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._remaining = count
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._on_done = on_done
        self._cancelled = cancelled
        self._watched: list[concurrent.futures.Future[Any]] = []
        if count == 0:
            self._finish()

    def watch(self, future: concurrent.futures.Future[Any]) -> None:
        self._watched.append(future)
        future.add_done_callback(self._one_done)

    def _one_done(self, future: concurrent.futures.Future[Any]) -> None:
        error = self._cancelled() if future.cancelled() else future.exception()
        with self._lock:
            self._remaining -= 1
            first_failure = error is not None and self._error is None
            if first_failure:
                self._error = error
            last = self._remaining == 0
        if first_failure:
            for other in list(self._watched):
                other.cancel()
        if last:
            self._finish()

    def _finish(self) -> None:
        # The watched futures call back into this object: drop them, or the cycle would keep
        # the caller's buffer (a whole staging pool, through its done callbacks) alive until
        # the garbage collector runs.
        self._watched = []
        if self._on_done is not None:
            self._on_done()
            self._on_done = None
        if self._error is not None:
            self.future.set_exception(self._error)
        else:
            self.future.set_result(None)
