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
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvsnap import format as fmt
from kvsnap.store import tuning
from kvsnap.store.completion import Completion
from kvsnap.store.kvikio_reads import read_runs_async
from kvsnap.store.pools import cpu_count, shared_executor
from kvsnap.store.source import Source
from kvsnap.store.tracing import TraceHook, traced

if TYPE_CHECKING:
    from kvsnap.format import TensorEntry
    from kvsnap.store.reader import SnapshotReader

#: Smallest and largest piece one read thread takes.
MIN_PIECE_BYTES = 256 << 10
MAX_PIECE_BYTES = 8 << 20
#: Pieces a slot's read is cut into (within the bounds above); ``None``: one per read thread.
#: Four: several slots are read at once, so the threads stay busy, and each piece is Python work
#: that must take the GIL back (one piece per thread made a 2k-token load 1.4-1.5x slower on
#: the H200: docs/benchmarks.md, "Tuning the read path").
PIECES_PER_SLOT: int | None = 4
#: Threads of the shared read pool; ``None``: one per core, at most 16.
READ_THREADS: int | None = None


def read_threads() -> int:
    """Threads of the shared read pool (:data:`READ_THREADS`, else one per core, at most 16):
    a page-cached file reads ~4 GB/s per thread and xxh3 hashes ~7.6 GB/s per thread
    (measured on the H200 host), so up to 16 keep scaling."""
    if READ_THREADS is not None:
        return READ_THREADS
    return max(2, min(16, cpu_count()))


def read_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The process-wide read pool (:func:`~kvsnap.store.pools.shared_executor`) of
    :func:`read_threads` threads: slot reads and their verification."""
    return shared_executor("read", read_threads())


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


def pieces_per_slot() -> int:
    """How many pieces a slot's read is cut into (:data:`PIECES_PER_SLOT`)."""
    return PIECES_PER_SLOT if PIECES_PER_SLOT is not None else read_threads()


@dataclass(frozen=True)
class PageRuns:
    """Runs of a slot's pages consecutive both in one file and in the slot: per run its file
    (an index into :attr:`TensorExtents.sources`), its first byte there, its offset in the
    slot, and its pages (``starts[i]`` to ``stops[i]`` of the slot's page arrays)."""

    files: np.ndarray
    file_offsets: np.ndarray
    slot_offsets: np.ndarray
    starts: np.ndarray
    stops: np.ndarray

    def rows(self) -> Iterator[tuple[int, int, int, int, int]]:
        """Per run, as Python ints: its file, first byte there, offset in the slot, and first
        and stop page."""
        return zip(
            self.files.tolist(),
            self.file_offsets.tolist(),
            self.slot_offsets.tolist(),
            self.starts.tolist(),
            self.stops.tolist(),
            strict=True,
        )


def page_runs(
    extents: TensorExtents,
    page_tensors: np.ndarray,
    page_blocks: np.ndarray,
    page_offsets: np.ndarray,
) -> PageRuns:
    """Where page ``i`` (block ``page_blocks[i]`` of tensor ``page_tensors[i]``, at
    ``page_offsets[i]`` in the slot) lies, as runs consecutive in one file and in the slot: a
    short prefix restored from a snapshot of that prefix is one run."""
    page = extents.page_size_bytes
    files = extents.file_of[page_tensors]
    file_offsets = extents.begin[page_tensors] + page_blocks * page
    count = len(page_tensors)
    span = (count - 1) * page
    if (
        count
        and files[0] == files[-1]
        and int(page_offsets[-1] - page_offsets[0]) == span
        and int(file_offsets[-1] - file_offsets[0]) == span
        and (len(extents.sources) == 1 or (files == files[0]).all())
        and (np.diff(file_offsets) == page).all()
    ):
        # One run (a slot of one file's consecutive pages): the usual case, found in fewer
        # passes. Slot offsets increase, so a span of exactly count - 1 pages is gapless.
        first = np.zeros(1, dtype=np.int64)
        return PageRuns(files[:1], file_offsets[:1], page_offsets[:1], first, first + count)
    continues = (
        (files[1:] == files[:-1])
        & (file_offsets[1:] == file_offsets[:-1] + page)
        & (page_offsets[1:] == page_offsets[:-1] + page)
    )
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    stops = np.append(starts[1:], len(page_tensors))
    return PageRuns(files[starts], file_offsets[starts], page_offsets[starts], starts, stops)


