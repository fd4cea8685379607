"""A prefix store as a whole: its entries, their sizes and last use, and LRU pruning.

:func:`store_entries` lists every chunk, quarantined chunk and leftover under a store root
(all namespaces), a parted chunk as one entry (its index and parts); :func:`prune_store`
deletes leftover temporary files, abandoned parts and quarantined chunks first, then chunks in
order of last use, until the store fits a byte bound. A chunk's last use is the later of its
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
import dataclasses
import fcntl
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from kvsnap import format as fmt
from kvsnap.engines.vllm.prefix_store import CHUNK_SUFFIX, LEGACY_KEY, part_files
from kvsnap.engines.vllm.store_directories import (
    directory_fd,
    lstat_at,
    relative_parts,
    walk_directories,
)
from kvsnap.store import publish
from kvsnap.store.hot import hot_tier
from kvsnap.store.location import INDEX_SUFFIX
from kvsnap.store.resolve import snapshot_stem

#: Seconds after its last modification from which a part named by no index is garbage.
ORPHAN_GRACE_S = 600.0
#: Marker of a chunk the connector staged before committing it within the bound.
STAGE_MARKER = ".kvsnap-stage-"
#: This host's name as staged chunk names carry it.
_HOST = re.sub(r"[^A-Za-z0-9]", "_", socket.gethostname()) or "host"
_STAGED = re.compile(
    re.escape(STAGE_MARKER) + r"(?P<host>[A-Za-z0-9_]+)-(?P<pid>[0-9]+)-[0-9a-f]{16}"
)
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
    #: A dead writer's temporary file or an abandoned staged chunk (listed as an orphan).
    temp: bool = False
    #: A chunk named by the store keys of kvsnap before SHA-256 (32 hex digits): it is never
    #: matched again, and pruning removes it whatever the bound.
    legacy: bool = False

    def age(self, now: float | None = None) -> float:
        """Seconds since the entry was last used."""
        return (time.time() if now is None else now) - self.last_used


def _stat(path: str | os.PathLike[str]) -> os.stat_result | None:
    try:
        return os.stat(path, follow_symlinks=False)
    except FileNotFoundError:  # removed while listing
        return None


def _entry(
    path: Path,
    namespace: str,
    quarantined: bool,
    parts: tuple[Path, ...] = (),
    status: os.stat_result | None = None,
) -> StoreEntry | None:
    """The entry committed by ``path`` (whose ``status`` the caller may have) with ``parts``
    (those still there); ``None`` when ``path`` is gone."""
    status = _stat(path) if status is None else status
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


def _is_temp(name: str) -> bool:
    return name.startswith(".") and (publish.TEMP_MARKER in name or STAGE_MARKER in name)


def _leftover(path: Path, namespace: str, quarantined: bool, grace_s: float) -> StoreEntry | None:
    """The entry of the temporary or staged file ``path`` once it is a leftover (its writer is
    dead, or a staged chunk older than ``grace_s``); ``None`` while it is a write in progress."""
    if STAGE_MARKER in path.name and publish.TEMP_MARKER not in path.name:
        entry = _entry(path, namespace, quarantined)
        if entry is None or _stager_alive(path.name, time.time() - entry.modified, grace_s):
            return None
    else:
        # Its status comes with the lock, so a writer publishing meanwhile is not counted.
        status = publish.leftover_status(str(path))
        entry = None if status is None else _entry(path, namespace, quarantined, status=status)
        if entry is None:
            return None
    return dataclasses.replace(entry, orphan=True, temp=True)


def _stager_alive(name: str, age_s: float, grace_s: float) -> bool:
    """Whether the process that staged the chunk ``name`` may still commit it: on this host,
    whether its pid is alive; from another host (a shared filesystem), whether the file is
    younger than ``grace_s``."""
    match = _STAGED.search(name)
    if match is None or match.group("host") != _HOST:
        return age_s < grace_s
    pid = int(match.group("pid"))
    try:
        # Signal 0 asks only whether the pid exists; refused, it exists as another user's.
        with contextlib.suppress(PermissionError):
            os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and only waits for its parent to reap it (Linux)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return status.rsplit(")", 1)[-1].split()[:1] == ["Z"]


def _directory_entries(
    directory: Path,
    files: list[os.DirEntry[str]],
    namespace: str,
    quarantined: bool,
    grace_s: float = 600.0,
) -> list[StoreEntry]:
    """The entries of one directory: parted chunks (an index and the parts it names), single
    files, orphan parts (named by no index here) and leftover temporary files."""
    temps = [item.name for item in files if _is_temp(item.name)]
    names = {item.name for item in files if not item.name.startswith(".")}
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
    found = [_marked_legacy(entry) for entry in found]
    found += [_leftover(directory / name, namespace, quarantined, grace_s) for name in temps]
    return [entry for entry in found if entry is not None]


def _marked_legacy(entry: StoreEntry | None) -> StoreEntry | None:
    """``entry`` marked ``legacy`` when it is a chunk (not quarantined, not a part) whose
    name is an old 32-digit store key."""
    if entry is None or entry.quarantined or entry.orphan:
        return entry
    stem = snapshot_stem(entry.path.name)
    return dataclasses.replace(entry, legacy=True) if LEGACY_KEY.fullmatch(stem) else entry


def store_entries(
    root: str | os.PathLike[str], *, orphan_grace_s: float = ORPHAN_GRACE_S
) -> list[StoreEntry]:
    """Every chunk, quarantined chunk, orphan part and leftover temporary file under the store
    ``root``, least recently used first; a parted chunk is one entry. Writes in progress (a
    locked temporary file, a staged chunk younger than ``orphan_grace_s``) are not listed."""
    entries = []
    base = Path(root)
    try:
        with os.scandir(base) as listing:
            # A namespace that is a link (to a directory outside the store) is not the store's.
            namespaces = sorted(item.name for item in listing if item.is_dir(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for namespace in namespaces:
        for kind, quarantined in (("chunks", False), ("quarantine", True)):
            for directory, files in walk_directories(base, (namespace, kind)):
                entries += _directory_entries(
                    directory, files, namespace, quarantined, orphan_grace_s
                )
    entries.sort(key=lambda entry: (entry.last_used, str(entry.path)))
    return entries


def store_bytes(root: str | os.PathLike[str]) -> int:
    """Bytes of every entry under the store ``root`` (:func:`store_entries`): chunks (all their
    files), quarantined chunks, orphan parts and leftover temporary files."""
    return sum(entry.size for entry in store_entries(root))


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
        elif not _exists(entry.path):
            total -= entry.size  # gone: deleted or quarantined by another process
    return removed, total


def _exists(path: Path) -> bool:
    return _stat(path) is not None


def staged_path(path: str | os.PathLike[str]) -> Path:
    """A fresh name beside the chunk ``path`` (``HASH.safetensors``) to write it under before
    :func:`~kvsnap.engines.vllm.capacity.commit_within_capacity` commits it:
    ``.HASH.kvsnap-stage-HOST-PID-TOKEN.safetensors`` (host and pid tell a dead stager's
    leftover from a commit to come)."""
    final = Path(path)
    stem = final.name[: -len(CHUNK_SUFFIX)]
    token = f"{_HOST}-{os.getpid()}-{secrets.token_hex(8)}"
    return final.with_name(f".{stem}{STAGE_MARKER}{token}{CHUNK_SUFFIX}")
