"""Atomic publish: write under a temporary name in the same directory, fsync, rename.

Every file kvsnap publishes locally (a snapshot, a shard, an index, a calibration file) is
written to a temporary name next to its final path, ``fsync``ed, renamed over the final path
and the directory ``fsync``ed: a crash leaves the old file or the new complete one, never a
mix. :func:`publish_bytes` does all of it for data held in memory (:func:`publish_to` for a
small file anywhere, local or fsspec); :func:`create_temp`,
:func:`replace_and_sync` let a streaming writer do the same in steps.

Temporary names are ``.{final name}.kvsnap-tmp-{pid}-{16 hex digits}`` (shortened, see
:func:`temp_name`, so they stay within the 255-byte file name limit). The writer holds an
exclusive ``flock`` on its temporary file from creation until the rename, so
:func:`remove_dead_temps` can tell a dead writer's leftover (lock free) from a live writer's
file (locked) and removes only the former.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import stat
from collections.abc import Callable

import xxhash

from kvsnap.store.location import Location

#: Marker between the final name and the writer's pid and token in a temporary name.
TEMP_MARKER = ".kvsnap-tmp-"
#: Longest file name (bytes) the common Linux filesystems accept.
MAX_NAME_BYTES = 255
_TEMP_NAME = re.compile(r"\.(?P<final>.+)\.kvsnap-tmp-(?P<pid>[0-9]+)-(?P<token>[0-9a-f]{16})")
_SHORTENED = re.compile(r"(?P<head>.*)~(?P<owner>[0-9a-f]{16})")


def temp_final_name(name: str) -> str | None:
    """The final name a temporary file named ``name`` is written for (cut short when its
    temporary name was), or ``None`` when ``name`` is no kvsnap temporary name."""
    match = _TEMP_NAME.fullmatch(name)
    return None if match is None else match.group("final")


def owner_tag(owner: str) -> str:
    """16 hex digits naming ``owner`` (a snapshot's stem) inside shortened temporary names."""
    return xxhash.xxh3_64_hexdigest(owner.encode("utf-8", "surrogateescape"))


def temp_name(final_name: str, owner: str | None = None) -> str:
    """A fresh temporary name for ``final_name``: ``.{final_name}.kvsnap-tmp-{pid}-{token}``.

    When that passes :data:`MAX_NAME_BYTES`, the final name is cut to fit and followed by
    ``~`` and :func:`owner_tag` of ``owner`` (default: the final name), so a cleanup that knows
    the owner still recognizes it.
    """
    suffix = f"{TEMP_MARKER}{os.getpid()}-{secrets.token_hex(8)}"
    name = f".{final_name}{suffix}"
    if len(name.encode("utf-8", "surrogateescape")) <= MAX_NAME_BYTES:
        return name
    tag = "~" + owner_tag(owner if owner is not None else final_name)
    room = MAX_NAME_BYTES - 1 - len(suffix) - len(tag)
    head = final_name.encode("utf-8", "surrogateescape")[:room].decode("utf-8", "ignore")
    return f".{head}{tag}{suffix}"


def file_mode(directory: str) -> int:
    """The mode a new file in ``directory`` is created with (before the umask): read-write for
    its owner, and for group and others only the read and write bits the directory grants
    them. A store kept in a ``0700`` directory thus holds ``0600`` files, and a group-shared
    (``0770``) one ``0660`` files."""
    try:
        granted = os.stat(directory or ".").st_mode & 0o066
    except OSError:
        return 0o666
    return 0o600 | granted


def create_temp(final_path: str, owner: str | None = None) -> tuple[int, str]:
    """Create and lock a temporary file next to ``final_path``; returns ``(fd, temp_path)``.

    The file is created exclusively (``O_EXCL``) and ``flock``ed; ``fd`` (read-write) holds
    the lock until it is closed. It grants group and others no more than its directory does
    (:func:`file_mode`): in a private (``0700``) directory it is ``0600``. Should a cleanup
    remove the file between creation and locking, a new name is tried, so the returned path
    is this file's. On a filesystem without
    ``flock`` the file stays unlocked, and :func:`remove_dead_temps` (which cannot lock it
    either) never removes it.
    """
    directory = os.path.dirname(final_path)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    mode = file_mode(directory)
    while True:
        path = os.path.join(directory, temp_name(os.path.basename(final_path), owner))
        fd = os.open(path, flags, mode)
        try:
            _lock(fd)
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd, path
        except FileNotFoundError:
            # A cleanup took it before the lock: let it go and try another name.
            os.close(fd)
            continue
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        os.close(fd)


#: ``flock`` errors meaning "this filesystem has no such locks" (some FUSE and network ones).
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


def _lock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as error:
        if error.errno not in _NO_LOCKS:
            raise


def fsync_directory(path: str) -> None:
    """``fsync`` the directory ``path``, so a rename inside it survives a power loss."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_and_sync(temp_path: str, final_path: str) -> None:
    """Rename ``temp_path`` over ``final_path`` and ``fsync`` their directory."""
    os.replace(temp_path, final_path)
    fsync_directory(os.path.dirname(os.path.abspath(final_path)))


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of ``data`` at the descriptor's position."""
    view = memoryview(data).cast("B")
    while len(view):
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.EIO, "write wrote nothing")
        view = view[written:]


