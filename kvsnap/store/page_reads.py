"""Reads of one layer tensor's pages: coalesced ranges, checked block by block, on the
reader's own threads (:meth:`SnapshotReader.read_pages <kvsnap.store.reader.SnapshotReader.
read_pages>` and ``read_pages_async``). Reads of many tensors' pages into one staging slot
are :mod:`kvsnap.store.slot_reads`."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvsnap.errors import SnapshotIOError
from kvsnap.store import tuning
from kvsnap.store.completion import Completion
from kvsnap.store.pools import cpu_count
from kvsnap.store.source import check_blocks, check_page_digests
from kvsnap.store.tracing import TraceHook, traced

if TYPE_CHECKING:
    from kvsnap.store.reader import SnapshotReader

#: A coalesced read: ``(first_block, num_blocks, output_page)``.
Piece = tuple[int, int, int]


class PageReads:
    """Page reads of ``reader``'s layer tensors on up to ``threads`` threads of its own
    (default: CPUs, 2 to 8; started on first concurrent use, stopped by :meth:`close`). The
    reader is reached through its named accessors (``layer``, ``num_blocks``, ``page_bytes``,
    ``verifies``, ``checksums``)."""

    def __init__(self, reader: SnapshotReader, threads: int | None) -> None:
        self._reader = reader
        self._threads = threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def read(self, name: str, block_ids: np.ndarray | Sequence[int], out: np.ndarray) -> None:
        """Blocks ``block_ids`` of layer tensor ``name`` into ``out``, now (see
        :meth:`SnapshotReader.read_pages`)."""
        read_piece, pieces, concurrent_ok = self._piece_reader(name, block_ids, out, None)
        nbytes = sum(count for _, count, _ in pieces) * self._reader.page_bytes
        # Small reads stay on the calling thread: a handoff costs more than it saves.
        if concurrent_ok and len(pieces) > 1 and nbytes > tuning.SUBCHUNK_BYTES:
            self._submit(read_piece, pieces).result()
        else:
            for piece in pieces:
                read_piece(piece)

    def read_async(
        self,
        name: str,
        block_ids: np.ndarray | Sequence[int],
        out: np.ndarray,
        trace: TraceHook | None,
    ) -> concurrent.futures.Future[None]:
        """:meth:`read` queued on the threads (see :meth:`SnapshotReader.read_pages_async`)."""
        read_piece, pieces, _ = self._piece_reader(name, block_ids, out, trace)
        return self._submit(read_piece, pieces)

    def pieces(self, block_ids: np.ndarray) -> list[Piece]:
        """Coalesced reads ``(first_block, num_blocks, output_page)``: runs of consecutive ids,
        cut at about tuning.SUBCHUNK_BYTES so threads share large runs."""
        if not len(block_ids):
            return []
        breaks = np.flatnonzero(np.diff(block_ids) != 1) + 1
        starts = np.concatenate(([0], breaks))
        stops = np.concatenate((breaks, [len(block_ids)]))
        per = max(1, tuning.SUBCHUNK_BYTES // self._reader.page_bytes)
        pieces = []
        for start, stop in zip(starts.tolist(), stops.tolist(), strict=True):
            for position in range(start, stop, per):
                count = min(per, stop - position)
                pieces.append((int(block_ids[position]), count, position))
        return pieces

    def run(
        self, work: Callable[[Any], Any], items: Sequence[Any], concurrent_ok: bool, nbytes: int
    ) -> list[Any]:
        """``work`` of every item, in order: on the threads when that pays."""
        if concurrent_ok and len(items) > 1 and nbytes > tuning.SUBCHUNK_BYTES:
            return list(self._executor().map(work, items))
        return [work(item) for item in items]

    def close(self) -> None:
        """Stop the threads (after the reads queued on them)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            threads = self._threads or max(2, min(8, cpu_count()))
            self._pool = concurrent.futures.ThreadPoolExecutor(
                threads, thread_name_prefix="kvsnap-read"
            )
        return self._pool

    def _submit(
        self, read_piece: Callable[[Piece], None], pieces: list[Piece]
    ) -> concurrent.futures.Future[None]:
        url = self._reader.url
        done = Completion(
            len(pieces),
            cancelled=lambda: SnapshotIOError("skipped after an earlier failure", file=url),
        )
        executor = self._executor()
        for piece in pieces:
            done.watch(executor.submit(read_piece, piece))
        return done.future

    def _piece_reader(
        self,
        name: str,
        block_ids: np.ndarray | Sequence[int],
        out: np.ndarray,
        trace: TraceHook | None,
    ) -> tuple[Callable[[Piece], None], list[Piece], bool]:
        """Check a read of ``block_ids`` into ``out``; the function that reads (and verifies)
        one piece, the pieces, and whether pieces may run concurrently."""
        reader = self._reader
        tensor, open_file, entry = reader.layer(name)
        ids = _checked_ids(name, block_ids, reader.num_blocks)
        if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise TypeError("out must be a C-contiguous uint8 numpy array")
        page = reader.page_bytes
        needed = len(ids) * page
        if out.nbytes < needed:
            raise ValueError(f"out holds {out.nbytes} bytes, {len(ids)} pages need {needed}")
        flat = out.reshape(-1)
        table = reader.page_digest_table
        bound = None if table is None else table[tensor]
        row = reader.checksums.row(tensor) if reader.verifies and bound is None else None
        source = open_file.source

        def read_piece(piece: Piece) -> None:
            block, count, position = piece
            view = flat[position * page : (position + count) * page]
            with traced(trace, "read", view.nbytes):
                source.read_into(entry.begin + block * page, memoryview(view), tensor=name)
            if bound is not None:
                with traced(trace, "verify", view.nbytes):
                    check_page_digests(view, page, bound, block, source.url, name)
            elif row is not None:
                with traced(trace, "verify", view.nbytes):
                    check_blocks(view, page, row, block, source.url, name)

        return read_piece, self.pieces(ids), source.concurrent


def _checked_ids(name: str, block_ids: np.ndarray | Sequence[int], num_blocks: int) -> np.ndarray:
    """``block_ids`` as int64, checked to be one-dimensional integers in ``[0, num_blocks)``."""
    ids = np.asarray(block_ids)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError("block_ids must be a one-dimensional integer array")
    ids = ids.astype(np.int64, copy=False)
    if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
        raise IndexError(
            f"{name}: block ids must lie in [0, {num_blocks}), got {ids.min()}..{ids.max()}"
        )
    return ids
