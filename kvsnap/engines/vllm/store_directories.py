"""Directories under a prefix store's root, opened without following symbolic links.

Anyone who can write a store (a shared store's other users, a process of the same user gone
wrong) can put a symbolic link where the store has a directory: a namespace, ``chunks/HH``,
``quarantine``. Whatever writes, renames or deletes in the store (quarantine, eviction,
``kvsnap store prune``, the capacity lock) therefore reaches its files through directory
descriptors: the root (the configured path, which may itself be a link) opened once, then
every component below it with ``O_NOFOLLOW | O_DIRECTORY`` relative to its parent, and the
file itself by name relative to its directory's descriptor. A link, or anything but a
directory, met on the way fails the open (``ELOOP``, ``ENOTDIR``), so nothing outside the
store root is ever opened for writing, renamed or deleted: the caller skips that work.

Nothing here needs vLLM.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

#: Flags of a directory opened below the root: never through a link, never kept by a child.
DIRECTORY_BELOW = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def relative_parts(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> tuple[str, ...]:
    """The components of ``path`` below ``root`` (``ValueError`` when it is not below it, or a
    component is ``..``)."""
    parts = Path(path).relative_to(Path(root)).parts
    if ".." in parts:
        raise ValueError(f"{path} is not inside the store {root}")
    return parts


def open_directory(
    root: str | os.PathLike[str], parts: Sequence[str], *, create_mode: int | None = None
) -> int:
    """A descriptor of the directory ``root/parts...``, every component below ``root`` opened
    without following a link (``OSError``: ``ELOOP`` or ``ENOTDIR`` for a link or a file on
    the way, ``ENOENT`` for a missing one). With ``create_mode``, missing components are made
    with exactly that mode (whatever the umask). The caller closes it."""
    fd = os.open(os.fspath(root), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in parts:
            child = _open_child(fd, name, create_mode)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_child(parent: int, name: str, create_mode: int | None) -> int:
    try:
        return os.open(name, DIRECTORY_BELOW, dir_fd=parent)
    except FileNotFoundError:
        if create_mode is None:
            raise
    made = False
    with contextlib.suppress(FileExistsError):  # another process made it meanwhile
        os.mkdir(name, create_mode, dir_fd=parent)
        made = True
    fd = os.open(name, DIRECTORY_BELOW, dir_fd=parent)
    if made:
        os.fchmod(fd, create_mode)  # exactly, whatever the umask took off
    return fd


@contextlib.contextmanager
def directory_fd(
    root: str | os.PathLike[str], parts: Sequence[str], *, create_mode: int | None = None
) -> Iterator[int]:
    """:func:`open_directory` for the body of a ``with`` block."""
    fd = open_directory(root, parts, create_mode=create_mode)
    try:
        yield fd
    finally:
        os.close(fd)


def lstat_at(directory: int, name: str) -> os.stat_result | None:
    """``lstat`` of ``name`` in the open ``directory``; ``None`` when it is not there."""
    try:
        return os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return None


def walk_directories(
    root: Path, parts: tuple[str, ...]
) -> Iterator[tuple[Path, list[os.DirEntry[str]]]]:
    """Every directory under ``root/parts...`` (itself included) with its entries that are not
    directories, dot names included; a link is never followed (:func:`open_directory`), on
    the way there or below: a link to a directory is listed as a file, never entered."""
    try:
        fd = open_directory(root, parts)
    except OSError:
        return  # missing, or not a directory of the store's (a link, a file)
    try:
        yield from _listed(fd, root.joinpath(*parts))
    finally:
        os.close(fd)


def _listed(fd: int, path: Path) -> Iterator[tuple[Path, list[os.DirEntry[str]]]]:
    """:func:`walk_directories` of the open directory ``fd`` (at ``path``)."""
    try:
        with os.scandir(fd) as entries:
            listing = list(entries)
    except OSError:
        return
    yield (path, [item for item in listing if not item.is_dir(follow_symlinks=False)])
    for item in listing:
        if not item.is_dir(follow_symlinks=False):
            continue
        try:
            child = os.open(item.name, DIRECTORY_BELOW, dir_fd=fd)
        except OSError:
            continue  # replaced by a link or removed since the listing
        try:
            yield from _listed(child, path / item.name)
        finally:
            os.close(child)
