"""The hot tier: snapshot files kept mapped from the page cache, registered with CUDA.

A file the page cache holds can reach the GPU without being read: mapped read-only and
registered with the driver (``cudaHostRegister(..., cudaHostRegisterReadOnly)``), one DMA per
staging slot copies its pages straight out of the page cache, as fast as from pinned memory
(docs/benchmarks.md, "Hits at the PCIe floor"). The mapping costs no copy and no RAM beyond
the page cache, but registering pins the file's pages (they cannot be reclaimed while
registered), and registering costs about as much as reading the file once. So this module
keeps one process-wide :class:`HotTier`:

* bounded by ``hot_bytes`` (whole files, least recently used evicted first);
* a file is registered on its ``register_after``-th hit (see :data:`REGISTER_AFTER`), or at
  once on the caller's word (``admit=True``), so a one-off restore does not pay for it, and
  only once the page cache holds all of it (registering a cold file would read it page by
  page);
* keyed by what identifies one version of a file (:func:`file_key`: device, inode, size and
  modification time; not the change time, which the vLLM store's record of each use moves): a
  file replaced by rename, truncated or rewritten is a new key and never served from the old
  mapping; entries whose path no longer names their version
  are dropped (:meth:`HotTier.prune`, run on every registration, and :meth:`HotTier.forget`);
* an entry is unregistered and unmapped when evicted, dropped or replaced, after the last DMA
  that read it has completed.

The mapping is only ever read by the GPU's DMA engine, never by this process's CPU: a file
truncated under a mapping raises SIGBUS on a CPU access, while the pinned pages the DMA reads
stay valid (they hold the bytes the file had, which the device then checks page by page
against the checksums the reader loaded when it opened the file). Without CUDA nothing is
registered and :meth:`HotTier.lookup` serves nothing: the CPU path reads with ``pread``.
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvsnap.caches import register_cache_clear
from kvsnap.host_registration import (
    PORTABLE,
    READ_ONLY,
    register_host_range,
    release_mapping,
)
from kvsnap.store.hot.mapping_release import pending_bytes
from kvsnap.store.hot.residency import resident
from kvsnap.store.hot.spare_files import spare_files

if TYPE_CHECKING:
    import torch

#: Default bound on the bytes registered at once, process-wide. Registered pages are locked in
#: RAM; 4 GiB holds ~30 prefixes of 2,048 tokens of an 8B model.
HOT_BYTES = 4 << 30
#: Default hit on which a file is registered: 1 registers on first use, 2 on the second.
REGISTER_AFTER = 2
#: Files whose hits are counted before they are registered (least recently seen dropped).
MAX_COUNTED_FILES = 4096
#: Usable from every device's context; the driver maps the pages read-only (the mapping itself
#: is ``PROT_READ``).
_REGISTER_FLAGS = PORTABLE | READ_ONLY

#: What identifies one version of a file: device, inode, size and mtime in nanoseconds.
FileKey = tuple[int, int, int, int]


def file_key(status: os.stat_result) -> FileKey:
    """The key of the file version ``status`` describes. kvsnap never rewrites a published
    file in place; a rename, truncation or rewrite changes the inode, the size or the mtime.

    Not the change time: the vLLM store records every hit's use of a chunk in its access time
    (:meth:`~kvsnap.engines.vllm.prefix_store.PrefixStore.touch`), which moves the change
    time, so a key holding it made every hit a new version, counted once and never held. What
    the change time alone would tell (a rewrite in place with its mtime put back) cannot make
    a restore serve wrong bytes: a mapping of the same inode shows the file's bytes as they
    are now, and the device checks every page against the checksums of the reader that opened
    the file, so such pages are refused, as from any damaged file.
    """
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


@dataclass(frozen=True)
class HotStats:
    """What the hot tier holds and has done since it was made."""

    hot_bytes: int
    registered_bytes: int
    files: int
    hits: int
    misses: int
    registrations: int
    evictions: int
    invalidations: int
    failures: int
    #: Bytes the process's captures hold registered outside the tier (and outside
    #: ``hot_bytes``): mappings waiting to be released after their publish
    #: (``store/mapping_release.py``) and spare capture files (``store/spare_files.py``).
    capture_registered_bytes: int = 0


class HotFile:
    """One file mapped read-only and (with CUDA) registered: ``host`` is a uint8 tensor over the
    whole mapping, for DMA only. Made and closed by :class:`HotTier`."""

    def __init__(self, key: FileKey, path: str, fd: int, *, register: bool) -> None:
        self.key = key
        self.path = path
        self.size = key[2]
        self.users = 0
        self.retired = False  # dropped from the tier while leased: closed at the last release
        self.last_use: Any = None  # the CUDA event of the last copy that read the mapping
        self._mapping: mmap.mmap | None = mmap.mmap(fd, self.size, prot=mmap.PROT_READ)
        import torch  # here, not at the top: the CLI reads snapshots without loading torch

        with warnings.catch_warnings():
            # torch warns that the buffer is not writable: nothing ever writes to it.
            warnings.simplefilter("ignore", UserWarning)
            self.host: torch.Tensor | None = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self.address = self.host.data_ptr()
        self.registered = False
        if register:
            self._register()

    def _register(self) -> None:
        assert self.host is not None
        code = register_host_range(self.address, self.size, _REGISTER_FLAGS)
        if code != 0:
            self.close()
            raise OSError(f"cudaHostRegister of {self.path} failed with CUDA error {code}")
        self.registered = True

    def close(self) -> None:
        """Wait for the last DMA that read the mapping, unregister it and drop the mapping
        (unmapped now, or when the last view of it is gone)."""
        if self.last_use is not None:
            self.last_use.synchronize()
            self.last_use = None
        self.host = None
        mapping, self._mapping = self._mapping, None
        registered, self.registered = self.registered, False
        release_mapping(mapping, self.address, registered)


class HotTier:
    """Process-wide registry of mapped (and, with CUDA, registered) snapshot files.

    Args:
        hot_bytes: most bytes of files held at once; a larger file is never held.
        register_after: the hit on which a file is mapped and registered (1: its first use).
        register: register mappings with CUDA; ``None``: exactly when CUDA is available.
            Without registration the tier still maps, bounds and invalidates (the CPU tests
            check the bookkeeping that way), but :meth:`lookup` serves nothing unregistered
            unless ``serve_unregistered``.
        serve_unregistered: serve mappings that are not registered (tests of the bookkeeping
            only: a CPU copy out of a mapping could raise SIGBUS on a truncated file).
    """

    def __init__(
        self,
        hot_bytes: int = HOT_BYTES,
        register_after: int = REGISTER_AFTER,
        *,
        register: bool | None = None,
        serve_unregistered: bool = False,
    ) -> None:
        if hot_bytes < 0 or register_after < 1:
            raise ValueError(f"need hot_bytes >= 0 and register_after >= 1, got {hot_bytes=}")
        self.hot_bytes = hot_bytes
        self.register_after = register_after
        if register is None:
            import torch

            register = torch.cuda.is_available()
        self.register = register
        self.serve_unregistered = serve_unregistered
        self._files: OrderedDict[FileKey, HotFile] = OrderedDict()
        self._seen: OrderedDict[FileKey, int] = OrderedDict()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("hits", "misses", "registrations", "evictions", "invalidations", "failures"), 0
        )
        #: Entries dropped from the table while leased: still mapped, closed at their release.
        self._leased_out: set[HotFile] = set()

    @property
    def enabled(self) -> bool:
        """Whether a lookup can serve anything."""
        return self.hot_bytes > 0 and (self.register or self.serve_unregistered)

    def lookup(
        self, path: str, fd: int, status: os.stat_result, *, admit: bool = False
    ) -> HotFile | None:
        """The held file for the open descriptor ``fd`` (whose ``fstat`` is ``status``), leased
        to the caller until :meth:`release`, or ``None``: not (yet) worth holding, not (all)
        in the page cache, too large, or everything it could displace is in use. Counts the
        hit; maps and registers the file on its ``register_after``-th hit, or now with
        ``admit``. Mapping ``fd`` itself maps the very file its opener checked. A failed
        mapping or registration serves nothing (counted in :attr:`HotStats.failures`)."""
        if not self.enabled:
            return None
        key = file_key(status)
        path = os.path.abspath(path)
        closing: list[HotFile] = []
        try:
            with self._lock:
                held = self._files.get(key)
                if held is not None:
                    self._files.move_to_end(key)
                    self._counts["hits"] += 1
                    held.users += 1
                    return held
                self._counts["misses"] += 1
                hits = self._seen.pop(key, 0) + 1
                if (hits < self.register_after and not admit) or key[2] > self.hot_bytes:
                    self._count_seen_locked(key, hits)
                    return None
                if resident(fd, 0, key[2]) is False:
                    # Registering faults every page in, one at a time, under this lock: a file
                    # the page cache does not hold (yet) is read instead, and held once it is.
                    self._count_seen_locked(key, hits)
                    return None
                closing = self._stale_locked(path, key)
                evicted = self._make_room_locked(key[2])
                if evicted is None:
                    self._count_seen_locked(key, hits)
                    return None
                closing += evicted
                # Under the lock: two threads never register one file twice, nor both fit.
                try:
                    entry = HotFile(key, path, fd, register=self.register)
                except (OSError, ValueError):
                    # A restore never fails for want of the hot tier: it reads the file.
                    self._counts["failures"] += 1
                    return None
                entry.users = 1
                self._files[key] = entry
                self._counts["registrations"] += 1
                return entry
        finally:
            for stale in closing:
                stale.close()

    def _count_seen_locked(self, key: FileKey, hits: int) -> None:
        self._seen[key] = hits
        while len(self._seen) > MAX_COUNTED_FILES:
            self._seen.popitem(last=False)

    def release(self, entry: HotFile, last_use: Any = None) -> None:
        """End a lease from :meth:`lookup`; ``last_use``: the CUDA event of the last copy that
        reads the mapping (the entry is not unregistered before it completes)."""
        with self._lock:
            entry.users -= 1
            if last_use is not None:
                entry.last_use = last_use
            closing = entry.retired and entry.users == 0
            if closing:
                self._leased_out.discard(entry)
        if closing:
            entry.close()

    def _drop_locked(self, entries: list[HotFile]) -> list[HotFile]:
        """Remove ``entries`` from the table: those to close now (the others are leased, and
        closed by their last :meth:`release`)."""
        for entry in entries:
            del self._files[entry.key]
            entry.retired = True
            if entry.users:
                self._leased_out.add(entry)
        return [entry for entry in entries if entry.users == 0]

    def _held_bytes_locked(self) -> int:
        """Bytes mapped now: the table's entries and the dropped ones still leased."""
        return sum(entry.size for entry in self._files.values()) + sum(
            entry.size for entry in self._leased_out
        )

    def _stale_locked(self, path: str, key: FileKey) -> list[HotFile]:
        """Drop the entries of ``path`` that are not ``key`` (the name now points at a new
        version) and those whose path no longer names their version: the ones to close now."""
        stale = [
            entry
            for entry in self._files.values()
            if (entry.path == path and entry.key != key) or not _still_names(entry)
        ]
        self._counts["invalidations"] += len(stale)
        return self._drop_locked(stale)

    def _make_room_locked(self, size: int) -> list[HotFile] | None:
        """Remove least recently used idle entries until ``size`` more bytes fit; the removed
        entries, or ``None`` (nothing removed) if the entries in use leave no room."""
        held = self._held_bytes_locked()
        idle = [entry for entry in self._files.values() if entry.users == 0]
        freeable = sum(entry.size for entry in idle)
        if held - freeable + size > self.hot_bytes:
            return None
        evicted = []
        for entry in idle:
            if held + size <= self.hot_bytes:
                break
            held -= entry.size
            evicted.append(entry)
        self._counts["evictions"] += len(evicted)
        return self._drop_locked(evicted)

    def prune(self) -> int:
        """Drop the entries whose path was removed or now names another version of the file
        (replaced, truncated, rewritten); how many were dropped (a leased one is closed when
        its lease ends)."""
        with self._lock:
            stale = [entry for entry in self._files.values() if not _still_names(entry)]
            self._counts["invalidations"] += len(stale)
            closing = self._drop_locked(stale)
        for entry in closing:
            entry.close()
        return len(stale)

    def forget(self, path: str) -> None:
        """Drop every entry of ``path`` (its owner is removing or replacing it); a leased entry
        is closed when its lease ends."""
        path = os.path.abspath(path)
        with self._lock:
            gone = [entry for entry in self._files.values() if entry.path == path]
            self._counts["invalidations"] += len(gone)
            closing = self._drop_locked(gone)
        for entry in closing:
            entry.close()

    def clear(self) -> None:
        """Drop every entry and every hit count (leased entries close when their lease ends)."""
        with self._lock:
            closing = self._drop_locked(list(self._files.values()))
            self._seen.clear()
        for entry in closing:
            entry.close()

    def stats(self) -> HotStats:
        """The bound, the bytes held (registered, with CUDA), the files and the counters,
        and the bytes captures hold registered besides."""
        captures = pending_bytes()[1] + spare_files().held_bytes()[1]
        with self._lock:
            held = self._held_bytes_locked()
            return HotStats(
                self.hot_bytes,
                held,
                len(self._files),
                **self._counts,
                capture_registered_bytes=captures,
            )


