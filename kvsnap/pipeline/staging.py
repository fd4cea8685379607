"""Staging memory kept warm for a whole process: pinned host slots and a device buffer.

Pinning costs seconds per GiB, so slots are pinned once, on first use, and reused by every
capture and restore after that (:func:`shared_ring`). A slot given back while a copy may still
read or write it carries that copy's CUDA event; whoever takes it next waits for the event
first, so a restore returns as soon as its copies are enqueued. On CUDA a device buffer per
device (:class:`DeviceStaging`, at most one slot large) holds the canonical pages between the
fused page kernel and the DMA over PCIe; one stream per device orders every use of it, and a
second one carries restores' uploads into it, so that a slot's pages go up while the pages
before them are hashed (:attr:`DeviceStaging.free` says when the buffer may be written again).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from kvsnap.pipeline import options as defaults
from kvsnap.pipeline.options import (
    LARGE_SLOT_BYTES,
    SHARED_SLOTS,
    SMALL_SLOT_BYTES,
    StagingOptions,
)
from kvsnap.transfer.pinned import PinnedPool, Slot


class StagingRing:
    """Slots of a :class:`PinnedPool`, each given back with the event of its last copy.

    ``owned``: the ring made the pool and closes it in :meth:`finish`.
    """

    def __init__(self, pool: PinnedPool, *, owned: bool) -> None:
        self.pool = pool
        self.owned = owned
        self._pending: dict[int, torch.cuda.Event] = {}
        self._lock = threading.Lock()

    @property
    def slot_bytes(self) -> int:
        return self.pool.slot_bytes

    def _ready(self, slot: Slot) -> Slot:
        with self._lock:
            event = self._pending.pop(slot.index, None)
        if event is not None:
            event.synchronize()
        return slot

    def acquire(self) -> Slot:
        """A free slot whose last copy has completed (waits for both): the slot given back
        first, whose copy is the first to complete."""
        return self._ready(self.pool.acquire(oldest=True))

    def try_acquire(self) -> Slot | None:
        """A free slot whose last copy has completed, without waiting for either (``None`` if
        there is none). Never the slot of a copy still running: a caller with work in flight
        is better off moving it than waiting here for the copy it just enqueued."""
        return self.pool.try_acquire_where(self._copy_done)

    def _copy_done(self, index: int) -> bool:
        """Whether the last copy of slot ``index`` has completed (forgotten once it has)."""
        with self._lock:
            event = self._pending.get(index)
            if event is None:
                return True
            if not event.query():
                return False
            del self._pending[index]
            return True

    def release(self, slot: Slot, after: torch.cuda.Event | None = None) -> None:
        """Give ``slot`` back; ``after`` is the event of a copy still using it."""
        if after is not None:
            with self._lock:
                self._pending[slot.index] = after
        self.pool.release(slot)

    def finish(self) -> None:
        """End of a call on a pool that is not kvsnap's own: wait for every copy still using a
        slot (the caller may reuse them at once), and close the pool if the ring made it."""
        if self.owned or not _is_shared(self):
            with self._lock:
                events, self._pending = list(self._pending.values()), {}
            for event in events:
                event.synchronize()
        if self.owned:
            self.pool.close()


_SHARED: dict[int, StagingRing] = {}
_SHARED_LOCK = threading.Lock()


def _is_shared(ring: StagingRing) -> bool:
    return any(ring is shared for shared in _SHARED.values())


def shared_ring(slot_bytes: int) -> StagingRing:
    """The process-wide ring of ``SHARED_SLOTS`` slots of ``slot_bytes`` (pinned on use)."""
    with _SHARED_LOCK:
        ring = _SHARED.get(slot_bytes)
        if ring is None:
            pool = PinnedPool(slot_bytes, SHARED_SLOTS, lazy=True)
            ring = _SHARED[slot_bytes] = StagingRing(pool, owned=False)
        return ring


def release_shared_staging() -> None:
    """Unpin and free kvsnap's process-wide staging (the next call pins again)."""
    with _SHARED_LOCK:
        rings = list(_SHARED.values())
        _SHARED.clear()
    for ring in rings:
        ring.finish()
        ring.pool.close()
    with _DEVICE_LOCK:
        _DEVICE.clear()


