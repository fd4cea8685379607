"""The zstd frames of a lossless tensor's coded planes (:mod:`kvsnap.encoding.lossless`), checked
from their headers before anything is allocated or decoded, and measured block by block.

A coded plane is one zstd frame (RFC 8878) that records its content size, and that size must be
the plane's. Its length must also leave room for that much: every block that decodes to
anything takes at least 4 bytes (a 3-byte header and at least one byte: a run-length block's
byte) and decodes to at most ``min(window, 128 KiB)``. So a frame of ``L`` bytes after its
header holds at most ``L // 4`` such blocks, and a decoded tensor is at most 32768 times its
coded bytes (plus its raw planes): a chunk table cannot claim pages that its frames could not
fill. :func:`check_frames` checks this for every coded plane of a tensor, in microseconds per
plane (zstd reads the headers), and decodes nothing: a hostile file is refused before the
decoded file it claims is allocated.
"""

from __future__ import annotations

import numpy as np

from kvsnap.encoding.lossless_table import CODEC_ZSTD, NUM_PAGES, OFFSET, PLANES_START, corrupt

try:
    import zstandard
except ImportError:  # pragma: no cover - a base dependency; absent only in foreign images
    zstandard = None  # type: ignore[assignment]

#: The most a zstd block decodes to (RFC 8878, Block_Maximum_Size: also at most the window).
BLOCK_MAX_BYTES = 128 << 10
#: The fewest bytes of a block that decodes to anything: its 3-byte header and one byte.
BLOCK_MIN_BYTES = 4


def check_frames(
    table: np.ndarray, data: np.ndarray, *, word_bytes: int, page_bytes: int, tensor: str | None
) -> None:
    """Refuse (``SnapshotCorruptError`` naming ``tensor`` and the chunk) a coded plane of the
    tensor stored as ``data`` (its chunks) under the checked chunk ``table`` whose zstd frame
    header is malformed, records no content size or another size than the plane's, or whose
    frame is too short to hold that many bytes (see the module). Reads frame headers only."""
    if zstandard is None:
        raise RuntimeError("lossless snapshots need the zstandard package: pip install zstandard")
    held = data.data
    plane_unit = page_bytes // word_bytes
    for chunk, row in enumerate(table.tolist()):
        position = row[OFFSET]
        plane_bytes = row[NUM_PAGES] * plane_unit
        for codec, length in zip(row[PLANES_START::2], row[PLANES_START + 1 :: 2], strict=True):
            if codec == CODEC_ZSTD:
                _check_frame(held[position : position + length], plane_bytes, tensor, chunk)
            position += length


def _check_frame(frame: memoryview, plane_bytes: int, tensor: str | None, chunk: int) -> None:
    try:
        header_bytes = zstandard.frame_header_size(frame)
        parameters = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError as error:
        problem = f"a plane's zstd frame header is not readable ({error})"
        raise corrupt(problem, tensor, chunk) from None
    declared = parameters.content_size
    if declared == zstandard.CONTENTSIZE_UNKNOWN:
        raise corrupt("a plane's zstd frame records no content size", tensor, chunk)
    if declared != plane_bytes:
        raise corrupt(f"a plane declares {declared} bytes, not {plane_bytes}", tensor, chunk)
    block_bytes = max(1, min(parameters.window_size, BLOCK_MAX_BYTES))
    blocks = (len(frame) - header_bytes) // BLOCK_MIN_BYTES
    if blocks * block_bytes < plane_bytes:
        raise corrupt(
            f"a plane of {plane_bytes} bytes cannot come out of a {len(frame)}-byte zstd frame "
            f"(at most {blocks * block_bytes} bytes)",
            tensor,
            chunk,
        )


def frame_length(frame: np.ndarray) -> int:
    """The length of the zstd frame starting ``frame`` (RFC 8878: its header, then blocks of a
    3-byte header each until the last, then a 4-byte checksum when the header says so).
    Raises ``zstandard.ZstdError`` when the bytes end first. Time grows with the blocks (about
    0.3 us each, a frame of empty 3-byte blocks included: about 0.1 s per MB of them)."""
    held = frame.data  # memoryview slices, not numpy ones: half the time a block
    position = zstandard.frame_header_size(held)
    has_checksum = bool(frame[4] & 0x04)
    while True:
        if position + 3 > len(held):
            raise zstandard.ZstdError("the frame ends inside a block header")
        header = int.from_bytes(held[position : position + 3], "little")
        last, kind, size = header & 1, (header >> 1) & 3, header >> 3
        position += 3 + (1 if kind == 1 else size)
        if kind == 3:
            raise zstandard.ZstdError("a reserved block type")
        if last:
            return position + (4 if has_checksum else 0)
