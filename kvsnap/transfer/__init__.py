"""Ordered asynchronous copies between an engine's KV cache and host pages.

:class:`TransferHandler` runs jobs (lists of :class:`~kvsnap.transfer.plan.PageCopy`) in one
direction on pooled streams; a :class:`CopyBackend` executes each job: ``cuda-batch`` (the
driver's batch DMA copy), ``triton`` (a UVA copy kernel), ``torch`` (gather/scatter through
staging) or ``cpu`` (host memory only). ``auto`` picks per job (`kvsnap.transfer.policy`);
`kvsnap.transfer.backends` is the registry.
"""

from kvsnap.errors import BackendUnavailable, BackendUnavailableError
from kvsnap.transfer.backends import (
    available_backends,
    make_backend,
    register_backend,
    unavailable_reason,
)
from kvsnap.transfer.base import CopyBackend, CopyJob, TransferResult
from kvsnap.transfer.handler import TransferHandler
from kvsnap.transfer.policy import AutoPolicy, choose_backend, current_policy, load_policy

__all__ = [
    "AutoPolicy",
    "BackendUnavailable",
    "BackendUnavailableError",
    "CopyBackend",
    "CopyJob",
    "TransferHandler",
    "TransferResult",
    "available_backends",
    "choose_backend",
    "current_policy",
    "load_policy",
    "make_backend",
    "register_backend",
    "unavailable_reason",
]
