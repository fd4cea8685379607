"""Host memory registered with CUDA: the one place kvsnap calls ``cudaHostRegister``.

A pinned staging pool (:mod:`~kvsnap.transfer.pinned`) registers its own memory. A mapped file
registered with the driver is memory the GPU's copy engines reach directly: the hot tier
(:mod:`~kvsnap.store.hot.tier`) registers snapshot files read-only and uploads from them; a capture
into a memory-backed file (:mod:`~kvsnap.store.hot.mapped_file`) registers the new file writable and
the device copies its pages straight to their final offsets. Registering pins and faults every
page of the range, so it costs time in proportion to its size.

A refused registration is an answer, not a failure: the caller falls back to another path. But
the CUDA runtime also keeps a refused call's error as the calling thread's last error, and the
next torch call that checks it (any kernel launch) raises it as its own "invalid argument"
(seen: a capture that fell back to the staged write made the restore after it fail). So every
call here clears that error when it reports one (:func:`_clear_last_error`).

torch is imported by the calls, not at the top: ``kvsnap inspect`` and ``kvsnap verify`` load
the store without torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
from typing import Any

#: ``cudaHostRegisterPortable``: the registration holds in every device's context.
PORTABLE = 1
#: ``cudaHostRegisterMapped``: the range is also mapped into the device's address space.
MAPPED = 2
#: ``cudaHostRegisterReadOnly``: the device only reads the range (a ``PROT_READ`` mapping).
READ_ONLY = 8


def cuda_unavailable_reason() -> str | None:
    """Why nothing can be registered here (``None``: CUDA is available)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    return None


def whole_pages(num_bytes: int) -> int:
    """``num_bytes`` rounded up to whole pages: a registration covers a mapping's last page."""
    return -(-num_bytes // mmap.PAGESIZE) * mmap.PAGESIZE


def register_host_range(address: int, num_bytes: int, flags: int) -> int:
    """``cudaHostRegister(address, whole_pages(num_bytes), flags)``; returns the CUDA error
    code (0: registered). A failed registration leaves nothing registered."""
    status = _cudart().cudaHostRegister(address, whole_pages(num_bytes), flags)
    return _answer(status)


def unregister_host_range(address: int) -> int:
    """``cudaHostUnregister(address)`` of a range :func:`register_host_range` registered;
    returns the CUDA error code (0: unregistered)."""
    return _answer(_cudart().cudaHostUnregister(address))


def _cudart() -> Any:
    """torch's CUDA runtime bindings (:func:`_torch`)."""
    return _torch().cuda.cudart()


@functools.cache
def _torch() -> Any:
    """torch, imported by the first call and kept here: a pool unregistering its memory from
    ``__del__`` at interpreter exit can no longer import anything, not even a loaded module."""
    import torch

    return torch


def _answer(status: Any) -> int:
    """The error code of a runtime call's ``status``, its error cleared from this thread."""
    code = int(getattr(status, "value", status))
    if code != 0:
        _clear_last_error()
    return code


def _clear_last_error() -> None:
    """``cudaGetLastError()`` of the CUDA runtime torch loaded: resets this thread's last error,
    which a refused runtime call leaves behind for the next error check to raise."""
    runtime = _torch_runtime()
    if runtime is not None:
        runtime.cudaGetLastError()


@functools.cache
def _torch_runtime() -> ctypes.CDLL | None:
    """The shared CUDA runtime library torch loaded (already in this process: found by its
    soname, never loaded anew, since another copy would keep errors of its own), or ``None``
    where torch linked the runtime statically."""
    major = (_torch().version.cuda or "").split(".")[0]
    if not major:
        return None
    try:
        return ctypes.CDLL(f"libcudart.so.{major}", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None


def release_mapping(mapping: mmap.mmap | None, address: int, registered: bool) -> None:
    """Unregister ``mapping`` (at ``address``) when ``registered``, then unmap it: now, or,
    where a view of it is still alive somewhere, when the last view is collected. The caller
    has waited for every copy that used the range."""
    if registered:
        unregister_host_range(address)
    if mapping is not None:
        with contextlib.suppress(BufferError):
            mapping.close()