def staging_ring(
    options: StagingOptions,
    page_size_bytes: int,
    job_bytes: int,
    *,
    restore: bool = False,
    device_checked: bool = False,
) -> StagingRing:
    """The ring a call (a capture, or with ``restore`` a restore, ``device_checked`` when the
    device checks its pages) of ``job_bytes`` over pages of ``page_size_bytes`` stages through.

    Raises ``ValueError`` when a caller's pool cannot hold one page.
    """
    if options.pool is not None:
        if options.pool.slot_bytes < page_size_bytes:
            raise ValueError(
                f"staging slots of {options.pool.slot_bytes} bytes cannot hold one "
                f"{page_size_bytes}-byte page"
            )
        return StagingRing(options.pool, owned=False)
    if options.private:
        slot_bytes = max(options.slot_bytes or SMALL_SLOT_BYTES, page_size_bytes)
        pool = PinnedPool(slot_bytes, options.num_slots or SHARED_SLOTS, lazy=True)
        return StagingRing(pool, owned=True)
    large_from = defaults.LARGE_JOB_BYTES
    if restore:
        large_from = (
            defaults.LARGE_DEVICE_RESTORE_JOB_BYTES
            if device_checked
            else defaults.LARGE_RESTORE_JOB_BYTES
        )
    slot_bytes = LARGE_SLOT_BYTES if job_bytes >= large_from else SMALL_SLOT_BYTES
    if page_size_bytes > slot_bytes:
        pool = PinnedPool(page_size_bytes, 2, lazy=True)  # pages larger than any shared slot
        return StagingRing(pool, owned=True)
    return shared_ring(slot_bytes)


#: Pinned tables (per use and staging slot) a device's staging keeps: a table per slot of the
#: shared rings and of a few pools a caller keeps.
MAX_PINNED_TABLES = 64


