"""A prefix store as a whole: its entries, their sizes and last use, and LRU pruning.

:func:`store_entries` lists every chunk and quarantined chunk under a store root (all
namespaces), a parted chunk as one entry (its index and parts); :func:`prune_store` deletes
abandoned parts and quarantined chunks first, then chunks in order of last use, until the
store fits a byte bound. A chunk's last use is the later of its access and modification times
(a parted chunk's: its index's): :meth:`~kvsnap.engines.vllm.store.PrefixStore.touch` sets the
access time on every hit, and the writer's publish sets both. The connector prunes after its
writes when ``store_capacity_bytes`` is set; ``kvsnap store prune`` does it by hand.

**Orphan parts.** A part file that no index beside it names is a failed or abandoned parted
write's leftover (its ranks died before the index was published, or a pruner or quarantine
lost a race), or a write still in progress: every part is published before the index that
commits them. It is listed as an entry of its own (``orphan``), counts toward the store's
bytes, and is deleted first once it was last modified ``orphan_grace_s`` ago (default
:data:`ORPHAN_GRACE_S`), which no live write takes between its first part and its index.

Nothing here needs vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvsnap import format as fmt
from kvsnap.engines.vllm.store import CHUNK_SUFFIX, part_files
from kvsnap.store.hot import hot_tier
from kvsnap.store.location import INDEX_SUFFIX

#: Seconds after its last modification from which a part named by no index is garbage.
ORPHAN_GRACE_S = 600.0
#: A part file name's stem (docs/format.md, "Parted snapshots"); :func:`_is_part` checks the
#: rest with :func:`kvsnap.format.is_part_of`.
_PART_STEM = re.compile(r"(.+)-g[0-9a-f]{12}-part-[0-9]{5}-of-[0-9]{5}" + re.escape(CHUNK_SUFFIX))


def _is_part(name: str) -> bool:
    """Whether ``name`` is a part file name of some snapshot."""
    match = _PART_STEM.fullmatch(name)
    return match is not None and fmt.is_part_of(match.group(1), name)


@dataclass(frozen=True)
class StoreEntry:
    """One entry of a store: a chunk or a quarantined chunk, with its size and times, or an
    orphan part.

    ``path`` is the file that commits it: the single file, or a parted chunk's index, whose
    ``parts`` are listed too (``()`` for a single file). ``size`` counts every file of the
    entry; ``last_used`` and ``modified`` are the committing file's.
    """

    path: Path
    namespace: str
    size: int
    last_used: float
    modified: float
    quarantined: bool
    parts: tuple[Path, ...] = ()
    orphan: bool = False

    def age(self, now: float | None = None) -> float:
        """Seconds since the entry was last used."""
        return (time.time() if now is None else now) - self.last_used


def _directories(directory: Path) -> Iterator[tuple[Path, list[os.DirEntry[str]]]]:
    """Every directory under ``directory`` (itself included) with its visible files, skipping
    writers' temporary files (dot names)."""
    try:
        listing = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return
    yield (
        directory,
        [
            item
            for item in listing
            if not item.name.startswith(".") and not item.is_dir(follow_symlinks=False)
        ],
    )
    for item in listing:
        if item.is_dir(follow_symlinks=False):
            yield from _directories(Path(item.path))


def _stat(path: str | os.PathLike[str]) -> os.stat_result | None:
    try:
        return os.stat(path, follow_symlinks=False)
    except FileNotFoundError:  # removed while listing
        return None


def _entry(
    path: Path, namespace: str, quarantined: bool, parts: tuple[Path, ...] = ()
) -> StoreEntry | None:
    """The entry committed by ``path`` with ``parts`` (those still there); ``None`` when
    ``path`` is gone."""
    status = _stat(path)
    if status is None:
        return None
    sizes = [(part, _stat(part)) for part in parts]
    present = tuple(part for part, part_status in sizes if part_status is not None)
    return StoreEntry(
        path=path,
        namespace=namespace,
        size=status.st_size + sum(item.st_size for _, item in sizes if item is not None),
        last_used=max(status.st_atime, status.st_mtime),
        modified=status.st_mtime,
        quarantined=quarantined,
        parts=present,
    )


