"""The registry of copy backends: which exist, which can run here, and making one.

The built-in backends (``cuda-batch``, ``triton``, ``torch``, ``cpu``) are registered here, in
the order ``available_backends`` lists them; each guards its own optional dependency (a missing
Triton or cuda-bindings makes that backend unavailable, not this module unimportable).
"""

from __future__ import annotations

from typing import Any

import torch

from kvsnap.layout import CacheLayout
from kvsnap.transfer.base import CopyBackend
from kvsnap.transfer.cpu import CpuBackend
from kvsnap.transfer.cuda_batch import CudaBatchBackend
from kvsnap.transfer.plan import Direction
from kvsnap.transfer.torch_copy import TorchBackend
from kvsnap.transfer.triton_copy import TritonBackend

_REGISTRY: dict[str, type[CopyBackend]] = {
    backend.name: backend for backend in (CudaBatchBackend, TritonBackend, TorchBackend, CpuBackend)
}


def register_backend(cls: type[CopyBackend]) -> type[CopyBackend]:
    """Class decorator: make ``cls`` available to ``make_backend`` under ``cls.name`` (a backend
    of one's own; the built-in ones are registered above)."""
    _REGISTRY[cls.name] = cls
    return cls


def backend_class(name: str) -> type[CopyBackend]:
    """The backend class registered as ``name``; ``KeyError`` naming the known ones otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise KeyError(f"unknown transfer backend {name!r}; known: {known}, or 'auto'") from None


def _default_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Names of the backends that can copy for a cache on ``device`` (default: CUDA if present).

    The order is the registry's; ``auto`` is not listed (it picks among these).
    """
    target = _default_device() if device is None else torch.device(device)
    return [name for name, cls in _REGISTRY.items() if cls.probe(target) is None]


def unavailable_reason(name: str, device: torch.device | str | None = None) -> str | None:
    """Why backend ``name`` cannot run for a cache on ``device`` (``None`` when it can)."""
    target = _default_device() if device is None else torch.device(device)
    return backend_class(name).probe(target)


def make_backend(
    name: str, layout: CacheLayout, direction: Direction, **options: Any
) -> CopyBackend:
    """Instantiate backend ``name`` for ``layout`` and ``direction``.

    ``options`` go to the backend (e.g. ``staging_bytes`` for ``torch``, ``max_programs`` for
    ``triton``). Raises ``BackendUnavailableError`` when the backend cannot run here and
    ``KeyError`` for an unknown name.
    """
    return backend_class(name)(layout, direction, **options)
