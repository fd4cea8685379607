"""A prefix store's entries: every chunk, quarantined chunk and leftover under a store root,
their sizes and last use, and the rules that tell a temporary or staged file of a live write
from a leftover (:mod:`~kvsnap.engines.vllm.eviction` describes them and prunes by them).

Nothing here needs vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
    walk_directories,
)
from kvsnap.store.files import publish
from kvsnap.store.files.location import INDEX_SUFFIX
from kvsnap.store.files.resolve import snapshot_stem

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


def entry_exists(path: Path) -> bool:
    """Whether ``path`` still names a file (a link counts; it is not followed)."""
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
