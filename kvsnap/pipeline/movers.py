"""Movers: how one staging slot's pages travel between the engine cache and the slot.

:class:`FusedMover` is the warm path: a :class:`~kvsnap.pipeline.page_table.PageTable` turns the
slot's pages into a few arrays and :mod:`kvsnap.transfer.page_copy` moves them, one kernel
launch and one DMA per slot on CUDA, whatever the number of layers and ranks.
:class:`HandlerMover` runs a named backend through each rank's
:class:`~kvsnap.transfer.TransferHandler`, one job per rank and slot.

``submit`` enqueues a slot and returns a ticket; ``wait`` blocks until it is done (raising
:class:`~kvsnap.errors.TransferFailedError` if it failed); ``event`` is the CUDA event a slot
can be given back with instead of waiting (``None``: done already, or wait first).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvsnap.errors import LayoutError, TransferFailedError
from kvsnap.layout import CacheLayout, check_tiling
from kvsnap.pinned import Slot
from kvsnap.pipeline.page_table import PageTable
from kvsnap.pipeline.slots import SlotPlan
from kvsnap.pipeline.staging import DeviceStaging, device_staging
from kvsnap.plan import Direction, HostPages, PageCopy
from kvsnap.transfer import TransferHandler
from kvsnap.transfer.page_copy import (
    kernel_table,
    launch_kernel,
    run_on_cpu,
    unavailable_reason,
)
from kvsnap.transfer.triton_copy import interpreting


class SlotMover(ABC):
    """Moves the pages of staging slots in one direction."""

    direction: Direction
    backend_name: str

    def begin(self) -> None:  # noqa: B027 - most movers need no set-up per call
        """Called at the start of each capture or restore."""

    @abstractmethod
    def submit(
        self, plan: SlotPlan, slot: Slot, device_blocks: np.ndarray, snapshot_blocks: np.ndarray
    ) -> Any:
        """Enqueue the copies of ``plan``'s pages: page ``i`` is device block
        ``device_blocks[i]`` (snapshot block ``snapshot_blocks[i]``), at
        ``plan.page_offsets[i]`` in ``slot``. Returns a ticket for :meth:`wait`."""

    @abstractmethod
    def wait(self, ticket: Any) -> None:
        """Block until the slot's copies are done; :class:`TransferFailedError` on failure."""

    def event(self, ticket: Any) -> torch.cuda.Event | None:
        """The CUDA event completing the ticket, if the slot may be given back before it."""
        return None

    def end(self) -> None:  # noqa: B027 - most movers need nothing at the end of a call
        """Called at the end of each capture or restore, also after a failure."""


