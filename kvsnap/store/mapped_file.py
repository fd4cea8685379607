"""A new local file mapped writable for the device to place its layer data in.

A capture to a memory-backed file (tmpfs, ramfs) through host staging copies every byte twice
on the host side (the device into pinned memory, then ``pwrite`` into the page cache, which is
the file) and runs at the page cache's write rate, about 3 GB/s for one writer. Mapped shared
and registered with CUDA, the file's own pages are the staging: the device copies each run of
pages straight to its final offset, at the PCIe rate. The host never reads or writes the
mapping: a CPU store into a tmpfs page the filesystem cannot back (the filesystem full) raises
SIGBUS, while registering faults every page in first and fails with an error code instead,
and a registered page stays backed until it is unregistered.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import numpy as np

from kvsnap.store.host_registration import (
    MAPPED,
    PORTABLE,
    register_host_range,
    unregister_host_range,
)

#: Reachable from every device's context and mapped into the device's address space; not
#: read-only: the device writes the pages.
_REGISTER_FLAGS = PORTABLE | MAPPED


class MappedFile:
    """The open file ``fd`` sized to ``size`` bytes (``ftruncate``) and mapped read-write,
    shared: what the device copies into the mapping is the file's content. With ``register``
    the mapping is registered with CUDA (every page faulted in and pinned).

    ``array`` is a uint8 view of the whole file, for the device's copies only (and for the
    CPU tests, which copy into an unregistered mapping). Raises ``OSError`` when the file
    cannot be sized, mapped or registered; nothing stays mapped or registered then.
    """

    def __init__(self, fd: int, size: int, *, register: bool) -> None:
        os.ftruncate(fd, size)
        self._mapping: mmap.mmap | None = mmap.mmap(
            fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
        self.array: np.ndarray | None = np.frombuffer(self._mapping, dtype=np.uint8)
        self.size = size
        self.address = self.array.ctypes.data
        self.registered = False
        if register:
            code = register_host_range(self.address, size, _REGISTER_FLAGS)
            if code != 0:
                self.close()
                raise OSError(f"cudaHostRegister of the mapped file failed with CUDA error {code}")
            self.registered = True

    def close(self) -> None:
        """Unregister and unmap; safe to call repeatedly. The caller has waited for every
        copy into the mapping. A view of ``array`` still alive elsewhere keeps the mapping
        until it is collected (never used again: the file is written by descriptor from here)."""
        if self.registered:
            unregister_host_range(self.address)
            self.registered = False
        self.array = None
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            with contextlib.suppress(BufferError):
                mapping.close()