def _still_names(entry: HotFile) -> bool:
    """Whether ``entry.path`` still names the file version the entry maps."""
    try:
        return file_key(os.stat(entry.path)) == entry.key
    except OSError:
        return False


_TIER: HotTier | None = None
_TIER_LOCK = threading.Lock()


def hot_tier() -> HotTier:
    """The process-wide hot tier (made on first use with :data:`HOT_BYTES` and
    :data:`REGISTER_AFTER`)."""
    global _TIER
    with _TIER_LOCK:
        if _TIER is None:
            _TIER = HotTier()
        return _TIER


@register_cache_clear
def _clear_hot_tier() -> None:
    """Unmap the process-wide tier's idle files and forget its hit counts (a tier not made
    yet stays unmade: making one asks CUDA)."""
    with _TIER_LOCK:
        tier = _TIER
    if tier is not None:
        tier.clear()


def configure_hot_tier(hot_bytes: int = HOT_BYTES, register_after: int = REGISTER_AFTER) -> HotTier:
    """Replace the process-wide hot tier by one bounded by ``hot_bytes`` (0 turns it off) that
    registers a file on its ``register_after``-th hit; the old tier's idle entries are
    unregistered and unmapped (entries in use when their restores end)."""
    global _TIER
    with _TIER_LOCK:
        previous, _TIER = _TIER, HotTier(hot_bytes, register_after)
    if previous is not None:
        previous.clear()
    return _TIER