def publish_bytes(path: str | os.PathLike[str], data: bytes | memoryview) -> None:
    """Atomically replace the local file ``path`` with ``data``.

    Writes a locked temporary file in the same directory (:func:`create_temp`), ``fsync``s it,
    renames it over ``path`` and ``fsync``s the directory. Readers see the old file or the
    new one, never a mix; on any error the temporary file is removed and ``path`` is
    untouched. Raises ``OSError``.
    """
    final = os.path.abspath(os.fspath(path))
    fd, temp = create_temp(final)
    try:
        write_all(fd, data)
        os.fsync(fd)
        replace_and_sync(temp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    finally:
        os.close(fd)


def publish_to(location: Location, data: bytes) -> None:
    """Atomically replace the small file ``location`` (an index) with ``data``: through
    :func:`publish_bytes` for a local file, in one put on an object store (an upload appears
    only when complete), through a temporary name and a move on other fsspec filesystems.
    Raises ``OSError``."""
    if location.is_local:
        publish_bytes(location.path, data)
    elif location.object_store:
        location.fs.pipe_file(location.path, data)
    else:
        temp = location.sibling(temp_name(location.name))
        temp.fs.pipe_file(temp.path, data)
        temp.fs.mv(temp.path, location.path)


def _is_ours(temp: str, owns: Callable[[str], bool], owner: str) -> bool:
    match = _TEMP_NAME.fullmatch(temp)
    if match is None:
        return False
    final = match.group("final")
    shortened = _SHORTENED.fullmatch(final)
    if shortened is not None and shortened.group("owner") == owner_tag(owner):
        return True
    return owns(final)


def remove_if_unlocked(path: str, *, dir_fd: int | None = None) -> bool:
    """Remove the regular file ``path`` (relative to the open directory ``dir_fd``, when given)
    if no process holds its lock; whether it was removed."""
    fd = _open_existing(path, dir_fd)
    if fd is None:
        return False
    try:
        if _lock_if_free(fd, path, without_locks=False, dir_fd=dir_fd) is None:
            return False
        os.unlink(path, dir_fd=dir_fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_dead_temps(directory: str, owns: Callable[[str], bool], owner: str) -> list[str]:
    """Remove the temporary files of dead writers in ``directory`` that belong to ``owner``.

    A temporary file belongs to it when ``owns(final name)`` holds for the final name it
    encodes, or when its shortened name carries :func:`owner_tag` of ``owner``. It is removed
    only when its lock can be taken: a live writer holds the lock of its own file, so only
    leftovers of killed writers go. Returns the removed paths.
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        if TEMP_MARKER in name and _is_ours(name, owns, owner):
            path = os.path.join(directory, name)
            if remove_if_unlocked(path):
                removed.append(path)
    return removed


def leftover_status(path: str) -> os.stat_result | None:
    """The status of the temporary file ``path`` when it is a dead writer's leftover: a
    regular file whose ``flock`` nobody holds (or on a filesystem without ``flock``), still
    under that name; ``None`` while a live writer holds it, or once it is gone.

    The status comes from the file whose lock was asked, and the name is checked after it: a
    live writer renames its file into place before it lets the lock go. (The name's status
    taken first and the lock asked after would report a writer that published in between as a
    leftover of its full size.)"""
    fd = _open_existing(path)
    if fd is None:
        return None
    try:
        return _lock_if_free(fd, path, without_locks=True)
    finally:
        os.close(fd)  # closing releases a lock taken here


def _open_existing(path: str, dir_fd: int | None = None) -> int | None:
    """A read-only descriptor on the file ``path`` (not through a symlink; relative to the
    open directory ``dir_fd`` when given), or ``None``."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        return os.open(path, flags, dir_fd=dir_fd)
    except OSError:
        return None


def _lock_if_free(
    fd: int, path: str, *, without_locks: bool, dir_fd: int | None = None
) -> os.stat_result | None:
    """Take the ``flock`` of ``fd``, opened as ``path`` (in ``dir_fd``), unless another holds
    it; the file's status when it is a regular file whose lock was free and ``path`` still
    names it, else ``None``. On a filesystem without ``flock`` the file counts as free when
    ``without_locks``, as held otherwise."""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if not (without_locks and error.errno in _NO_LOCKS):
                return None  # a live writer holds it, or no lock can tell
        status = os.fstat(fd)
        # Still the file locked here? One renamed away meanwhile was a live writer's, and
        # another file now under the name is not the one whose lock was free.
        if os.stat(path, dir_fd=dir_fd, follow_symlinks=False).st_ino != status.st_ino:
            return None
        return status
    except OSError:
        return None
