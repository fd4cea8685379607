"""A signed ordinary snapshot as the source of an encoded one.

The decoded file of an encoded snapshot is unsigned: the encoded file carries its own signature
(``encoded-hmac-sha256-blake3[-pages]``), which covers the decoded file's header and tensors
(docs/format.md, "Encoded snapshots"). A direct encoded capture makes that unsigned file from
the caches (:mod:`kvsnap.encoded.capture`); an encode of a signed file checks the file's
signature with the caller's keys and encodes the unsigned file it stands for, which
:func:`encodable` gives: the same header (its ``signature`` left out), the same tensors but the
page digests and the signature, its trailer computed for that header.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvsnap import format as fmt
from kvsnap.encoded.original import (
    OriginalFile,
    parse_original,
    stored_block_checksums,
    trailer_digests,
)
from kvsnap.errors import BadSignatureError, SnapshotCorruptError
from kvsnap.format.signing import KeyRing

#: Why a page of a signed file is refused: what a restore of the file says of it.
_DIGEST_MISMATCH = "BLAKE3 digest does not match the signed page digest (changed after signing)"


def encodable(original: OriginalFile, keys: KeyRing | None) -> OriginalFile:
    """``original`` (checked against its checksums already) as an encoded file holds it: as
    it is when unsigned; signed, its signature checked with ``keys`` (``ValueError`` without
    them, :class:`~kvsnap.errors.BadSignatureError` or
    :class:`~kvsnap.errors.SnapshotCorruptError` when it does not verify) and the unsigned
    file it stands for returned."""
    if original.metadata.signature is None:
        return original
    if keys is None:
        raise unkeyed(original.file)
    check_original_signature(original, keys)
    return unsigned_file(original)


def unkeyed(file: str | None) -> ValueError:
    """The refusal of a signed snapshot ``file`` to encode without its keys: the encoded file
    would not be signed."""
    return ValueError(
        f"{file or 'the snapshot'} is signed: encode it with its key (--key-file, or keys=), "
        "which checks its signature and signs the encoded file"
    )


def check_original_signature(original: OriginalFile, keys: KeyRing) -> None:
    """Refuse a signed ``original`` that ``keys`` do not vouch for: a signature of another key
    or over other bytes, or (``hmac-sha256-blake3``) a page whose BLAKE3 differs from the
    signed page digest."""
    algorithm = original.metadata.signature
    assert algorithm is not None
    layout = original.layout
    signed = [original.bytes_of(entry) for entry in fmt.signed_entries(layout, algorithm)]
    signature = original.bytes_of(layout.by_name[fmt.SIGNATURE_TENSOR]).tobytes()
    problem = keys.problem([layout.header, *signed], signature, algorithm)
    if problem is not None:
        raise BadSignatureError(f"bad signature: {problem}", file=original.file)
    if algorithm != fmt.SIGNATURE_ALGORITHM:
        return  # an older file: its pages are bound by the signed xxh3-64 checksums only
    entries = original.layer_entries
    digests = original.bytes_of(layout.by_name[fmt.PAGE_DIGESTS_TENSOR])
    digests = digests.reshape(len(entries), -1, fmt.PAGE_DIGEST_BYTES)
    for row, entry in enumerate(entries):
        page_bytes = entry.nbytes // max(entry.shape[0], 1)
        failed = fmt.page_digest_failures(original.bytes_of(entry), page_bytes, digests[row])
        if len(failed):
            raise SnapshotCorruptError(
                _DIGEST_MISMATCH, file=original.file, tensor=entry.name, block=int(failed[0])
            )


def unsigned_file(original: OriginalFile) -> OriginalFile:
    """The unsigned ordinary file of the signed ``original``, in memory: what a capture of the
    same KV without keys writes."""
    metadata = original.metadata.with_tensors(_metadata_tensors(original), file=original.file)
    (layout,) = fmt.file_layouts(dataclasses.replace(metadata, signature=None))
    data = np.zeros(layout.file_size, dtype=np.uint8)
    data[: layout.data_start] = np.frombuffer(layout.header, dtype=np.uint8)
    unsigned = parse_original(data, original.file)
    source = original.layout.by_name
    for entry in layout.entries:
        if entry.name != fmt.CHECKSUMS_TENSOR and not entry.name.startswith(fmt.PADDING_PREFIX):
            unsigned.bytes_of(entry)[:] = original.bytes_of(source[entry.name])
    trailer = fmt.encode_trailer(trailer_digests(unsigned, stored_block_checksums(unsigned)))
    unsigned.bytes_of(layout.by_name[fmt.CHECKSUMS_TENSOR])[:] = np.frombuffer(trailer, np.uint8)
    return unsigned


def _metadata_tensors(original: OriginalFile) -> dict[str, np.ndarray]:
    """The sequences' token and block ids and the prefix hashes ``original`` stores."""
    tensors = {}
    for entry in original.layout.entries:
        if entry.name.startswith("sequences."):
            tensors[entry.name] = original.bytes_of(entry).view("<i8")
    hashes = original.bytes_of(original.layout.by_name[fmt.BLOCK_HASHES_TENSOR])
    tensors[fmt.BLOCK_HASHES_TENSOR] = hashes.reshape(-1, fmt.DIGEST_BYTES)
    return tensors