class DeviceStaging:
    """One device's staging buffer and the streams that use it.

    :meth:`use` holds a lock while a slot's copies are enqueued, so two threads never
    interleave their copies through the buffer. Kernels and captures' copies run on
    :attr:`stream`; restores' uploads run on :attr:`upload_stream`, after :attr:`free`; every
    kernel that reads an upload waits for it, and the end of every use joins the uploads into
    :attr:`stream`.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.upload_stream = torch.cuda.Stream(device)
        #: Recorded on :attr:`stream` after the last work that reads or writes the buffer: an
        #: upload into it waits for this, not for whatever the stream waits on (the caller's
        #: forward pass, before a restore writes the cache).
        self.free: torch.cuda.Event | None = None
        self._buffer: torch.Tensor | None = None
        self._pinned: dict[tuple[str, int], torch.Tensor] = {}
        self._piece_events: list[torch.cuda.Event] = []
        # Regions of the buffer the last use released before its end, and those the current
        # use has released so far; each region's event is recorded again only by a later use,
        # after that use's uploads have enqueued their waits (they come before its kernels).
        self._released: list[tuple[int, int, torch.cuda.Event]] = []
        self._releasing: list[tuple[int, int, torch.cuda.Event]] = []
        self._region_events: list[torch.cuda.Event] = []
        self._lock = threading.Lock()

    @contextmanager
    def use(self, num_bytes: int) -> Iterator[torch.Tensor]:
        """The buffer (at least ``num_bytes``), current stream set to :attr:`stream`."""
        with self._lock:
            if self._buffer is None or self._buffer.numel() < num_bytes:
                # Grown only to the largest slot used: at most LARGE_SLOT_BYTES of GPU memory.
                # The old buffer may still be read or written on either stream.
                self.stream.wait_stream(self.upload_stream)
                with torch.cuda.stream(self.stream):
                    self._buffer = torch.empty(num_bytes, dtype=torch.uint8, device=self.device)
                self._released = []  # regions of the old buffer
            # Any thread may move a slot (restores move a slot on the read thread that
            # completed it): make this device current too, for kernels launched here.
            with torch.cuda.device(self.device):
                previous = torch.cuda.current_stream(self.device)
                torch.cuda.set_stream(self.stream)
                try:
                    yield self._buffer
                finally:
                    torch.cuda.set_stream(previous)
                    # Joined even where the kernels reading the uploads were never enqueued
                    # (an error): nothing after this on the stream may overlap an upload.
                    self.stream.wait_stream(self.upload_stream)
                    self.free = torch.cuda.Event()
                    self.free.record(self.stream)
                    self._released, self._releasing = self._releasing, []

    def piece_events(self, count: int) -> list[torch.cuda.Event]:
        """``count`` events for marking a slot's pieces as they arrive, reused by every slot:
        call inside :meth:`use`, and have every wait on them enqueued before it ends (a wait
        is on the record made before it, so recording an event again later is harmless)."""
        while len(self._piece_events) < count:
            self._piece_events.append(torch.cuda.Event())
        return self._piece_events[:count]

    def wait_for_bytes(self, stream: torch.cuda.Stream, low: int, high: int) -> None:
        """Make ``stream`` wait until no earlier use reads or writes bytes ``[low, high)`` of
        the buffer: for the regions the last use released as it went (:meth:`release_bytes`)
        where they cover them, else for its end (:attr:`free`). Call inside :meth:`use`."""
        covered = 0
        for region_low, region_high, event in self._released:
            if region_low < high and low < region_high:
                stream.wait_event(event)
            covered = max(covered, region_high)
        if covered < high and self.free is not None:
            stream.wait_event(self.free)

    def release_bytes(self, low: int, high: int) -> None:
        """Mark bytes ``[low, high)`` free from here on :attr:`stream`: the next use may write
        them before this one ends. Call inside :meth:`use`, in increasing order of bytes,
        after the last work that reads them is enqueued and before :meth:`use` ends."""
        index = len(self._releasing)
        while len(self._region_events) <= index:
            self._region_events.append(torch.cuda.Event())
        event = self._region_events[index]
        event.record(self.stream)
        self._releasing.append((low, high, event))

    def pinned(
        self, key: tuple[str, int], values: np.ndarray | None, size: int = 0
    ) -> torch.Tensor:
        """Pinned int64 memory for ``key`` (a use, and a staging slot's address), grown as
        needed, holding ``values`` (or ``size`` entries as they are). Only the slot's holder
        uses it, and a slot is reused only after its last copy completed. Call inside
        :meth:`use`."""
        count = len(values) if values is not None else size
        buffer = self._pinned.pop(key, None)
        if buffer is None or buffer.numel() < count:
            buffer = torch.empty(max(count, 1024), dtype=torch.int64, pin_memory=True)
        self._pinned[key] = buffer  # the most recently used last
        if len(self._pinned) > MAX_PINNED_TABLES:
            # Slots of pools that are gone (a caller's private pool per call) would otherwise
            # keep theirs forever. Dropping a buffer a copy still reads is safe: torch's pinned
            # allocator reuses its memory only once the copies that read it have completed.
            del self._pinned[next(iter(self._pinned))]
        view = buffer[:count]
        if values is not None:
            view.numpy()[:] = values
        return view


_DEVICE: dict[int, DeviceStaging] = {}
_DEVICE_LOCK = threading.Lock()


def device_staging(device: torch.device) -> DeviceStaging:
    """The process-wide :class:`DeviceStaging` of a CUDA device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _DEVICE_LOCK:
        staging = _DEVICE.get(index)
        if staging is None:
            staging = _DEVICE[index] = DeviceStaging(torch.device("cuda", index))
        return staging
