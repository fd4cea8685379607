"""Captures' mapped files unregistered and unmapped after the publish, off the caller's path.

A capture by DMA (:mod:`~kvsnap.store.hot.mapped_file`) ends with its file's mapping registered
with CUDA. Unregistering unpins every page and unmapping drops every page-table entry: 18 ms
of a 104 ms capture of 268 MB on the H200 machine, work the published snapshot does not need.
So once the file is published the writer hands its mappings to :func:`release_later`, which
unregisters and unmaps them on a one-thread background pool and returns at once.

What may be pending is bounded: past :data:`~kvsnap.store.base.tuning.PENDING_RELEASE_BYTES` of
mappings waiting, the caller releases its own now (so a caller capturing faster than the
driver unpins holds no more than the bound). Pending bytes are reported with the other
registered bytes (:func:`pending_bytes`, the hot tier's ``HotStats.capture_registered_bytes``).
:func:`wait_for_releases` waits until nothing is pending; ``kvsnap.clear_caches()`` calls it,
and at exit the pool's queued releases run before its thread is joined
(:mod:`~kvsnap.store.base.pools`). A forked child forgets its parent's pending releases: the
registrations are the parent's, and the parent releases them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from kvsnap.caches import register_cache_clear
from kvsnap.store.base import tuning
from kvsnap.store.base.pools import shared_executor
from kvsnap.store.hot.mapped_file import MappedFile


class _Pending:
    """The releases queued and not finished: how many, and the bytes their mappings cover."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.count = 0
        self.bytes = 0
        #: Of :attr:`bytes`, those of mappings registered with CUDA (pinned).
        self.registered_bytes = 0


_PENDING = _Pending()


def _forget_after_fork() -> None:
    global _PENDING
    _PENDING = _Pending()


os.register_at_fork(after_in_child=_forget_after_fork)


def release_later(mapped_files: Iterable[MappedFile]) -> None:
    """Unregister and unmap each of ``mapped_files`` on the background pool, or at once on
    this thread where queuing it would put more than ``tuning.PENDING_RELEASE_BYTES``
    pending (or the pool takes no more work: the interpreter is exiting). Every copy into
    the mappings has completed; nothing else uses them."""
    pending = _PENDING
    for mapped in mapped_files:
        with pending.changed:
            later = pending.bytes + mapped.size <= tuning.PENDING_RELEASE_BYTES
            if later:
                _count(pending, mapped.size, mapped.registered, 1)
        if later:
            try:
                shared_executor("release", 1).submit(_release, pending, mapped, mapped.registered)
                continue
            except RuntimeError:
                with pending.changed:
                    _count(pending, mapped.size, mapped.registered, -1)
        mapped.close()


def _release(pending: _Pending, mapped: MappedFile, registered: bool) -> None:
    try:
        mapped.close()
    finally:
        with pending.changed:
            _count(pending, mapped.size, registered, -1)
            pending.changed.notify_all()


def _count(pending: _Pending, size: int, registered: bool, sign: int) -> None:
    """Add (``sign`` 1) or take away (-1) one release of ``size`` bytes; under the lock."""
    pending.count += sign
    pending.bytes += sign * size
    if registered:
        pending.registered_bytes += sign * size


def pending_bytes() -> tuple[int, int]:
    """Bytes of captures' mappings queued for release and not yet released, and how many of
    them are registered with CUDA (pinned)."""
    with _PENDING.changed:
        return _PENDING.bytes, _PENDING.registered_bytes


@register_cache_clear
def wait_for_releases() -> None:
    """Return once no release is pending (one that failed is not raised: a mapping whose
    unmap fails stays until the process ends, which frees it)."""
    pending = _PENDING
    with pending.changed:
        pending.changed.wait_for(lambda: pending.count == 0)
