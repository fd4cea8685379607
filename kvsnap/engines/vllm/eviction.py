"""A prefix store as a whole: its entries, their sizes and last use, and LRU pruning.

:func:`store_entries` lists every chunk and quarantined file under a store root (all
namespaces); :func:`prune_store` deletes quarantined files first, then chunks in order of
last use, until the store fits a byte bound. A chunk's last use is the later of its access
and modification times: :meth:`~kvsnap.engines.vllm.store.PrefixStore.touch` sets the access
time on every hit, and the writer's publish sets both. The connector prunes after its writes
when ``store_capacity_bytes`` is set; ``kvsnap store prune`` does it by hand.

Nothing here needs vLLM.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvsnap.engines.vllm.store import CHUNK_SUFFIX


@dataclass(frozen=True)
class StoreEntry:
    """One file of a store: a chunk or a quarantined chunk, with its size and times."""

    path: Path
    namespace: str
    size: int
    last_used: float
    modified: float
    quarantined: bool

    def age(self, now: float | None = None) -> float:
        """Seconds since the entry was last used."""
        return (time.time() if now is None else now) - self.last_used


def _files(directory: Path) -> Iterator[os.DirEntry[str]]:
    """Every chunk file under ``directory`` (recursively), skipping writers' temporary files."""
    try:
        listing = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return
    for item in listing:
        if item.is_dir(follow_symlinks=False):
            yield from _files(Path(item.path))
        elif item.name.endswith(CHUNK_SUFFIX) and not item.name.startswith("."):
            yield item


def _entry(item: os.DirEntry[str], namespace: str, quarantined: bool) -> StoreEntry | None:
    try:
        status = item.stat(follow_symlinks=False)
    except FileNotFoundError:  # removed while listing
        return None
    return StoreEntry(
        path=Path(item.path),
        namespace=namespace,
        size=status.st_size,
        last_used=max(status.st_atime, status.st_mtime),
        modified=status.st_mtime,
        quarantined=quarantined,
    )


def store_entries(root: str | os.PathLike[str]) -> list[StoreEntry]:
    """Every chunk and quarantined file under the store ``root``, least recently used first."""
    entries = []
    base = Path(root)
    try:
        namespaces = sorted(item for item in base.iterdir() if item.is_dir())
    except FileNotFoundError:
        return []
    for namespace in namespaces:
        for kind, quarantined in (("chunks", False), ("quarantine", True)):
            for item in _files(namespace / kind):
                entry = _entry(item, namespace.name, quarantined)
                if entry is not None:
                    entries.append(entry)
    entries.sort(key=lambda entry: (entry.last_used, str(entry.path)))
    return entries


def store_bytes(root: str | os.PathLike[str]) -> int:
    """Bytes of every chunk and quarantined file under the store ``root``."""
    return sum(entry.size for entry in store_entries(root))


def eviction_order(entries: list[StoreEntry]) -> list[StoreEntry]:
    """``entries`` in the order pruning deletes them: quarantined files first, then chunks,
    each least recently used first."""
    return sorted(entries, key=lambda entry: (not entry.quarantined, entry.last_used))


def prune_store(
    root: str | os.PathLike[str],
    max_bytes: int,
    *,
    min_idle_s: float = 0.0,
    now: float | None = None,
) -> list[StoreEntry]:
    """Delete entries of the store ``root`` in :func:`eviction_order` until it holds at most
    ``max_bytes``; return the deleted ones.

    Chunks used in the last ``min_idle_s`` seconds are kept even if the store stays above the
    bound: a scheduler may have matched one that a worker is about to load.
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
        if not entry.quarantined and entry.age(moment) < min_idle_s:
            continue
        with contextlib.suppress(FileNotFoundError):  # another process removed it
            entry.path.unlink()
        total -= entry.size
        removed.append(entry)
    return removed
