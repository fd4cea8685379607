"""Signed snapshot files: an HMAC-SHA256 over a file's header and checksum trailer.

A file's header fixes its layout and metadata, and its checksum trailer holds a digest of the
header and of every tensor (a layer tensor's digest covers its per-page checksums), so a key
that signs those two signs everything a reader checks. The signature is the file's last tensor,
:data:`~kvsnap.format.constants.SIGNATURE_TENSOR`, right after the trailer and outside it:

    key id (16 bytes) ‖ HMAC-SHA256(key, "kvsnap-signature-v1\\0" ‖ header ‖ trailer)

``header`` is the file's first ``data_start`` bytes (length prefix and padding included) and
``trailer`` the bytes of ``kvsnap.checksums``. The key id is the first 16 bytes of
``HMAC-SHA256(key, "kvsnap-key-id-v1")``: it names the key without revealing it, so a reader
holding several keys (rotation) knows which one to try. docs/format.md ("Signed snapshots")
says how any reader checks it.

Bytes in memory only: :mod:`kvsnap.store.keys` reads key files.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from kvsnap.format.constants import KEY_ID_BYTES, SIGNATURE_ALGORITHM, SIGNATURE_BYTES

#: Shortest key accepted: 32 bytes (256 bits), the HMAC-SHA256 block's natural key size.
MIN_KEY_BYTES = 32
_MESSAGE_TAG = b"kvsnap-signature-v1\0"
_KEY_ID_TAG = b"kvsnap-key-id-v1"

__all__ = ["MIN_KEY_BYTES", "SIGNATURE_ALGORITHM", "KeyRing", "SigningKey", "key_id"]


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

    def sign(self, header: bytes, trailer: bytes) -> bytes:
        """The :data:`SIGNATURE_BYTES`-byte signature of a file with these header and trailer
        bytes, made with the first key."""
        key = self.keys[0]
        return key.key_id + _mac(key.secret, header, trailer)

    def problem(self, header: bytes, trailer: bytes, signature: bytes) -> str | None:
        """Why ``signature`` does not vouch for a file with this header and trailer (``None``
        when it does): a key id none of the keys has, or a MAC that differs (compared in
        constant time)."""
        if len(signature) != SIGNATURE_BYTES:
            return f"the signature has {len(signature)} bytes, not {SIGNATURE_BYTES}"
        key = self._by_id.get(signature[:KEY_ID_BYTES])
        if key is None:
            return f"signed with key {signature[:KEY_ID_BYTES].hex()}, which is not one of ours"
        if not hmac.compare_digest(signature[KEY_ID_BYTES:], _mac(key.secret, header, trailer)):
            return "the signature does not match the file's header and checksums"
        return None

    def __repr__(self) -> str:
        return f"KeyRing({', '.join(key.key_id.hex() for key in self.keys)})"


def _mac(secret: bytes, header: bytes, trailer: bytes) -> bytes:
    mac = hmac.new(secret, _MESSAGE_TAG, hashlib.sha256)
    mac.update(header)
    mac.update(trailer)
    return mac.digest()
