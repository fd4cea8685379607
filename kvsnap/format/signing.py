"""Signed snapshot files: an HMAC-SHA256 over every byte of a file but its pages, the pages
bound by their BLAKE3 digests.

The signature is the file's last tensor, :data:`~kvsnap.format.constants.SIGNATURE_TENSOR`,
right after the checksum trailer. A file signed with ``"hmac-sha256-blake3"`` (what kvsnap
writes) holds, before its trailer, the BLAKE3-256 of every page of its layer tensors
(:data:`~kvsnap.format.constants.PAGE_DIGESTS_TENSOR`), and signs its header and the bytes of
every tensor that is neither a layer tensor nor padding nor the signature, in file order
(sequences, prefix hashes, block checksums, page digests, trailer): those are small, so they
are signed as they are, never through a fast checksum, and each page is bound through a
collision-resistant digest:

    key id (16 bytes) ‖ HMAC-SHA256(key, "kvsnap-signature-v2\\0" ‖ header ‖ those tensors)

Older files (``"hmac-sha256"``) sign ``"kvsnap-signature-v1\\0" ‖ header ‖ trailer``: their
pages are bound by xxh3-64 checksums only, which are not collision-resistant; they are still
read. ``header`` is the file's first ``data_start`` bytes (length prefix and padding included).
The key id is the first 16 bytes of ``HMAC-SHA256(key, "kvsnap-key-id-v1")``: it names the key
without revealing it, so a reader holding several keys (rotation) knows which one to try.
docs/format.md ("Signed snapshots") says how any reader checks it.

Bytes in memory only: :mod:`kvsnap.store.files.keys` reads key files.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvsnap.format.constants import (
    CHECKSUMS_TENSOR,
    KEY_ID_BYTES,
    SIGNATURE_ALGORITHM,
    SIGNATURE_ALGORITHM_V1,
    SIGNATURE_BYTES,
)
from kvsnap.format.container import FileLayout, TensorEntry, is_signed_bytes_tensor
from kvsnap.format.encoded import PAGES_SIGNATURE_ALGORITHM, PAGES_SIGNATURE_TAG
from kvsnap.format.encoded import SIGNATURE_ALGORITHM as ENCODED_SIGNATURE_ALGORITHM
from kvsnap.format.encoded import SIGNATURE_TAG as ENCODED_SIGNATURE_TAG

#: Shortest key accepted: 32 bytes (256 bits), the HMAC-SHA256 block's natural key size.
MIN_KEY_BYTES = 32
#: The message's first bytes, by signature algorithm.
_MESSAGE_TAGS = {
    SIGNATURE_ALGORITHM: b"kvsnap-signature-v2\0",
    ENCODED_SIGNATURE_ALGORITHM: ENCODED_SIGNATURE_TAG,
    PAGES_SIGNATURE_ALGORITHM: PAGES_SIGNATURE_TAG,
    SIGNATURE_ALGORITHM_V1: b"kvsnap-signature-v1\0",
}
_KEY_ID_TAG = b"kvsnap-key-id-v1"

#: Bytes of a signed message after its tag: the header, then each signed tensor's bytes.
MessageParts = Sequence[bytes | bytearray | memoryview]

__all__ = [
    "MIN_KEY_BYTES",
    "SIGNATURE_ALGORITHM",
    "KeyRing",
    "MessageParts",
    "SigningKey",
    "key_id",
    "signed_entries",
]


def signed_entries(layout: FileLayout, algorithm: str) -> list[TensorEntry]:
    """The tensors of a file laid out as ``layout`` whose bytes follow its header in the
    message ``algorithm`` signs, in order: for ``"hmac-sha256-blake3"`` every tensor but the
    layer tensors, the padding and the signature; for ``"hmac-sha256"`` the trailer alone.
    ``ValueError`` for an algorithm this kvsnap does not know."""
    if algorithm == SIGNATURE_ALGORITHM:
        return [entry for entry in layout.entries if is_signed_bytes_tensor(entry.name)]
    if algorithm == SIGNATURE_ALGORITHM_V1:
        return [layout.by_name[CHECKSUMS_TENSOR]]
    raise ValueError(f"unknown signature algorithm {algorithm!r}")


def key_id(secret: bytes) -> bytes:
    """The 16-byte public name of the key ``secret``."""
    return hmac.new(secret, _KEY_ID_TAG, hashlib.sha256).digest()[:KEY_ID_BYTES]


@dataclass(frozen=True, repr=False)
class SigningKey:
    """One HMAC key; its ``repr`` shows the key id only, never the secret."""

    secret: bytes

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_KEY_BYTES:
            raise ValueError(
                f"a signing key needs at least {MIN_KEY_BYTES} bytes, this one has "
                f"{len(self.secret)}"
            )

    @property
    def key_id(self) -> bytes:
        return key_id(self.secret)

    def __repr__(self) -> str:
        return f"SigningKey(key_id={self.key_id.hex()})"


class KeyRing:
    """The keys a process signs with and accepts: the first signs, every one verifies.

    Several keys let a store rotate: add the new key first, keep the old one until every
    entry it signed is gone.
    """

    def __init__(self, keys: Iterable[SigningKey | bytes]) -> None:
        self.keys = tuple(key if isinstance(key, SigningKey) else SigningKey(key) for key in keys)
        if not self.keys:
            raise ValueError("a key ring needs at least one key")
        self._by_id = {key.key_id: key for key in self.keys}

    @property
    def signing_key_id(self) -> str:
        """The hex id of the key that signs."""
        return self.keys[0].key_id.hex()

    def sign(self, parts: MessageParts, algorithm: str = SIGNATURE_ALGORITHM) -> bytes:
        """The :data:`SIGNATURE_BYTES`-byte signature, made with the first key, of a file
        whose header and signed tensors (:func:`signed_entries`) are ``parts``."""
        key = self.keys[0]
        return key.key_id + _mac(key.secret, algorithm, parts)

    def problem(
        self, parts: MessageParts, signature: bytes, algorithm: str = SIGNATURE_ALGORITHM
    ) -> str | None:
        """Why ``signature`` does not vouch for a file whose header and signed tensors are
        ``parts`` (``None`` when it does): a key id none of the keys has, or a MAC that
        differs (compared in constant time)."""
        if len(signature) != SIGNATURE_BYTES:
            return f"the signature has {len(signature)} bytes, not {SIGNATURE_BYTES}"
        key = self._by_id.get(signature[:KEY_ID_BYTES])
        if key is None:
            return f"signed with key {signature[:KEY_ID_BYTES].hex()}, which is not one of ours"
        if not hmac.compare_digest(signature[KEY_ID_BYTES:], _mac(key.secret, algorithm, parts)):
            signed = "header and checksums" if algorithm == SIGNATURE_ALGORITHM_V1 else "bytes"
            return f"the signature does not match the file's {signed}"
        return None

    def __repr__(self) -> str:
        return f"KeyRing({', '.join(key.key_id.hex() for key in self.keys)})"


def _mac(secret: bytes, algorithm: str, parts: MessageParts) -> bytes:
    tag = _MESSAGE_TAGS.get(algorithm)
    if tag is None:
        raise ValueError(f"unknown signature algorithm {algorithm!r}")
    mac = hmac.new(secret, tag, hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()
