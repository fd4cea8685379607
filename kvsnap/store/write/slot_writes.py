"""Writes of whole staging slots: many tensors' pages in one call, the writer's fast path.

A capture's slot holds pages of many layer tensors, in file order.
:meth:`SnapshotWriter.write_slot <kvsnap.store.write.writer.SnapshotWriter.write_slot>` hashes
a slot in a few batches whatever the number of tensors in it (:func:`hash_batches`), or takes
digests computed on the device, and writes the pages that follow each other in the file and in
memory as one ``pwrite`` (:func:`contiguous_writes`): the cost of a call does not grow with the
number of tensors it spans.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence

import numpy as np

from kvsnap.errors import SnapshotIOError
from kvsnap.store.base.completion import Completion

#: One tensor's pages of a slot: (tensor, first block, flat pages, file, file offset).
SlotPiece = tuple[int, int, np.ndarray, int, int]


def all_done(
    futures: Sequence[concurrent.futures.Future[None]],
) -> concurrent.futures.Future[None]:
    """One future for several: done when all are, with the first failure."""
    done = Completion(len(futures), cancelled=lambda: SnapshotIOError("the writer was aborted"))
    for future in futures:
        done.watch(future)
    return done.future


def hash_batches(
    pieces: Sequence[SlotPiece], unit_bytes: int
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


def contiguous_writes(
    pieces: Sequence[SlotPiece], unit_bytes: int
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
