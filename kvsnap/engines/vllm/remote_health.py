"""What went wrong with the remote tier, counted and said once per kind, and when to try again.

Every failure of a remote request is a miss (a fetch) or a skipped upload, never a failed
request: :func:`failure_kind` names it from the exception (fsspec and s3fs translate S3's
answers into Python exceptions whose cause is botocore's error; aiohttp's and botocore's
connection errors come through as themselves), and :class:`RemoteHealth` counts it, logs the
first of each kind (``remote_failure``, at WARNING) and, for the kinds that say the remote is
down or overloaded, stops asking it for a while (:meth:`RemoteHealth.available`): a request
that would only wait out a deadline against a dead server is computed at once instead. The
pause starts at :data:`RETRY_FIRST_S` and doubles, up to :data:`RETRY_MAX_S`, each time the
first request after it fails too; one request that works ends it (``remote_available``).

Nothing here needs vLLM or the network.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator

from kvsnap.engines.vllm.events import EventLog

#: Kinds of failure, what each means.
FAILURE_KINDS = {
    "unreachable": "the remote cannot be reached (connection refused or closed, no route)",
    "timeout": "the remote did not answer within its timeout",
    "deadline": "a request's remote lookup did not finish by its deadline (slow remote)",
    "forbidden": "the remote refused the credentials (403; without s3:ListBucket S3 answers a "
    "missing object with 403 too)",
    "server_error": "the remote failed the request (5xx)",
    "throttled": "the remote asked to slow down (503 SlowDown, 429)",
    "truncated": "a response body ended before its length",
    "invalid": "a fetched object failed the chunk check (signature, identity, checksums)",
    "error": "another error",
}
#: Kinds after which the remote is left alone for a while: it is down, slow or overloaded.
PAUSING_KINDS = frozenset({"unreachable", "timeout", "deadline", "server_error", "throttled"})
#: The first pause after such a failure, and the longest.
RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _http_status(error: BaseException) -> tuple[int | None, str]:
    """The HTTP status and error code of a botocore ``ClientError`` (``None``, ``""``
    otherwise)."""
    response = getattr(error, "response", None)
    if not isinstance(response, dict):
        return None, ""
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = str(response.get("Error", {}).get("Code", ""))
    return (int(status) if status is not None else None), code


def failure_kind(error: BaseException) -> str:
    """The kind (:data:`FAILURE_KINDS`) of a failed remote request, or ``not_found`` for an
    object that is not there (a plain miss, no failure)."""
    for cause in _chain(error):
        status, code = _http_status(cause)
        if status in (429, 503) or code in ("SlowDown", "Throttling", "RequestLimitExceeded"):
            return "throttled"
        if status == 403:
            return "forbidden"
        if status is not None and status >= 500:
            return "server_error"
        if status == 404:
            return "not_found"
        name = type(cause).__name__
        if "ContentLength" in name or "Payload" in name or "IncompleteRead" in name:
            return "truncated"
        if isinstance(cause, TimeoutError | asyncio.TimeoutError) or "Timeout" in name:
            return "timeout"
        if isinstance(cause, ConnectionError) or name in (
            "EndpointConnectionError",
            "ConnectionClosedError",
            "ClientConnectorError",
            "ServerDisconnectedError",
        ):
            return "unreachable"
    if isinstance(error, FileNotFoundError):
        return "not_found"
    if isinstance(error, PermissionError):
        return "forbidden"
    return "error"


class RemoteHealth:
    """Counts a remote's failures by kind, says the first of each, and pauses the remote after
    the kinds that say it is down (:data:`PAUSING_KINDS`). Thread-safe."""

    def __init__(self, events: EventLog, url: str) -> None:
        self.events = events
        self.url = url
        #: Failures so far, by kind.
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._paused_until = 0.0
        self._pause_s = 0.0

    def available(self, now: float | None = None) -> bool:
        """Whether the remote may be asked now (not paused after a failure)."""
        return (time.monotonic() if now is None else now) >= self._paused_until

    def failed(self, kind: str, error: BaseException | str, *, path: str | None = None) -> None:
        """Count a failure of ``kind``; say it if it is the first of its kind; pause the
        remote after a :data:`PAUSING_KINDS` one."""
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            first = self.counts[kind] == 1
            if kind in PAUSING_KINDS:
                now = time.monotonic()
                if now >= self._paused_until:  # not already paused: the pause grows
                    self._pause_s = min(
                        RETRY_MAX_S, 2 * self._pause_s if self._pause_s else RETRY_FIRST_S
                    )
                    self._paused_until = now + self._pause_s
        if first:
            message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            self.events.emit(
                "remote_failure",
                logging.WARNING,
                url=self.url,
                kind=kind,
                path=path,
                error=message[:500],
                message=f"{FAILURE_KINDS.get(kind, kind)}: counted as a miss, and said once "
                "per kind",
            )

    def succeeded(self) -> None:
        """A request was answered: end a pause (said once, ``remote_available``)."""
        with self._lock:
            was_paused = self._pause_s > 0
            self._pause_s = 0.0
            self._paused_until = 0.0
        if was_paused:
            self.events.emit("remote_available", url=self.url, failures=dict(self.counts))
