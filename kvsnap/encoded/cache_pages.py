"""A capture's canonical pages gathered out of the caches where they lie, one layer tensor at a
time, into a buffer on the caches' device: the fused page copy's gather
(:mod:`kvsnap.transfer.page_copy`) without its staging slot and DMA, for a capture that encodes
the pages where they are (:mod:`kvsnap.encoded.capture`).

The copies of every tensor are worked out at once from the page table, so a CUDA capture
uploads one kernel table and launches one gather per tensor (its range of the table's pages),
each tensor of a part (key, value, latent) into that part's buffer: a buffer is reused a layer
later, after everything the stream queued on the previous layer's pages. In host memory the
same copies run on the calling thread (under ``TRITON_INTERPRET=1`` through the kernel, as the
fused mover does).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvsnap.transfer.page_copy import kernel_table, launch_kernel, run_on_cpu
from kvsnap.transfer.page_table import GroupCopy, PageTable
from kvsnap.transfer.plan import Direction
from kvsnap.transfer.triton_copy import interpreting


def _pages_of(copy: GroupCopy, first: int, stop: int) -> GroupCopy | None:
    """The part of ``copy`` moving the slot pages ``first`` to ``stop`` (exclusive; a group's
    pages are in slot order), or ``None`` when it moves none of them."""
    low, high = np.searchsorted(copy.slot_pages, (first, stop)).tolist()
    if low == high:
        return None
    return dataclasses.replace(
        copy,
        src_bases=copy.src_bases[low:high],
        dst_bases=copy.dst_bases[low:high],
        slot_pages=copy.slot_pages[low:high],
    )


class CachePages:
    """The canonical pages of ``device_blocks`` (snapshot block ``i`` is device block
    ``device_blocks[i]``) of every tensor of ``table``, gathered a tensor at a time
    (:meth:`gather`). ``sm_budget`` bounds the gather kernel's grid.

    Each block's elected writer among the table's ranks copies its fragments, as a capture
    through staging does, so the gathered page is the TP-free canonical page."""

    def __init__(
        self, table: PageTable, device_blocks: np.ndarray, sm_budget: int | None = None
    ) -> None:
        self.device = table.device
        self.num_blocks = len(device_blocks)
        self.page_bytes = table.page_size_bytes
        self._sm_budget = sm_budget
        num_tensors = len(table.names)
        self._parts = max(1, len(table.geometry.parts))
        self._buffers = [
            torch.empty(self.num_blocks * self.page_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(min(self._parts, num_tensors))
        ]
        tensors = np.repeat(np.arange(num_tensors, dtype=np.int64), self.num_blocks)
        bases = np.array([buffer.data_ptr() for buffer in self._buffers], dtype=np.int64)
        offsets = np.arange(self.num_blocks, dtype=np.int64) * self.page_bytes
        self._copies = table.copies(
            Direction.DEVICE_TO_HOST,
            tensors,
            np.tile(np.asarray(device_blocks, dtype=np.int64), num_tensors),
            bases[tensors % self._parts] + np.tile(offsets, num_tensors),
            np.tile(np.arange(self.num_blocks, dtype=np.int64), num_tensors),
        )
        self._kernel_table: torch.Tensor | None = None
        if self.device.type == "cuda" or interpreting():
            # Up once, on the caller's stream: every gather reads its range of it.
            self._kernel_table = torch.from_numpy(kernel_table(self._copies)).to(self.device)

    def gather(self, tensor: int) -> torch.Tensor:
        """Tensor ``tensor``'s pages (in table order), every block's, back to back in a
        ``uint8`` buffer on the caches' device: queued on the current stream (CUDA) or copied
        now (host memory). The buffer is overwritten by the gather of the next tensor of the
        same part."""
        buffer = self._buffers[tensor % self._parts]
        first, stop = tensor * self.num_blocks, (tensor + 1) * self.num_blocks
        if self._kernel_table is not None:
            launch_kernel(
                self._copies,
                self._kernel_table,
                self.device,
                self._sm_budget,
                slot_pages=(first, stop),
            )
        else:
            parts = [_pages_of(copy, first, stop) for copy in self._copies]
            run_on_cpu([part for part in parts if part is not None])
        return buffer
