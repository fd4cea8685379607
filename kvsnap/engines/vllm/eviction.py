"""A prefix store as a whole: its entries, their sizes and last use, and LRU pruning.

:func:`~kvsnap.engines.vllm.store_listing.store_entries` lists every chunk, quarantined chunk
and leftover under a store root (all namespaces), a parted chunk as one entry (its index and
parts); :func:`prune_store` deletes leftover temporary files, abandoned parts and quarantined
chunks first, then chunks in order of last use, until the store fits a byte bound. A chunk's
last use is the later of its
access and modification times (a parted chunk's: its index's):
:meth:`~kvsnap.engines.vllm.prefix_store.PrefixStore.touch` sets the access time on every hit, and
the writer's publish sets both. With ``store_capacity_bytes`` the connector commits each chunk
through :func:`~kvsnap.engines.vllm.capacity.commit_within_capacity` (under the store-wide
capacity lock: the store is measured by listing it, pruned to make room, then the staged chunk
is renamed into place), so the bound holds however many engines share the store;
``kvsnap store prune`` prunes by hand.

**Links.** Listing and pruning never follow a symbolic link: namespaces, ``chunks``,
``quarantine`` and their subdirectories are opened below the root with ``O_NOFOLLOW``
(:mod:`~kvsnap.engines.vllm.store_directories`), a link among them is not listed, and every
file is renamed or deleted by name relative to its directory's descriptor, opened again from
the root when it is deleted. A link planted after the listing fails that open: the entry is
skipped. Nothing outside the store root is ever deleted.

**Orphan parts.** A part file that no index beside it names is a failed or abandoned parted
write's leftover (its ranks died before the index was published, or a pruner or quarantine
lost a race), or a write still in progress: every part is published before the index that
commits them. It is listed as an entry of its own (``orphan``), counts toward the store's
bytes, and is deleted first once it was last modified ``orphan_grace_s`` ago (default
:data:`ORPHAN_GRACE_S`), which no live write takes between its first part and its index.

**Temporary files.** A writer publishes through a temporary file
(``.NAME.kvsnap-tmp-PID-TOKEN``, ``flock``ed by its writer until the rename), and the connector
stages a chunk under ``.HASH.kvsnap-stage-PID-TOKEN.safetensors`` before it commits it within
the bound (:func:`commit_within_capacity`). A temporary file whose lock is held, or a staged
chunk modified in the last ``orphan_grace_s``, is a write in progress: not listed. Once its
writer is dead (the lock is free) or the grace has passed, it is a leftover: listed as an
orphan entry (``temp``), counted, and deleted first.

**Eviction racing with use.** Pruning works from a listing that may be old by the time it
deletes an entry: another engine may have matched the chunk since. So each chunk is first
renamed aside (under a temporary name whose lock the pruner holds), its last use read again
from the renamed file, and it is renamed back when it was used since the listing or within
``min_idle_s``; only otherwise deleted. A scheduler's :meth:`PrefixStore.touch
<kvsnap.engines.vllm.prefix_store.PrefixStore.touch>` that finds the chunk gone (renamed aside or
deleted) reports a miss.

Nothing here needs vLLM.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time

from kvsnap.engines.vllm.store_directories import (
    directory_fd,
    lstat_at,
    relative_parts,
)
from kvsnap.engines.vllm.store_listing import (
    ORPHAN_GRACE_S,
    STAGE_MARKER,
    StoreEntry,
    entry_exists,
    staged_path,
    store_bytes,
    store_entries,
)
from kvsnap.store.files import publish
from kvsnap.store.hot.tier import hot_tier

# The entries' names are read from here too, where they lived before store_listing.py.
__all__ = [
    "ORPHAN_GRACE_S",
    "STAGE_MARKER",
    "StoreEntry",
    "eviction_order",
    "prune_measured",
    "prune_store",
    "staged_path",
    "store_bytes",
    "store_entries",
]


def eviction_order(entries: list[StoreEntry]) -> list[StoreEntry]:
    """``entries`` in the order pruning deletes them: leftover temporary files, chunks of the
    old key scheme, orphan parts, quarantined chunks, then chunks, each least recently used
    first."""
    return sorted(
        entries,
        key=lambda entry: (
            not entry.temp,
            not entry.legacy,
            not entry.orphan,
            not entry.quarantined,
            entry.last_used,
        ),
    )


def _removable(entry: StoreEntry, moment: float, min_idle_s: float, orphan_grace_s: float) -> bool:
    if entry.temp:
        return True  # listed only once its writer is dead or its grace has passed
    if entry.orphan:
        return moment - entry.modified >= orphan_grace_s
    return entry.quarantined or entry.age(moment) >= min_idle_s


def _delete_temp(directory: int, entry: StoreEntry) -> bool:
    """Delete a leftover temporary file in the open ``directory``, unless its lock is held
    (then it is not a leftover); a staged chunk past its grace goes plainly."""
    name = entry.path.name
    if publish.TEMP_MARKER in name:
        return publish.remove_if_unlocked(name, dir_fd=directory)
    try:
        os.unlink(name, dir_fd=directory)
    except FileNotFoundError:
        return False
    return True


def _set_aside(directory: int, name: str) -> tuple[int, str] | None:
    """Rename the file ``name`` of the open ``directory`` to a temporary name beside it whose
    lock this process holds (so no other pruner removes it meanwhile); ``(fd holding the
    lock, new name)``, or ``None`` when it is gone or another pruner holds it."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=directory)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        aside = publish.temp_name(name)
        os.rename(name, aside, src_dir_fd=directory, dst_dir_fd=directory)
        if os.stat(aside, dir_fd=directory, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
            # Renamed another file than the one locked: leave it.
            os.rename(aside, name, src_dir_fd=directory, dst_dir_fd=directory)
            raise FileNotFoundError(name)
    except OSError:
        os.close(fd)
        return None
    return fd, aside


def _still_idle(
    entry: StoreEntry, directory: int, aside: str, moment: float, min_idle_s: float
) -> bool:
    """Whether the chunk set aside as ``aside`` in ``directory`` was not used since it was
    listed (``entry``) nor in the last ``min_idle_s`` seconds, reading its last use again."""
    status = lstat_at(directory, aside)
    if status is None:
        return True
    last_used = max(status.st_atime, status.st_mtime)
    return last_used <= entry.last_used and moment - last_used >= min_idle_s


def _delete(root: str | os.PathLike[str], entry: StoreEntry, min_idle_s: float = 0.0) -> bool:
    """Delete ``entry``'s files, the committing one first; ``False`` (nothing deleted) when it
    is gone already (another process evicted or quarantined it, and its parts are that
    process's to move or delete), was used since it was listed, or its directory is no longer
    the store's (a link planted since the listing: nothing is deleted through it).

    A chunk's committing file is first set aside and its last use read again
    (:func:`_still_idle`): used since the listing or within ``min_idle_s``, it is renamed back
    and kept."""
    try:
        with directory_fd(root, relative_parts(root, entry.path.parent)) as directory:
            if not _delete_files(directory, entry, min_idle_s):
                return False
    except (OSError, ValueError):
        return False
    tier = hot_tier()
    tier.forget(str(entry.path))  # its registered pages are freed now, not at the next prune
    for part in entry.parts:
        tier.forget(str(part))
    if entry.quarantined and entry.parts:
        # The parted chunk's own quarantine/HASH.T/; not empty: something else is in it.
        with contextlib.suppress(OSError, ValueError):
            parent = entry.path.parent
            with directory_fd(root, relative_parts(root, parent.parent)) as above:
                os.rmdir(parent.name, dir_fd=above)
    return True


def _delete_files(directory: int, entry: StoreEntry, min_idle_s: float) -> bool:
    """:func:`_delete`'s work in the entry's open ``directory``."""
    name = entry.path.name
    if entry.temp:
        return _delete_temp(directory, entry)
    if entry.orphan or entry.quarantined:
        try:
            os.unlink(name, dir_fd=directory)
        except FileNotFoundError:
            return False
    else:
        held = _set_aside(directory, name)
        if held is None:
            return False
        fd, aside = held
        try:
            if not _still_idle(entry, directory, aside, time.time(), min_idle_s):
                # Used meanwhile: put it back.
                os.replace(aside, name, src_dir_fd=directory, dst_dir_fd=directory)
                return False
            os.unlink(aside, dir_fd=directory)
        finally:
            os.close(fd)
    for part in entry.parts:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part.name, dir_fd=directory)
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

    Leftover temporary files (dead writers', abandoned staged chunks) and chunks of the old
    key scheme (``legacy``: never matched) are deleted whatever the bound. Chunks used in the
    last ``min_idle_s`` seconds are kept even if the store stays above the bound: a scheduler
    may have matched one that a worker is about to load; a chunk used after the listing is set
    aside, found used and put back (see the module's notes).
    Orphan parts modified in the last ``orphan_grace_s`` seconds are kept: they may be a write
    in progress.
    """
    removed, _ = prune_measured(root, max_bytes, min_idle_s, orphan_grace_s, now)
    return removed


def prune_measured(
    root: str | os.PathLike[str],
    max_bytes: int,
    min_idle_s: float,
    orphan_grace_s: float,
    now: float | None,
) -> tuple[list[StoreEntry], int]:
    """:func:`prune_store`, returning also the bytes the store holds after it (what a commit
    within the bound needs: :mod:`~kvsnap.engines.vllm.capacity`)."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    entries = store_entries(root, orphan_grace_s=orphan_grace_s)
    total = sum(entry.size for entry in entries)
    moment = time.time() if now is None else now
    removed = []
    for entry in eviction_order(entries):
        # Leftover temporary files and old-scheme chunks are garbage whatever the bound.
        if total <= max_bytes and not (entry.temp or entry.legacy):
            break
        if not _removable(entry, moment, min_idle_s, orphan_grace_s):
            continue
        if _delete(root, entry, min_idle_s):
            removed.append(entry)
            total -= entry.size
        elif not entry_exists(entry.path):
            total -= entry.size  # gone: deleted or quarantined by another process
    return removed, total
