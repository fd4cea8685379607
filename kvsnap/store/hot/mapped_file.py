"""A new local file mapped writable for the device to place its layer data in.

A capture to a memory-backed file (tmpfs, ramfs) through host staging copies every byte twice
on the host side (the device into pinned memory, then ``pwrite`` into the page cache, which is
the file) and runs at the page cache's write rate, about 2-3 GB/s for one writer. Mapped shared
and registered with CUDA, the file's own pages are the staging: the device copies each run of
pages straight to its final offset, at the PCIe rate.

What that costs is bringing the file's pages into being: each one allocated, zeroed and
mapped. ``cudaHostRegister`` would fault them in one at a time on the calling thread (136 ms
for 268 MB on the H200 machine, slower than writing the file); :meth:`MappedFile.populate`
faults them in first, ``MADV_POPULATE_WRITE`` on disjoint ranges from several threads, and
the registration then only pins pages that are there.

The host never reads or writes the mapping: a CPU store into a tmpfs page the filesystem
cannot back (the filesystem full) raises SIGBUS, while ``MADV_POPULATE_WRITE`` and the
registration fail with an error code instead, and a registered page stays backed until it is
unregistered.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import mmap
import os

import numpy as np

from kvsnap.host_registration import (
    MAPPED,
    PORTABLE,
    register_host_range,
    release_mapping,
)

#: Reachable from every device's context and mapped into the device's address space; not
#: read-only: the device writes the pages.
_REGISTER_FLAGS = PORTABLE | MAPPED
#: ``madvise`` advice: fault the range in, writable, as a write would (Linux 5.14+).
_MADV_POPULATE_WRITE = 23
#: Smallest range one populating task takes (the 2 MiB of a huge page; a task costs some tens
#: of microseconds to hand over, faulting 2 MiB in about a millisecond).
POPULATE_CHUNK_BYTES = 2 << 20


def _madvise_function() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libc's ``madvise`` (its calls release the GIL: ctypes drops it around foreign calls)."""
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


_MADVISE = _madvise_function()


class MappedFile:
    """The open file ``fd`` sized to ``size`` bytes (``ftruncate``) and mapped read-write,
    shared: what the device copies into the mapping is the file's content.

    ``array`` is a uint8 view of the file's bytes (``file_size`` of them), for the device's
    copies only (and for the CPU tests, which copy into an unregistered mapping). ``size`` is
    the mapping's length, which populate and the registration cover; the file may be shrunk
    below it (:meth:`shrink_file`), and the mapping then keeps its length. Raises ``OSError``
    when the file cannot be sized or mapped.
    """

    def __init__(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)
        self._mapping: mmap.mmap | None = mmap.mmap(
            fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        self.array: np.ndarray | None = np.frombuffer(self._mapping, dtype=np.uint8)
        self.fd = fd
        self.size = size
        self.file_size = size
        self.address = self.array.ctypes.data
        self.registered = False

    def shrink_file(self, file_size: int) -> None:
        """Cut the file to ``file_size`` bytes (at most :attr:`size`) and :attr:`array` with it.

        The mapping and its registration keep their length: the pages past the new end leave
        the file, and those the registration pinned stay allocated, unreachable from the file,
        until it is unregistered. Nothing may touch the mapping past ``file_size`` from the
        CPU (SIGBUS): :attr:`array` ends there. Raises ``OSError`` if the file cannot be cut
        (the file and the view are then unchanged)."""
        if not 0 <= file_size <= self.size:
            raise ValueError(f"cannot shrink a mapping of {self.size} bytes to {file_size}")
        if file_size == self.file_size:
            return
        assert self.array is not None
        os.ftruncate(self.fd, file_size)
        self.array = self.array[:file_size]
        self.file_size = file_size

    def populate(self, executor: concurrent.futures.Executor | None, threads: int) -> bool:
        """Fault every page of the mapping in, writable, in ranges of at least
        :data:`POPULATE_CHUNK_BYTES` on up to ``threads`` tasks of ``executor`` (``None``: on
        this thread). Returns False where the kernel cannot (before Linux 5.14: the
        registration then faults the pages); ``OSError(ENOSPC)`` when the filesystem cannot
        back them."""
        if _MADVISE is None:
            return False
        chunk = max(POPULATE_CHUNK_BYTES, -(-self.size // max(1, threads)))
        chunk = -(-chunk // POPULATE_CHUNK_BYTES) * POPULATE_CHUNK_BYTES
        ranges = [(start, min(chunk, self.size - start)) for start in range(0, self.size, chunk)]
        if executor is None or len(ranges) == 1:
            codes = [self._populate_range(start, length) for start, length in ranges]
        else:
            futures = [executor.submit(self._populate_range, *piece) for piece in ranges]
            codes = [future.result() for future in futures]
        failed = [code for code in codes if code != 0]
        if not failed:
            return True
        if all(code == errno.EINVAL for code in failed):
            return False  # no MADV_POPULATE_WRITE in this kernel
        if errno.EFAULT in failed or errno.ENOMEM in failed:
            # EFAULT: a page the filesystem cannot back (the access would raise SIGBUS).
            raise OSError(errno.ENOSPC, "the filesystem cannot back the file's pages")
        raise OSError(failed[0], os.strerror(failed[0]))

    def _populate_range(self, start: int, length: int) -> int:
        """``madvise(MADV_POPULATE_WRITE)`` of one range; 0 or the errno."""
        assert _MADVISE is not None
        if _MADVISE(self.address + start, length, _MADV_POPULATE_WRITE) == 0:
            return 0
        return ctypes.get_errno()

    def register(self) -> None:
        """Register the file's pages of the mapping with CUDA (pins every page, faulting in
        those not there); ``OSError`` if the driver refuses, and nothing is registered then.

        Only the pages up to :attr:`file_size` are registered: a spare cut to a smaller file
        (:meth:`shrink_file`) before it is registered has no pages past the file's end, and
        the driver refuses a range that covers them."""
        code = register_host_range(self.address, self.file_size, _REGISTER_FLAGS)
        if code != 0:
            raise OSError(f"cudaHostRegister of the mapped file failed with CUDA error {code}")
        self.registered = True

    def close(self) -> None:
        """Unregister and unmap; safe to call repeatedly. The caller has waited for every
        copy into the mapping. A view of ``array`` still alive elsewhere keeps the mapping
        until it is collected (never used again: the file is written by descriptor from here)."""
        self.array = None
        mapping, self._mapping = self._mapping, None
        registered, self.registered = self.registered, False
        release_mapping(mapping, self.address, registered)
