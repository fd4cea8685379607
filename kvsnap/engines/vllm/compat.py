"""vLLM's connector base classes, or stand-ins where vLLM is missing.

Only constructing :class:`~kvsnap.engines.vllm.KVSnapConnector` needs vLLM; importing the
package does not. :data:`VLLM_IMPORT_ERROR` says why vLLM could not be imported (``None``
when it could).
"""

from __future__ import annotations

from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    #: How vLLM's metrics label the tokens kvsnap loads: from disk.
    DISK_HIT_SOURCE: Any = CacheHitSource.DISK
    VLLM_IMPORT_ERROR: str | None = None
except ImportError as _error:  # pragma: no cover - exercised only where vLLM is missing
    VLLM_IMPORT_ERROR = f"{type(_error).__name__}: {_error}"

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in so this package imports without vLLM; the connector refuses to start."""

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        """Stand-in so this package imports without vLLM."""

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        """Stand-in so this package imports without vLLM; constructing it raises."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ImportError(f"KVSnapConnector needs vLLM ({VLLM_IMPORT_ERROR})")

    KVConnectorRole = None  # type: ignore[assignment,misc]
    DISK_HIT_SOURCE = "disk"

__all__ = [
    "DISK_HIT_SOURCE",
    "VLLM_IMPORT_ERROR",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorWorkerMetadata",
]
