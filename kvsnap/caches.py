"""Process-wide caches: one bounded, thread-safe LRU, and one call that empties them all.

An engine process opens the same snapshots again and again, so kvsnap keeps what it worked
out (decoded headers, checked checksum tables, file placements, copy runs) for the next call.
Every such cache is bounded, and every one is emptied by :func:`clear_caches`: a
:class:`BoundedLRU` registers itself when made, and a cache of another kind (a
``functools.lru_cache``, a table keyed by layout objects) registers its clear function with
:func:`register_cache_clear`. This module imports nothing from kvsnap, so any layer can use it.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["BoundedLRU", "clear_caches", "register_cache_clear"]

_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")

#: What :func:`clear_caches` calls: plain functions, and weak references to the clear methods
#: of LRUs (an LRU made per object must not live as long as the process because of this list).
_CLEARS: list[Callable[[], None] | weakref.WeakMethod[Callable[[], None]]] = []
_CLEARS_LOCK = threading.Lock()


def register_cache_clear(clear: Callable[[], None]) -> Callable[[], None]:
    """Have :func:`clear_caches` call ``clear`` (e.g. an ``lru_cache``'s ``cache_clear``);
    returns ``clear``, so it can decorate a function."""
    with _CLEARS_LOCK:
        _CLEARS.append(clear)
    return clear


def clear_caches() -> None:
    """Empty every process-wide cache kvsnap keeps: decoded headers, checksum tables, file
    placements, copy runs, part layouts, the transfer policy, the hot tier's idle files, the
    spare capture files (removed), and whatever else registered (:func:`register_cache_clear`);
    it also waits for captures' mappings still being released after their publish. Nothing
    is lost but time: the next call works it out again.
    Pinned staging memory is not a cache: `kvsnap.pipeline.release_shared_staging` frees it.
    """
    with _CLEARS_LOCK:
        _CLEARS[:] = [entry for entry in _CLEARS if _resolve(entry) is not None]
        clears = [_resolve(entry) for entry in _CLEARS]
    for clear in clears:
        if clear is not None:
            clear()


def _resolve(
    entry: Callable[[], None] | weakref.WeakMethod[Callable[[], None]],
) -> Callable[[], None] | None:
    """The function an entry of :data:`_CLEARS` stands for; ``None`` once its LRU is gone."""
    return entry() if isinstance(entry, weakref.WeakMethod) else entry


class BoundedLRU(Generic[_K, _V]):
    """A dictionary of at most ``max_entries`` entries that drops the least recently used one
    when full; every method is safe to call from several threads. Registered with
    :func:`clear_caches` when made. Values are never ``None`` (:meth:`get`'s miss)."""

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[_K, _V] = OrderedDict()
        self._lock = threading.Lock()
        with _CLEARS_LOCK:
            _CLEARS.append(weakref.WeakMethod(self.clear))

    def get(self, key: _K) -> _V | None:
        """The value kept under ``key`` (now the most recently used), or ``None``."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: _K, value: _V) -> None:
        """Keep ``value`` under ``key``, dropping the least recently used entries past the
        bound (read when the entry is added, so a bound lowered meanwhile applies)."""
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def discard(self, key: _K) -> None:
        """Drop the entry under ``key``, if there is one."""
        with self._lock:
            self._entries.pop(key, None)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries
