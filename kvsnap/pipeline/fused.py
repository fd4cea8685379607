"""The fused mover: a slot's pages, of every layer, K/V and rank, in one pass on the device.

On CUDA a slot goes through the device staging buffer: at capture one page-copy kernel gathers
the slot's pages there, the page-digest kernel hashes them, and one DMA each brings the pages
and their digests to pinned memory (the pages, given ``downloads``, straight into a registered
snapshot file instead), and for a signed capture the BLAKE3 kernel digests them too; at
restore the slot goes up in pieces (:mod:`~kvsnap.pipeline.slot_pieces`), one DMA each, the
digest kernel checks each piece against the stored digests (the signed BLAKE3 digests, for a
snapshot opened with keys and signed with them: :mod:`~kvsnap.pipeline.page_checks`) and the
page-copy kernel scatters only the pages whose digest matched, so a corrupt or forged page never
reaches the cache and the host hashes nothing.
Kernels run on the staging stream, restores' uploads on its upload stream; the slot's event
marks its completion. On a cache in host memory the copies run at once on the host (the host
then hashes, as the store does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvsnap.errors import LayoutError, TransferFailedError
from kvsnap.layout import CacheLayout, check_tiling
from kvsnap.pipeline.movers import SlotMover
from kvsnap.pipeline.page_checks import PageChecks, hash_constants
from kvsnap.pipeline.slot_pieces import slot_extent, upload_chunks, upload_range
from kvsnap.pipeline.slots import SlotLoad
from kvsnap.pipeline.staging import DeviceStaging, device_staging
from kvsnap.transfer import page_blake3, page_hash
from kvsnap.transfer.page_copy import (
    kernel_arrays,
    kernel_table,
    launch_kernel,
    run_on_cpu,
    unavailable_reason,
)
from kvsnap.transfer.page_table import PageTable
from kvsnap.transfer.pinned import Slot
from kvsnap.transfer.plan import Direction
from kvsnap.transfer.triton_copy import interpreting


@dataclass(frozen=True)
class FusedTicket:
    """A submitted slot: its completion event (``None`` once done on the host) and a result per
    page: its digest, in pinned memory (capture), or 1/0 for written/refused, on the device
    (restore); a signed capture's BLAKE3 digests too (pinned int32 ``(pages, 8)``)."""

    event: torch.cuda.Event | None
    results: torch.Tensor | None
    page_digests: torch.Tensor | None = None


