"""The store-wide capacity lock, and a chunk committed within the store's bound under it.

With ``store_capacity_bytes`` every engine on a store commits its chunks under one lock, the
file :data:`CAPACITY_LOCK` at the store root (``flock``; the kernel releases a dead holder's):
the store is measured by listing it, pruned to make room (:mod:`~kvsnap.engines.vllm.eviction`)
and the staged chunk renamed into place (:func:`commit_within_capacity`), so the bound holds
however many engines share the store.

The lock is a file anyone who can write the store can tamper with, so:

* it is opened with ``O_NOFOLLOW`` (and ``O_NONBLOCK``, against a named pipe): a link planted
  in its place is refused, and no file is created where it points;
* it must be a regular file owned by this process's user or by root (any user's in a
  ``shared_store``);
* taking it is bounded (``wait_s``): a holder that keeps it past the wait makes the commit
  fail (:class:`CapacityLockError`, ``busy``) instead of stalling the save thread, and with it
  the engine's step once ``max_pending_writes`` saves are queued behind it.

Either failure drops the staged chunk: the save is skipped, the request served as always.

Nothing here needs vLLM.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from kvsnap.engines.vllm.eviction import ORPHAN_GRACE_S, StoreEntry, prune_measured, prune_store
from kvsnap.engines.vllm.prefix_store import committed_file
from kvsnap.engines.vllm.store_directories import directory_fd, relative_parts
from kvsnap.store import publish

#: The store-wide lock file (at the store root) that serializes commits within the bound.
CAPACITY_LOCK = ".kvsnap-capacity.lock"
#: How long a save waits for another engine's commit or prune to let the lock go before it is
#: skipped. A commit holds the lock for one listing of the store and a few deletions.
LOCK_WAIT_S = 1.0
#: How the lock is opened: never through a link, never blocking on a planted pipe, and only
#: read (``flock`` needs no more): nothing is opened for writing.
_LOCK_FLAGS = os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class CapacityLockError(Exception):
    """The capacity lock could not be taken: ``busy`` when another process held it past the
    wait, else refused (a link, not a regular file, another user's file, unreadable)."""

    def __init__(self, message: str, *, busy: bool) -> None:
        super().__init__(message)
        self.busy = busy


def _open_lock(root: str | os.PathLike[str], shared: bool) -> int:
    path = Path(root) / CAPACITY_LOCK
    try:
        fd = os.open(path, _LOCK_FLAGS, publish.file_mode(os.fspath(root)))
    except OSError as error:
        raise CapacityLockError(
            f"cannot open the store's lock {path}: {error.strerror} (a link planted there?)",
            busy=False,
        ) from error
    status = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(status.st_mode):
        problem = "is not a regular file"
    elif not shared and status.st_uid not in (os.geteuid(), 0):
        problem = f"belongs to user id {status.st_uid}, not to this process ({os.geteuid()})"
    if problem is not None:
        os.close(fd)
        raise CapacityLockError(f"the store's lock {path} {problem}", busy=False)
    return fd


def _take(fd: int, wait_s: float | None) -> None:
    """``flock`` ``fd`` exclusively, waiting at most ``wait_s`` seconds (``None``: for as long
    as it takes)."""
    if wait_s is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + wait_s
    # Asked often: a holder that lets go only for an instant between two of its own turns (a
    # sampler listing the store in a loop) must not starve a commit.
    pause = 0.0002
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CapacityLockError(
                    f"another process held the store's lock for more than {wait_s:g} s",
                    busy=True,
                ) from None
            time.sleep(min(pause, left))
            pause = min(2 * pause, 0.002)


@contextlib.contextmanager
def capacity_lock(
    root: str | os.PathLike[str], *, wait_s: float | None = None, shared: bool = False
) -> Iterator[None]:
    """Hold the store-wide lock that serializes commits within the bound (every engine on the
    store takes it; a dead holder's lock is released by the kernel). Waits at most ``wait_s``
    seconds for it (``None``: as long as it takes, for tools such as a sampler); raises
    :class:`CapacityLockError` when it cannot be had (see the module's notes); ``shared``:
    a lock file of another user is accepted (a deliberate multi-user store)."""
    fd = _open_lock(root, shared)
    try:
        _take(fd, wait_s)
        yield
    finally:
        os.close(fd)


def lock_is_free(root: str | os.PathLike[str], *, shared: bool = False) -> bool:
    """Whether the capacity lock can be taken at once (it is let go again straight away)."""
    try:
        with capacity_lock(root, wait_s=0.0, shared=shared):
            return True
    except CapacityLockError:
        return False


def commit_within_capacity(
    root: str | os.PathLike[str],
    staged: str | os.PathLike[str],
    path: str | os.PathLike[str],
    max_bytes: int,
    *,
    min_idle_s: float = 0.0,
    wait_s: float | None = LOCK_WAIT_S,
    shared: bool = False,
) -> tuple[bool, list[StoreEntry]]:
    """Commit the chunk written at ``staged`` as ``path`` so that the store ``root`` stays
    within ``max_bytes``; returns whether it was committed and the entries pruned for it.

    Under the store-wide :func:`capacity_lock` (waited for at most ``wait_s``): when the store
    holds the chunk already (another engine committed it) the staged file is dropped;
    otherwise the store, measured by listing it (every engine's chunks), is pruned to
    ``max_bytes`` less the chunk's size, then the chunk is renamed into place (by name in
    its directory, opened without following links), unless pruning could not make room (the
    chunks left were all used within ``min_idle_s``): then the staged file is dropped and the
    save skipped, a cache that is full of chunks in use keeps them. So however many engines
    share the store, a commit never takes it over the bound. When the lock cannot be had the
    staged file is dropped and :class:`CapacityLockError` raised.
    """
    staged, final = Path(staged), Path(path)
    try:
        with (
            capacity_lock(root, wait_s=wait_s, shared=shared),
            directory_fd(root, relative_parts(root, final.parent)) as directory,
        ):
            if committed_file(final) is not None:
                os.unlink(staged.name, dir_fd=directory)
                return False, []
            size = os.stat(staged.name, dir_fd=directory, follow_symlinks=False).st_size
            removed, held = prune_measured(
                root, max(max_bytes - size, 0), min_idle_s, ORPHAN_GRACE_S, None
            )
            if held + size > max_bytes:
                os.unlink(staged.name, dir_fd=directory)
                return False, removed
            os.replace(staged.name, final.name, src_dir_fd=directory, dst_dir_fd=directory)
            os.fsync(directory)
    except CapacityLockError:
        with contextlib.suppress(OSError, ValueError):
            with directory_fd(root, relative_parts(root, staged.parent)) as directory:
                os.unlink(staged.name, dir_fd=directory)
        raise
    return True, removed


def prune_locked(
    root: str | os.PathLike[str],
    max_bytes: int,
    *,
    min_idle_s: float = 0.0,
    wait_s: float | None = LOCK_WAIT_S,
    shared: bool = False,
) -> list[StoreEntry]:
    """:func:`~kvsnap.engines.vllm.eviction.prune_store` under the store-wide
    :func:`capacity_lock` (after a write committed without staging: a parted chunk, whose
    index rank 0 publishes); :class:`CapacityLockError` when the lock cannot be had."""
    with capacity_lock(root, wait_s=wait_s, shared=shared):
        return prune_store(root, max_bytes, min_idle_s=min_idle_s)
