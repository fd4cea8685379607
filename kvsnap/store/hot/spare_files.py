"""Spare capture files: the next DMA capture's file, made ready in the background.

A capture by DMA into a memory-backed file (:mod:`~kvsnap.store.hot.mapped_file`) spends most of
its time bringing the new file's pages into being (allocated, zeroed, mapped: 55 ms of 268 MB
on the H200 machine) and pinning them (13 ms), against 6 ms of copies. None of that depends on
what the capture holds. So after a DMA capture publishes a single-file snapshot, the writer asks
:meth:`SpareFiles.replenish` for a spare in the same directory: a background thread creates a
temporary file there (named and ``flock``ed as the writers' own, :func:`~kvsnap.store.files.publish.
create_temp`, after the snapshot just published), sizes it to that snapshot's size rounded up to
:data:`SPARE_SIZE_STEP`, maps it, populates it and (``tuning.SPARE_CAPTURE_FILES_REGISTERED``)
registers it. The next DMA capture into the directory whose file fits it
(:meth:`SpareFiles.take`: at most the spare's size and at least half of it) renames it to its
own temporary name, cuts it to its size and writes into it: no page work left on its path.

Bounds and cleanup:

* one spare per directory, at most ``tuning.SPARE_CAPTURE_FILES_BYTES`` of them in all (the
  directories used least recently lose theirs first);
* none where the filesystem lacks room for the spare and one more capture of its size, and
  none when populating fails (ENOSPC: memory is short); a capture whose filesystem is short of
  room drops the spares there first (:meth:`SpareFiles.drop` by device);
* dropped (unregistered, unmapped, unlinked) by ``kvsnap.clear_caches()``, at exit, and by
  :func:`drop_spare_files` (a store closing its directories);
* never visible as a snapshot: it lives under a temporary name whose lock its process holds,
  which readers never open and cleanups leave alone; a process killed while it holds one leaves
  a temporary file whose lock is free, which the next writer of that name, and a store's
  pruning, remove as any dead writer's.

Registered bytes are reported beside the hot tier's (``HotStats.capture_registered_bytes``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from kvsnap.caches import register_cache_clear
from kvsnap.host_registration import cuda_unavailable_reason
from kvsnap.store.base import tuning
from kvsnap.store.base.pools import cpu_count, shared_executor
from kvsnap.store.files.publish import create_temp
from kvsnap.store.hot.mapped_file import POPULATE_CHUNK_BYTES, MappedFile

#: Spare sizes are the snapshot's size rounded up to this (the populating unit), so that the
#: next capture of about the same size (a header a few bytes longer) fits.
SPARE_SIZE_STEP = POPULATE_CHUNK_BYTES


@dataclass
class SpareFile:
    """A temporary file in ``directory`` at ``path``, mapped whole (``mapped``: its descriptor,
    which holds the file's lock, its size, and whether it is registered), populated."""

    directory: str
    path: str
    mapped: MappedFile

    def discard(self) -> None:
        """Remove the file, then unregister, unmap and close it."""
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        self.mapped.close()
        with contextlib.suppress(OSError):
            os.close(self.mapped.fd)


@dataclass
class _Preparing:
    """A spare being made: its size and its background task; ``cancelled`` once dropped."""

    size: int
    future: concurrent.futures.Future[None] | None = None
    cancelled: bool = False
    #: Where the file was created (set by the task), for drops by device.
    device: int | None = field(default=None)


def fits(spare_size: int, needed: int) -> bool:
    """Whether a capture of ``needed`` bytes takes a spare of ``spare_size`` bytes: cutting
    the rest off costs about half of what populating costs per byte (benchmarks/tmpfs_pages.py),
    so a tail longer than the capture would cost about what making the capture's file does."""
    return needed <= spare_size <= max(2 * needed, needed + SPARE_SIZE_STEP)


class SpareFiles:
    """The process's spare capture files, at most one per directory (keyed by the
    directory's absolute path), least recently used first out; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, SpareFile | _Preparing] = OrderedDict()
        self.closed = False
        #: Spares made, taken by a capture, dropped, and preparations that failed.
        self.counts = {"prepared": 0, "taken": 0, "dropped": 0, "failed": 0}

    def take(self, directory: str, needed: int) -> SpareFile | None:
        """The spare of ``directory`` if it fits a file of ``needed`` bytes (:func:`fits`),
        now the caller's; waits for one being made (the same work the caller would do),
        unless its making has not started (then it is called off). ``None`` otherwise."""
        key = os.path.abspath(directory)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or not fits(_size(entry), needed):
                return None
            if isinstance(entry, SpareFile):
                return self._taken_locked(key)
            future = entry.future
            if future is None or not future.running():
                # Queued behind other work: the caller makes its own file sooner. The task
                # still runs, to remove the spares it replaces, and makes none.
                entry.cancelled = True
                del self._entries[key]
                return None
        concurrent.futures.wait([future])  # its task never raises
        with self._lock:
            entry = self._entries.get(key)
            if isinstance(entry, SpareFile) and fits(entry.mapped.size, needed):
                return self._taken_locked(key)
        return None

    def _taken_locked(self, key: str) -> SpareFile:
        spare = self._entries.pop(key)
        assert isinstance(spare, SpareFile)
        self.counts["taken"] += 1
        return spare

    def replenish(self, final_path: str, owner: str, file_size: int, register: bool) -> None:
        """Have a spare made in ``final_path``'s directory for captures of about
        ``file_size`` bytes, named as a temporary file of ``final_path`` (of snapshot
        ``owner``), unless the directory has one that fits already; ``register``: registered
        with CUDA too (where ``tuning.SPARE_CAPTURE_FILES_REGISTERED``). Returns at once."""
        size = -(-file_size // SPARE_SIZE_STEP) * SPARE_SIZE_STEP
        key = os.path.dirname(os.path.abspath(final_path))
        dropped: list[SpareFile | _Preparing] = []
        with self._lock:
            if self.closed or size > tuning.SPARE_CAPTURE_FILES_BYTES:
                return
            entry = self._entries.get(key)
            if entry is not None and fits(_size(entry), file_size):
                self._entries.move_to_end(key)
                return
            if entry is not None:
                dropped.append(self._entries.pop(key))
            while self._entries and self._held_locked() + size > tuning.SPARE_CAPTURE_FILES_BYTES:
                dropped.append(self._entries.popitem(last=False)[1])
            preparing = self._entries[key] = _Preparing(size)
            # The spares it replaces are removed by the task, before it makes the new one:
            # off the caller's path, and their memory is free before the new file takes its own.
            replaced = [entry for entry in dropped if isinstance(entry, SpareFile)]
            for entry in dropped:
                if isinstance(entry, _Preparing):
                    entry.cancelled = True  # its task removes what it replaces, makes nothing
            self.counts["dropped"] += len(dropped)
            register = register and tuning.SPARE_CAPTURE_FILES_REGISTERED
            try:
                preparing.future = shared_executor("spare", 1).submit(
                    self._prepare, key, preparing, final_path, owner, register, replaced
                )
                return
            except RuntimeError:  # the interpreter is exiting
                del self._entries[key]
        for spare in replaced:
            spare.discard()

    def _prepare(
        self,
        key: str,
        preparing: _Preparing,
        final_path: str,
        owner: str,
        register: bool,
        replaced: list[SpareFile],
    ) -> None:
        """Remove the ``replaced`` spares, then make the new one (on the background pool) and
        keep it if it is still wanted then."""
        for old in replaced:
            old.discard()
        spare = None
        try:
            spare = _make_spare(key, preparing, final_path, owner, register)
        except Exception:
            # No room, no pinnable memory, a driver error: no spare (the next capture makes
            # its own file, and meets the same error there if it is not passing).
            with self._lock:
                self.counts["failed"] += 1
        with self._lock:
            keep = (
                spare is not None
                and not self.closed
                and not preparing.cancelled
                and self._entries.get(key) is preparing
            )
            if keep:
                assert spare is not None
                self._entries[key] = spare
                self.counts["prepared"] += 1
            elif self._entries.get(key) is preparing:
                del self._entries[key]
        if not keep and spare is not None:
            spare.discard()

    def drop(self, under: str | None = None, device: int | None = None) -> None:
        """Drop (unregister, unmap, remove) the spares of directories at or under ``under``,
        or on the filesystem ``device`` (``st_dev``), or all of them, and return once they
        are gone (one being made is removed by its task, which this waits for)."""
        with self._lock:
            keys = [
                key for key, entry in self._entries.items() if _matches(key, entry, under, device)
            ]
            dropped = [self._entries.pop(key) for key in keys]
        concurrent.futures.wait(self._discard(dropped))

    def _discard(
        self, entries: list[SpareFile | _Preparing]
    ) -> list[concurrent.futures.Future[None]]:
        """Remove the spares made among ``entries`` and cancel those being made; returns the
        tasks of the latter, which remove what they made or replace when they end (a task is
        never cancelled unstarted: it holds the spares it replaces, to remove first)."""
        running = []
        for entry in entries:
            if isinstance(entry, SpareFile):
                entry.discard()
                continue
            entry.cancelled = True
            if entry.future is not None:
                running.append(entry.future)
        with self._lock:
            self.counts["dropped"] += len(entries)
        return running

    def wait(self) -> None:
        """Return once no spare is being made."""
        with self._lock:
            futures = [
                entry.future
                for entry in self._entries.values()
                if isinstance(entry, _Preparing) and entry.future is not None
            ]
        concurrent.futures.wait(futures)

    def _held_locked(self) -> int:
        return sum(_size(entry) for entry in self._entries.values())

    def held_bytes(self) -> tuple[int, int]:
        """Bytes of the spares made or being made, and of those registered with CUDA."""
        with self._lock:
            registered = sum(
                entry.mapped.size
                for entry in self._entries.values()
                if isinstance(entry, SpareFile) and entry.mapped.registered
            )
            return self._held_locked(), registered

    def paths(self) -> list[str]:
        """The spares' files (those made), least recently used directory first."""
        with self._lock:
            return [entry.path for entry in self._entries.values() if isinstance(entry, SpareFile)]

    def close(self) -> None:
        """Drop every spare and make no more (the process is exiting)."""
        with self._lock:
            self.closed = True
        self.drop()


def _size(entry: SpareFile | _Preparing) -> int:
    return entry.mapped.size if isinstance(entry, SpareFile) else entry.size


def _matches(
    key: str, entry: SpareFile | _Preparing, under: str | None, device: int | None
) -> bool:
    if under is not None:
        root = os.path.abspath(under)
        return key == root or key.startswith(root.rstrip(os.sep) + os.sep)
    if device is not None:
        return (entry.device if isinstance(entry, _Preparing) else _device(entry.mapped.fd)) in (
            device,
            None,
        )
    return True


def _device(fd: int) -> int | None:
    try:
        return os.fstat(fd).st_dev
    except OSError:
        return None


def _make_spare(
    directory: str, preparing: _Preparing, final_path: str, owner: str, register: bool
) -> SpareFile | None:
    """Create, size, map, populate and (``register``) register a spare of
    ``preparing.size`` bytes; ``None`` when it was dropped meanwhile. Raises ``OSError``
    (ENOSPC) where the filesystem lacks room for the spare and one more capture of its size,
    or populating finds it full, after removing what it made."""
    if preparing.cancelled:
        return None
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    if free < 2 * preparing.size:
        raise OSError(errno.ENOSPC, f"{free} bytes free, a spare of {preparing.size} needs twice")
    fd, path = create_temp(final_path, owner)
    try:
        preparing.device = os.fstat(fd).st_dev
        mapped = MappedFile(fd, preparing.size)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)
        raise
    spare = SpareFile(directory, path, mapped)
    try:
        threads = min(tuning.POPULATE_THREADS, cpu_count())
        executor = shared_executor("populate", threads) if threads > 1 else None
        mapped.populate(executor, threads)
        if register and not preparing.cancelled and cuda_unavailable_reason() is None:
            mapped.register()
    except BaseException:
        spare.discard()
        raise
    return spare


_SPARES = SpareFiles()


def spare_files() -> SpareFiles:
    """The process's spare capture files."""
    return _SPARES


def drop_spare_files(under: str | None = None) -> None:
    """Drop the spare capture files of directories at or under ``under`` (every one:
    ``None``), e.g. when the store they belong to closes."""
    _SPARES.drop(under=under)


def _forget_after_fork() -> None:
    """A forked child holds copies of its parent's spares' descriptors and mappings, but not
    their registrations: it closes its copies (the files, their locks and the registrations
    stay the parent's) and starts with none."""
    global _SPARES
    inherited, _SPARES = _SPARES, SpareFiles()
    for entry in inherited._entries.values():
        if isinstance(entry, SpareFile):
            entry.mapped.registered = False
            entry.mapped.close()
            with contextlib.suppress(OSError):
                os.close(entry.mapped.fd)


os.register_at_fork(after_in_child=_forget_after_fork)
register_cache_clear(lambda: _SPARES.drop())
# At exit, before the interpreter joins the pools' threads: a spare being made then is
# removed by its own task when it ends (the pools run queued work before their threads stop).
threading._register_atexit(lambda: _SPARES.close())  # type: ignore[attr-defined]
