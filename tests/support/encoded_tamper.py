"""Encoded snapshot files rewritten by someone who can write them and recompute every checksum
but holds no key: one field is wrong, the container around it (header, offsets, padding,
trailer) consistent, so that the check of that field, not the trailer, is what refuses the
file. Rebuilt with kvsnap's own container code (kvsnap/format/encoded.py,
kvsnap/encoded/write.py), as a careless or hostile writer using kvsnap would. A lossless
plane's zstd frame can be swapped (:func:`set_plane`), or the whole file made to claim larger
pages behind frames of one's choosing (:func:`set_decoded_layout`, :func:`lying_plane_frames`)."""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
import zstandard

from kvsnap import format as fmt
from kvsnap.encoded.write import container_pieces, container_specs
from kvsnap.encoding import lossless
from kvsnap.format import encoded as enc
from kvsnap.format.constants import SIGNATURE_TENSOR
from kvsnap.format.metadata import SnapshotMetadata


@dataclass
class StoredParts:
    """An encoded file's kvsnap document and its tensors but padding, the trailer and the
    signature (kept apart, unchecked by a reader without keys), in file order."""

    document: dict[str, Any]
    tensors: list[tuple[str, str, tuple[int, ...], np.ndarray]]
    signature: np.ndarray | None

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name``'s bytes (a view: change them in place)."""
        return next(data for stored, _, _, data in self.tensors if stored == name)

    def replace(self, name: str, dtype: str, shape: tuple[int, ...], data: np.ndarray) -> None:
        """Store ``data`` as tensor ``name`` of ``dtype`` and ``shape`` instead."""
        index = next(i for i, (stored, *_) in enumerate(self.tensors) if stored == name)
        self.tensors[index] = (name, dtype, shape, np.ascontiguousarray(data).view(np.uint8))


def stored_parts(path: Path) -> StoredParts:
    data = np.fromfile(path, dtype=np.uint8)
    length = enc.header_length(data[:8].tobytes(), len(data))
    layout = enc.parse_header(data[: 8 + length].tobytes(), len(data))
    tensors = [(t.name, t.dtype, t.shape, data[t.begin : t.end].copy()) for t in layout.checksummed]
    signature = layout.by_name.get(SIGNATURE_TENSOR)
    held = None if signature is None else data[signature.begin : signature.end].copy()
    return StoredParts(json.loads(json.dumps(layout.document)), tensors, held)


def write_parts(parts: StoredParts, path: Path) -> Path:
    """The encoded file of ``parts`` at ``path``: laid out, padded and checksummed as kvsnap
    lays out any encoded file; a signature kept as it was (now stale)."""
    specs = container_specs([(name, dtype, shape) for name, dtype, shape, _ in parts.tensors], None)
    data: dict[str, bytes | np.ndarray | None] = {name: a for name, _, _, a in parts.tensors}
    if parts.signature is not None:
        specs.append((SIGNATURE_TENSOR, "U8", (len(parts.signature),)))
        data[SIGNATURE_TENSOR] = parts.signature
    header, layout = enc.build_layout(parts.document, specs)
    with open(path, "wb") as stream:
        stream.write(header)
        for _, piece in container_pieces(header, layout, data, None):
            assert piece is not None
            stream.write(piece if isinstance(piece, bytes) else piece.tobytes())
    return path


def original_header(parts: StoredParts) -> tuple[dict[str, Any], dict[str, Any], int]:
    """The decoded file's header kept in ``parts``: its entries (``__metadata__`` included),
    its kvsnap metadata, and its JSON's length (the bytes between the prefix and the data)."""
    raw = parts.array(enc.ORIGINAL_HEADER_TENSOR).tobytes()
    (length,) = struct.unpack("<Q", raw[:8])
    entries = json.loads(raw[8 : 8 + length])
    return entries, json.loads(entries["__metadata__"]["kvsnap"]), length


def set_original_metadata(parts: StoredParts, metadata: dict[str, Any]) -> None:
    """Put ``metadata`` in the decoded file's header kept in ``parts``, at the same length
    (the header's space padding takes the difference)."""
    entries, _, length = original_header(parts)
    entries["__metadata__"]["kvsnap"] = json.dumps(metadata, separators=(",", ":"))
    text = json.dumps(entries, separators=(",", ":")).encode()
    assert len(text) <= length, "the new metadata does not fit the header's padding"
    raw = struct.pack("<Q", length) + text + b" " * (length - len(text))
    parts.array(enc.ORIGINAL_HEADER_TENSOR)[:] = np.frombuffer(raw, dtype=np.uint8)


def chunk_table(parts: StoredParts, name: str) -> np.ndarray:
    """The chunk table of lossless layer tensor ``name`` (a view: change it in place)."""
    chunks = name + enc.CHUNKS_SUFFIX
    shape = next(shape for stored, _, shape, _ in parts.tensors if stored == chunks)
    return parts.array(chunks).view("<u8").reshape(shape)


def coded_plane(parts: StoredParts, name: str, chunk: int, plane: int) -> tuple[bytes, int]:
    """The stored bytes of plane ``plane`` of chunk ``chunk`` of lossless layer tensor ``name``
    (its zstd frame when coded), and the size in bytes it decodes to (one byte a word)."""
    row = chunk_table(parts, name)[chunk].tolist()
    lengths = row[lossless.PLANES_START + 1 :: 2]
    start = row[lossless.OFFSET] + sum(lengths[:plane])
    entries, _, _ = original_header(parts)
    words_per_page = math.prod(entries[name]["shape"][1:])
    stored = parts.array(name)[start : start + lengths[plane]].tobytes()
    return stored, row[lossless.NUM_PAGES] * words_per_page


