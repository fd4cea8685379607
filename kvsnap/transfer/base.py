"""The copy-backend interface and the job results.

A backend executes one job's copies on one stream. Every backend sees the same job: the
validated `kvsnap.transfer.plan.ResolvedCopy` list (which the ``torch`` backend gathers from)
and the flat `kvsnap.transfer.plan.Descriptors` built from it (which the pointer backends
``cpu``, ``triton`` and ``cuda-batch`` execute). Backends never decide ordering or completion;
the `kvsnap.transfer.handler.TransferHandler` does. The registry of backends is
`kvsnap.transfer.backends`, the ``auto`` policy `kvsnap.transfer.policy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvsnap.errors import BackendUnavailableError
from kvsnap.layout import CacheLayout
from kvsnap.transfer.plan import Descriptors, Direction, ResolvedCopy


@dataclass(frozen=True)
class TransferResult:
    """The outcome of one job: ``num_bytes`` moved in ``seconds`` (GPU time on CUDA).

    ``success`` is False when the job's copies could not run or their stream reported an
    error; ``error`` then says why. ``backend`` names the backend that executed the job.
    """

    job_id: int
    success: bool
    num_bytes: int
    seconds: float
    error: str | None = None
    backend: str | None = None


@dataclass
class CopyJob:
    """What a backend executes: one job's copies, validated and resolved, and as descriptors.

    ``descriptors`` are numpy int64 arrays; on CUDA they are views of ``pinned`` (three
    page-locked int64 tensors owned by the handler, untouched until the job completes), so a
    backend may hand them to the GPU asynchronously. ``stream`` is the job's CUDA stream, and
    the current stream while :meth:`CopyBackend.execute` runs; ``None`` on CPU.
    """

    job_id: int
    copies: Sequence[ResolvedCopy]
    descriptors: Descriptors
    stream: torch.cuda.Stream | None = None
    pinned: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def mean_descriptor_bytes(self) -> float:
        count = len(self.descriptors)
        return self.descriptors.num_bytes / count if count else 0.0


@contextmanager
def on_stream(stream: torch.cuda.Stream) -> Iterator[None]:
    """Make ``stream`` the current stream of its device inside the block.

    The same as ``torch.cuda.stream(stream)`` on the current device, at a fraction of its host
    cost (it looks the current stream and device up several times per entry and exit), which
    counts on the submit path: a job switches streams once or twice per staging batch.
    """
    previous = torch.cuda.current_stream(stream.device_index)
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(previous)


class CopyBackend(ABC):
    """One way of executing a job's copies; every backend is interchangeable and bit-exact.

    Subclasses set :attr:`name`, implement :meth:`probe` (can this backend serve a layout on
    this device, and if not, why) and :meth:`execute`. ``execute`` enqueues the copies on the
    current stream (CUDA) or performs them before returning (CPU); it raises on any error it
    can see, which fails that job only.
    """

    name: ClassVar[str]
    #: Whether :meth:`execute` reads ``job.descriptors`` (else only ``job.copies``; the handler
    #: then skips building descriptors).
    uses_descriptors: ClassVar[bool] = True

    def __init__(self, layout: CacheLayout, direction: Direction, **options: Any) -> None:
        reason = self.probe(layout.device)
        if reason is not None:
            raise BackendUnavailableError(f"backend {self.name!r} is unavailable: {reason}")
        self.layout = layout
        self.direction = direction
        self.device = layout.device
        if options:
            raise TypeError(f"backend {self.name!r} takes no options {sorted(options)}")

    @classmethod
    @abstractmethod
    def probe(cls, device: torch.device) -> str | None:
        """``None`` if this backend can copy for a cache on ``device``, else the reason why not."""

    @abstractmethod
    def execute(self, job: CopyJob) -> None:
        """Perform (CPU) or enqueue on the current stream (CUDA) all copies of ``job``."""

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release what the backend holds (staging buffers, device descriptor buffers)."""
