"""Movers: how one staging slot's pages travel between the engine cache and the slot.

:class:`SlotMover` is the interface; :class:`~kvsnap.pipeline.fused.FusedMover` is the warm
path (one kernel launch and one DMA per slot, whatever the number of layers and ranks), and
:class:`HandlerMover` runs a named backend through each rank's
:class:`~kvsnap.transfer.TransferHandler`, one job per rank and slot.

``submit`` enqueues a slot and returns a ticket; ``wait`` blocks until it is done (raising
:class:`~kvsnap.errors.TransferFailedError` if it failed); ``event`` is the CUDA event a slot
can be given back with instead of waiting (``None``: done already, or wait first). A mover
that hashes pages on the device (``hashes_pages``) hands a capture's page digests back
(``digests``) and, given the stored digests at restore, writes no page that differs from
them and names those pages (``failed_pages``).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvsnap.errors import TransferFailedError
from kvsnap.layout import CacheLayout
from kvsnap.pipeline.slots import SlotLoad
from kvsnap.transfer import TransferHandler
from kvsnap.transfer.pinned import Slot
from kvsnap.transfer.plan import Direction, HostPages, PageCopy


class SlotMover(ABC):
    """Moves the pages of staging slots in one direction."""

    direction: Direction
    backend_name: str
    #: Whether the mover computes every page's xxh3-64 itself (else the host hashes them).
    hashes_pages: bool = False
    #: Whether the mover computes every page's BLAKE3 digest itself: a capture's for a signed
    #: snapshot (``page_digests``), a restore's checked against signed digests given as
    #: ``expected`` (``(pages, 32)`` uint8); else the host computes them.
    checks_page_digests: bool = False
    #: Whether a restore may hand ``submit`` the slot's bytes as ``uploads`` (registered host
    #: memory the device copies from) instead of the slot's own.
    takes_uploads: bool = False
    #: Whether a capture may hand ``submit`` registered host memory to copy the slot's pages
    #: into (``downloads``: a mapped snapshot file) instead of the slot.
    takes_downloads: bool = False
    #: Whether the mover copies on the calling thread (the cache is in host memory): no device
    #: work waits on that thread, so a restore reads its small slots on it too.
    copies_on_host: bool = False

    def begin(self, after: torch.cuda.Event | None = None) -> None:
        """Called at the start of each capture or restore. ``after``: a CUDA event that the
        first copy must follow (the one recorded after the KV was computed); movers without
        a stream of their own wait for it on the host."""
        if after is not None:
            after.synchronize()

    @abstractmethod
    def submit(
        self,
        load: SlotLoad,
        slot: Slot,
        device_blocks: np.ndarray,
        snapshot_blocks: np.ndarray,
        expected: np.ndarray | None = None,
        uploads: Sequence[tuple[torch.Tensor, int]] | None = None,
        downloads: Sequence[tuple[torch.Tensor, int]] | None = None,
        page_digests: bool = False,
    ) -> Any:
        """Enqueue the copies of ``load``'s pages: page ``i`` is device block
        ``device_blocks[i]`` (snapshot block ``snapshot_blocks[i]``), at
        ``load.page_offsets[i]`` in ``slot``. ``expected`` (restores, movers that hash pages
        only) holds each page's stored xxh3-64, or (movers that check page digests) its signed
        BLAKE3 digest (``(pages, 32)`` uint8). ``page_digests`` (captures): compute the pages'
        BLAKE3 digests too (:meth:`page_digests`; ignored by a mover that does not check
        page digests). ``uploads`` (restores, movers with
        :attr:`takes_uploads` only): the slot's bytes are not in ``slot`` but in these registered
        host tensors, each going to its offset in the slot. ``downloads`` (captures, movers with
        :attr:`takes_downloads` only): the pages go not to ``slot`` but into these registered
        host tensors, each taking the slot's bytes from its offset. Returns a ticket for
        :meth:`wait`."""

    @abstractmethod
    def wait(self, ticket: Any) -> None:
        """Block until the slot's copies are done; :class:`TransferFailedError` on failure."""

    def event(self, ticket: Any) -> torch.cuda.Event | None:
        """The CUDA event completing the ticket, if the slot may be given back before it."""
        return None

    def digests(self, ticket: Any) -> np.ndarray | None:
        """A finished capture slot's page digests, if the mover hashed them (else ``None``)."""
        return None

    def page_digests(self, ticket: Any) -> np.ndarray | None:
        """A finished capture slot's BLAKE3 page digests (``(pages, 32)`` uint8), if the mover
        computed them (``submit(..., page_digests=True)``; else ``None``)."""
        return None

    def failed_pages(self, ticket: Any) -> np.ndarray:
        """A finished restore slot's pages that differed from ``expected`` (not written)."""
        return np.empty(0, dtype=np.int64)

    def failed_pages_of(self, tickets: Sequence[Any]) -> list[np.ndarray]:
        """:meth:`failed_pages` of each of ``tickets``, waiting for them first."""
        for ticket in tickets:
            self.wait(ticket)
        return [self.failed_pages(ticket) for ticket in tickets]

    def end(self) -> None:  # noqa: B027 - most movers need nothing at the end of a call
        """Called at the end of each capture or restore, also after a failure."""


class HandlerMover(SlotMover):
    """One job per rank and slot on each rank's :class:`TransferHandler` (a named backend)."""

    def __init__(
        self, layouts: Sequence[CacheLayout], direction: Direction, handlers: list[TransferHandler]
    ) -> None:
        self.layouts = list(layouts)
        self.direction = direction
        self.handlers = handlers
        self.backend_name = handlers[0].backend_name
        self._job_ids = itertools.count()
        self._names = layouts[0].geometry.tensor_names()
        self._page_bytes = layouts[0].geometry.canonical_page_size_bytes

    def submit(
        self,
        load: SlotLoad,
        slot: Slot,
        device_blocks: np.ndarray,
        snapshot_blocks: np.ndarray,
        expected: np.ndarray | None = None,
        uploads: Sequence[tuple[torch.Tensor, int]] | None = None,
        downloads: Sequence[tuple[torch.Tensor, int]] | None = None,
        page_digests: bool = False,
    ) -> list[tuple[TransferHandler, int]]:
        if uploads is not None or downloads is not None:
            raise ValueError("a transfer handler copies through its staging slot only")
        host = HostPages(
            slot.data_ptr,
            slot.size_bytes // self._page_bytes,
            self._page_bytes,
            self._page_bytes,
        )
        chunks = load.page_offsets // self._page_bytes
        copies = []
        for tensor in np.unique(load.page_tensors).tolist():
            pages = np.flatnonzero(load.page_tensors == tensor)
            copies.append(
                PageCopy(
                    name=self._names[tensor],
                    device_block_ids=device_blocks[pages],
                    host=host,
                    host_chunk_ids=chunks[pages],
                    snapshot_block_ids=snapshot_blocks[pages],
                )
            )
        ticket = []
        for handler in self.handlers:
            job_id = next(self._job_ids)
            if not handler.submit(job_id, copies):
                self.wait(ticket)
                raise TransferFailedError(
                    f"the transfer handler refused a job: {handler.last_rejection}"
                )
            ticket.append((handler, job_id))
        return ticket

    def wait(self, ticket: list[tuple[TransferHandler, int]]) -> None:
        errors = []
        for handler, job_id in ticket:
            for result in handler.wait([job_id]):
                if not result.success:
                    errors.append(f"transfer job {result.job_id} failed: {result.error}")
        if errors:
            raise TransferFailedError("; ".join(errors))

    def end(self) -> None:
        for handler in self.handlers:
            handler.shutdown()