class FusedMover(SlotMover):
    """One kernel launch (per fragment group) and one DMA per slot."""

    backend_name = "fused"

    def __init__(self, table: PageTable, direction: Direction, sm_budget: int | None) -> None:
        self.table = table
        self.direction = direction
        self.sm_budget = sm_budget
        self.device = table.device
        self._staging: DeviceStaging | None = (
            device_staging(self.device) if self.device.type == "cuda" else None
        )

    def begin(self) -> None:
        if self._staging is not None:
            # The copies wait for what the caller enqueued before (the KV being computed, or a
            # restore's target blocks being allocated or cleared).
            self._staging.stream.wait_stream(torch.cuda.current_stream(self.device))

    def submit(
        self, plan: SlotPlan, slot: Slot, device_blocks: np.ndarray, snapshot_blocks: np.ndarray
    ) -> torch.cuda.Event | None:
        try:
            if self._staging is None:
                self._copy_on_host(plan, slot, device_blocks, snapshot_blocks)
                return None
            return self._enqueue_on_device(plan, slot, device_blocks, snapshot_blocks)
        except (RuntimeError, OSError, ValueError) as error:
            raise TransferFailedError(f"the fused page copy failed: {error}") from error

    def _copy_on_host(
        self, plan: SlotPlan, slot: Slot, device_blocks: np.ndarray, snapshot_blocks: np.ndarray
    ) -> None:
        """A cache in host memory: copy straight between it and the slot, now. Under
        ``TRITON_INTERPRET=1`` the kernel itself runs (how the CPU tests check it)."""
        staging_addresses = slot.data_ptr + plan.page_offsets
        copies = self.table.copies(
            self.direction, plan.page_tensors, device_blocks, staging_addresses, snapshot_blocks
        )
        if interpreting():
            table = torch.from_numpy(kernel_table(copies))
            launch_kernel(copies, table, self.device, self.sm_budget)
        else:
            run_on_cpu(copies)

    def _enqueue_on_device(
        self, plan: SlotPlan, slot: Slot, device_blocks: np.ndarray, snapshot_blocks: np.ndarray
    ) -> torch.cuda.Event:
        """Kernel and DMA through the device staging buffer, on its stream; the event marks
        the slot's completion."""
        assert self._staging is not None
        num_bytes = plan.num_bytes(self.table.page_size_bytes)
        with self._staging.use(num_bytes) as buffer:
            copies = self.table.copies(
                self.direction,
                plan.page_tensors,
                device_blocks,
                buffer.data_ptr() + plan.page_offsets,
                snapshot_blocks,
            )
            # The kernel's table goes up from pinned memory tied to this slot: an upload from
            # pageable memory would wait for the stream, i.e. for the previous slot's copies.
            host_table = self._table_buffer(slot, kernel_table(copies))
            device_table = host_table.to(self.device, non_blocking=True)
            host, device = slot.tensor[:num_bytes], buffer[:num_bytes]
            if self.direction is Direction.DEVICE_TO_HOST:
                launch_kernel(copies, device_table, self.device, self.sm_budget)
                host.copy_(device, non_blocking=True)
            else:
                device.copy_(host, non_blocking=True)
                launch_kernel(copies, device_table, self.device, self.sm_budget)
            done = torch.cuda.Event()
            done.record(self._staging.stream)
        return done

    def _table_buffer(self, slot: Slot, table: np.ndarray) -> torch.Tensor:
        """``table`` copied into pinned memory owned by ``slot``'s place: a slot is reused only
        after its last copy completed, so its table buffer is free whenever the slot is."""
        assert self._staging is not None
        buffer = self._staging.table_buffer(slot.data_ptr, len(table))
        buffer.numpy()[:] = table
        return buffer

    def wait(self, ticket: torch.cuda.Event | None) -> None:
        if ticket is not None:
            try:
                ticket.synchronize()
            except RuntimeError as error:
                raise TransferFailedError(f"the fused page copy failed: {error}") from error

    def event(self, ticket: torch.cuda.Event | None) -> torch.cuda.Event | None:
        return ticket

    def end(self) -> None:
        if self._staging is not None and self.direction is Direction.HOST_TO_DEVICE:
            # Whatever the caller runs next on its stream sees the restored blocks.
            torch.cuda.current_stream(self.device).wait_stream(self._staging.stream)


def fused_unavailable(layouts: Sequence[CacheLayout], direction: Direction) -> str | None:
    """Why the fused path cannot serve ``layouts`` in ``direction`` (``None`` if it can)."""
    devices = {layout.device for layout in layouts}
    if len(devices) > 1:
        return "the layouts live on several devices"
    reason = unavailable_reason(layouts[0].device)
    if reason is not None:
        return reason
    if direction is Direction.DEVICE_TO_HOST and len(layouts) > 1:
        # The slot's canonical pages are assembled in one buffer: every byte needs a writer.
        try:
            check_tiling(layouts)
        except LayoutError as error:
            return str(error)
    return None


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
        self, plan: SlotPlan, slot: Slot, device_blocks: np.ndarray, snapshot_blocks: np.ndarray
    ) -> list[tuple[TransferHandler, int]]:
        host = HostPages(
            slot.data_ptr,
            slot.size_bytes // self._page_bytes,
            self._page_bytes,
            self._page_bytes,
        )
        chunks = plan.page_offsets // self._page_bytes
        copies = []
        for tensor in np.unique(plan.page_tensors).tolist():
            pages = np.flatnonzero(plan.page_tensors == tensor)
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
