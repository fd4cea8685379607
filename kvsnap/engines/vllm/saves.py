"""The worker's save queue: snapshot writes behind the engine, and vLLM's async save contract.

A step's saves run on one background thread (:class:`SaveQueue`), in the order they were
queued. Each :class:`PendingSave` carries a ``copied`` flag, set once the save no longer reads
the engine's blocks (its copy from the cache completed, it was skipped, or it failed) — usually
long before its file is written. vLLM must not free and reuse a request's blocks before then:
the scheduler side holds the blocks of every request it planned a save for
(``request_finished`` returns ``delay_free``), and :meth:`SaveQueue.finished` names those
requests, once they have finished and all their copies are done, for the worker's
``get_finished``. A preempted request (its blocks freed without ``request_finished``) is
waited for before the next forward pass can overwrite them (:meth:`SaveQueue.wait_copied`).

At shutdown (:meth:`SaveQueue.shutdown`) the queue waits for its saves up to a bound; once it
passes, :attr:`SaveQueue.abandoning` is set and the runs still to come stop unpublished
(``SaveAbandonedError``, logged as ``save_abandoned``), so a shutdown takes at most the bound
plus what the save then in progress needs to reach its next staging slot or its publish.

Nothing here needs vLLM or CUDA.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field

from kvsnap.engines.vllm.events import EventLog
from kvsnap.engines.vllm.specs import SaveSpec
from kvsnap.errors import RankFailedError, SaveAbandonedError


@dataclass(eq=False)
class PendingSave:
    """One queued save: its spec and whether it is done reading the engine's blocks."""

    spec: SaveSpec
    copied: threading.Event = field(default_factory=threading.Event)


#: A save's work, run on the queue's thread: copy ``save``'s blocks, write its snapshot.
SaveRun = Callable[[PendingSave], None]


@dataclass(frozen=True)
class DrainReport:
    """What a :meth:`SaveQueue.shutdown` found and did."""

    #: Saves queued or running when the shutdown began.
    pending: int
    #: Of those, the saves that stopped unpublished once the bound had passed.
    abandoned: int
    #: Seconds the shutdown took, the save in progress at the bound included.
    seconds: float


class SaveQueue:
    """Runs saves on one background thread; tracks which requests' blocks are still read.

    All methods are called from the engine's thread; only the runs execute on the queue's.
    """

    def __init__(self, events: EventLog, max_pending: int) -> None:
        self.events = events
        self.max_pending = max_pending
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsnap-writer")
        #: Submitted steps, oldest first: their saves and the future of their run.
        self._steps: deque[tuple[Sequence[PendingSave], Future[None]]] = deque()
        #: Per request with planned saves: the ``copied`` flags not yet seen set.
        self._copies: dict[str, list[threading.Event]] = {}
        #: Requests vLLM finished whose blocks this queue still holds (reported once copied).
        self._finishing: set[str] = set()
        #: Set once a shutdown's bound has passed: the runs still to come stop unpublished.
        self.abandoning = threading.Event()
        #: Saves that ended as ``save_abandoned`` (counted on the queue's thread).
        self._abandoned = 0
        #: Saves submitted and not yet ended, written, skipped or failed.
        self._unfinished = 0
        self._unfinished_lock = threading.Lock()

    def submit(self, saves: Sequence[PendingSave], run: SaveRun) -> None:
        """Run ``run(save)`` for each of ``saves``, in order, on the queue's thread.

        Waits first (the engine's thread) only while ``max_pending`` saves of earlier steps
        are still queued. A run that raises is logged as ``save_failed``; every save's
        ``copied`` is set once its run returns or raises.
        """
        self.track(saves)
        with self._unfinished_lock:
            self._unfinished += len(saves)
        self._reap()
        while self._steps and self._queued() >= self.max_pending:
            self._steps[0][1].exception()  # the oldest step's run never raises; wait for it
            self._reap()
        self._steps.append((saves, self._executor.submit(self._run_step, saves, run)))

    def track(self, saves: Iterable[PendingSave]) -> None:
        """Count ``saves`` as their requests' (``copied`` flags already set or not)."""
        for save in saves:
            flags = self._copies.setdefault(save.spec.request_id, [])
            flags[:] = [flag for flag in flags if not flag.is_set()]
            flags.append(save.copied)

    def _run_step(self, saves: Sequence[PendingSave], run: SaveRun) -> None:
        for save in saves:
            try:
                run(save)
            except Exception as error:  # one save's failure is logged; the others still run
                abandoned = self._was_abandoned(error)
                self._abandoned += abandoned
                self.events.emit(
                    "save_abandoned" if abandoned else "save_failed",
                    logging.WARNING if abandoned else logging.ERROR,
                    request=save.spec.request_id,
                    path=save.spec.path,
                    error=f"{type(error).__name__}: {error}",
                )
            finally:
                save.copied.set()
                with self._unfinished_lock:
                    self._unfinished -= 1

    def _was_abandoned(self, error: Exception) -> bool:
        """Whether ``error`` ended a save because the shutdown's bound passed: this rank's
        own ``SaveAbandonedError``, or, at TP > 1, the failure every rank reports once a rank
        abandoned its part."""
        if isinstance(error, SaveAbandonedError):
            return True
        return isinstance(error, RankFailedError) and self.abandoning.is_set()

    def _queued(self) -> int:
        return sum(len(saves) for saves, future in self._steps if not future.done())

    def _reap(self) -> None:
        while self._steps and self._steps[0][1].done():
            self._steps.popleft()

    def finished(self, finished_req_ids: Iterable[str]) -> set[str]:
        """The requests, finished now or before (``finished_req_ids``), that have saves and
        whose blocks no save reads any more: vLLM may free their blocks. Each is named once."""
        self._finishing.update(rid for rid in finished_req_ids if rid in self._copies)
        done = {rid for rid in self._finishing if all(flag.is_set() for flag in self._copies[rid])}
        for rid in done:
            del self._copies[rid]
        self._finishing -= done
        return done

    def wait_copied(self, request_ids: Iterable[str]) -> None:
        """Block until no save reads the blocks of ``request_ids`` (preempted requests)."""
        for rid in request_ids:
            for flag in self._copies.get(rid, ()):
                flag.wait()

    def drain(self) -> None:
        """Wait for every queued save to be written (or to fail)."""
        while self._steps:
            self._steps.popleft()[1].exception()

    def shutdown(self, bound_s: float) -> DrainReport:
        """Wait up to ``bound_s`` seconds for the queued saves, abandon the rest, stop the
        queue's thread.

        Once the bound passes, :attr:`abandoning` is set: each save still to come stops
        before it publishes anything (its run raises ``SaveAbandonedError``), and the save in
        progress stops at its next staging slot (or publishes, if its pages are all written
        already). Returns once the queue's thread has ended.
        """
        started = time.monotonic()
        with self._unfinished_lock:
            pending = self._unfinished
        futures = [future for _, future in self._steps]
        _, not_done = wait_for_futures(futures, timeout=bound_s)
        if not_done:
            self.abandoning.set()
        self._executor.shutdown(wait=True)
        self._steps.clear()
        return DrainReport(pending, self._abandoned, time.monotonic() - started)
