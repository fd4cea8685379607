"""Snapshots kept open by path between one use and the next, for as long as the file is the
version that was opened.

Opening a snapshot (its header, trailer and metadata read and checked, and its signature) costs
a few hundred microseconds of Python, and a long-lived process opens the same files again and
again: an engine's hot prefix is loaded by request after request, each of its chunks a file.
:class:`OpenSnapshots` keeps single-file snapshots open for their next use; its users are
vLLM's connector (``engines/vllm/open_chunks.py``: the chunks its scheduler checked, the chunks
a worker loaded) and transformers' restores from a path (``engines/transformers/model.py``).

A kept snapshot is served only while its path and its open descriptor both name the version
that was opened (device, inode, size and modification time; with ``change_time``, the change
time too). A file replaced by a rename, removed or quarantined is therefore opened anew, and a
kept snapshot whose file is gone is closed as soon as another is kept anew (its descriptor
would keep the file's space). A rewrite in place that forged the modification time back is no
wrong KV either: every restore checks every page it copies against the checksum table read
when the snapshot opened, which the new bytes fail.

With ``follow_name=False`` (the vLLM scheduler's checked chunks, handed to its worker) the path
is not looked at again: what was opened and checked is what is served, whatever has been
renamed over its name since. A snapshot read whole as it opened is served from those bytes;
any other while its descriptor still names the version opened.
"""

from __future__ import annotations

import collections
import os
import threading

from kvsnap.format.signing import KeyRing
from kvsnap.snapshot import Snapshot

__all__ = ["FileVersion", "OpenSnapshots", "file_version"]

#: What identifies one version of a file an open snapshot is kept for: device, inode, size,
#: modification and change times (a rewrite in place changes the change time).
FileVersion = tuple[int, int, int, int, int]


def file_version(status: os.stat_result) -> FileVersion:
    """The :data:`FileVersion` of a ``stat`` result."""
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)


def _descriptor_status(snapshot: Snapshot) -> os.stat_result | None:
    """``fstat`` of the descriptor a kept single-file snapshot was opened through; ``None`` once
    it is closed or cannot be asked."""
    files = snapshot.parts[0].reader.local_files()
    try:
        return None if files is None else os.fstat(files[0][1])
    except OSError:
        return None


def _key_ids(keys: KeyRing | None) -> frozenset[bytes] | None:
    return None if keys is None else frozenset(key.key_id for key in keys.keys)


