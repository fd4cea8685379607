"""Writes of whole staging slots: many tensors' pages in one call, the writer's fast path.

A capture's slot holds pages of many layer tensors, in file order. :class:`SlotWrites` (a mixin
of :class:`~kvsnap.store.writer.SnapshotWriter`) hashes a slot in a few batches whatever the
number of tensors in it, or takes digests computed on the device, and writes the pages that
follow each other in the file and in memory as one ``pwrite``: the cost of a call does not grow
with the number of tensors it spans.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvsnap.errors import SnapshotIOError
from kvsnap.store import tuning
from kvsnap.store.completion import Completion


class SlotWrites:
    """The slot-at-a-time half of :class:`~kvsnap.store.writer.SnapshotWriter` (a mixin)."""

    def write_slot(
        self,
        segments: Sequence[tuple[str, np.ndarray]],
        digests: np.ndarray | None = None,
    ) -> concurrent.futures.Future[None]:
        """:meth:`write_pages` of several tensors' pages at once, in order.

        Each ``(name, pages)`` continues its tensor as :meth:`write_pages` would. The slot is
        hashed in a few tasks of about ``SUBCHUNK_BYTES`` whatever the number of tensors in it,
        and the pages that follow each other in the file and in memory (a slot holding whole
        tensors, back to back) go to the file as one write: a call's cost does not grow with
        the number of tensors it spans. The future completes once every page may be reused.
        ``digests``, the pages' xxh3-64 in order (computed where the pages were, on the
        device), replaces the hashing.
        """
        if self._lane is not None:
            # The stream lane is ordered per tensor item: one write_pages per segment.
            return _all_done([self.write_pages(name, pages) for name, pages in segments])
        pieces = []  # (tensor, first block, flat pages, shard, file offset)
        for name, pages in segments:
            tensor, flat = self._checked_pages(name, pages)
            count = flat.nbytes // self._page_bytes
            first = self._blocks_written[tensor]
            shard, entry = self._placement[name]
            pieces.append((tensor, first, flat, shard, entry.begin + first * self._page_bytes))
            self._blocks_written[tensor] += count
            if self._blocks_written[tensor] == self._num_blocks:
                self._current += 1
        total = sum(piece[2].nbytes for piece in pieces)
        self._admit(total)
        hash_batches = _batches(pieces, tuning.SUBCHUNK_BYTES) if digests is None else []
        if digests is not None:
            self._store_digests(pieces, digests)
        writes = _contiguous_writes(pieces, tuning.WRITE_CHUNK_BYTES)

        def release() -> None:
            # Until here ``pieces`` keeps the caller's arrays alive under the merged views.
            self._release(total)
            pieces.clear()

        done = Completion(
            len(hash_batches) + len(writes),
            on_done=release,
            cancelled=lambda: SnapshotIOError("the writer was aborted", file=self._location.url),
        )
        for batch in hash_batches:
            done.watch(self._submit_hash(self._hash_batch, batch))
        for shard, offset, view in writes:
            done.watch(self._submit_write(shard, offset, view))
        return done.future

    def _submit_hash(
        self, work: Callable[..., None], *args: Any
    ) -> concurrent.futures.Future[None]:
        """Queue a hashing task on this writer's threads."""
        return self._hash_pool.submit(self._guarded(work, *args))

    def _store_digests(
        self, pieces: Sequence[tuple[int, int, np.ndarray, int, int]], digests: np.ndarray
    ) -> None:
        """Record digests computed elsewhere, page by page in the order of ``pieces``."""
        page = 0
        for tensor, first, flat, _, _ in pieces:
            count = flat.nbytes // self._page_bytes
            self._digests[tensor, first : first + count] = digests[page : page + count]
            page += count
        if page != len(digests):
            raise ValueError(f"{len(digests)} digests for {page} pages")

    def _hash_batch(self, batch: Sequence[tuple[int, int, np.ndarray]]) -> None:
        for tensor, block, view in batch:
            self._hash(tensor, block, view)


def _all_done(
    futures: Sequence[concurrent.futures.Future[None]],
) -> concurrent.futures.Future[None]:
    """One future for several: done when all are, with the first failure."""
    done = Completion(len(futures), cancelled=lambda: SnapshotIOError("the writer was aborted"))
    for future in futures:
        done.watch(future)
    return done.future


def _batches(
    pieces: Sequence[tuple[int, int, np.ndarray, int, int]], unit_bytes: int
) -> list[list[tuple[int, int, np.ndarray]]]:
    """``(tensor, first block, pages)`` items in batches of about ``unit_bytes``."""
    batches: list[list[tuple[int, int, np.ndarray]]] = [[]]
    size = 0
    for tensor, first, flat, _, _ in pieces:
        if size >= unit_bytes:
            batches.append([])
            size = 0
        batches[-1].append((tensor, first, flat))
        size += flat.nbytes
    return [batch for batch in batches if batch]


def _contiguous_writes(
    pieces: Sequence[tuple[int, int, np.ndarray, int, int]], unit_bytes: int
) -> list[tuple[int, int, np.ndarray]]:
    """``(shard, file offset, view)`` writes: pieces that continue each other in the file and
    in memory merged into one view over their memory, cut at ``unit_bytes``. The caller keeps
    the pieces' arrays alive until the writes complete (the merged views do not own memory)."""
    runs: list[tuple[int, int, int, int]] = []  # shard, file offset, address, bytes
    for _, _, flat, shard, offset in pieces:
        address = flat.ctypes.data
        if runs:
            last_shard, last_offset, last_address, last_bytes = runs[-1]
            if (
                last_shard == shard
                and last_offset + last_bytes == offset
                and last_address + last_bytes == address
            ):
                runs[-1] = (shard, last_offset, last_address, last_bytes + flat.nbytes)
                continue
        runs.append((shard, offset, address, flat.nbytes))
    # Not at module level: kvsnap.transfer.pinned imports torch, which reading a snapshot does
    # not need.
    from kvsnap.transfer.pinned import host_address_view

    writes = []
    for shard, offset, address, nbytes in runs:
        view = host_address_view(address, nbytes)
        for start in range(0, nbytes, unit_bytes):
            writes.append((shard, offset + start, view[start : start + unit_bytes]))
    return writes
