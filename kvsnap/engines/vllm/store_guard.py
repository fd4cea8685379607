"""Who may write the store, checked again while the engine runs.

At start-up the connector refuses a store that other users may write or that another user
owns, unless ``shared_store`` with a key (:func:`~kvsnap.engines.vllm.prefix_store.
check_store_directory`). A ``chmod 777`` later would open the running engine's store to
anyone: without a key, a chunk planted there would be served. :class:`StoreGuard` repeats the
start-up check at most once every :data:`RECHECK_S` seconds, from the scheduler before it
matches or plans a save and from a worker before it saves: while the store fails it, nothing
is served from it and nothing saved to it (one ``store_refused`` error when it starts, one
``store_accepted`` once the store passes again).

Nothing here needs vLLM.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from kvsnap.engines.vllm.events import EventLog
from kvsnap.engines.vllm.prefix_store import check_store_directory

#: Seconds between two checks of the store's mode and owner: one ``stat`` each.
RECHECK_S = 1.0


class StoreGuard:
    """The store ``root``'s mode and owner, checked as at start-up (``shared``, ``signed``) at
    most every ``interval_s`` seconds; :meth:`allows` says whether the store may be used."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        events: EventLog,
        *,
        shared: bool,
        signed: bool,
        interval_s: float = RECHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self.events = events
        self.shared = shared
        self.signed = signed
        self.interval_s = interval_s
        self._clock = clock
        self._checked_at = clock()  # the connector checked it at start-up
        self._problem: str | None = None

    def allows(self) -> bool:
        """Whether the store passed its last check (made now if the last is
        ``interval_s`` old)."""
        now = self._clock()
        if now - self._checked_at >= self.interval_s:
            self._checked_at = now
            self._recheck()
        return self._problem is None

    def _recheck(self) -> None:
        try:
            check_store_directory(self.root, shared=self.shared, signed=self.signed)
        except OSError as error:  # PermissionError: open to others, another user's
            problem: str | None = str(error)
        else:
            problem = None
        if problem is not None and self._problem is None:
            self.events.emit(
                "store_refused",
                logging.ERROR,
                path=os.fspath(self.root),
                error=problem,
                message="nothing is served from the store or saved to it until it is fixed",
            )
        elif problem is None and self._problem is not None:
            self.events.emit("store_accepted", path=os.fspath(self.root))
        self._problem = problem
