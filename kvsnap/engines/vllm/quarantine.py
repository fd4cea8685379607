"""Chunks that failed a check, moved aside and logged, by the scheduler and by every worker.

:class:`Quarantine` moves a chunk into ``quarantine/`` (:meth:`~kvsnap.engines.vllm.
prefix_store.PrefixStore.quarantine`) and logs a ``quarantine`` event. Where the store's
directories make the move fail (a file or a link where ``quarantine`` or ``chunks/HH``
belongs, a link to another filesystem: ``ENOTDIR``, ``ELOOP``, ``EXDEV``, ...), the chunk stays
where it is, is missed again each time it is matched, and the failure is one
``quarantine_skipped`` warning per chunk and file version: a co-writer of the store costs
misses, never an exception in vLLM's scheduler or worker.

Nothing here needs vLLM.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvsnap.caches import BoundedLRU
from kvsnap.engines.vllm.events import EventLog
from kvsnap.engines.vllm.prefix_store import PrefixStore

#: Chunks whose skipped quarantine was said, remembered per process (then said again).
_SAID = 1024


class Quarantine:
    """Moves chunks of ``store`` that failed a check aside, logging to ``events``."""

    def __init__(self, store: PrefixStore, events: EventLog) -> None:
        self.store = store
        self.events = events
        self._said: BoundedLRU[tuple[str, int, int], bool] = BoundedLRU(_SAID)

    def __call__(self, *, request: str, path: str, reason: str) -> Path | None:
        """Quarantine the chunk at ``path`` for ``reason``; the moved file, or ``None`` (gone
        already, or skipped). The request is served either way (a miss)."""
        try:
            moved = self.store.quarantine(path)
        except OSError as error:
            self._skipped(request, path, reason, error)
            return None
        if moved is not None:
            self.events.emit(
                "quarantine",
                logging.WARNING,
                request=request,
                path=path,
                moved_to=str(moved),
                reason=reason,
            )
        return moved

    def _skipped(self, request: str, path: str, reason: str, error: OSError) -> None:
        """One warning per chunk and file version whose quarantine failed."""
        try:
            status = os.stat(path)
            version = (path, status.st_ino, status.st_mtime_ns)
        except OSError:
            version = (path, 0, 0)
        if self._said.get(version):
            return
        self._said.put(version, True)
        self.events.emit(
            "quarantine_skipped",
            logging.WARNING,
            request=request,
            path=path,
            reason=reason,
            error=f"{type(error).__name__}: {error}",
            message="the chunk stays where it is and is missed whenever it is matched",
        )
