"""The trace hook: spans of pipeline work reported to an optional callback."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

TraceHook = Callable[[str, float, float, int], None]
"""``trace(kind, started, finished, nbytes)``: one span of pipeline work (``time.perf_counter``
seconds), called from worker threads; it must be cheap and thread-safe (``list.append`` is)."""


@contextlib.contextmanager
def traced(trace: TraceHook | None, kind: str, nbytes: int = 0) -> Iterator[None]:
    """Report the time the ``with`` body takes to ``trace`` as a ``kind`` span (when tracing)."""
    if trace is None:
        yield
        return
    started = time.perf_counter()
    try:
        yield
    finally:
        trace(kind, started, time.perf_counter(), nbytes)