def _directory_entries(
    directory: Path, files: list[os.DirEntry[str]], namespace: str, quarantined: bool
) -> list[StoreEntry]:
    """The entries of one directory: parted chunks (an index and the parts it names), single
    files, and orphan parts (named by no index here)."""
    names = {item.name for item in files}
    claimed: set[str] = set()
    found: list[StoreEntry | None] = []
    for name in sorted(names):
        if name.endswith(CHUNK_SUFFIX + INDEX_SUFFIX):
            parts = tuple(part for part in part_files(directory / name) if part.name in names)
            claimed.update(part.name for part in parts)
            found.append(_entry(directory / name, namespace, quarantined, parts))
    for name in sorted(names - claimed):
        if not name.endswith(CHUNK_SUFFIX):
            continue
        entry = _entry(directory / name, namespace, quarantined)
        if entry is not None and _is_part(name):
            entry = dataclasses.replace(entry, orphan=True)
        found.append(entry)
    return [entry for entry in found if entry is not None]


def store_entries(root: str | os.PathLike[str]) -> list[StoreEntry]:
    """Every chunk, quarantined chunk and orphan part under the store ``root``, least
    recently used first; a parted chunk is one entry."""
    entries = []
    base = Path(root)
    try:
        namespaces = sorted(item for item in base.iterdir() if item.is_dir())
    except FileNotFoundError:
        return []
    for namespace in namespaces:
        for kind, quarantined in (("chunks", False), ("quarantine", True)):
            for directory, files in _directories(namespace / kind):
                entries += _directory_entries(directory, files, namespace.name, quarantined)
    entries.sort(key=lambda entry: (entry.last_used, str(entry.path)))
    return entries


def store_bytes(root: str | os.PathLike[str]) -> int:
    """Bytes of every chunk (all its files), quarantined chunk and orphan part under the store
    ``root``."""
    return sum(entry.size for entry in store_entries(root))


def eviction_order(entries: list[StoreEntry]) -> list[StoreEntry]:
    """``entries`` in the order pruning deletes them: orphan parts, then quarantined chunks,
    then chunks, each least recently used first."""
    return sorted(
        entries, key=lambda entry: (not entry.orphan, not entry.quarantined, entry.last_used)
    )


def _removable(entry: StoreEntry, moment: float, min_idle_s: float, orphan_grace_s: float) -> bool:
    if entry.orphan:
        return moment - entry.modified >= orphan_grace_s
    return entry.quarantined or entry.age(moment) >= min_idle_s


def _delete(entry: StoreEntry) -> bool:
    """Delete ``entry``'s files, the committing one first; ``False`` (nothing deleted) when it
    is gone already: another process evicted or quarantined it, and its parts are that
    process's to move or delete."""
    try:
        entry.path.unlink()
    except FileNotFoundError:
        return False
    tier = hot_tier()
    tier.forget(str(entry.path))  # its registered pages are freed now, not at the next prune
    for part in entry.parts:
        tier.forget(str(part))
        with contextlib.suppress(FileNotFoundError):
            part.unlink()
    if entry.quarantined and entry.parts:
        with contextlib.suppress(OSError):  # not empty: something else is in it, keep it
            entry.path.parent.rmdir()  # the parted chunk's own quarantine/HASH.T/
    return True


def prune_store(
    root: str | os.PathLike[str],
    max_bytes: int,
    *,
    min_idle_s: float = 0.0,
    orphan_grace_s: float = ORPHAN_GRACE_S,
    now: float | None = None,
) -> list[StoreEntry]:
    """Delete entries of the store ``root`` in :func:`eviction_order` until it holds at most
    ``max_bytes``; return the deleted ones. A parted chunk goes whole: its index first (the
    commit point: no reader finds it from then on), then its parts.

    Chunks used in the last ``min_idle_s`` seconds are kept even if the store stays above the
    bound: a scheduler may have matched one that a worker is about to load. Orphan parts
    modified in the last ``orphan_grace_s`` seconds are kept: they may be a write in progress.
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    entries = store_entries(root)
    total = sum(entry.size for entry in entries)
    moment = time.time() if now is None else now
    removed = []
    for entry in eviction_order(entries):
        if total <= max_bytes:
            break
        if not _removable(entry, moment, min_idle_s, orphan_grace_s):
            continue
        total -= entry.size  # gone either way: deleted here, or by another process
        if _delete(entry):
            removed.append(entry)
    return removed
