"""Where a snapshot lives: a local path or an fsspec URL, and small whole-file reads."""

from __future__ import annotations

import contextlib
import fcntl
import os
import posixpath
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvsnap.errors import (
    KVSnapError,
    NotASnapshotError,
    SnapshotCorruptError,
    SnapshotIOError,
)

#: fsspec protocols whose writes publish atomically at close, so no temporary name is needed.
OBJECT_STORE_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "abfs", "abfss", "az", "adl"})
INDEX_SUFFIX = ".index.json"
SAFETENSORS_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class Location:
    """A local path (``fs is None``) or a path on an fsspec filesystem."""

    url: str
    path: str
    fs: Any = None

    @property
    def is_local(self) -> bool:
        return self.fs is None

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
        try:
            return os.path.exists(self.path) if self.fs is None else bool(self.fs.exists(self.path))
        except OSError as error:
            raise SnapshotIOError(
                f"cannot check whether it exists ({error})", file=self.url
            ) from error

    def remove(self) -> None:
        """Delete, ignoring a missing file."""
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


def open_regular(location: Location) -> tuple[int, os.stat_result]:
    """Open the local file ``location`` for reading, refusing anything but a regular file.

    The open never blocks (``O_NONBLOCK``: a named pipe with no writer would block a plain open
    forever); the type is checked on the open descriptor (``fstat``), so the file checked is
    the file read. Returns the blocking descriptor and its ``stat``. Raises
    :class:`NotASnapshotError` for a FIFO, device, socket or directory; ``OSError`` otherwise.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(location.path, flags)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            kind = "a directory" if stat.S_ISDIR(status.st_mode) else "a pipe, device or socket"
            raise NotASnapshotError(f"not a regular file ({kind})", file=location.url)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd, status


def read_small(location: Location, limit: int) -> bytes:
    """A whole small file (an index), refusing files larger than ``limit`` and anything but a
    regular file (:func:`open_regular`)."""
    try:
        if location.is_local:
            fd, status = open_regular(location)
            with os.fdopen(fd, "rb") as handle:
                if status.st_size > limit:
                    raise NotASnapshotError(
                        f"{status.st_size} bytes is too large for an index", file=location.url
                    )
                return handle.read(limit + 1)
        size = location.fs.size(location.path)
        if size is not None and size > limit:
            raise NotASnapshotError(f"{size} bytes is too large for an index", file=location.url)
        return bytes(location.fs.cat_file(location.path))
    except FileNotFoundError as error:
        raise SnapshotIOError("no such file", file=location.url) from error
    except OSError as error:
        raise io_error("reading", location.url, error) from error
