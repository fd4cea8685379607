"""The store's process-wide thread pools, one per role and size, made on first use and kept.

Slot reads and their verification (``read``), the writers' hashing (``hash``) and their serial
write lanes (``write``) run on these pools: a snapshot starts no thread of its own (three per
snapshot cost ~7 ms of a small capture, holding the GIL the engine's thread needs). A pool
starts its threads only as concurrent work needs them, up to its size.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading

_EXECUTORS: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_EXECUTOR_LOCK = threading.Lock()


def _forget_executors_after_fork() -> None:
    """A forked child inherits the pools but none of their threads: an inherited pool that
    believes a worker idle never starts one, and its work would wait forever. The child starts
    its own pools on first use (and a lock held by another thread at the fork is replaced)."""
    global _EXECUTOR_LOCK
    _EXECUTOR_LOCK = threading.Lock()
    _EXECUTORS.clear()


os.register_at_fork(after_in_child=_forget_executors_after_fork)


def _stop_workers_at_exit() -> None:
    """Tell every pool's workers to stop once their queued work is done, before the
    interpreter joins its threads.

    ``concurrent.futures`` wakes only the workers it registered, and it registers a worker
    after starting it: a Ctrl-C that lands in between (the main thread submitting the work
    that starts a worker, as a capture does when its first write begins) leaves a worker no
    one wakes, and the process hangs at exit. Shutting the pool down wakes every worker of
    its queue, registered or not."""
    with _EXECUTOR_LOCK:
        executors = list(_EXECUTORS.values())
    for executor in executors:
        executor.shutdown(wait=False)


# Runs before the interpreter joins non-daemon threads (a plain ``atexit`` hook runs after).
threading._register_atexit(_stop_workers_at_exit)  # type: ignore[attr-defined]


@functools.cache
def cpu_count() -> int:
    """The cores of this machine, asked once: ``os.cpu_count`` reads ``/sys`` (about 12 us a
    call), which every open, slot read and writer paid to size a pool."""
    return os.cpu_count() or 1


def shared_executor(role: str, threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process-wide pool of ``role`` (``read``, ``hash``, ``write``) with ``threads``
    workers, created on first use and kept; each size of a role is a pool of its own."""
    key = f"{role}-{threads}"
    with _EXECUTOR_LOCK:
        executor = _EXECUTORS.get(key)
        if executor is None:
            executor = _EXECUTORS[key] = concurrent.futures.ThreadPoolExecutor(
                threads, thread_name_prefix=f"kvsnap-{role}"
            )
        return executor
