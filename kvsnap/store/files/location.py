"""Where a snapshot lives: a local path, an fsspec URL or bytes held in memory, and small
whole-file reads."""

from __future__ import annotations

import contextlib
import fcntl
import os
import posixpath
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvsnap.errors import (
    KVSnapError,
    NotASnapshotError,
    SnapshotCorruptError,
    SnapshotIOError,
)

if TYPE_CHECKING:
    import numpy as np

#: fsspec protocols whose writes publish atomically at close, so no temporary name is needed.
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl"})
INDEX_SUFFIX = ".index.json"
SAFETENSORS_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class Location:
    """A local path (``fs is None``), a path on an fsspec filesystem, or a file whose bytes
    are ``held`` in memory (a decoded encoded snapshot): only ever read, its reads served
    from that array, which must not change while it is open. A held file exists for as long
    as the location does, whatever is on disk under its name (the encoded file it was decoded
    from, or nothing), and cannot be removed: its ``path`` is only a name."""

    url: str
    path: str
    fs: Any = None
    #: The whole file's bytes (1-D ``uint8``) for a file held in memory, else ``None``.
    held: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def is_local(self) -> bool:
        return self.fs is None and self.held is None

    @property
    def object_store(self) -> bool:
        protocols = self.fs.protocol if self.fs is not None else ()
        protocols = (protocols,) if isinstance(protocols, str) else tuple(protocols)
        return any(protocol in OBJECT_STORE_PROTOCOLS for protocol in protocols)

    def sibling(self, name: str) -> Location:
        """The location of ``name`` in the same directory."""
        if self.fs is None:
            path = os.path.join(os.path.dirname(self.path), name)
            return Location(path, path)
        path = posixpath.join(posixpath.dirname(self.path), name)
        return Location(self.fs.unstrip_protocol(path), path, self.fs)

    def with_suffix(self, suffix: str) -> Location:
        if self.fs is None:
            return Location(self.url + suffix, self.path + suffix)
        return Location(self.url + suffix, self.path + suffix, self.fs)

    @property
    def name(self) -> str:
        return os.path.basename(self.path) if self.fs is None else posixpath.basename(self.path)

    def exists(self) -> bool:
        """Whether the file is there (a held file always is)."""
        if self.held is not None:
            return True
        try:
            return os.path.exists(self.path) if self.fs is None else bool(self.fs.exists(self.path))
        except OSError as error:
            raise SnapshotIOError(
                f"cannot check whether it exists ({error})", file=self.url
            ) from error

    def remove(self) -> None:
        """Delete, ignoring a missing file. A held file is refused with ``ValueError`` (the
        caller's mistake, kvsnap.errors' rule): it has no file of its own, and the file its
        ``path`` names (the encoded file it was decoded from) is not it, so is left alone."""
        if self.held is not None:
            raise ValueError(
                f"{self.url}: held in memory (decoded from the file of that name): "
                "it has no file to remove"
            )
        with contextlib.suppress(FileNotFoundError):
            if self.fs is None:
                os.unlink(self.path)
            elif self.fs.exists(self.path):
                self.fs.rm(self.path)


def locate(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None) -> Location:
    text = os.fspath(url)
    if "\0" in text:
        raise SnapshotIOError("a path cannot contain a NUL byte", file=text.replace("\0", "\\0"))
    if "://" not in text:
        return Location(text, os.path.abspath(text))
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    try:
        fs, path = fsspec.core.url_to_fs(text, **dict(storage_options or {}))
    except (ImportError, ValueError) as error:
        raise SnapshotIOError(f"cannot open this URL ({error})", file=text) from error
    if isinstance(fs, LocalFileSystem):
        return Location(text, os.path.abspath(path))
    return Location(text, path, fs)


def stem_of(location: Location) -> str:
    name = location.name
    return name[: -len(SAFETENSORS_SUFFIX)] if name.endswith(SAFETENSORS_SUFFIX) else name


def io_error(action: str, location: str, error: BaseException) -> SnapshotIOError:
    return SnapshotIOError(f"{action} failed: {error}", file=location)


def missing_member(error: SnapshotIOError, *named: Location) -> KVSnapError:
    """What an open that gave up raises for ``error``: a file that vanished but was not one of
    ``named`` (the path the caller gave, its index) is a file the index names, so the snapshot
    is incomplete (:class:`SnapshotCorruptError` naming that file), not a bad path."""
    if not isinstance(error.__cause__, FileNotFoundError) or error.file is None:
        return error
    if error.file in {location.url for location in named}:
        return error
    return SnapshotCorruptError(
        "missing: the index names this file, but it is not there", file=error.file
    )


def open_regular(
    location: Location,
    *,
    keep_atime: bool = False,
    inside: str | None = None,
    follow: bool = True,
) -> tuple[int, os.stat_result]:
    """Open the local file ``location`` for reading, refusing anything but a regular file.

    The open never blocks (``O_NONBLOCK``: a named pipe with no writer would block a plain open
    forever); the type is checked on the open descriptor (``fstat``), so the file checked is
    the file read. ``inside``: the real directory the file must resolve into (through
    symbolic links), checked on the descriptor too, before its type and before any read.
    ``keep_atime`` opens with ``O_NOATIME`` where this process may (it owns the file); without
    ``follow`` a symbolic link is refused (``OSError`` ``ELOOP``). Returns
    the blocking descriptor and its ``stat``. Raises :class:`NotASnapshotError` for a FIFO,
    device, socket or directory, :class:`SnapshotCorruptError` for a file outside ``inside``;
    ``OSError`` otherwise.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= os.O_NOFOLLOW
    if keep_atime and hasattr(os, "O_NOATIME"):
        try:
            fd = os.open(location.path, flags | os.O_NOATIME)
        except PermissionError:  # O_NOATIME needs the file's owner: open it the plain way
            fd = os.open(location.path, flags)
    else:
        fd = os.open(location.path, flags)
    try:
        if inside is not None and real_directory(fd, location.path) != inside:
            raise SnapshotCorruptError(
                "is a symbolic link to a file outside the snapshot's directory (refused)",
                file=location.url,
            )
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            kind = "a directory" if stat.S_ISDIR(status.st_mode) else "a pipe, device or socket"
            raise NotASnapshotError(f"not a regular file ({kind})", file=location.url)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd, status


def real_directory(fd: int, path: str) -> str:
    """The real directory (symbolic links resolved) of the file open as ``fd`` at ``path``.

    Asked of the descriptor (``/proc/self/fd``), so it is the directory of the very file opened
    and costs no ``lstat`` per path component; where there is no ``/proc``, of the path.
    """
    try:
        return os.path.dirname(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return os.path.dirname(os.path.realpath(path))