def set_plane(parts: StoredParts, name: str, chunk: int, plane: int, frame: bytes) -> None:
    """Store ``frame`` as plane ``plane`` (zstd-coded) of chunk ``chunk`` of lossless layer
    tensor ``name``: the table's codec, lengths and offsets and the chunk's xxh3-64 rewritten
    to match, as a writer would, so that only the frame can be wrong."""
    table = chunk_table(parts, name).copy()
    stored = parts.array(name)
    lengths = table[:, lossless.PLANES_START + 1 :: 2]
    pieces = []
    for index, row in enumerate(table.tolist()):
        start = row[lossless.OFFSET]
        planes = []
        for length in row[lossless.PLANES_START + 1 :: 2]:
            planes.append(stored[start : start + length].tobytes())
            start += length
        if index == chunk:
            planes[plane] = frame
            table[index, lossless.PLANES_START + 2 * plane] = lossless.CODEC_ZSTD
            lengths[index, plane] = len(frame)
            table[index, lossless.CHECKSUM] = xxhash.xxh3_64_intdigest(b"".join(planes))
        pieces.append(b"".join(planes))
    ends = np.cumsum(lengths.sum(axis=1))
    table[:, lossless.OFFSET] = np.concatenate([[0], ends[:-1]])
    data = np.frombuffer(b"".join(pieces), dtype=np.uint8)
    parts.replace(name, "U8", (len(data),), data)
    parts.replace(name + enc.CHUNKS_SUFFIX, "U64", table.shape, table.astype("<u8"))


def set_decoded_layout(
    parts: StoredParts, metadata: SnapshotMetadata, plane_frame: Callable[[int], bytes]
) -> int:
    """``parts`` (a lossless file of bf16 KV) made the encoded file of a decoded file laid out
    for ``metadata`` (another geometry: larger pages, say): its header kept, ``decoded_bytes``
    its size, every lossless layer tensor one chunk per page whose planes are each
    ``plane_frame(plane bytes)``, checksummed. The tensors that are not layer tensors keep
    their bytes (their shapes follow the block count, kept). Returns ``decoded_bytes``."""
    (layout,) = fmt.file_layouts(metadata)
    header = np.frombuffer(layout.header, dtype=np.uint8)
    parts.replace(enc.ORIGINAL_HEADER_TENSOR, "U8", (len(header),), header)
    parts.document["encoding"]["decoded_bytes"] = layout.file_size
    for entry in layout.entries:
        if parts.document["encoding"]["tensors"].get(entry.name) != "lossless":
            continue
        assert entry.dtype == "BF16", entry.dtype
        blocks = entry.shape[0]
        frame = plane_frame(entry.nbytes // blocks // 2)
        chunk = frame + frame
        table = np.zeros((blocks, lossless.columns(2)), dtype="<u8")
        table[:, lossless.FIRST_PAGE] = np.arange(blocks)
        table[:, lossless.NUM_PAGES] = 1
        table[:, lossless.OFFSET] = np.arange(blocks) * len(chunk)
        table[:, lossless.CHECKSUM] = xxhash.xxh3_64_intdigest(chunk)
        table[:, lossless.PLANES_START :: 2] = lossless.CODEC_ZSTD
        table[:, lossless.PLANES_START + 1 :: 2] = len(frame)
        data = np.frombuffer(chunk * blocks, dtype=np.uint8)
        parts.replace(entry.name, "U8", (len(data),), data)
        parts.replace(entry.name + enc.CHUNKS_SUFFIX, "U64", table.shape, table)
    return layout.file_size


def run_length_frame(declared: int, blocks: int = 1, block_bytes: int = 128 << 10) -> bytes:
    """A zstd frame (RFC 8878) recording a content size of ``declared`` (single segment, an
    8-byte size field), then ``blocks`` run-length blocks of ``block_bytes`` zeros, the last
    marked last: a few bytes that claim anything, or a bomb whose size field lies."""
    magic = (0xFD2FB528).to_bytes(4, "little")
    header = magic + bytes([0b11100000]) + declared.to_bytes(8, "little")
    block = ((1 << 1) | (block_bytes << 3)).to_bytes(3, "little") + b"\x00"
    last = (1 | (1 << 1) | (block_bytes << 3)).to_bytes(3, "little") + b"\x00"
    return header + block * (blocks - 1) + last


def with_larger_pages(metadata: SnapshotMetadata, factor: int) -> SnapshotMetadata:
    """``metadata`` with heads ``factor`` times wider: pages ``factor`` times larger, the block
    count and every other tensor's shape kept."""
    geometry = dataclasses.replace(metadata.geometry, head_dim=metadata.geometry.head_dim * factor)
    return dataclasses.replace(metadata, geometry=geometry)


def lying_plane_frames() -> dict[str, Callable[[int], bytes]]:
    """For :func:`set_decoded_layout`, by case, the zstd frame that stands for a plane of a
    given size: each but ``zeros`` lies about it (17 bytes claiming it all, a claim of 2**40,
    no size recorded, 2 KiB less, 64 MiB of zeros); ``zeros`` is a real frame of that many
    zero bytes (a run-length block per 128 KiB: 4 bytes for each)."""
    compressor = zstandard.ZstdCompressor(level=1)
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False)
    return {
        "tiny-frames": run_length_frame,
        "frames-claim-2**40": lambda size: run_length_frame(1 << 40),
        "frames-without-size": lambda size: unsized.compress(bytes(size)),
        "frames-of-another-size": lambda size: compressor.compress(bytes(size - 2048)),
        "bombs": lambda size: compressor.compress(bytes(64 << 20)),
        "zeros": lambda size: compressor.compress(bytes(size)),
    }