def _pieces(
    extents: TensorExtents,
    page_tensors: np.ndarray,
    page_blocks: np.ndarray,
    page_offsets: np.ndarray,
    *,
    cut: bool = True,
) -> list[_Piece]:
    """Runs of pages consecutive in one file and in the slot, cut to share the threads (with
    ``cut``; else one piece per run, for one thread to read in order)."""
    page = extents.page_size_bytes
    runs = page_runs(extents, page_tensors, page_blocks, page_offsets)
    # The slot in at most pieces_per_slot() pieces of whole pages, within the size bounds.
    per_piece = max(-(-len(page_tensors) // pieces_per_slot()), MIN_PIECE_BYTES // page, 1)
    per_piece = min(per_piece, max(1, MAX_PIECE_BYTES // page))
    if not cut:
        per_piece = max(1, len(page_tensors))
    pieces = []
    for file, file_offset, slot_offset, start, stop in runs.rows():
        for first in range(start, stop, per_piece):
            last = min(stop, first + per_piece)
            skipped = (first - start) * page
            pieces.append(
                _Piece(
                    extents.sources[file],
                    file_offset + skipped,
                    slot_offset + skipped,
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
    *,
    inline: bool = False,
    digests: np.ndarray | None = None,
) -> concurrent.futures.Future[np.ndarray]:
    """Read page ``i`` (block ``page_blocks[i]`` of tensor ``page_tensors[i]``) into ``out`` at
    ``page_offsets[i]``, on the shared read threads.

    With ``checksums`` (``(tensors, blocks)`` stored xxh3-64) every page is verified; with
    ``digests`` (``(tensors, blocks, 32)`` signed BLAKE3 digests) every page is checked
    against those instead, on the thread that read it. The future completes once no thread
    touches ``out``: with the sorted indices of the pages that failed their check (empty when
    all passed), or the first I/O error (truncation, a vanished file), after which pieces not
    started are skipped.

    ``inline``: the caller may be kept waiting (it has no device work to keep fed). Then a slot
    of at most :data:`~kvsnap.store.tuning.INLINE_READ_MAX_BYTES` is read and checked on this
    thread, one piece per run of pages, and the future is complete when this returns: handing
    so few bytes to the read threads costs more than reading them.
    """
    page = extents.page_size_bytes
    flat = out.reshape(-1)
    inline = inline and len(page_tensors) * page <= tuning.INLINE_READ_MAX_BYTES
    if checksums is None and digests is None and not inline:
        by_kvikio = _read_by_kvikio(extents, page_tensors, page_blocks, page_offsets, flat, trace)
        if by_kvikio is not None:
            return by_kvikio
    bad: list[np.ndarray] = []
    lock = threading.Lock()

    def read(piece: _Piece) -> None:
        view = flat[piece.slot_offset : piece.slot_offset + len(piece.pages) * page]
        with traced(trace, "read", view.nbytes):
            piece.source.read_into(piece.file_offset, memoryview(view))
        if digests is not None:
            with traced(trace, "verify", view.nbytes):
                signed = digests[page_tensors[piece.pages], page_blocks[piece.pages]]
                failed = piece.pages[fmt.page_digest_failures(view, page, signed)]
        elif checksums is None:
            return
        else:
            with traced(trace, "verify", view.nbytes):
                got = fmt.block_digests(view, page)
                stored = checksums[page_tensors[piece.pages], page_blocks[piece.pages]]
                failed = piece.pages[got != stored]
        if len(failed):
            with lock:
                bad.append(failed)

    pieces = _pieces(extents, page_tensors, page_blocks, page_offsets, cut=not inline)
    if inline:
        return _read_on_this_thread(read, pieces, bad)
    return _read_on_threads(read, pieces, bad)


def held_page_failures(
    whole: np.ndarray, offsets: np.ndarray, page_bytes: int, stored: np.ndarray
) -> np.ndarray:
    """The sorted indices of the pages at ``offsets`` in ``whole`` (a file's bytes read whole:
    :meth:`SnapshotReader.held_file`) whose xxh3-64 differs from ``stored`` (or, ``stored``
    being ``(pages, 32)`` signed BLAKE3 digests, whose BLAKE3 digest differs); each run of
    pages that follow each other there is hashed as one buffer."""
    if not len(offsets):
        return np.empty(0, dtype=np.int64)
    digest = fmt.block_digests if stored.ndim == 1 else fmt.page_digests
    apart = np.diff(offsets) != page_bytes
    if not apart.any():  # one run: every page of a chunk's layer tensors, as files lay them
        first = int(offsets[0])
        got = digest(whole[first : first + len(offsets) * page_bytes], page_bytes)
    else:
        breaks = np.flatnonzero(apart) + 1
        starts = np.concatenate(([0], breaks)).tolist()
        stops = np.append(breaks, len(offsets)).tolist()
        got = np.concatenate(
            [
                digest(
                    whole[offsets[start] : offsets[start] + (stop - start) * page_bytes],
                    page_bytes,
                )
                for start, stop in zip(starts, stops, strict=True)
            ]
        )
    differs = got != stored
    return np.flatnonzero(differs if stored.ndim == 1 else differs.any(axis=1))


def _read_on_threads(
    read: Callable[[_Piece], None], pieces: list[_Piece], bad: list[np.ndarray]
) -> concurrent.futures.Future[np.ndarray]:
    """``pieces`` read and checked on the shared read threads (:func:`_run_pieces`): a future
    with the pages that failed their checksum (``read`` adds them to ``bad``), or the first
    error, once no thread touches the slot."""
    result: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
    done = Completion(len(pieces), cancelled=lambda: RuntimeError("skipped after a failure"))

    def finish(future: concurrent.futures.Future[None]) -> None:
        error = future.exception()
        if error is not None:
            result.set_exception(error)
        else:
            result.set_result(np.sort(np.concatenate(bad)) if bad else np.empty(0, np.int64))

    done.future.add_done_callback(finish)
    _run_pieces(read, pieces, done)
    return result


def _read_on_this_thread(
    read: Callable[[_Piece], None], pieces: list[_Piece], bad: list[np.ndarray]
) -> concurrent.futures.Future[np.ndarray]:
    """``pieces`` read and checked in order on this thread: a completed future with the pages
    that failed their checksum (``read`` adds them to ``bad``), or the first error, after
    which no piece is read."""
    result: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
    try:
        for piece in pieces:
            read(piece)
    except Exception as error:  # an I/O error reaches the caller as a threaded read's would
        result.set_exception(error)
        return result
    result.set_result(np.sort(np.concatenate(bad)) if bad else np.empty(0, np.int64))
    return result


def _read_by_kvikio(
    extents: TensorExtents,
    page_tensors: np.ndarray,
    page_blocks: np.ndarray,
    page_offsets: np.ndarray,
    flat: np.ndarray,
    trace: TraceHook | None,
) -> concurrent.futures.Future[np.ndarray] | None:
    """The unchecked read of a slot's runs on kvikio's pool (a small slot cut over its threads), or
    ``None`` where some file cannot be read that way (``store/kvikio_reads.py``)."""
    threads = read_threads()
    files = []
    for source in extents.sources:
        handle = source.kvikio_file(threads)
        if handle is None:
            return None
        files.append((handle, source.url))
    runs = page_runs(extents, page_tensors, page_blocks, page_offsets)
    page = extents.page_size_bytes
    reads = [
        (file, file_offset, flat[slot_offset : slot_offset + (stop - start) * page])
        for file, file_offset, slot_offset, start, stop in runs.rows()
    ]
    return read_runs_async(files, reads, read_executor(), trace)


def _run_pieces(read: Callable[[_Piece], None], pieces: list[_Piece], done: Completion) -> None:
    """Each piece on the shared read threads; where a file reads through one handle (fsspec),
    in order on this thread."""
    executor = read_executor()
    concurrent_ok = all(piece.source.concurrent for piece in pieces)
    for piece in pieces:
        if concurrent_ok:
            done.watch(executor.submit(read, piece))
            continue
        inline: concurrent.futures.Future[None] = concurrent.futures.Future()
        try:
            read(piece)
            inline.set_result(None)
        except BaseException as error:
            inline.set_exception(error)
        done.watch(inline)


def tensor_extents(
    sources: Sequence[Source], located: Sequence[tuple[int, TensorEntry]], page_bytes: int
) -> TensorExtents:
    """Where each layer tensor lies, given per tensor its file (an index into ``sources``) and
    its entry there."""
    return TensorExtents(
        sources,
        np.array([position for position, _ in located], dtype=np.int64),
        np.array([entry.begin for _, entry in located], dtype=np.int64),
        page_bytes,
    )


def read_reader_slot(
    reader: SnapshotReader,
    page_tensors: np.ndarray,
    page_blocks: np.ndarray,
    page_offsets: np.ndarray,
    out: np.ndarray,
    *,
    verify: bool,
    trace: TraceHook | None,
    inline: bool = False,
) -> concurrent.futures.Future[np.ndarray]:
    """:meth:`SnapshotReader.read_slot_async <kvsnap.store.reader.SnapshotReader.
    read_slot_async>`: the pages checked to lie in ``reader``'s snapshot and ``out``, then
    :func:`read_slot_async` with the reader's checked checksum table (when it and the caller
    verify; its signed BLAKE3 page digests instead when it has them), on this thread when
    ``inline`` allows it."""
    num_tensors, num_blocks = len(reader.layer_names), reader.num_blocks
    if len(page_tensors) and (
        page_tensors.min() < 0
        or page_tensors.max() >= num_tensors
        or page_blocks.min() < 0
        or page_blocks.max() >= num_blocks
    ):
        raise IndexError(f"pages outside {num_tensors} tensors of {num_blocks} blocks")
    if len(page_offsets) and page_offsets.max() + reader.page_bytes > out.nbytes:
        raise ValueError(f"out holds {out.nbytes} bytes, the pages reach further")
    digests = reader.page_digest_table if verify else None
    checksums = reader.checksums.table() if verify and digests is None and reader.verifies else None
    return read_slot_async(
        reader.extents(),
        checksums,
        page_tensors,
        page_blocks,
        page_offsets,
        out,
        trace,
        inline=inline,
        digests=digests,
    )
