"""The writer's page digests: its pieces cut for hashing and writing, every page's xxh3-64 and,
for a signed snapshot, its BLAKE3 digest, computed on the hashing pool or recorded from the
caller (digests computed on the device)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kvsnap import format as fmt
from kvsnap.store.base.tracing import TraceHook, traced
from kvsnap.store.write.slot_writes import SlotPiece
from kvsnap.store.write.snapshot_files import SnapshotFiles

__all__ = ["PageHashing"]


class PageHashing:
    """The page digests of the snapshot ``files`` describes, into its digest tables."""

    def __init__(self, files: SnapshotFiles, trace: TraceHook | None) -> None:
        self._files = files
        self._page_bytes = files.page_bytes
        self._trace = trace

    def split(self, first: int, count: int, unit_bytes: int) -> list[tuple[int, int]]:
        """Pieces ``(first_block, num_blocks)`` of about ``unit_bytes``; when pages are not
        4096-multiples, piece sizes stay multiples of 4096 so O_DIRECT keeps alignment."""
        per = max(1, unit_bytes // self._page_bytes)
        step = fmt.DATA_ALIGNMENT // math.gcd(self._page_bytes, fmt.DATA_ALIGNMENT)
        per = -(-per // step) * step
        return [
            (block, min(per, first + count - block)) for block in range(first, first + count, per)
        ]

    def hash(
        self, tensor: int, block: int, view: np.ndarray, xxh3: bool = True, blake3: bool = True
    ) -> None:
        """Hash pages ``view`` (blocks ``block`` onwards of layer tensor ``tensor``): their
        xxh3-64 (``xxh3``) and, for a signed snapshot, their BLAKE3 digests (``blake3``)."""
        files = self._files
        with traced(self._trace, "hash", view.nbytes):
            if xxh3:
                digests = fmt.block_digests(view, self._page_bytes)
                files.digests[tensor, block : block + len(digests)] = digests
            if blake3 and files.page_digests is not None:
                bound = fmt.page_digests(view, self._page_bytes)
                files.page_digests[tensor, block : block + len(bound)] = bound

    def hash_batch(
        self, batch: Sequence[tuple[int, int, np.ndarray]], xxh3: bool, blake3: bool
    ) -> None:
        for tensor, block, view in batch:
            self.hash(tensor, block, view, xxh3, blake3)

    def store_digests(
        self, pieces: Sequence[SlotPiece], digests: np.ndarray, table: np.ndarray | None
    ) -> None:
        """Record digests computed elsewhere into ``table`` (tensors x blocks, of xxh3-64 or
        of BLAKE3 digests), page by page in the order of ``pieces``."""
        assert table is not None
        page = 0
        for tensor, first, flat, _, _ in pieces:
            count = flat.nbytes // self._page_bytes
            table[tensor, first : first + count] = digests[page : page + count]
            page += count
        if page != len(digests):
            raise ValueError(f"{len(digests)} digests for {page} pages")

    def pages_view(self, flat: np.ndarray, first: int, block: int, count: int) -> np.ndarray:
        """Blocks ``block .. block+count`` of a buffer whose first page is block ``first``."""
        page = self._page_bytes
        return flat[(block - first) * page : (block - first + count) * page]
