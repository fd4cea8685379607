"""What a reader checks as it opens one file: the decoded-header cache, and a damaged format
version told from a newer format."""

from __future__ import annotations

from kvsnap import format as fmt
from kvsnap.caches import BoundedLRU
from kvsnap.errors import KVSnapError, SnapshotCorruptError, UnsupportedVersionError
from kvsnap.store.read.source import Source

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
