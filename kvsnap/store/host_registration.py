"""Host memory registered with CUDA: the one place kvsnap's store calls ``cudaHostRegister``.

A mapped file registered with the driver is memory the GPU's copy engines reach directly: the
hot tier (:mod:`~kvsnap.store.hot`) registers snapshot files read-only and uploads from them;
a capture into a memory-backed file (:mod:`~kvsnap.store.mapped_file`) registers the new file
writable and the device copies its pages straight to their final offsets. Registering pins and
faults every page of the range, so it costs time in proportion to its size.

torch is imported by the calls, not at the top: ``kvsnap inspect`` and ``kvsnap verify`` load
the store without torch.
"""

from __future__ import annotations

import contextlib
import mmap

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
    import torch

    status = torch.cuda.cudart().cudaHostRegister(address, whole_pages(num_bytes), flags)
    return int(getattr(status, "value", status))


def unregister_host_range(address: int) -> None:
    """``cudaHostUnregister(address)`` of a range :func:`register_host_range` registered."""
    import torch

    torch.cuda.cudart().cudaHostUnregister(address)


def release_mapping(mapping: mmap.mmap | None, address: int, registered: bool) -> None:
    """Unregister ``mapping`` (at ``address``) when ``registered``, then unmap it: now, or,
    where a view of it is still alive somewhere, when the last view is collected. The caller
    has waited for every copy that used the range."""
    if registered:
        unregister_host_range(address)
    if mapping is not None:
        with contextlib.suppress(BufferError):
            mapping.close()
