"""Slot loads: which pages of which tensors one staging slot carries, in file order.

A snapshot stores each layer tensor's blocks back to back, tensor after tensor. A slot takes
the next pages in that order until it is full, so one slot can hold the tail of one tensor,
several whole tensors and the head of another: a restore of a short prefix over 80 layers is a
single slot, and every slot is one kernel launch and one DMA whatever the number of tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Segment:
    """Pages ``[start, stop)`` of the job's block list for tensor ``tensor``, at ``offset``
    bytes into the slot."""

    tensor: int
    start: int
    stop: int
    offset: int

    @property
    def num_pages(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class SlotLoad:
    """One slot's pages: per page its tensor, its position in the block list and its byte
    offset in the slot (the arrays the copy kernels take)."""

    page_tensors: np.ndarray
    page_positions: np.ndarray
    page_offsets: np.ndarray

    @property
    def num_pages(self) -> int:
        return len(self.page_tensors)

    def num_bytes(self, page_size_bytes: int) -> int:
        return self.num_pages * page_size_bytes

    @functools.cached_property
    def segments(self) -> tuple[Segment, ...]:
        """The slot's runs of pages of one tensor at consecutive positions, in slot order
        (what a capture writes as one piece; built on first use, restores never ask)."""
        if not self.num_pages:
            return ()
        tensors, positions = self.page_tensors, self.page_positions
        breaks = (np.diff(tensors) != 0) | (np.diff(positions) != 1)
        starts = np.concatenate(([0], np.flatnonzero(breaks) + 1))
        stops = np.concatenate((starts[1:], [self.num_pages]))
        return tuple(
            Segment(tensor, start, stop, offset)
            for tensor, start, stop, offset in zip(
                tensors[starts].tolist(),
                positions[starts].tolist(),
                (positions[stops - 1] + 1).tolist(),
                self.page_offsets[starts].tolist(),
                strict=True,
            )
        )

    def subset(self, keep: np.ndarray) -> SlotLoad:
        """The pages where ``keep`` is true, at their offsets in the slot."""
        return SlotLoad(self.page_tensors[keep], self.page_positions[keep], self.page_offsets[keep])


def slot_loads(
    num_tensors: int, num_blocks: int, page_size_bytes: int, slot_bytes: int
) -> Iterator[SlotLoad]:
    """Slots covering ``num_blocks`` pages of each of ``num_tensors`` tensors, in file order.

    Each slot holds at most ``slot_bytes // page_size_bytes`` pages (at least one).
    """
    pages_per_slot = max(1, slot_bytes // page_size_bytes)
    total_pages = num_tensors * num_blocks
    for first in range(0, total_pages, pages_per_slot):
        last = min(total_pages, first + pages_per_slot)
        flat = np.arange(first, last, dtype=np.int64)
        tensors, positions = np.divmod(flat, num_blocks)
        yield SlotLoad(tensors, positions, (flat - first) * page_size_bytes)
