"""Hostile lossless data: chunk tables that overlap, leave gaps, run past the data or lie about
sizes, corrupt chunks, and zstd frames that declare more (or other) than their plane. Each is
one ``SnapshotCorruptError`` naming the tensor and the chunk, raised before anything is decoded
past what the table declares."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvsnap.encoding import lossless, lossless_table
from kvsnap.errors import SnapshotCorruptError
from tests.support.encoded_tamper import run_length_frame

# A base dependency; absent only where the tree runs uninstalled (the GPU machine's image),
# whose `pytest -m gpu tests` collects this file too.
zstandard = pytest.importorskip("zstandard")

TENSOR = "layers.0.key"
PAGE_BYTES = 4096


def _encoded() -> lossless.LosslessTensor:
    """Twelve pages of bf16-like words (narrow exponents, random mantissas), three a chunk."""
    rng = np.random.default_rng(7)
    words = (0x3C00 + rng.integers(0, 0x400, 12 * PAGE_BYTES // 2)).astype("<u2")
    pages = words.view(np.uint8).reshape(12, PAGE_BYTES)
    encoded = lossless.encode_pages(pages, 2, chunk_bytes=3 * PAGE_BYTES)
    assert encoded is not None and len(encoded.chunk_table) == 4
    return encoded


def _decode(encoded: lossless.LosslessTensor, **options) -> None:
    out = np.empty((encoded.num_pages, encoded.page_bytes), dtype=np.uint8)
    lossless.decode_pages(encoded, out, tensor=TENSOR, **options)


def _with(encoded, table=None, data=None, num_pages=None) -> lossless.LosslessTensor:
    return lossless.LosslessTensor(
        encoded.word_bytes,
        encoded.page_bytes,
        encoded.num_pages if num_pages is None else num_pages,
        encoded.chunk_table if table is None else table,
        encoded.data if data is None else data,
    )


def _table_edit(column: int, chunk: int, value: int):
    def edit(table: np.ndarray) -> None:
        table[chunk, column] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (_table_edit(lossless.OFFSET, 2, 0), "chunk 2: starts at byte 0"),  # overlaps chunk 0
        (_table_edit(lossless.OFFSET, 1, 10**12), "chunk 1: starts at byte"),  # past the data
        (_table_edit(lossless.FIRST_PAGE, 3, 5), "chunk 3: starts at page 5"),
        (_table_edit(lossless.NUM_PAGES, 1, 0), "chunk 1: holds 0 pages"),
        (_table_edit(lossless.NUM_PAGES, 0, 10**9), "chunk 0: holds 1000000000 pages"),
        (_table_edit(lossless.PLANES_START, 2, 7), "chunk 2: has codec"),
        (_table_edit(lossless.PLANES_START + 1, 1, 5), "chunk 1: has plane lengths"),  # raw plane
        (_table_edit(lossless.PLANES_START + 3, 0, 3 * PAGE_BYTES), "chunk 0: has plane lengths"),
        (_table_edit(lossless.PLANES_START + 3, 0, 0), "chunk 0: has plane lengths"),
    ],
)
def test_a_chunk_table_that_lies_is_refused_naming_the_chunk(edit, words):
    encoded = _encoded()
    table = encoded.chunk_table.copy()
    edit(table)
    with pytest.raises(SnapshotCorruptError, match=words) as raised:
        _decode(_with(encoded, table=table))
    assert raised.value.tensor == TENSOR


def test_chunks_that_do_not_fill_the_data_exactly_are_refused():
    encoded = _encoded()
    with pytest.raises(SnapshotCorruptError, match=r"the chunks fill .* the data holds"):
        _decode(_with(encoded, data=encoded.data[:-1]))  # a file cut short
    longer = np.concatenate([encoded.data, np.zeros(9, dtype=np.uint8)])
    with pytest.raises(SnapshotCorruptError, match="the chunks fill"):
        _decode(_with(encoded, data=longer))  # trailing bytes
    with pytest.raises(SnapshotCorruptError, match="hold 12 pages, not 13"):
        _decode(_with(encoded, num_pages=13))  # a page count that lies
    with pytest.raises(SnapshotCorruptError, match="a chunk table of"):
        _decode(_with(encoded, table=encoded.chunk_table.astype(np.int64)))
    with pytest.raises(SnapshotCorruptError, match="a chunk table of"):
        _decode(_with(encoded, table=encoded.chunk_table[:, :-1].copy()))


@pytest.mark.parametrize("position", [0, 5, 100, -1])
def test_a_corrupt_chunk_is_found_by_its_checksum_before_decoding(position):
    encoded = _encoded()
    data = encoded.data.copy()
    row = encoded.chunk_table[1]
    start = int(row[lossless.OFFSET])
    length = int(row[lossless.PLANES_START + 1 :: 2].sum())
    data[start + (position % length)] ^= 0x10
    with pytest.raises(SnapshotCorruptError, match="chunk 1: the stored bytes do not match"):
        _decode(_with(encoded, data=data))


def _forge_plane(encoded, chunk: int, frame: bytes) -> lossless.LosslessTensor:
    """``encoded`` with chunk ``chunk``'s coded plane replaced by ``frame``, its table and
    checksum rewritten to match (what a hostile writer can do): only the frame itself can be
    wrong."""
    pieces, rows = [], encoded.chunk_table.copy()
    for index, row in enumerate(encoded.chunk_table):
        offset = int(row[lossless.OFFSET])
        raw_length, coded_length = int(row[lossless.PLANES_START + 1]), int(row[-1])
        raw = encoded.data[offset : offset + raw_length].tobytes()
        coded = encoded.data[offset + raw_length : offset + raw_length + coded_length].tobytes()
        if index == chunk:
            coded = frame
            rows[index, -1] = len(frame)
            rows[index, lossless.CHECKSUM] = xxhash.xxh3_64_intdigest(raw + coded)
        pieces.append(raw + coded)
    lengths = rows[:, lossless.PLANES_START + 1 :: 2].sum(axis=1)
    rows[:, lossless.OFFSET] = np.concatenate([[0], np.cumsum(lengths[:-1])])
    data = np.frombuffer(b"".join(pieces), dtype=np.uint8).copy()
    return _with(encoded, table=rows, data=data)


def test_a_frame_declaring_more_than_its_plane_is_refused_unread():
    encoded = _encoded()
    plane_bytes = 3 * PAGE_BYTES // 2
    # A bomb: a frame declaring 1 TiB (single segment, 8-byte content size), then one run-length
    # block of 128 KiB marked last. It must be refused on its declaration, never inflated.
    magic = (0xFD2FB528).to_bytes(4, "little")
    block = (1 | 1 << 1 | (128 << 10) << 3).to_bytes(3, "little") + b"\x00"
    bomb = magic + bytes([0b11100000]) + (1 << 40).to_bytes(8, "little") + block
    assert zstandard.frame_content_size(bomb) == 1 << 40
    with pytest.raises(SnapshotCorruptError, match=f"declares {1 << 40} bytes, not {plane_bytes}"):
        _decode(_forge_plane(encoded, 2, bomb))
    # A real one: 1 MiB of zeros in a few dozen bytes.
    zeros = zstandard.ZstdCompressor(level=1).compress(bytes(1 << 20))
    with pytest.raises(SnapshotCorruptError, match=f"declares {1 << 20} bytes"):
        _decode(_forge_plane(encoded, 1, zeros))


def test_a_frame_whose_size_lies_is_refused():
    encoded = _encoded()
    plane_bytes = 3 * PAGE_BYTES // 2
    # A frame of more bytes than it declares: its content-size field patched down.
    frame = bytearray(zstandard.ZstdCompressor(level=1).compress(bytes(range(256)) * 40))
    assert frame[4] >> 6 == 1  # a 2-byte content-size field, holding size - 256
    frame[5:7] = (plane_bytes - 256).to_bytes(2, "little")
    assert zstandard.frame_content_size(bytes(frame)) == plane_bytes
    with pytest.raises(SnapshotCorruptError, match="chunk 0: a plane does not decode"):
        _decode(_forge_plane(encoded, 0, bytes(frame)))


def test_bytes_after_the_frame_and_frames_without_a_size_are_refused():
    encoded = _encoded()
    plane_bytes = 3 * PAGE_BYTES // 2
    plane = np.random.default_rng(0).integers(60, 62, plane_bytes, dtype=np.uint8).tobytes()
    frame = zstandard.ZstdCompressor(level=1).compress(plane)
    with pytest.raises(SnapshotCorruptError, match="chunk 3: a plane is not exactly one"):
        _decode(_forge_plane(encoded, 3, frame + b"junk"))
    with pytest.raises(SnapshotCorruptError, match="chunk 3: a plane is not exactly one"):
        _decode(_forge_plane(encoded, 3, frame + frame))
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(plane)
    with pytest.raises(SnapshotCorruptError, match="chunk 3: a plane's zstd frame records no"):
        _decode(_forge_plane(encoded, 3, unsized))
    with pytest.raises(SnapshotCorruptError, match="chunk 3: a plane's zstd frame header is not"):
        _decode(_forge_plane(encoded, 3, b"\x01\x02\x03\x04garbage!"))
    # The untouched frame decodes: the forging itself is sound.
    _decode(_forge_plane(encoded, 3, frame))


def test_frame_length_reads_the_block_headers():
    for size in (0, 1, 1000, 300_000):
        frame = zstandard.ZstdCompressor(level=1).compress(bytes(size))
        assert lossless.frame_length(np.frombuffer(frame, dtype=np.uint8)) == len(frame)
        checked = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(bytes(size))
        assert lossless.frame_length(np.frombuffer(checked, dtype=np.uint8)) == len(checked)
    with pytest.raises(zstandard.ZstdError):
        lossless.frame_length(np.frombuffer(frame[:-3], dtype=np.uint8))


def _wide_pages() -> np.ndarray:
    """Six pages of 256 KiB of bf16-like words: planes of 384 KiB, three pages a chunk."""
    rng = np.random.default_rng(11)
    words = (0x3C00 + rng.integers(0, 0x400, 6 * (128 << 10))).astype("<u2")
    return words.view(np.uint8).reshape(6, 256 << 10)


def test_a_frame_too_short_to_hold_its_plane_is_refused_before_any_decoding():
    # The audit's case: a table declaring large pages behind frames of a few bytes that record
    # the right size. 17 bytes hold one block, at most 128 KiB: not a plane of 384 KiB.
    encoded = lossless.encode_pages(_wide_pages(), 2, chunk_bytes=768 << 10)
    assert encoded is not None and len(encoded.chunk_table) == 2
    plane_bytes = 3 * (128 << 10)
    tiny = run_length_frame(plane_bytes)
    assert len(tiny) == 17 and zstandard.frame_content_size(tiny) == plane_bytes
    forged = _forge_plane(encoded, 1, tiny)
    words = f"chunk 1: a plane of {plane_bytes} bytes cannot come out of a 17-byte zstd frame"
    with pytest.raises(SnapshotCorruptError, match=words):
        lossless.chunk_decoders(forged, np.empty((6, 256 << 10), dtype=np.uint8))
    # Three blocks can hold it: that frame passes the check, and decodes (to zeros, which the
    # checksums of the file's pages refuse later).
    enough = run_length_frame(plane_bytes, blocks=3)
    out = np.empty((6, 256 << 10), dtype=np.uint8)
    lossless.decode_pages(_forge_plane(encoded, 1, enough), out)
    assert not out[3:, 1::2].any()  # every word's high byte: the plane replaced


def test_a_bomb_whose_size_field_lies_is_refused_without_producing_more():
    # A real frame of 64 MiB of zeros (about 2 KiB), its content size patched to the plane's:
    # the headers agree with the table, and the decode into a buffer of the plane's size stops
    # at the first block that does not fit (zstd sizes its own buffer by the declared size).
    encoded = _encoded()
    plane_bytes = 3 * PAGE_BYTES // 2
    bomb = bytearray(zstandard.ZstdCompressor(level=1).compress(bytes(64 << 20)))
    assert len(bomb) < plane_bytes
    size_at = zstandard.frame_header_size(bytes(bomb)) - 4  # a 4-byte size field, last
    bomb[size_at : size_at + 4] = plane_bytes.to_bytes(4, "little")
    assert zstandard.frame_content_size(bytes(bomb)) == plane_bytes
    with pytest.raises(SnapshotCorruptError, match="chunk 2: a plane does not decode"):
        _decode(_forge_plane(encoded, 2, bytes(bomb)))


def test_pages_larger_than_a_chunk_are_stored_raw_and_refused_in_a_table():
    page_bytes = lossless_table.MAX_CHUNK_BYTES + 2
    assert lossless.encode_pages(np.zeros((1, page_bytes), dtype=np.uint8), 2) is None
    table = np.array([[0, 1, 0, 0, 1, 100, 1, 100]], dtype=np.uint64)
    with pytest.raises(SnapshotCorruptError, match=f"pages of {page_bytes} bytes, more than"):
        lossless_table.check_chunk_table(
            table, word_bytes=2, page_bytes=page_bytes, num_pages=1, stored_bytes=200
        )
