"""The chunk table of a lossless tensor (:mod:`kvsnap.encoding.lossless`): its columns, and the
check that refuses a table that does not describe its pages and stored bytes exactly, before
anything is decoded.

One row per chunk, :func:`columns` ``uint64`` columns::

    first_page, num_pages, offset, xxh3_64, then per plane b: codec_b, length_b
"""

from __future__ import annotations

import numpy as np

from kvsnap.errors import SnapshotCorruptError

#: A chunk's raw bytes may be at most this (a table declaring more is refused): the most one
#: chunk's decode can be asked to produce, whatever its pages. A tensor of pages larger than
#: this is stored raw.
MAX_CHUNK_BYTES = 64 << 20
#: Plane codecs.
CODEC_RAW = 0
CODEC_ZSTD = 1
#: Columns of a chunk table row before the per-plane pairs.
FIRST_PAGE, NUM_PAGES, OFFSET, CHECKSUM = 0, 1, 2, 3
PLANES_START = 4


def columns(word_bytes: int) -> int:
    """Columns of a chunk table for words of ``word_bytes``."""
    return PLANES_START + 2 * word_bytes


#: Element sizes that are encoded (16-, 32- and 64-bit floats); one-byte dtypes stay raw.
ENCODED_WORD_BYTES = (2, 4, 8)


def corrupt(message: str, tensor: str | None, chunk: int | None = None) -> SnapshotCorruptError:
    where = "" if chunk is None else f"chunk {chunk}: "
    return SnapshotCorruptError(where + message, tensor=tensor)


def check_chunk_table(
    table: np.ndarray,
    *,
    word_bytes: int,
    page_bytes: int,
    num_pages: int,
    stored_bytes: int,
    tensor: str | None = None,
) -> None:
    """Refuse (``SnapshotCorruptError``, naming ``tensor`` and the chunk) a chunk table that
    does not describe exactly ``num_pages`` pages stored in exactly ``stored_bytes`` bytes:
    chunks out of order, overlapping, leaving gaps or running past the data, a chunk (or a
    page) larger than :data:`MAX_CHUNK_BYTES`, an unknown codec, or a plane length its codec
    cannot have. Vectorized: a table of a million rows is checked in milliseconds."""
    if word_bytes not in ENCODED_WORD_BYTES or page_bytes <= 0 or page_bytes % word_bytes:
        raise corrupt(f"{word_bytes}-byte words in {page_bytes}-byte pages", tensor)
    if page_bytes > MAX_CHUNK_BYTES:
        raise corrupt(f"pages of {page_bytes} bytes, more than a chunk holds", tensor)
    if table.dtype != np.uint64 or table.ndim != 2 or table.shape[1] != columns(word_bytes):
        raise corrupt(f"a chunk table of {table.dtype} {table.shape}", tensor)
    if len(table) == 0 or len(table) > num_pages:
        raise corrupt(f"{len(table)} chunks for {num_pages} pages", tensor)
    limit = MAX_CHUNK_BYTES // page_bytes
    pages = table[:, NUM_PAGES]
    _first_bad(tensor, (pages == 0) | (pages > limit), "holds {} pages", pages)
    starts = np.concatenate([[0], np.cumsum(pages[:-1], dtype=np.uint64)])
    _first_bad(tensor, table[:, FIRST_PAGE] != starts, "starts at page {}", table[:, FIRST_PAGE])
    if int(pages.sum(dtype=np.uint64)) != num_pages:
        raise corrupt(f"the chunks hold {int(pages.sum())} pages, not {num_pages}", tensor)
    codecs, lengths = table[:, PLANES_START::2], table[:, PLANES_START + 1 :: 2]
    plane_bytes = pages * np.uint64(page_bytes // word_bytes)
    bad_codec = (codecs != CODEC_RAW) & (codecs != CODEC_ZSTD)
    _first_bad(tensor, bad_codec.any(axis=1), "has codec {}", codecs.max(axis=1))
    raw_wrong = (codecs == CODEC_RAW) & (lengths != plane_bytes[:, None])
    coded_wrong = (codecs == CODEC_ZSTD) & ((lengths == 0) | (lengths >= plane_bytes[:, None]))
    _first_bad(tensor, (raw_wrong | coded_wrong).any(axis=1), "has plane lengths {}", lengths)
    chunk_lengths = lengths.sum(axis=1, dtype=np.uint64)
    offsets = np.concatenate([[0], np.cumsum(chunk_lengths[:-1], dtype=np.uint64)])
    _first_bad(tensor, table[:, OFFSET] != offsets, "starts at byte {}", table[:, OFFSET])
    total = int(chunk_lengths.sum(dtype=np.uint64))
    if total != stored_bytes:
        raise corrupt(f"the chunks fill {total} bytes, the data holds {stored_bytes}", tensor)


def _first_bad(tensor: str | None, bad: np.ndarray, message: str, values: np.ndarray) -> None:
    if bad.any():
        chunk = int(np.argmax(bad))
        shown = values[chunk]
        shown = shown.tolist() if isinstance(shown, np.ndarray) else int(shown)
        raise corrupt(message.format(shown), tensor, chunk)


def chunks_covering(table: np.ndarray, first_page: int, stop_page: int) -> range:
    """The chunks holding pages ``first_page`` to ``stop_page`` (exclusive) of a checked
    table."""
    if stop_page <= first_page:
        return range(0)
    starts = table[:, FIRST_PAGE]
    low = int(np.searchsorted(starts, first_page, side="right")) - 1
    high = int(np.searchsorted(starts, stop_page, side="left"))
    return range(max(low, 0), high)
