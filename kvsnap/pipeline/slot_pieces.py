"""A restore's slot as it crosses the bus: the pieces it goes up in, its extent, and the
copies that carry a piece from the host bytes it lies in (the staging slot, or hot files'
mappings) into the device buffer (docs/architecture.md, "The warm pipeline": a slot goes up in
pieces, each checked and scattered as soon as it has arrived)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import numpy as np
import torch

from kvsnap.pipeline.options import MIN_UPLOAD_CHUNK_BYTES, UPLOAD_CHUNKS_PER_SLOT
from kvsnap.pipeline.slots import SlotLoad


def upload_range(
    buffer: torch.Tensor, uploads: Sequence[tuple[torch.Tensor, int]], low: int, high: int
) -> None:
    """Enqueue, on the current stream, the bytes ``[low, high)`` of a slot whose host bytes
    are ``uploads`` (each at its offset in the slot) into the same bytes of ``buffer``."""
    if len(uploads) == 1 and uploads[0][1] == 0:
        # The slot's bytes are one run (a slot of one file, or the staging slot itself).
        buffer[low:high].copy_(uploads[0][0][low:high], non_blocking=True)
        return
    for source, offset in uploads:
        start, stop = max(low, offset), min(high, offset + source.numel())
        if start < stop:
            buffer[start:stop].copy_(source[start - offset : stop - offset], non_blocking=True)


def slot_extent(load: SlotLoad, page_size_bytes: int) -> int:
    """The bytes of a slot up to the end of ``load``'s last page (pages a host check refused
    leave gaps: a load's pages keep their offsets)."""
    return int(load.page_offsets[-1]) + page_size_bytes if load.num_pages else 0


def upload_chunks(
    page_offsets: np.ndarray, page_size_bytes: int
) -> Sequence[tuple[int, int, int, int]]:
    """A slot's pages (at ``page_offsets``, increasing) cut into up to
    ``UPLOAD_CHUNKS_PER_SLOT`` runs of whole pages of at least ``MIN_UPLOAD_CHUNK_BYTES``:
    per run its first and stop page and its bytes ``[low, high)`` in the slot."""
    num_pages = len(page_offsets)
    if num_pages == 0:
        return [(0, 0, 0, 0)]
    pieces, min_bytes = UPLOAD_CHUNKS_PER_SLOT, MIN_UPLOAD_CHUNK_BYTES
    if int(page_offsets[-1]) == (num_pages - 1) * page_size_bytes:
        # Increasing multiples of the page size from 0 with no gap (no page refused by a host
        # check): the usual slot, whose cut depends on its length alone.
        return _gapless_chunks(num_pages, page_size_bytes, pieces, min_bytes)
    return _cut_chunks(page_offsets, page_size_bytes, pieces, min_bytes)


@functools.lru_cache(maxsize=256)
def _gapless_chunks(
    num_pages: int, page_size_bytes: int, pieces: int, min_bytes: int
) -> tuple[tuple[int, int, int, int], ...]:
    offsets = np.arange(num_pages, dtype=np.int64) * page_size_bytes
    return tuple(_cut_chunks(offsets, page_size_bytes, pieces, min_bytes))


def _cut_chunks(
    page_offsets: np.ndarray, page_size_bytes: int, pieces: int, min_bytes: int
) -> list[tuple[int, int, int, int]]:
    num_pages = len(page_offsets)
    end = int(page_offsets[-1]) + page_size_bytes
    chunk_bytes = max(-(-end // pieces), min_bytes)
    # A chunk ends at the first page starting at or past its share of the slot's bytes.
    bounds = np.searchsorted(page_offsets, np.arange(chunk_bytes, end, chunk_bytes))
    edges = [0, *(int(bound) for bound in np.unique(bounds) if 0 < bound < num_pages), num_pages]
    chunks = []
    for first, stop in itertools.pairwise(edges):
        low = int(page_offsets[first])
        chunks.append((first, stop, low, int(page_offsets[stop - 1]) + page_size_bytes))
    return chunks
