"""The decoded side of an encoded snapshot: an ordinary single-file snapshot held in memory, its
layout, its check, and what the encoders need from it (pages, tokens held per block)."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvsnap import format as fmt
from kvsnap.errors import SnapshotCorruptError, SnapshotIOError
from kvsnap.format.container import FileLayout, TensorEntry, is_layer_tensor
from kvsnap.format.encoded import ORIGINAL_HEADER_TENSOR
from kvsnap.format.hashing import (
    block_digests,
    decode_trailer,
    digest128,
    layer_tensor_digest,
)

#: numpy dtypes of the safetensors names a layer tensor may have.
NUMPY_TYPES = {
    "BF16": np.uint16,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "F8_E4M3": np.uint8,
    "F8_E5M2": np.uint8,
    "I8": np.int8,
    "U8": np.uint8,
}


@dataclass(frozen=True)
class OriginalFile:
    """An ordinary snapshot file's bytes (``data``, ``uint8``) and its checked layout."""

    data: np.ndarray
    layout: FileLayout
    metadata: fmt.HeaderMetadata
    file: str | None

    def bytes_of(self, entry: TensorEntry) -> np.ndarray:
        return self.data[entry.begin : entry.end]

    def pages(self, entry: TensorEntry) -> np.ndarray:
        """A layer tensor's bytes as ``(num_blocks, page_bytes)``."""
        blocks = entry.shape[0]
        return self.bytes_of(entry).reshape(blocks, entry.nbytes // max(blocks, 1))

    @property
    def layer_entries(self) -> list[TensorEntry]:
        return [entry for entry in self.layout.entries if is_layer_tensor(entry.name)]

    def tokens_per_block(self) -> np.ndarray:
        """How many leading tokens of each block hold KV (:func:`tokens_per_block`)."""
        sequences = self.metadata.sequences
        entries = [self.layout.by_name[f"sequences.{i}.block_ids"] for i in range(len(sequences))]
        held = [
            (sequence.num_tokens, self.bytes_of(entry).view("<i8"))
            for sequence, entry in zip(sequences, entries, strict=True)
        ]
        return tokens_per_block(self.metadata.geometry.block_size, self.metadata.num_blocks, held)


def tokens_per_block(
    block_size: int, num_blocks: int, sequences: Iterable[tuple[int, np.ndarray]]
) -> np.ndarray:
    """How many leading tokens of each of ``num_blocks`` snapshot blocks hold KV, given each
    sequence's token count and snapshot block ids: the longest use of a block by a sequence
    (0 for a block no sequence uses)."""
    counts = np.zeros(num_blocks, dtype=np.int64)
    for num_tokens, block_ids in sequences:
        held = np.minimum(block_size, num_tokens - block_size * np.arange(len(block_ids)))
        np.maximum.at(counts, block_ids, held)
    return counts


def parse_original(data: np.ndarray, file: str | None = None) -> OriginalFile:
    """An ordinary snapshot file held in ``data``: its header decoded as the format requires.
    Sharded and parted files are refused: an encoded snapshot is one whole file."""
    length = fmt.header_length(data[:8].tobytes(), len(data), file)
    header = data[: 8 + length].tobytes()
    decoded = fmt.decode_header(header, len(data), file)
    if decoded.metadata.shard is not None or decoded.metadata.part is not None:
        raise ValueError(f"{file}: a shard or part file cannot be encoded alone")
    layout = FileLayout(header, decoded.entries, decoded.kvsnap_json)
    return OriginalFile(data, layout, decoded.metadata, file)


def described_file(header: bytes, decoded_bytes: int, file: str | None) -> fmt.DecodedHeader:
    """The decoded file's ``header`` (an encoded file's ``kvsnap.original_header``) checked as
    the format checks any file's header, for a file of the encoding's ``decoded_bytes``, and
    refused when it is a shard's or a part's (``SnapshotCorruptError`` naming the encoded
    ``file``): nothing sized by ``decoded_bytes`` need exist before it passes."""
    try:
        described = fmt.decode_header(header, decoded_bytes, file)
    except SnapshotCorruptError as error:
        raise SnapshotCorruptError(
            f"{ORIGINAL_HEADER_TENSOR} does not describe a file of decoded_bytes = {decoded_bytes} "
            f"bytes: {error.detail}",
            file=file,
            tensor=error.tensor,
            block=error.block,
        ) from None
    if described.metadata.shard is not None or described.metadata.part is not None:
        raise SnapshotCorruptError("holds a shard or part file", file=file)
    return described


def trailer_digests(original: OriginalFile, block_checksums: np.ndarray) -> list[bytes]:
    """The trailer rows of ``original`` (header row first) with ``block_checksums`` as the
    layer tensors' checksums."""
    digests = [digest128(original.layout.header)]
    layer_row = 0
    for entry in original.layout.checksummed():
        if is_layer_tensor(entry.name):
            digests.append(layer_tensor_digest(block_checksums[layer_row]))
            layer_row += 1
        else:
            digests.append(digest128(original.bytes_of(entry)))
    return digests


def stored_block_checksums(original: OriginalFile) -> np.ndarray:
    """The page checksums ``original`` stores, ``(layer tensors, blocks)`` ``<u8``."""
    stored = original.bytes_of(original.layout.by_name[fmt.BLOCK_CHECKSUMS_TENSOR]).view("<u8")
    return stored.reshape(len(original.layer_entries), -1)


def check_layer_pages(
    original: OriginalFile, entry: TensorEntry, first: int, pages: np.ndarray, stored: np.ndarray
) -> None:
    """Refuse (``SnapshotCorruptError`` naming the block) pages ``first ..`` of the layer tensor
    ``entry`` (their bytes ``pages``) whose xxh3-64 is not ``stored``'s, its stored checksums."""
    page_bytes = entry.nbytes // max(entry.shape[0], 1)
    digests = block_digests(pages, page_bytes)
    differ = np.flatnonzero(digests != stored[first : first + len(digests)])
    if len(differ):
        raise SnapshotCorruptError(
            "page checksum mismatch",
            file=original.file,
            tensor=entry.name,
            block=first + int(differ[0]),
        )


def check_trailer(original: OriginalFile, stored: np.ndarray) -> None:
    """Refuse a file whose trailer does not match its tensors (its layer tensors by their
    stored page checksums ``stored``, checked against the pages elsewhere) or whose padding
    is not zero."""
    trailer = original.bytes_of(original.layout.by_name[fmt.CHECKSUMS_TENSOR]).tobytes()
    rows = decode_trailer(trailer, original.file)
    if rows != trailer_digests(original, stored):
        raise SnapshotCorruptError("checksum trailer mismatch", file=original.file)
    for entry in original.layout.entries:
        if entry.name.startswith(fmt.PADDING_PREFIX) and original.bytes_of(entry).any():
            raise SnapshotCorruptError("padding is not zero", file=original.file, tensor=entry.name)


def check_original(original: OriginalFile) -> None:
    """Refuse (``SnapshotCorruptError``) a file whose pages, tensors or trailer do not match
    its checksums: nothing corrupt is encoded, and a lossless decode is checked this way."""
    stored = stored_block_checksums(original)
    for row, entry in enumerate(original.layer_entries):
        check_layer_pages(original, entry, 0, original.bytes_of(entry), stored[row])
    check_trailer(original, stored)


def read_local(path: str | os.PathLike[str]) -> np.ndarray:
    """A local file's bytes (``SnapshotIOError`` when it cannot be read), in anonymous memory
    that starts on a page boundary (so that CUDA can register it for copies straight out of
    it: an fp8 restore into CUDA caches)."""
    try:
        with open(os.fspath(path), "rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            buffer = mmap.mmap(-1, max(size, 1))
            view = memoryview(buffer)[:size]
            got = stream.readinto(view)
            view.release()
    except OSError as exc:
        raise SnapshotIOError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    if got != size:
        raise SnapshotIOError(f"{path}: read {got} of {size} bytes (changed while read)")
    return np.frombuffer(buffer, dtype=np.uint8, count=size)
