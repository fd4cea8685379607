"""The options every capture and restore shares: how to copy, through which staging, and whom
to tell how far it got."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvsnap.transfer.pinned import PinnedPool

ProgressCallback = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``, called as data moves."""


class ProgressCounter:
    """Counts the bytes moved and reports them to an optional :data:`ProgressCallback`."""

    def __init__(self, callback: ProgressCallback | None, total_bytes: int) -> None:
        self.callback = callback
        self.total_bytes = total_bytes
        self.done_bytes = 0
        self._lock = threading.Lock()

    def add(self, num_bytes: int) -> None:
        """Count ``num_bytes`` more; reports are serialized (restores move slots on several
        threads) and never decrease."""
        with self._lock:
            self.done_bytes += num_bytes
            if self.callback is not None:
                self.callback(self.done_bytes, self.total_bytes)


#: Host staging slot of small jobs (an engine's per-request prefix) and of large ones.
SMALL_SLOT_BYTES = 16 << 20
LARGE_SLOT_BYTES = 64 << 20
#: A capture of at least this many bytes stages through large slots (fewer, larger disk writes).
LARGE_JOB_BYTES = 128 << 20
#: A restore of at least this many bytes stages through large slots.
LARGE_RESTORE_JOB_BYTES = 128 << 20
#: A restore whose pages the device checks (CUDA) stages through large slots from this many
#: bytes: each slot costs the host its enqueue, and a first touch of 36-67 MB took 25-33% less
#: time through 64 MiB slots than through 16 MiB ones on the H200 (42 MB: 5.92 -> 4.42 ms;
#: docs/benchmarks.md). Caches in host memory keep the larger bound: there the slots overlap
#: the reads with the host's copies (42 MB: 13 ms through small slots, 29 through a large one).
LARGE_DEVICE_RESTORE_JOB_BYTES = 32 << 20
#: Slots of each size kvsnap keeps pinned per process at most (pinned on first use).
SHARED_SLOTS = 8
#: A restore slot goes up to the device in this many pieces (each at least
#: ``MIN_UPLOAD_CHUNK_BYTES``); each piece is checked and scattered once it has arrived and
#: then released to the next slot's upload (docs/architecture.md, "A slot goes up in pieces").
#: Every piece costs the host two launches. On the H200, hot 2k and 8k restores: two pieces
#: 0.81 and 0.90 of the pinned floor, one 0.72 and 0.78, four 0.81 and 0.79 (docs/benchmarks.md).
UPLOAD_CHUNKS_PER_SLOT = 2
MIN_UPLOAD_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class TransferOptions:
    """How pages move between the engine cache and host staging.

    ``backend``: ``"auto"`` runs the fused page copy (one kernel launch and one DMA per staging
    slot, whatever the number of layers and ranks) wherever it applies, and the transfer
    handler's ``auto`` choice elsewhere; a backend name (``cuda-batch``, ``triton``, ``torch``,
    ``cpu``) runs that backend through the transfer handler, one job per rank and slot.
    ``sm_budget`` bounds the streaming multiprocessors a copy may occupy while the model
    computes (the fused kernel's grid, or the Triton backend's programs).
    """

    backend: str = "auto"
    sm_budget: int | None = None

    def __post_init__(self) -> None:
        if self.sm_budget is not None and self.sm_budget < 1:
            raise ValueError(f"sm_budget must be at least 1, got {self.sm_budget}")
        if self.sm_budget is not None and self.backend not in ("auto", "triton"):
            raise ValueError(
                f"sm_budget bounds a kernel's grid; backend={self.backend!r} runs no kernel"
            )


@dataclass(frozen=True)
class StagingOptions:
    """The host memory a capture or restore stages through.

    By default kvsnap's process-wide staging is used: slots pinned once, on first use, and kept
    for every later call (``SHARED_SLOTS`` of ``SMALL_SLOT_BYTES``, and as many of
    ``LARGE_SLOT_BYTES`` for jobs of ``LARGE_JOB_BYTES`` or more). ``pool`` is a
    :class:`~kvsnap.transfer.pinned.PinnedPool` the caller keeps instead; ``slot_bytes`` and
    ``num_slots`` ask for a private pool of that shape, made and freed by the call. A restore
    from hot files reads nothing into the slots: with kvsnap's own staging its pages go to the
    device in loads of up to ``LARGE_SLOT_BYTES`` (the device buffer) whatever the job's size;
    a pool or slot shape of the caller's is kept for them too.

    ``hot`` (restores on CUDA): whether the snapshot's files may be served from the hot tier
    (:mod:`kvsnap.store.hot.tier`: the files mapped from the page cache and registered with CUDA,
    copied to the device without being read). ``None``: as the tier decides (a file is
    registered on its ``register_after``-th use); ``True``: register them now if they fit (the
    caller knows they will be hit again); ``False``: read them, and count no hit.
    """

    pool: PinnedPool | None = None
    slot_bytes: int | None = None
    num_slots: int | None = None
    hot: bool | None = None

    def __post_init__(self) -> None:
        if self.pool is not None and (self.slot_bytes or self.num_slots):
            raise ValueError("give either a pool or a slot shape, not both")
        if self.slot_bytes is not None and self.slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {self.slot_bytes}")
        if self.num_slots is not None and self.num_slots < 1:
            raise ValueError(f"staging needs at least one slot, got {self.num_slots}")

    @property
    def private(self) -> bool:
        """Whether the call makes (and frees) a pool of its own."""
        return self.slot_bytes is not None or self.num_slots is not None


def staging_options(staging: StagingOptions | PinnedPool | None) -> StagingOptions | None:
    """A caller's pool as :class:`StagingOptions` (anything else unchanged)."""
    return StagingOptions(pool=staging) if isinstance(staging, PinnedPool) else staging
