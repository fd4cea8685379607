"""The remote tier listed and pruned: what ``kvsnap store list|verify|prune URL`` work on.

An object store keeps no access time, so a chunk's last use on the remote tier is the later of
its object's last modification (its upload) and that of its ``used`` object, which every node
rewrites when it fetches the chunk (:meth:`~kvsnap.engines.vllm.remote_store.RemoteStore.
record_use`). :func:`remote_entries` lists every chunk of every namespace under a URL with
that time; :func:`prune_remote` deletes chunks least recently used first until the tier fits a
size (each chunk's ``used`` object with it, and ``used`` objects whose chunk is gone), skipping
chunks used within ``min_idle_s``; leftovers of a writer that died on a filesystem without
atomic uploads (``.NAME.kvsnap-tmp-...``) older than ``temp_grace_s`` go first. Objects of
other names are listed (``other``) and never deleted.

A node fetching a chunk while it is pruned gets a miss (a ``404``), never part of a chunk: an
object is deleted whole.

Nothing here needs vLLM.
"""

from __future__ import annotations

import datetime
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvsnap.engines.vllm.eviction import ORPHAN_GRACE_S
from kvsnap.engines.vllm.prefix_store import CHUNK_SUFFIX
from kvsnap.engines.vllm.remote_store import CHUNKS, USED, remote_filesystem
from kvsnap.store.publish import TEMP_MARKER

_KEY = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class RemoteEntry:
    """One object of the remote tier: a chunk (``kind`` ``chunk``, with its ``used`` object's
    time if any), a dead writer's temporary object (``temp``), or anything else (``other``).
    ``path`` is relative to the URL; times are seconds since the epoch."""

    path: str
    namespace: str
    kind: str
    size: int
    written: float
    used: float | None = None

    @property
    def last_used(self) -> float:
        """The later of the upload and the last fetch recorded."""
        return max(self.written, self.used or 0.0)

    def age(self, now: float | None = None) -> float:
        """Seconds since the last use."""
        return (time.time() if now is None else now) - self.last_used


def _modified(info: Mapping[str, Any]) -> float:
    """An fsspec listing's last modification time of an object, in seconds since the epoch
    (s3fs ``LastModified``, gcsfs ``updated``, local ``mtime``...)."""
    for name in ("LastModified", "last_modified", "updated", "mtime", "modified", "created"):
        value = info.get(name)
        if value is None:
            continue
        if isinstance(value, datetime.datetime):
            return value.timestamp()
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    return 0.0


def _classify(relative: str) -> tuple[str, str, str]:
    """``(namespace, kind, key)`` of an object at ``relative`` under the URL; ``kind`` is
    ``chunk``, ``used``, ``temp`` or ``other``."""
    parts = relative.split("/")
    name = parts[-1]
    if TEMP_MARKER in name and name.startswith("."):
        return (parts[0] if len(parts) > 1 else ""), "temp", ""
    if len(parts) == 4 and parts[1] == CHUNKS and name.endswith(CHUNK_SUFFIX):
        key = name[: -len(CHUNK_SUFFIX)]
        if _KEY.fullmatch(key) and parts[2] == key[:2]:
            return parts[0], "chunk", key
    if len(parts) == 4 and parts[1] == USED and _KEY.fullmatch(name) and parts[2] == name[:2]:
        return parts[0], "used", name
    return (parts[0] if len(parts) > 1 else ""), "other", ""


def _listing(
    url: str, storage_options: Mapping[str, Any] | None
) -> tuple[Any, str, dict[str, Mapping[str, Any]]]:
    fs, root = remote_filesystem(url, storage_options)
    found = fs.find(root, detail=True)
    return fs, root, dict(found)


def remote_entries(url: str, storage_options: Mapping[str, Any] | None = None) -> list[RemoteEntry]:
    """Every object under ``url`` as an entry (a chunk's ``used`` object folded into the
    chunk's), least recently used first."""
    return _entries(*_listing(url, storage_options))[0]


def _entries(
    fs: Any, root: str, listing: dict[str, Mapping[str, Any]]
) -> tuple[list[RemoteEntry], dict[tuple[str, str], str]]:
    """The entries of ``listing`` and the ``used`` objects by (namespace, key): their paths."""
    chunks: dict[tuple[str, str], RemoteEntry] = {}
    used: dict[tuple[str, str], tuple[str, float]] = {}
    entries: list[RemoteEntry] = []
    for path, info in listing.items():
        if info.get("type", "file") != "file":
            continue
        relative = path[len(root) :].lstrip("/")
        namespace, kind, key = _classify(relative)
        modified = _modified(info)
        if kind == "used":
            used[(namespace, key)] = (relative, modified)
            continue
        entry = RemoteEntry(relative, namespace, kind, int(info.get("size") or 0), modified)
        if kind == "chunk":
            chunks[(namespace, key)] = entry
        else:
            entries.append(entry)
    for ident, entry in chunks.items():
        recorded = used.get(ident)
        entries.append(entry if recorded is None else _with_use(entry, recorded[1]))
    entries.sort(key=lambda entry: entry.last_used)
    return entries, {ident: path for ident, (path, _) in used.items()}


def _with_use(entry: RemoteEntry, used: float) -> RemoteEntry:
    return RemoteEntry(entry.path, entry.namespace, entry.kind, entry.size, entry.written, used)


def prune_remote(
    url: str,
    max_bytes: int,
    *,
    min_idle_s: float = 0.0,
    temp_grace_s: float = ORPHAN_GRACE_S,
    storage_options: Mapping[str, Any] | None = None,
    now: float | None = None,
) -> tuple[list[RemoteEntry], int]:
    """Delete dead writers' temporary objects, then chunks least recently used first, until
    the remote tier under ``url`` holds at most ``max_bytes`` (chunks used within
    ``min_idle_s`` are kept); a chunk's ``used`` object goes with it, and ``used`` objects of
    chunks that are gone go too. Returns the deleted entries and the bytes left."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    now = time.time() if now is None else now
    fs, root, listing = _listing(url, storage_options)
    entries, used = _entries(fs, root, listing)
    total = sum(entry.size for entry in entries)
    removed: list[RemoteEntry] = []
    stale = [e for e in entries if e.kind == "temp" and now - e.written >= temp_grace_s]
    chunks = [e for e in entries if e.kind == "chunk"]
    for entry in stale + chunks:
        if entry.kind == "chunk" and (total <= max_bytes or now - entry.last_used < min_idle_s):
            continue
        fs.rm_file(f"{root}/{entry.path}")
        total -= entry.size
        removed.append(entry)
        marker = used.pop(_ident(entry), None) if entry.kind == "chunk" else None
        if marker is not None:
            fs.rm_file(f"{root}/{marker}")
    kept = {_ident(entry) for entry in chunks} - {_ident(entry) for entry in removed}
    for ident, marker in used.items():
        if ident not in kept:  # its chunk is gone: nothing to record the use of
            fs.rm_file(f"{root}/{marker}")
    return removed, total


def _ident(entry: RemoteEntry) -> tuple[str, str]:
    """A chunk entry's namespace and store key."""
    return entry.namespace, entry.path.rsplit("/", 1)[-1][: -len(CHUNK_SUFFIX)]