class OpenSnapshots:
    """Open single-file snapshots by path: at most ``capacity`` (the oldest is closed), each taken
    once. ``change_time``: whether a moved change time alone (a ``touch`` recording a hit, a
    ``chmod``) makes the file another version. ``follow_name``: whether a snapshot is served
    only while its path still names the version opened (else it is served as opened, see the
    module's notes)."""

    def __init__(
        self, capacity: int = 8, *, change_time: bool = True, follow_name: bool = True
    ) -> None:
        self.capacity = capacity
        self._compared = 5 if change_time else 4
        self._follow_name = follow_name
        self._lock = threading.Lock()
        self._open: collections.OrderedDict[
            str, tuple[Snapshot, FileVersion, frozenset[bytes] | None]
        ] = collections.OrderedDict()

    def keep(self, path: str, snapshot: Snapshot, keys: KeyRing | None) -> bool:
        """Keep ``snapshot`` (opened from ``path`` with ``keys``) for :meth:`take`; ``False``
        (the caller closes it) unless it is one local file unchanged since it was opened."""
        files = snapshot.parts[0].reader.local_files() if len(snapshot.parts) == 1 else None
        if snapshot.index is not None or files is None or len(files) != 1:
            return False
        _, descriptor, opened = files[0]
        version = file_version(opened)
        if not self._same(file_version(os.fstat(descriptor)), version):
            return False
        # A kept snapshot holds a descriptor, not threads: a verify's read threads end here (a
        # later read starts them again).
        snapshot.parts[0].reader.page_reads.close()
        with self._lock:
            replaced = self._open.pop(path, None)
            self._open[path] = (snapshot, version, _key_ids(keys))
            evicted = [self._open.popitem(last=False)[1][0] for _ in range(self._over())]
            if replaced is None and self._follow_name:
                # Kept anew: the others' files may have gone meanwhile. (Snapshots served as
                # opened stay: what they hold is what was checked; at most ``capacity``.)
                evicted += self._pop_removed()
        if replaced is not None and replaced[0] is not snapshot:
            evicted.append(replaced[0])
        for old in evicted:
            old.close()
        return True

    def _same(self, now: FileVersion | None, version: FileVersion) -> bool:
        return now is not None and now[: self._compared] == version[: self._compared]

    def _over(self) -> int:
        return max(0, len(self._open) - self.capacity)

    def _pop_removed(self) -> list[Snapshot]:
        """Take out the kept snapshots whose file has no name left (removed, or replaced by a
        rename): their descriptors hold its space. Called with the lock held."""
        removed = []
        for path, (snapshot, _, _) in list(self._open.items()):
            status = _descriptor_status(snapshot)
            if status is None or status.st_nlink == 0:
                removed.append(self._open.pop(path)[0])
        return removed

    def take(self, path: str, keys: KeyRing | None) -> Snapshot | None:
        """The open snapshot kept for ``path``, if it was opened with the same keys and the path
        and its descriptor still name the version that was opened; it is the caller's to
        close. ``None`` otherwise (a kept one that no longer matches is closed)."""
        with self._lock:
            kept = self._open.pop(path, None)
        if kept is None:
            return None
        snapshot, version, key_ids = kept
        if key_ids == _key_ids(keys) and self._unchanged(path, snapshot, version):
            return snapshot
        snapshot.close()
        return None

    def _unchanged(self, path: str, snapshot: Snapshot, version: FileVersion) -> bool:
        """Whether the kept ``snapshot`` (opened as ``version`` of ``path``) may be served."""
        if not self._follow_name and snapshot.parts[0].reader.held_file() is not None:
            return True  # its bytes, read whole and checked, are in memory
        status = _descriptor_status(snapshot)
        if status is None or not self._same(file_version(status), version):
            return False
        if not self._follow_name:
            return True
        try:
            current: FileVersion | None = file_version(os.stat(path))
        except OSError:
            current = None
        return self._same(current, version)

    def holds(self, path: str, version: tuple[int, ...]) -> bool:
        """Whether a snapshot read whole is kept for ``path``, opened as the file version that
        starts with ``version`` (device, inode, size, modification time): its bytes, checked
        when it opened, are in memory."""
        with self._lock:  # not closed meanwhile by another thread's keep
            kept = self._open.get(path)
            if kept is None or kept[0].parts[0].reader.held_file() is None:
                return False
            return kept[1][: len(version)] == tuple(version)

    def give_back(self, path: str, snapshot: Snapshot, keys: KeyRing | None) -> bool:
        """Keep ``snapshot``, taken from here and used, for the next :meth:`take` of ``path``
        again, unless another is kept for ``path`` meanwhile (a newer check's); whether it
        was kept (else the caller closes it)."""
        with self._lock:
            if path in self._open:
                return False
        return self.keep(path, snapshot, keys)

    def touched(self, path: str) -> None:
        """After this process recorded a use of the file at ``path`` in its access time (vLLM's
        :meth:`~kvsnap.engines.vllm.prefix_store.PrefixStore.touch`, which keeps the
        modification time and so moves only the change time): keep its open snapshot for the
        version its descriptor names now, if only that time moved; else close it."""
        with self._lock:
            kept = self._open.get(path)
            if kept is None:
                return
            snapshot, version, key_ids = kept
            if not self._follow_name and snapshot.parts[0].reader.held_file() is not None:
                return  # served from the bytes read: a change of the file does not matter
            status = _descriptor_status(snapshot)
            now = None if status is None else file_version(status)
            if now is not None and now[:4] == version[:4]:
                self._open[path] = (snapshot, now, key_ids)
                return
            del self._open[path]
        snapshot.close()

    def clear(self) -> None:
        """Close every kept snapshot."""
        with self._lock:
            kept = [entry[0] for entry in self._open.values()]
            self._open.clear()
        for snapshot in kept:
            snapshot.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)
