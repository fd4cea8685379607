"""The scheduler's remote lookups: a local miss looked up on the remote tier, never waited for.

vLLM's scheduler asks the connector how many tokens of a waiting request it can load
(``get_num_new_matched_tokens``) step after step until it gets a number: ``None`` means "not
yet, ask again on a later step" (vLLM 0.32's ``KVConnectorBase_V1`` contract, what its own
offloading tiers answer while a lookup is in flight). :class:`RemoteFetcher` gives the
scheduler that answer:

* :meth:`~RemoteFetcher.start` begins a request's lookup: the chunks of its prompt after those
  the local store holds, each fetched on one of ``remote_fetches`` threads
  (:func:`~kvsnap.engines.vllm.remote_publish.fetch_into_store`: one ``GET``, checked as a
  local chunk, published into the local store). All of them at once: fetches overlap, and
  the chunk a later span needs does not wait for the one before. A chunk another request is
  fetching already is shared, not fetched twice.
* :meth:`~RemoteFetcher.pending` says whether the request is still waiting: until its chunks
  are in the store, or one of them turned out to be a miss (then the rest do not matter), or
  its ``remote_deadline_s`` passes (``deadline``, a failure of the remote: counted, and the
  remote is paused like a slow one). The scheduler then matches the prompt in the local store
  as always, the fetched chunks included.

Nothing here blocks: starting a lookup queues work, and asking about it reads futures. While
the remote is paused after failures (:class:`~kvsnap.engines.vllm.remote_health.RemoteHealth`)
or ``4 * remote_fetches`` fetches are queued, no lookup starts and the request is computed at
once. Each lookup ends in one ``remote_lookup`` event (its outcome, chunks and tokens).

Nothing here needs vLLM.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_futures
from dataclasses import dataclass, field

import numpy as np

from kvsnap.engines.vllm.events import EventLog
from kvsnap.engines.vllm.remote_health import RemoteHealth, failure_kind
from kvsnap.engines.vllm.remote_publish import (
    FetchTarget,
    LocalPublish,
    fetch_into_store,
    record_fetch,
)
from kvsnap.engines.vllm.remote_store import RemoteStore

#: Fetches queued or running, per fetch thread, past which no lookup starts.
QUEUED_PER_THREAD = 4


@dataclass
class _Lookup:
    """One request's remote lookup: its chunks' fetches in prompt order."""

    request_id: str
    targets: list[FetchTarget]
    futures: list[Future[bool]]
    started: float
    deadline: float
    block_size: int
    done: bool = False
    #: Local paths of the chunks this lookup brought into the store.
    fetched: set[str] = field(default_factory=set)


class RemoteFetcher:
    """Remote lookups of one scheduler (module notes). ``remote`` is the remote tier,
    ``local`` how its chunks enter the local store."""

    def __init__(
        self,
        remote: RemoteStore,
        local: LocalPublish,
        events: EventLog,
        *,
        deadline_s: float,
        fetches: int,
    ) -> None:
        self.remote = remote
        self.local = local
        self.events = events
        self.deadline_s = deadline_s
        self.health = RemoteHealth(events, remote.url)
        self._max_queued = QUEUED_PER_THREAD * fetches
        self._pool = ThreadPoolExecutor(max_workers=fetches, thread_name_prefix="kvsnap-fetch")
        #: Records of fetches (one ``PUT`` each), on a thread of their own: a lookup never
        #: waits for them, and they never hold a fetch thread.
        self._records = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsnap-record")
        self._lock = threading.Lock()
        #: Fetches queued or running, by store key: shared by the lookups that need them.
        self._inflight: dict[str, Future[bool]] = {}
        self._lookups: dict[str, _Lookup] = {}

    def probe(self) -> Future[None]:
        """Ask the remote, on a fetch thread, whether it answers; say so either way
        (``remote_ready``, or ``remote_unreachable`` at WARNING: the engine serves from its
        local store meanwhile). The engine's start never waits for it."""
        return self._pool.submit(self._probe)

    def _probe(self) -> None:
        try:
            self.remote.probe()
        except Exception as error:
            kind = failure_kind(error)
            self.health.failed(kind, error)
            self.events.emit(
                "remote_unreachable",
                logging.WARNING,
                url=self.remote.url,
                kind=kind,
                error=f"{type(error).__name__}: {error}"[:500],
                message="the remote store cannot be reached: requests are served from the "
                "local store and computed, and the remote is asked again later",
            )
            return
        self.health.succeeded()
        self.events.emit("remote_ready", url=self.remote.url)

    def consulted(self, request_id: str) -> bool:
        """Whether a lookup was started for ``request_id`` (one per request)."""
        return request_id in self._lookups

    def start(
        self,
        request_id: str,
        prompt: np.ndarray,
        chain: Sequence[str],
        spans: Sequence[tuple[int, int]],
        block_size: int,
    ) -> bool:
        """Begin the lookup of the chunks ``spans`` (``[start, end)`` blocks, in prompt order)
        of ``prompt``; whether it began (not while the remote is paused or busy: the request
        is then computed, and the outcome logged)."""
        now = time.monotonic()
        lookup = _Lookup(request_id, [], [], now, now + self.deadline_s, block_size)
        self._lookups[request_id] = lookup
        if not spans:
            lookup.done = True
            return False
        if not self.health.available(now):
            self._finish(lookup, "paused")
            return False
        with self._lock:
            if len(self._inflight) >= self._max_queued:
                busy = True
            else:
                busy = False
                for start, end in spans:
                    target = self._target(request_id, prompt, chain, start, end)
                    lookup.targets.append(target)
                    lookup.futures.append(self._fetch_of(target))
        if busy:
            self._finish(lookup, "busy")
            return False
        return True

    def _target(
        self, request_id: str, prompt: np.ndarray, chain: Sequence[str], start: int, end: int
    ) -> FetchTarget:
        key = chain[end - 1]
        path = str(self.local.store.chunk_path(key))
        return FetchTarget(key, path, start, end - start, prompt, chain, request_id)

    def _fetch_of(self, target: FetchTarget) -> Future[bool]:
        """The fetch of ``target``'s chunk: the one in flight, or a new one (under the lock)."""
        future = self._inflight.get(target.key)
        if future is not None:
            return future
        future = self._pool.submit(
            fetch_into_store,
            target,
            self.remote,
            self.local,
            self.health,
            self.events,
            record=self._record_later,
        )
        self._inflight[target.key] = future
        future.add_done_callback(lambda _: self._fetched(target.key, future))
        return future

    def _record_later(self, target: FetchTarget) -> None:
        self._records.submit(record_fetch, target, self.remote, self.health)

    def wait_for_fetches(self) -> None:
        """Block until the fetches queued or running now are done (those of lookups that
        ended already included)."""
        with self._lock:
            futures = list(self._inflight.values())
        wait_for_futures(futures)

    def wait_for_records(self) -> None:
        """Block until the records of the fetches done so far are written."""
        self._records.submit(lambda: None).result()

    def _fetched(self, key: str, future: Future[bool]) -> None:
        with self._lock:
            if self._inflight.get(key) is future:
                del self._inflight[key]

    def pending(self, request_id: str) -> bool:
        """Whether ``request_id``'s lookup still waits for a fetch (vLLM is answered "not
        yet"); once it does not, its outcome is logged."""
        lookup = self._lookups.get(request_id)
        if lookup is None or lookup.done:
            return False
        for position, future in enumerate(lookup.futures):
            if not future.done():
                if time.monotonic() < lookup.deadline:
                    return True
                self.health.failed(
                    "deadline",
                    f"{self.deadline_s:g} s passed with {len(lookup.futures) - position} "
                    "fetches unfinished",
                    path=lookup.targets[position].path,
                )
                self._finish(lookup, "deadline")
                return False
            if future.cancelled() or future.exception() is not None or not future.result():
                self._finish(lookup, "miss" if position == 0 else "partial")
                return False
            lookup.fetched.add(lookup.targets[position].path)
        self._finish(lookup, "hit")
        return False

    def _finish(self, lookup: _Lookup, outcome: str) -> None:
        """End ``lookup`` with ``outcome``: fetches no other lookup waits for and that have
        not begun are dropped; one ``remote_lookup`` event."""
        lookup.done = True
        for future in lookup.futures:
            if not future.done() and not self._needed_elsewhere(future, lookup):
                future.cancel()  # succeeds only for a fetch not yet begun
        blocks = sum(t.num_blocks for t in lookup.targets if t.path in lookup.fetched)
        self.events.emit(
            "remote_lookup",
            request=lookup.request_id,
            outcome=outcome,
            chunks=len(lookup.fetched),
            tokens=blocks * lookup.block_size,
            seconds=round(time.monotonic() - lookup.started, 6),
        )

    def _needed_elsewhere(self, future: Future[bool], lookup: _Lookup) -> bool:
        """Whether a lookup other than ``lookup`` still waits for ``future``."""
        return any(
            other is not lookup and not other.done and future in other.futures
            for other in self._lookups.values()
        )

    def fetched_paths(self, request_id: str) -> set[str]:
        """Local paths of the chunks ``request_id``'s lookup brought into the store."""
        lookup = self._lookups.get(request_id)
        return set() if lookup is None else lookup.fetched

    def forget(self, request_id: str) -> None:
        """The request finished: its lookup (ended or not) is dropped."""
        lookup = self._lookups.pop(request_id, None)
        if lookup is not None and not lookup.done:
            self._finish(lookup, "abandoned")

    def shutdown(self) -> None:
        """Stop the fetch threads, dropping the fetches not yet begun (and records of fetches
        not yet written: only LRU times are lost)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._records.shutdown(wait=False, cancel_futures=True)
