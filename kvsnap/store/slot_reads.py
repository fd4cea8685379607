"""Reads of whole staging slots: many tensors' pages in one call, verified page by page.

A restore's slot holds pages of many layer tensors. They are addressed with a few numpy
operations (each tensor's file and start offset, the block's position), runs of pages that
follow each other both in the file and in the slot become one ``pread`` — a short prefix
restored from a snapshot of that prefix is one contiguous range — and the runs are cut into
pieces so the process-wide read threads share them. Each piece is checked against the stored
xxh3-64 of its pages on the thread that read it; a page that fails is reported, not raised,
so the caller can move every other page and tell exactly which blocks were not restored.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvsnap import format as fmt
from kvsnap.store.completion import Completion
from kvsnap.store.source import Source
from kvsnap.store.tracing import TraceHook, traced

#: Smallest and largest piece one read thread takes.
MIN_PIECE_BYTES = 256 << 10
MAX_PIECE_BYTES = 8 << 20

_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def read_threads() -> int:
    """Threads of the shared read pool: a page-cached file reads ~4 GB/s per thread and xxh3
    hashes ~7.6 GB/s per thread (DESIGN.md), so up to 16 keep scaling."""
    return max(2, min(16, os.cpu_count() or 1))


def shared_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process-wide pool that reads (and verifies) slot pieces, started once."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = concurrent.futures.ThreadPoolExecutor(
                read_threads(), thread_name_prefix="kvsnap-slot-read"
            )
        return _EXECUTOR


@dataclass(frozen=True)
class TensorExtents:
    """Where each layer tensor's pages lie: its file's source, and its first byte there."""

    sources: Sequence[Source]
    file_of: np.ndarray  # per tensor, index into sources
    begin: np.ndarray  # per tensor, file offset of block 0
    page_size_bytes: int


@dataclass(frozen=True)
class _Piece:
    source: Source
    file_offset: int
    slot_offset: int
    pages: np.ndarray  # indices into the slot's page arrays, consecutive in file and slot


def _pieces(
    extents: TensorExtents,
    page_tensors: np.ndarray,
    page_blocks: np.ndarray,
    page_offsets: np.ndarray,
) -> list[_Piece]:
    """Runs of pages consecutive in one file and in the slot, cut to share the threads."""
    page = extents.page_size_bytes
    files = extents.file_of[page_tensors]
    file_offsets = extents.begin[page_tensors] + page_blocks * page
    continues = (
        (files[1:] == files[:-1])
        & (file_offsets[1:] == file_offsets[:-1] + page)
        & (page_offsets[1:] == page_offsets[:-1] + page)
    )
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    stops = np.append(starts[1:], len(page_tensors))
    total = len(page_tensors) * page
    piece_bytes = min(MAX_PIECE_BYTES, max(MIN_PIECE_BYTES, total // read_threads()))
    per_piece = max(1, piece_bytes // page)
    pieces = []
    for start, stop in zip(starts.tolist(), stops.tolist(), strict=True):
        for first in range(start, stop, per_piece):
            last = min(stop, first + per_piece)
            pieces.append(
                _Piece(
                    extents.sources[int(files[first])],
                    int(file_offsets[first]),
                    int(page_offsets[first]),
                    np.arange(first, last),
                )
            )
    return pieces


def read_slot_async(
    extents: TensorExtents,
    checksums: np.ndarray | None,
    page_tensors: np.ndarray,
    page_blocks: np.ndarray,
    page_offsets: np.ndarray,
    out: np.ndarray,
    trace: TraceHook | None = None,
) -> concurrent.futures.Future[np.ndarray]:
    """Read page ``i`` (block ``page_blocks[i]`` of tensor ``page_tensors[i]``) into ``out`` at
    ``page_offsets[i]``, on the shared read threads.

    With ``checksums`` (``(tensors, blocks)`` stored xxh3-64) every page is verified. The
    future completes once no thread touches ``out``: with the sorted indices of the pages that
    failed their checksum (empty when all passed), or the first I/O error (truncation, a
    vanished file), after which pieces not started are skipped.
    """
    page = extents.page_size_bytes
    flat = out.reshape(-1)
    bad: list[np.ndarray] = []
    lock = threading.Lock()

    def read(piece: _Piece) -> None:
        view = flat[piece.slot_offset : piece.slot_offset + len(piece.pages) * page]
        with traced(trace, "read", view.nbytes):
            piece.source.read_into(piece.file_offset, memoryview(view))
        if checksums is None:
            return
        with traced(trace, "verify", view.nbytes):
            got = fmt.block_digests(view, page)
            stored = checksums[page_tensors[piece.pages], page_blocks[piece.pages]]
            failed = piece.pages[got != stored]
        if len(failed):
            with lock:
                bad.append(failed)

    pieces = _pieces(extents, page_tensors, page_blocks, page_offsets)
    result: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
    done = Completion(len(pieces), cancelled=lambda: RuntimeError("skipped after a failure"))

    def finish(future: concurrent.futures.Future[None]) -> None:
        error = future.exception()
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(np.sort(np.concatenate(bad)) if bad else np.empty(0, np.int64))

    done.future.add_done_callback(finish)
    executor = shared_executor()
    concurrent_ok = all(piece.source.concurrent for piece in pieces)
    for piece in pieces:
        if concurrent_ok:
            done.watch(executor.submit(read, piece))
        else:
            # An fsspec file reads through one handle: in order, on this thread's turn.
            inline: concurrent.futures.Future[None] = concurrent.futures.Future()
            try:
                read(piece)
                inline.set_result(None)
            except BaseException as error:
                inline.set_exception(error)
            done.watch(inline)
    return result
