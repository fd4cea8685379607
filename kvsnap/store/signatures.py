"""Checking a file's signature as it is opened (:mod:`kvsnap.format.signing` says what is
signed): one read of the trailer and the signature, which lie side by side at the file's end."""

from __future__ import annotations

from kvsnap import format as fmt
from kvsnap.errors import BadSignatureError, SignatureError, UnsignedSnapshotError
from kvsnap.format.signing import KeyRing
from kvsnap.store.source import OpenFile


def signature_problem(open_file: OpenFile, keys: KeyRing) -> SignatureError | None:
    """Why ``keys`` do not vouch for the opened file (``None`` when they do):
    :class:`UnsignedSnapshotError` for a file without a signature, :class:`BadSignatureError`
    for one made with another key or over other bytes."""
    layout = open_file.layout
    url = open_file.source.url
    signature = layout.by_name.get(fmt.SIGNATURE_TENSOR)
    if signature is None:
        return UnsignedSnapshotError("unsigned: written without a signing key", file=url)
    trailer = layout.by_name[fmt.CHECKSUMS_TENSOR]
    raw = open_file.source.read(
        trailer.begin, signature.end - trailer.begin, tensor=fmt.SIGNATURE_TENSOR
    )
    split = trailer.nbytes
    problem = keys.problem(layout.header, raw[:split], raw[split:])
    if problem is not None:
        return BadSignatureError(f"bad signature: {problem}", file=url)
    return None


def signing_key_id(open_file: OpenFile) -> str | None:
    """The hex id of the key that signed the opened file, unchecked (``None``: unsigned)."""
    signature = open_file.layout.by_name.get(fmt.SIGNATURE_TENSOR)
    if signature is None:
        return None
    raw = open_file.source.read(signature.begin, fmt.KEY_ID_BYTES, tensor=fmt.SIGNATURE_TENSOR)
    return raw.hex()
