"""What a reader checks as it opens its files: the decoded-header cache, a damaged format
version told from a newer format, each shard against its index, a parted index refused (a
reader opens one file or a sharded snapshot; ``Snapshot.open`` opens the parts), the names
of the metadata tensors it loads, and a single file's trailer digest."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from kvsnap import format as fmt
from kvsnap.caches import BoundedLRU, register_cache_clear
from kvsnap.errors import (
    KVSnapError,
    NotASnapshotError,
    SnapshotCorruptError,
    UnsupportedVersionError,
)
from kvsnap.store.files.location import Location
from kvsnap.store.files.resolve import Resolved
from kvsnap.store.read.source import OpenFile, Source

#: Largest checksum trailer read to tell a damaged format version from a newer format.
_MAX_TRAILER_PROBE_BYTES = 16 << 20


#: Headers decoded lately, by their bytes' xxh3-128 and the file size: an engine opening the same
#: snapshots again and again skips the JSON parse and schema validation. Only headers that
#: passed every check are kept, and any change to a header's bytes misses the cache.
_HEADER_CACHE: BoundedLRU[tuple[bytes, int], tuple[fmt.DecodedHeader, fmt.FileLayout]]
_HEADER_CACHE = BoundedLRU(64)


def decoded_header(source: Source, header_bytes: bytes) -> tuple[fmt.DecodedHeader, fmt.FileLayout]:
    """The checked header and file layout of ``source`` (whose first bytes are
    ``header_bytes``); see :func:`kvsnap.format.decode_header`."""
    key = (fmt.digest128(header_bytes), source.size)
    cached = _HEADER_CACHE.get(key)
    if cached is not None:
        return cached
    try:
        # A header kvsnap wrote is the packing of its own metadata: one comparison of bytes;
        # anything else (a shard, a damaged or foreign header) is decoded entry by entry.
        canonical = fmt.canonical_header(header_bytes, source.size, file=source.url)
        if canonical is None:
            header = fmt.decode_header(header_bytes, source.size, file=source.url)
    except UnsupportedVersionError as error:
        raise _version_or_damage(source, header_bytes, error) from None
    if canonical is None:
        layout, _, _ = fmt.expected_layout(header, file=source.url, header=header_bytes)
        if layout.header != header_bytes:
            raise SnapshotCorruptError(
                "header bytes differ from the format's encoding", file=source.url
            )
        canonical = (header, layout)
    _HEADER_CACHE.put(key, canonical)
    return canonical


def _version_or_damage(
    source: Source, header: bytes, error: UnsupportedVersionError
) -> KVSnapError:
    """``error`` for a header that is intact by its checksum trailer (a newer format, really),
    a :class:`SnapshotCorruptError` for one whose intact trailer disagrees with it (a damaged
    byte in ``format_version``), ``error`` again when the trailer cannot tell."""
    where = fmt.locate_trailer(header)
    if where is None or where[1] != source.size or where[1] - where[0] > _MAX_TRAILER_PROBE_BYTES:
        return error
    try:
        digests = fmt.decode_trailer(source.read(where[0], where[1] - where[0]))
    except KVSnapError:
        return error
    if digests[0] == fmt.digest128(header):
        return error
    return SnapshotCorruptError(
        f"format_version reads {error.version!r}, but the header does not match its checksum "
        "(trailer row 0): a damaged header, not a newer format",
        file=source.url,
    )


def check_shard(
    index: fmt.ShardIndex,
    number: int,
    location: Location,
    header: fmt.DecodedHeader,
    layout: fmt.FileLayout,
    specs: Sequence[fmt.TensorSpec],
    position: int,
) -> int:
    """Check that the file at ``location`` (its ``header`` and ``layout``) is shard ``number``
    of ``index``: its number, its metadata the index's, and the tensors the index assigns it,
    which start at ``specs[position]``. Returns the position of the next shard's first."""
    count = len(index.files)
    if header.metadata.shard != (number, count):
        raise SnapshotCorruptError(
            f"claims to be shard {header.metadata.shard}, "
            f"the index lists it as {number} of {count}",
            file=location.url,
        )
    if header.metadata.unsharded_document() != index.metadata.document:
        raise SnapshotCorruptError("metadata differs from the index's", file=location.url)
    held = [entry.name for entry in layout.layer_entries]
    expected = [spec.name for spec in specs[position : position + len(held)]]
    if held != expected or any(index.weight_map[name] != location.name for name in held):
        raise SnapshotCorruptError(
            "holds other tensors than the index assigns it", file=location.url
        )
    return position + len(held)


def parted_index_refused(resolved: Resolved) -> NotASnapshotError:
    """What a reader raises when asked to open a parted snapshot's index."""
    assert resolved.index_location is not None
    return NotASnapshotError(
        "is the index of a parted snapshot (one file per head range): open it with "
        "kvsnap.Snapshot.open, or open one part file",
        file=resolved.index_location.url,
    )


def trailer_digest(open_files: Sequence[OpenFile]) -> str:
    """xxh3-128 (32 hex digits) of a single-file snapshot's checksum trailer, read from the
    file."""
    if len(open_files) != 1:
        raise ValueError("trailer_digest is defined for a single-file snapshot")
    open_file = open_files[0]
    entry = open_file.layout.by_name[fmt.CHECKSUMS_TENSOR]
    raw = open_file.source.read(entry.begin, entry.nbytes, tensor=fmt.CHECKSUMS_TENSOR)
    return xxhash.xxh3_128_hexdigest(raw)


def loaded_metadata(
    header: fmt.HeaderMetadata, read_checked: Callable[[str], bytes], url: str
) -> fmt.SnapshotMetadata:
    """``header`` (the metadata a header holds) completed with its metadata tensors (every
    sequence's token and block ids, the block hashes), each read with ``read_checked``."""
    tensors: dict[str, np.ndarray] = {}
    for name in metadata_names(len(header.sequences)):
        raw = read_checked(name)
        dtype = np.dtype("<i8") if name.startswith("sequences.") else np.dtype(np.uint8)
        array = np.frombuffer(raw, dtype=dtype)
        tensors[name] = (
            array.reshape(-1, fmt.DIGEST_BYTES) if name == fmt.BLOCK_HASHES_TENSOR else array
        )
    return header.with_tensors(tensors, file=url)


@functools.lru_cache(maxsize=16)
def metadata_names(sequences: int) -> tuple[str, ...]:
    """The metadata tensors of a snapshot of ``sequences`` sequences, in file order."""
    parts = ("token_ids", "block_ids")
    per_sequence = [f"sequences.{index}.{part}" for index in range(sequences) for part in parts]
    return (*per_sequence, fmt.BLOCK_HASHES_TENSOR)


register_cache_clear(metadata_names.cache_clear)
