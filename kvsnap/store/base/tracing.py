"""The trace hook: spans of pipeline work reported to an optional callback."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

TraceHook = Callable[[str, float, float, int], None]
"""``trace(kind, started, finished, nbytes)``: one span of pipeline work (``time.perf_counter``
seconds), called from worker threads; it must be cheap and thread-safe (``list.append`` is)."""


#: What :func:`traced` gives when nothing traces: one context manager that does nothing,
#: shared (a new generator-based one per ``with`` cost more than the small steps it wraps).
_UNTRACED = contextlib.nullcontext()


def traced(
    trace: TraceHook | None, kind: str, nbytes: int = 0
) -> contextlib.AbstractContextManager[None]:
    """Report the time the ``with`` body takes to ``trace`` as a ``kind`` span (when tracing)."""
    if trace is None:
        return _UNTRACED
    return _span(trace, kind, nbytes)


@contextlib.contextmanager
def _span(trace: TraceHook, kind: str, nbytes: int) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        trace(kind, started, time.perf_counter(), nbytes)
