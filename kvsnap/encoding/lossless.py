"""Lossless encoding of a layer tensor: byte planes, entropy-coded in independent chunks.

A floating-point page's bytes are far from random in one place only: the byte holding the sign
and the exponent's high bits (byte 1 of a little-endian bf16 or fp16 word, byte 3 of an fp32
one) carries about 2.6-3.6 of its 8 bits, the mantissa bytes close to 8. So a tensor of pages is
cut into chunks of whole pages (:data:`CHUNK_BYTES` of pages, the last one shorter), each
chunk's words are split into byte planes (plane ``b`` holds byte ``b`` of every word, in
order), and each plane is stored zstd-coded where that saves at least :data:`MIN_SAVING` of
it, raw otherwise. A chunk is independent of every other (its own zstd frames, its own
checksum), so chunks decode in parallel on threads (zstandard and numpy release the GIL) and a
read of some blocks decodes only the chunks holding them.

The stored bytes of a tensor are its chunks one after the other; chunk ``c``'s bytes are its
planes in order ``0 .. word_bytes - 1``. The chunk table (:func:`columns` ``uint64`` columns,
one row per chunk; :mod:`kvsnap.encoding.lossless_table`) says where everything lies::

    first_page, num_pages, offset, xxh3_64, then per plane b: codec_b, length_b

``first_page`` and ``offset`` are the running sums of ``num_pages`` and of the chunk's stored
length (the sum of its planes' lengths): a table whose chunks overlap, leave a gap, or run past
the stored bytes is refused by :func:`check_chunk_table` before anything is decoded.
``xxh3_64`` covers the chunk's stored bytes, so a corrupt chunk is found before zstd sees it.
A coded plane is one zstd frame recording its content size, which must be the plane's size,
in bytes that can hold that much (:mod:`kvsnap.encoding.lossless_frames`): checked from the
frame headers with the table (:func:`check_encoded`), before anything is allocated, and
nothing ever decodes to more than its declared output (each frame is decoded into a buffer of
its plane's size, and one byte more refuses it).

A tensor whose chunks together do not save :data:`MIN_SAVING` of its bytes is not encoded at
all (:func:`encode_pages` returns ``None``): it is stored as it is. One-byte dtypes (fp8, int8)
are never encoded: their bytes are mostly mantissa.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import xxhash

from kvsnap.encoding.lossless_frames import check_frames, frame_length
from kvsnap.encoding.lossless_table import (
    CHECKSUM,
    CODEC_RAW,
    CODEC_ZSTD,
    ENCODED_WORD_BYTES,
    FIRST_PAGE,
    MAX_CHUNK_BYTES,
    NUM_PAGES,
    OFFSET,
    PLANES_START,
    check_chunk_table,
    columns,
    corrupt,
)

try:
    import zstandard
except ImportError:  # pragma: no cover - a base dependency; absent only in foreign images
    zstandard = None  # type: ignore[assignment]

#: Raw bytes of pages per chunk (rounded down to whole pages, at least one page).
CHUNK_BYTES = 2 << 20
#: A plane (and a tensor) is kept coded only when coding saves at least this share of it.
MIN_SAVING = 0.05
#: zstd's parameters: its fastest strategy, a 128 KiB window (a channel's next token lies a page
#: row away) and matches of at least 7 bytes (short matches cost more than the literals they
#: replace in an exponent plane). On real KV they gave 5-10% more than level 1 (same speed or
#: better; docs/benchmarks.md, "Encodings").
ZSTD_PARAMETERS = {
    "strategy": 1,  # zstandard.STRATEGY_FAST
    "window_log": 17,
    "hash_log": 10,
    "min_match": 7,
    "search_log": 1,
    "target_length": 0,
}
#: A plane whose first bytes do not shrink is stored raw without coding the rest.
SAMPLE_BYTES = 64 << 10

#: The name recorded for this encoding.
NAME = "kvsnap-planes-zstd-v1"

T = TypeVar("T")


@dataclass(frozen=True)
class LosslessTensor:
    """A tensor of ``num_pages`` pages of ``page_bytes`` each, words of ``word_bytes``, stored
    as ``data`` (its chunks back to back) described by ``chunk_table``."""

    word_bytes: int
    page_bytes: int
    num_pages: int
    chunk_table: np.ndarray
    data: np.ndarray

    @property
    def raw_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def stored_bytes(self) -> int:
        return len(self.data)

    @property
    def ratio(self) -> float:
        """Raw bytes per stored byte (1.5 means a third smaller)."""
        return self.raw_bytes / max(self.stored_bytes, 1)


def chunk_pages(page_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Pages per chunk for pages of ``page_bytes``: whole pages, at least one."""
    return max(1, chunk_bytes // page_bytes)


_LOCAL = threading.local()


def _zstd() -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
    """This thread's zstd contexts (an instance must not be shared between threads)."""
    if zstandard is None:
        raise RuntimeError("lossless snapshots need the zstandard package: pip install zstandard")
    contexts = getattr(_LOCAL, "contexts", None)
    if contexts is None:
        parameters = zstandard.ZstdCompressionParameters(**ZSTD_PARAMETERS, write_content_size=True)
        compressor = zstandard.ZstdCompressor(compression_params=parameters)
        contexts = _LOCAL.contexts = (compressor, zstandard.ZstdDecompressor())
    return contexts


def split_planes(words: np.ndarray, word_bytes: int, out: np.ndarray | None = None) -> np.ndarray:
    """``(word_bytes, n)``: byte ``b`` of each of the ``n`` words of the ``uint8`` array
    ``words`` in row ``b`` (into ``out`` when given, ``word_bytes * n`` bytes)."""
    shape = (word_bytes, len(words) // word_bytes)
    planes = np.empty(shape, dtype=np.uint8) if out is None else out.reshape(shape)
    if word_bytes == 2:
        # Shifts over 16-bit words, cast down, beat a strided byte copy (about 2.5x).
        as_words = words.view("<u2")
        np.right_shift(as_words, 8, out=planes[1], casting="unsafe")
        np.copyto(planes[0], as_words, casting="unsafe")
        return planes
    np.copyto(planes, words.reshape(-1, word_bytes).T)
    return planes


def join_planes(planes: Sequence[np.ndarray], out: np.ndarray) -> None:
    """The inverse of :func:`split_planes` into the contiguous ``uint8`` array ``out``."""
    if len(planes) == 2:
        # Two vectorized passes over 16-bit words beat a strided byte copy (about 1.7x).
        words = out.view("<u2")
        np.left_shift(planes[1], 8, out=words, dtype=np.uint16)
        np.bitwise_or(words, planes[0], out=words)
        return
    as_words = out.reshape(-1, len(planes))
    for index, plane in enumerate(planes):
        as_words[:, index] = plane


def _code_plane(plane: np.ndarray) -> tuple[int, bytes | np.ndarray]:
    """A plane's codec and stored bytes: zstd where that saves :data:`MIN_SAVING`."""
    compressor = _zstd()[0]
    if len(plane) > 2 * SAMPLE_BYTES:
        sample = compressor.compress(plane[:SAMPLE_BYTES].data)
        if len(sample) > (1 - MIN_SAVING) * SAMPLE_BYTES:
            return CODEC_RAW, plane
    coded = compressor.compress(plane.data)
    if len(coded) > (1 - MIN_SAVING) * len(plane):
        return CODEC_RAW, plane
    return CODEC_ZSTD, coded


def _code_chunk(pages: np.ndarray, word_bytes: int) -> tuple[np.ndarray, list[bytes | None]]:
    """One chunk's table row (first page, offset and checksum left 0) and its coded planes,
    ``None`` for a plane stored raw. ``pages``: ``uint8`` ``(num_pages, page_bytes)``."""
    # Split into this thread's scratch buffer, reused chunk after chunk: a raw plane is not
    # kept from it but written again from the pages into the stored bytes (_store_chunk).
    planes = split_planes(pages.reshape(-1), word_bytes, _scratch(-1, pages.size))
    row = np.zeros(columns(word_bytes), dtype=np.uint64)
    row[NUM_PAGES] = len(pages)
    coded: list[bytes | None] = []
    for index, plane in enumerate(planes):
        codec, stored = _code_plane(plane)
        row[PLANES_START + 2 * index] = codec
        row[PLANES_START + 2 * index + 1] = len(stored)
        coded.append(stored if isinstance(stored, bytes) else None)  # a raw plane: None
    return row, coded


def _store_chunk(
    pages: np.ndarray, coded: list[bytes | None], word_bytes: int, stored: np.ndarray
) -> int:
    """Write one chunk's planes into its stored bytes ``stored`` (a coded plane's frame, a raw
    plane's bytes straight from ``pages``) and return their xxh3-64, read while they are in
    cache."""
    words = pages.reshape(-1)
    plane_bytes = len(words) // word_bytes
    position = 0
    for index, frame in enumerate(coded):
        if frame is None:
            target = stored[position : position + plane_bytes]
            _extract_plane(words, word_bytes, index, target)
            position += plane_bytes
        else:
            stored[position : position + len(frame)] = np.frombuffer(frame, dtype=np.uint8)
            position += len(frame)
    return xxhash.xxh3_64_intdigest(stored.data)


def _extract_plane(words: np.ndarray, word_bytes: int, index: int, out: np.ndarray) -> None:
    """Byte ``index`` of every ``word_bytes`` word of ``words`` into ``out``."""
    if word_bytes == 2:
        as_words = words.view("<u2")
        if index:
            np.right_shift(as_words, 8, out=out, casting="unsafe")
        else:
            np.copyto(out, as_words, casting="unsafe")  # truncation keeps the low byte
        return
    np.copyto(out, words.reshape(-1, word_bytes)[:, index])


def encode_pages(
    pages: np.ndarray,
    word_bytes: int,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    executor: Executor | None = None,
) -> LosslessTensor | None:
    """Encode a tensor of pages (``uint8``, ``(num_pages, page_bytes)``, C-contiguous) whose
    elements are ``word_bytes`` wide; ``None`` when it is not worth it (one-byte elements, a
    saving under :data:`MIN_SAVING`, or pages over :data:`MAX_CHUNK_BYTES`, more than a chunk
    may hold): store the tensor as it is. Chunks are coded, then written into the stored
    bytes, on ``executor``'s threads when one is given."""
    if pages.ndim != 2 or pages.dtype != np.uint8 or not pages.flags.c_contiguous:
        raise ValueError("pages must be a C-contiguous uint8 array (num_pages, page_bytes)")
    num_pages, page_bytes = pages.shape
    if word_bytes not in ENCODED_WORD_BYTES or num_pages == 0 or page_bytes > MAX_CHUNK_BYTES:
        return None
    if page_bytes % word_bytes:
        raise ValueError(f"a page of {page_bytes} bytes is not whole {word_bytes}-byte words")
    step = chunk_pages(page_bytes, min(chunk_bytes, MAX_CHUNK_BYTES))
    slices = [pages[first : first + step] for first in range(0, num_pages, step)]
    results = run_tasks([functools.partial(_code_chunk, s, word_bytes) for s in slices], executor)
    table = np.stack([row for row, _ in results])
    stored_lengths = table[:, PLANES_START + 1 :: 2].sum(axis=1)
    table[:, FIRST_PAGE] = np.concatenate([[0], np.cumsum(table[:-1, NUM_PAGES])])
    table[:, OFFSET] = np.concatenate([[0], np.cumsum(stored_lengths[:-1])])
    total = int(stored_lengths.sum())
    if total > (1 - MIN_SAVING) * num_pages * page_bytes:
        return None
    data = np.empty(total, dtype=np.uint8)
    ends = (table[:, OFFSET] + stored_lengths).tolist()
    stores = [
        functools.partial(_store_chunk, piece, coded, word_bytes, data[start:end])
        for piece, (_, coded), start, end in zip(
            slices, results, table[:, OFFSET].tolist(), ends, strict=True
        )
    ]
    table[:, CHECKSUM] = run_tasks(stores, executor)
    return LosslessTensor(word_bytes, page_bytes, num_pages, table, data)


def run_tasks(tasks: Sequence[Callable[[], T]], executor: Executor | None = None) -> list[T]:
    """The results of ``tasks`` in order, run on ``executor``'s threads when one is given (the
    first task to fail, in order, raises)."""
    if executor is None:
        return [task() for task in tasks]
    return list(executor.map(_call, tasks))


def _call(task: Callable[[], T]) -> T:
    return task()


def decode_chunk(
    row: np.ndarray,
    stored: np.ndarray,
    out: np.ndarray,
    *,
    word_bytes: int,
    tensor: str | None = None,
    chunk: int | None = None,
    verify: bool = True,
) -> None:
    """Decode one chunk (``row`` of a checked table, its stored bytes ``stored``) into
    ``out``, its pages' bytes (``uint8``, contiguous, ``num_pages * page_bytes`` long).

    Raises ``SnapshotCorruptError`` when the bytes do not match the row's checksum (with
    ``verify``) or do not decode to exactly the plane's size."""
    _decode_row(row.tolist(), stored, out, word_bytes, tensor, chunk, verify)


def _decode_row(
    row: list[int],
    stored: np.ndarray,
    out: np.ndarray,
    word_bytes: int,
    tensor: str | None,
    chunk: int | None,
    verify: bool,
) -> None:
    """:func:`decode_chunk` of a row as Python integers."""
    lengths = row[PLANES_START + 1 :: 2]
    if len(stored) != sum(lengths):
        raise ValueError(f"chunk {chunk}: {len(stored)} stored bytes, not the row's")
    if verify and xxhash.xxh3_64_intdigest(stored.data) != row[CHECKSUM]:
        raise corrupt("the stored bytes do not match their checksum", tensor, chunk)
    plane_bytes = len(out) // word_bytes
    planes = []
    position = 0
    for index, (codec, length) in enumerate(zip(row[PLANES_START::2], lengths, strict=True)):
        piece = stored[position : position + length]
        position += length
        if codec == CODEC_RAW:
            planes.append(piece)
        else:
            planes.append(_decode_plane(piece, plane_bytes, index, tensor, chunk))
    join_planes(planes, out)


def check_encoded(encoded: LosslessTensor, tensor: str | None = None) -> None:
    """Refuse (``SnapshotCorruptError`` naming ``tensor`` and the chunk) an encoded tensor whose
    chunk table does not describe exactly its pages and stored bytes (:func:`check_chunk_table`)
    or one of whose coded planes' zstd frames does not declare exactly its plane's size in bytes
    that can hold it (:func:`~kvsnap.encoding.lossless_frames.check_frames`). Reads the table
    and the frames' headers, decodes nothing: what passes decodes to at most its pages."""
    check_chunk_table(
        encoded.chunk_table,
        word_bytes=encoded.word_bytes,
        page_bytes=encoded.page_bytes,
        num_pages=encoded.num_pages,
        stored_bytes=encoded.stored_bytes,
        tensor=tensor,
    )
    check_frames(
        encoded.chunk_table,
        encoded.data,
        word_bytes=encoded.word_bytes,
        page_bytes=encoded.page_bytes,
        tensor=tensor,
    )


def chunk_decoders(
    encoded: LosslessTensor,
    out: np.ndarray,
    *,
    tensor: str | None = None,
    verify: bool = True,
    after: Callable[[int, np.ndarray], None] | None = None,
) -> list[Callable[[], None]]:
    """One task per chunk of ``encoded`` that decodes it into its pages of ``out`` (``uint8``,
    ``(num_pages, page_bytes)``, C-contiguous), for :func:`run_tasks`; the table and the
    frames' headers are checked first (:func:`check_encoded`), so a lying table or frame is
    refused before any task exists.
    ``after(first_page, pages)``, when given, runs in the same task right after the chunk's
    pages (their bytes, flat) are written, while they are still in cache."""
    check_encoded(encoded, tensor)
    if out.shape != (encoded.num_pages, encoded.page_bytes) or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous {(encoded.num_pages, encoded.page_bytes)}")
    flat = out.reshape(-1)
    page_bytes = encoded.page_bytes
    tasks: list[Callable[[], None]] = []
    for chunk, row in enumerate(encoded.chunk_table.tolist()):
        first, count, offset = row[FIRST_PAGE], row[NUM_PAGES], row[OFFSET]
        stored = encoded.data[offset : offset + sum(row[PLANES_START + 1 :: 2])]
        pages = flat[first * page_bytes : (first + count) * page_bytes]
        decode = functools.partial(
            _decode_row, row, stored, pages, encoded.word_bytes, tensor, chunk, verify
        )
        tasks.append(
            decode if after is None else functools.partial(_then, decode, after, first, pages)
        )
    return tasks


def _then(
    task: Callable[[], None],
    after: Callable[[int, np.ndarray], None],
    first: int,
    pages: np.ndarray,
) -> None:
    task()
    after(first, pages)


def _decode_plane(
    piece: np.ndarray, plane_bytes: int, index: int, tensor: str | None, chunk: int | None
) -> np.ndarray:
    """One zstd frame that must decode to exactly ``plane_bytes`` and fill ``piece``: decoded
    into this thread's scratch buffer for plane ``index`` (valid until this thread's next
    decode)."""
    decompressor = _zstd()[1]
    try:
        declared = zstandard.frame_content_size(piece.data)
        if declared != plane_bytes:
            raise corrupt(f"a plane declares {declared} bytes, not {plane_bytes}", tensor, chunk)
        if frame_length(piece) != len(piece):
            raise corrupt("a plane is not exactly one zstd frame", tensor, chunk)
        scratch = _scratch(index, plane_bytes)
        # Into a buffer kept per thread: decompress(), a new output object per plane, decoded
        # at less than half this rate (docs/architecture.md, "Encodings").
        with decompressor.stream_reader(piece.data) as reader:
            decoded = reader.readinto(scratch)
            if decoded != plane_bytes or reader.read(1):
                raise corrupt("a plane does not decode to its declared size", tensor, chunk)
    except zstandard.ZstdError as error:
        raise corrupt(f"a plane does not decode ({error})", tensor, chunk) from None
    return scratch


def _scratch(index: int, size: int) -> np.ndarray:
    buffers = getattr(_LOCAL, "scratch", None)
    if buffers is None:
        buffers = _LOCAL.scratch = {}
    buffer = buffers.get(index)
    if buffer is None or len(buffer) < size:
        buffer = buffers[index] = np.empty(size, dtype=np.uint8)
    return buffer[:size]


def decode_pages(
    encoded: LosslessTensor,
    out: np.ndarray,
    *,
    executor: Executor | None = None,
    tensor: str | None = None,
    verify: bool = True,
) -> None:
    """Decode every page of ``encoded`` into ``out`` (``uint8``, ``(num_pages, page_bytes)``,
    C-contiguous), chunks on ``executor``'s threads when one is given. The table and the
    frames' headers are checked first (:func:`check_encoded`)."""
    run_tasks(chunk_decoders(encoded, out, tensor=tensor, verify=verify), executor)
