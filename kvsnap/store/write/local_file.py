"""A local output file: temporary name, O_DIRECT probe, pwrite, block reservation."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
from collections.abc import Callable

from kvsnap.store.files.location import (
    Location,
)
from kvsnap.store.files.publish import create_temp


def _open_direct(path: str) -> int:
    """A second, O_DIRECT descriptor on ``path`` (tests replace this to simulate refusal)."""
    return os.open(path, os.O_WRONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        view = view[written:]
        offset += written


def _aligned_copy(data: bytes) -> mmap.mmap:
    """``data`` in page-aligned anonymous memory (O_DIRECT needs aligned buffers)."""
    buffer = mmap.mmap(-1, max(len(data), 1))
    buffer[: len(data)] = data
    return buffer


def _libc_function(name: str, argtypes: list[type]) -> Callable[..., int] | None:
    """libc's ``name``, typed, looked up once (a lookup per call costs more than the call)."""
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (AttributeError, OSError):
        return None  # not glibc/Linux
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


_FALLOCATE = _libc_function(
    "fallocate", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
)
_STATFS = _libc_function("statfs", [ctypes.c_char_p, ctypes.c_void_p])
#: fallocate errors that mean "not for this file": the snapshot is then written without it.
_NO_FALLOCATE = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EPERM})


#: ``statfs`` filesystem types whose files live in memory (tmpfs, ramfs).
_MEMORY_FILESYSTEMS = frozenset({0x01021994, 0x858458F6})


class _StatFs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]


def memory_backed(directory: str) -> bool:
    """Whether files in ``directory`` live in memory (tmpfs or ramfs, by ``statfs``); False
    where that cannot be told."""
    result = _StatFs()
    if _STATFS is None or _STATFS(os.fsencode(directory or "."), ctypes.byref(result)) != 0:
        return False
    return (result.f_type & 0xFFFFFFFF) in _MEMORY_FILESYSTEMS


def preallocate(fd: int, size: int) -> bool:
    """Reserve ``size`` bytes of disk blocks for ``fd`` (and set its size) before any data.

    Writes into reserved blocks do not allocate as they go (on the H200 machine's ext4 one
    O_DIRECT stream reached 0.89-0.92 of the raw write with the reservation, 0.87 without); a
    full disk also fails here, before any data moves. Not ``posix_fallocate``: glibc emulates
    it by writing every block where the filesystem lacks fallocate. Returns whether the blocks
    were reserved.
    """
    if _FALLOCATE is None or size <= 0:
        return False
    if _FALLOCATE(fd, 0, 0, size) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_FALLOCATE:
        return False
    raise OSError(code, os.strerror(code))


class LocalFile:
    """One output file written through a temporary name next to its final path."""

    def __init__(self, final: Location, owner: str | None = None) -> None:
        self.final = final
        # Locked from creation until published or discarded (see kvsnap.store.files.publish).
        fd, self.temp = create_temp(final.path, owner)
        self.fd: int | None = fd
        self.direct_fd: int | None = None

    def enable_direct(self, header: bytes) -> str | None:
        """Write ``header`` through O_DIRECT as a probe; keep the O_DIRECT descriptor when it works.

        Returns ``None`` on success, else why O_DIRECT is unavailable (the header is then
        written through the page cache).
        """
        if not hasattr(os, "O_DIRECT"):
            return "this platform has no O_DIRECT"
        try:
            self.direct_fd = _open_direct(self.temp)
        except OSError as error:
            return f"the filesystem refused O_DIRECT ({error.strerror or error})"
        buffer = _aligned_copy(header)
        try:
            _pwrite_all(self.direct_fd, memoryview(buffer)[: len(header)], 0)
            return None
        except OSError as error:
            os.close(self.direct_fd)
            self.direct_fd = None
            return f"the filesystem refused an O_DIRECT write ({error.strerror or error})"
        finally:
            buffer.close()

    def adopt(self, fd: int, temp: str) -> None:
        """Go on through ``fd``, the locked temporary file ``temp`` beside the final path (a
        spare capture file renamed for this one), instead of the file this one created, which
        is closed and removed (nothing of it is kept: the caller writes the front again)."""
        previous = self.temp
        self._close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(previous)
        self.fd, self.temp = fd, temp

    def write(self, offset: int, view: memoryview) -> None:
        assert self.fd is not None
        _pwrite_all(self.fd, view, offset)

    def write_direct(self, offset: int, view: memoryview) -> None:
        assert self.direct_fd is not None
        _pwrite_all(self.direct_fd, view, offset)

    def sync(self) -> None:
        """fsync (flushes the page-cache writes and the file's metadata). The descriptor stays
        open, and so the lock that marks the temporary file as a live writer's, until
        :meth:`publish`."""
        assert self.fd is not None
        os.fsync(self.fd)
        if self.direct_fd is not None:
            os.close(self.direct_fd)
            self.direct_fd = None

    def _close(self) -> None:
        for fd in (self.direct_fd, self.fd):
            if fd is not None:
                os.close(fd)
        self.fd = self.direct_fd = None

    def publish(self) -> None:
        """Rename the temporary file to the final path (the caller fsyncs the directory)."""
        os.replace(self.temp, self.final.path)
        self._close()

    def unlink_temp(self) -> None:
        """Remove the temporary name at once; the descriptors stay open (a write may still be
        running on them) until :meth:`discard`."""
        with contextlib.suppress(OSError):
            os.unlink(self.temp)

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self._close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temp)