class FusedMover(SlotMover):
    """One page-copy launch (per fragment group), one digest launch and one DMA per slot."""

    backend_name = "fused"

    def __init__(self, table: PageTable, direction: Direction, sm_budget: int | None) -> None:
        self.table = table
        self.direction = direction
        self.sm_budget = sm_budget
        self.device = table.device
        self._staging: DeviceStaging | None = (
            device_staging(self.device) if self.device.type == "cuda" else None
        )
        self.copies_on_host = self._staging is None
        page_bytes = table.page_size_bytes
        self.hashes_pages = self._staging is not None and page_hash.supports(page_bytes)
        # BLAKE3 of pages addressed in 8-byte words, as the xxh3 kernel's are.
        self.checks_page_digests = (
            self.hashes_pages and page_bytes % 8 == 0 and page_blake3.supports(page_bytes)
        )
        # Restores on CUDA may upload straight from registered host memory (the hot tier).
        self.takes_uploads = self._staging is not None and direction is Direction.HOST_TO_DEVICE
        # Captures on CUDA may copy straight into a registered, mapped snapshot file; the
        # digests then come from the device only (the host never reads the mapping).
        self.takes_downloads = self.hashes_pages and direction is Direction.DEVICE_TO_HOST
        self._constants: torch.Tensor | None = None
        if self.hashes_pages:
            self._constants = hash_constants(self.device, page_bytes)

    def begin(self, after: torch.cuda.Event | None = None) -> None:
        if self._staging is None:
            return  # a cache in host memory: copied by this thread, nothing is in flight
        if after is not None:
            # A capture from another thread than the one computing the KV: the copies follow
            # the event recorded after the KV, not whatever that thread's stream holds now.
            self._staging.stream.wait_event(after)
        else:
            # The copies wait for what the caller enqueued before (the KV being computed, or a
            # restore's target blocks being allocated or cleared).
            self._staging.stream.wait_stream(torch.cuda.current_stream(self.device))

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
    ) -> FusedTicket:
        if uploads is not None and not self.takes_uploads:
            raise ValueError("this mover copies from its staging slot only")
        if downloads is not None and not self.takes_downloads:
            raise ValueError("this mover copies into its staging slot only")
        try:
            if self._staging is None:
                self._copy_on_host(load, slot, device_blocks, snapshot_blocks)
                return FusedTicket(None, None)
            return self._enqueue_on_device(
                load,
                slot,
                device_blocks,
                snapshot_blocks,
                expected,
                uploads,
                downloads,
                page_digests and self.checks_page_digests,
            )
        except (RuntimeError, OSError, ValueError) as error:
            raise TransferFailedError(f"the fused page copy failed: {error}") from error

    def _copy_on_host(
        self, load: SlotLoad, slot: Slot, device_blocks: np.ndarray, snapshot_blocks: np.ndarray
    ) -> None:
        """A cache in host memory: copy straight between it and the slot, now. Under
        ``TRITON_INTERPRET=1`` the kernel itself runs (how the CPU tests check it)."""
        staging_addresses = slot.data_ptr + load.page_offsets
        copies = self.table.copies(
            self.direction, load.page_tensors, device_blocks, staging_addresses, snapshot_blocks
        )
        if interpreting():
            table = torch.from_numpy(kernel_table(copies))
            launch_kernel(copies, table, self.device, self.sm_budget)
        else:
            run_on_cpu(copies)

    def _enqueue_on_device(
        self,
        load: SlotLoad,
        slot: Slot,
        device_blocks: np.ndarray,
        snapshot_blocks: np.ndarray,
        expected: np.ndarray | None,
        uploads: Sequence[tuple[torch.Tensor, int]] | None = None,
        downloads: Sequence[tuple[torch.Tensor, int]] | None = None,
        page_digests: bool = False,
    ) -> FusedTicket:
        assert self._staging is not None
        bound = None
        with self._staging.use(slot_extent(load, self.table.page_size_bytes)) as buffer:
            if self.direction is Direction.DEVICE_TO_HOST:
                results, bound = self._enqueue_capture(
                    load, slot, device_blocks, snapshot_blocks, buffer, downloads, page_digests
                )
            else:
                results = self._enqueue_restore(
                    load, slot, device_blocks, snapshot_blocks, expected, uploads, buffer
                )
            done = torch.cuda.Event()
            done.record(self._staging.stream)
        return FusedTicket(done, results, bound)

    def _device_table(
        self,
        load: SlotLoad,
        slot: Slot,
        device_blocks: np.ndarray,
        snapshot_blocks: np.ndarray,
        buffer: torch.Tensor,
        expected: np.ndarray | None,
    ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """The slot's copies, and on the device their kernel table followed by the pages'
        offsets in the buffer in 8-byte words (and ``expected``, the stored digests), carried
        up on the current stream."""
        assert self._staging is not None
        copies = self.table.copies(
            self.direction,
            load.page_tensors,
            device_blocks,
            buffer.data_ptr() + load.page_offsets,
            snapshot_blocks,
        )
        parts = kernel_arrays(copies)
        table_length = sum(len(part) for part in parts)
        # Hashed pages are a multiple of 8 bytes long (page_hash.supports), so whole words.
        parts.append(load.page_offsets // 8)
        if expected is not None:
            # xxh3-64 (uint64 a page) or signed BLAKE3 digests (32 bytes a page), as int64.
            parts.append(np.ascontiguousarray(expected).reshape(-1).view(np.int64))
        # Up from pinned memory of this slot's own (free whenever the slot is: a slot is
        # reused only after its last copy completed); from pageable memory the upload would
        # wait for the stream, that is for the previous slot's copies. Written in place.
        host_table = self._staging.pinned(
            ("table", slot.data_ptr), None, sum(len(part) for part in parts)
        )
        np.concatenate(parts, out=host_table.numpy())
        device_table = host_table.to(self.device, non_blocking=True)
        return copies, device_table, device_table[table_length:]

    def _enqueue_capture(
        self,
        load: SlotLoad,
        slot: Slot,
        device_blocks: np.ndarray,
        snapshot_blocks: np.ndarray,
        buffer: torch.Tensor,
        downloads: Sequence[tuple[torch.Tensor, int]] | None,
        page_digests: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Gather, hash and bring down one slot (into the slot, or with ``downloads`` straight
        into the registered snapshot file, one DMA per run of pages): the pages' digests, in
        pinned memory, and with ``page_digests`` their BLAKE3 digests (pinned int32
        ``(pages, 8)``: a signed capture)."""
        assert self._staging is not None
        num_pages = load.num_pages
        num_bytes = slot_extent(load, self.table.page_size_bytes)
        copies, device_table, tail = self._device_table(
            load, slot, device_blocks, snapshot_blocks, buffer, None
        )
        launch_kernel(copies, device_table, self.device, self.sm_budget)
        results = bound = None
        if self.hashes_pages:
            # Read by the capture right after this slot's event, before it is reused.
            results = self._staging.pinned(("digests", slot.data_ptr), None, num_pages)
            results.copy_(self._digests(buffer, tail[:num_pages]), non_blocking=True)
        if page_digests:
            digests = torch.empty((num_pages, 8), dtype=torch.int32, device=self.device)
            page_blake3.launch_page_blake3_at_words(
                buffer, tail[:num_pages], self.table.page_size_bytes, digests
            )
            pinned = self._staging.pinned(("blake3", slot.data_ptr), None, num_pages * 4)
            bound = pinned.view(torch.int32).view(num_pages, 8)
            bound.copy_(digests, non_blocking=True)
        if downloads is None:
            slot.tensor[:num_bytes].copy_(buffer[:num_bytes], non_blocking=True)
        for mapped, offset in downloads or ():
            mapped.copy_(buffer[offset : offset + mapped.numel()], non_blocking=True)
        return results, bound

    def _enqueue_restore(
        self,
        load: SlotLoad,
        slot: Slot,
        device_blocks: np.ndarray,
        snapshot_blocks: np.ndarray,
        expected: np.ndarray | None,
        uploads: Sequence[tuple[torch.Tensor, int]] | None,
        buffer: torch.Tensor,
    ) -> torch.Tensor | None:
        """Bring one slot up, check and scatter it: a flag per page (1 written, 0 refused), on
        the device, when the pages are checked.

        The slot goes up in pieces (:meth:`_upload_pieces`). Each piece is checked (digest
        and compare in one launch) and scattered as soon as it and the copy table have
        arrived, and its bytes of the buffer are released then: the next slot's first piece
        goes up while this slot's last one is still checked and scattered (released once per
        slot, the buffer left the device idle ~0.1 ms at every slot boundary).

        This runs once per slot on the thread that feeds the device, and a slot's DMA can be
        as short as 0.6 ms: each Python-level call counts (docs/benchmarks.md), so a piece
        costs two launches, the stream is switched twice in all and the pieces' events are
        the staging's own.
        """
        assert self._staging is not None
        staging = self._staging
        page_bytes = self.table.page_size_bytes
        chunks = upload_chunks(load.page_offsets, page_bytes)
        # Stored xxh3-64 (one per page) or signed BLAKE3 digests (32 bytes a page).
        blake3 = expected is not None and np.asarray(expected).ndim == 2
        checks_here = self.checks_page_digests if blake3 else self.hashes_pages
        checked = expected is not None and checks_here
        copies, device_table, tail, arrived = self._upload_pieces(
            load,
            slot,
            device_blocks,
            snapshot_blocks,
            expected if checked else None,
            uploads,
            buffer,
            chunks,
        )
        stream = staging.stream
        checks = self._page_checks(tail, load.num_pages, blake3) if checked else None
        released = 0
        for (first, stop, _, high), event in zip(chunks, arrived, strict=True):
            stream.wait_event(event)
            self.check_and_scatter(buffer, copies, device_table, checks, first, stop)
            # From the end of the previous piece: together the pieces cover the slot's bytes.
            staging.release_bytes(released, high)
            released = high
        return None if checks is None else checks.page_ok

    def _page_checks(self, tail: torch.Tensor, num_pages: int, blake3: bool) -> PageChecks:
        """The slot's checks from the tail of its table: the pages' words, then what they are
        checked against; the verdicts kept on the device (one flag a page) until the restore
        collects them."""
        words, stored = tail[:num_pages], tail[num_pages:]
        if blake3:
            stored = stored.view(torch.int32).view(num_pages, 8)
        page_ok = torch.empty(num_pages, dtype=torch.int64, device=self.device)
        return PageChecks(words, stored, page_ok, blake3)

    def check_and_scatter(
        self,
        buffer: torch.Tensor,
        copies: Any,
        device_table: torch.Tensor,
        checks: PageChecks | None,
        first: int,
        stop: int,
    ) -> None:
        """Enqueue one piece of a restore's slot (its pages ``first`` to ``stop``, arrived in
        ``buffer``): the pages checked (``checks``: digest and compare in one launch, xxh3-64
        or BLAKE3), then the scatter of those that passed (all, unchecked) into the cache."""
        if checks is not None:
            checks.launch(buffer, self.table.page_size_bytes, self._constants, slice(first, stop))
        page_ok = None if checks is None else checks.page_ok
        launch_kernel(copies, device_table, self.device, self.sm_budget, page_ok, (first, stop))

    def _upload_pieces(
        self,
        load: SlotLoad,
        slot: Slot,
        device_blocks: np.ndarray,
        snapshot_blocks: np.ndarray,
        expected: np.ndarray | None,
        uploads: Sequence[tuple[torch.Tensor, int]] | None,
        buffer: torch.Tensor,
        chunks: Sequence[tuple[int, int, int, int]],
    ) -> tuple[Any, torch.Tensor, torch.Tensor, list[torch.cuda.Event]]:
        """Enqueue a slot's host bytes (``uploads``, default: the staging slot) into
        ``buffer`` on the upload stream, piece by piece (``chunks``), each once the last use
        of the buffer has released its bytes, and the copy table right behind the first piece:
        the copies, the device table and its tail (:meth:`_device_table`), and per piece an
        event recorded once it (and, for the first, the table) has arrived.

        The first piece is enqueued before anything else, so the bus is busy while this
        thread builds the table; the copy engine serves host-to-device copies in the order
        they were enqueued, so a table enqueued after the last piece (or on another stream)
        would arrive only after the whole slot, and no piece could be hashed before then.
        """
        assert self._staging is not None
        staging = self._staging
        if uploads is None:
            uploads = [(slot.tensor[: slot_extent(load, self.table.page_size_bytes)], 0)]
        upload_stream = staging.upload_stream
        arrived = staging.piece_events(len(chunks))
        torch.cuda.set_stream(upload_stream)
        try:
            _, _, low, high = chunks[0]
            staging.wait_for_bytes(upload_stream, low, high)
            upload_range(buffer, uploads, low, high)
            copies, device_table, tail = self._device_table(
                load, slot, device_blocks, snapshot_blocks, buffer, expected
            )
            arrived[0].record(upload_stream)
            for (_, _, low, high), event in zip(chunks[1:], arrived[1:], strict=True):
                staging.wait_for_bytes(upload_stream, low, high)
                upload_range(buffer, uploads, low, high)
                event.record(upload_stream)
        finally:
            torch.cuda.set_stream(staging.stream)
        # Allocated on the upload stream, read by kernels on the staging stream: not to be
        # handed to the next table before they have run.
        device_table.record_stream(staging.stream)
        return copies, device_table, tail, arrived

    def _digests(
        self, buffer: torch.Tensor, words: torch.Tensor, digests: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Enqueue the xxh3-64 of the pages at ``words`` (8-byte words) in ``buffer`` (int64
        bit patterns) into ``digests`` (a new tensor by default)."""
        assert self._constants is not None
        if digests is None:
            digests = torch.empty(len(words), dtype=torch.int64, device=self.device)
        page_hash.launch_page_digests_at_words(
            buffer, words, self.table.page_size_bytes, self._constants, digests
        )
        return digests

    def fence(self) -> torch.cuda.Event | None:
        """An event completing once everything enqueued so far has run (``None`` on a host
        cache, where nothing is in flight)."""
        if self._staging is None:
            return None
        event = torch.cuda.Event()
        event.record(self._staging.stream)
        return event

    def wait(self, ticket: FusedTicket) -> None:
        if ticket.event is not None:
            try:
                ticket.event.synchronize()
            except RuntimeError as error:
                raise TransferFailedError(f"the fused page copy failed: {error}") from error

    def event(self, ticket: FusedTicket) -> torch.cuda.Event | None:
        return ticket.event

    def digests(self, ticket: FusedTicket) -> np.ndarray | None:
        if self.direction is not Direction.DEVICE_TO_HOST or ticket.results is None:
            return None
        return ticket.results.numpy().view(np.uint64).copy()

    def page_digests(self, ticket: FusedTicket) -> np.ndarray | None:
        if ticket.page_digests is None:
            return None
        return ticket.page_digests.numpy().view(np.uint8).copy()

    def failed_pages(self, ticket: FusedTicket) -> np.ndarray:
        if self.direction is not Direction.HOST_TO_DEVICE or ticket.results is None:
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(ticket.results.cpu().numpy() == 0)

    def failed_pages_of(self, tickets: Sequence[FusedTicket]) -> list[np.ndarray]:
        """The flags of every slot in one copy to the host (one wait, not one per slot)."""
        flags = [t.results for t in tickets if t.results is not None]
        if self.direction is not Direction.HOST_TO_DEVICE or len(flags) < 2:
            return super().failed_pages_of(tickets)
        assert self._staging is not None
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(self._staging.stream):
                # Enqueued behind every slot's kernels: the copy to the host waits for them all.
                joined = torch.cat(flags).cpu().numpy()
        except RuntimeError as error:
            raise TransferFailedError(f"the fused page copy failed: {error}") from error
        failed, start = [], 0
        for ticket in tickets:
            count = 0 if ticket.results is None else len(ticket.results)
            failed.append(np.flatnonzero(joined[start : start + count] == 0))
            start += count
        return failed

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
