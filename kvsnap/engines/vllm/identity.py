"""What a stored prefix is keyed on: a request's whole cache identity, hashed with SHA-256.

vLLM's own prefix cache keys a block on its parent's hash, its token ids and "extra keys": the
LoRA adapter, the multimodal inputs overlapping the block (their content hashes and where
their placeholders sit) and, for the first block, the request's ``cache_salt`` (tenant
isolation). A store that outlives the engine keys on as much, and on what the engine never had
to, because the store's namespace (:func:`kvsnap.engines.vllm.prefix_store.store_namespace`) already
separates models, weights, dtypes, block sizes and KV geometries. vLLM's block hashes
themselves are not reused: their root is seeded per process (``PYTHONHASHSEED``), so they
differ after a restart; the inputs are.

:func:`store_key_chain` is SHA-256 over length-prefixed fields, so no crafted prompt can make
two different identities, token runs or multimodal inputs meet on one key (CVE-2025-25183 is
the attack on a non-cryptographic chain). A chunk's key is the chain entry of its last block.

Nothing here needs vLLM; :func:`identity_of` reads a vLLM ``Request`` by attribute.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvsnap.format.hashing import as_token_array

#: Length of a store key: SHA-256 as lowercase hex.
KEY_HEX_DIGITS = 64
KEY_PATTERN = re.compile(r"[0-9a-f]{64}")
#: Domain tag of the chain: a key never equals a SHA-256 computed for another purpose.
_CHAIN_TAG = b"kvsnap-prefix-key-v2\0"
_ROOT_TAG = b"kvsnap-identity-v2\0"


@dataclass(frozen=True)
class MultimodalInput:
    """One multimodal input of a prompt: the engine's hash of its content and the prompt
    positions ``[offset, offset + length)`` its placeholder tokens occupy."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class CacheIdentity:
    """Everything besides token ids that decides what KV a prompt's prefix holds.

    ``lora_name`` and ``lora_digest`` (SHA-256 of the adapter's files: a retrained adapter
    under the same name is another identity), ``cache_salt`` (tenant isolation), and the
    prompt's ``multimodal`` inputs. The default is a plain text prompt on the base model.
    """

    lora_name: str | None = None
    lora_digest: str | None = None
    cache_salt: str | None = None
    multimodal: tuple[MultimodalInput, ...] = ()

    def root(self) -> bytes:
        """The 32-byte digest block 0 of every prompt of this identity follows."""
        hasher = hashlib.sha256(_ROOT_TAG)
        for field in (self.lora_name, self.lora_digest, self.cache_salt):
            _update_optional(hasher, field)
        return hasher.digest()

    def inputs_in(self, start: int, end: int) -> list[MultimodalInput]:
        """The multimodal inputs whose placeholders overlap prompt positions ``[start, end)``."""
        return [
            item
            for item in self.multimodal
            if item.offset < end and item.offset + item.length > start
        ]


def _update_optional(hasher: Any, text: str | None) -> None:
    """Feed ``text`` to ``hasher`` so that ``None``, ``""`` and every string differ, and no
    run of fields can be read as another run (:func:`_optional_bytes`)."""
    hasher.update(_optional_bytes(text))


def _optional_bytes(text: str | None) -> bytes:
    """``text`` as a field no run of fields can be read as another run of: a presence byte
    (``None`` is that byte alone), then the UTF-8 bytes' length and the bytes."""
    if text is None:
        return b"\0"
    raw = text.encode("utf-8", "surrogatepass")
    return b"\1" + len(raw).to_bytes(8, "little") + raw


def store_key_chain(
    token_ids: np.ndarray | Sequence[int], block_size: int, identity: CacheIdentity
) -> list[str]:
    """The store key of every block of a prompt, as 64-digit hex strings.

    Block ``i`` covers tokens ``[i*block_size, (i+1)*block_size)`` (the last may be partial).
    Its key is ``SHA-256(tag ‖ previous ‖ count ‖ tokens ‖ inputs)``: ``previous`` the 32-byte
    key of block ``i-1`` (``identity.root()`` for block 0), ``count`` the block's token count
    and ``tokens`` its token ids as little-endian int64, ``inputs`` the number of multimodal
    inputs overlapping the block, then each one's identifier (length-prefixed), offset and
    length. A key therefore identifies the identity and the whole prefix up to its block, is
    the same in every process and on every machine, and equal keys mean equal prefixes short
    of a SHA-256 collision.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = as_token_array(token_ids)
    raw = memoryview(tokens).cast("B")
    previous = identity.root()
    digests: list[bytes] = []
    sha256 = hashlib.sha256
    # One digest call per block over its concatenated fields (the same bytes as one update
    # per field: a block of a plain prompt had six calls, ~0.1 ms a 1,536-token prompt); the
    # hex of all of them at the end, by map.
    full_count = block_size.to_bytes(8, "little")
    for start in range(0, len(tokens), block_size):
        count = min(block_size, len(tokens) - start)
        counted = full_count if count == block_size else count.to_bytes(8, "little")
        inputs = _inputs_field(identity, start, start + count) if identity.multimodal else _NONE
        piece = raw[start * 8 : (start + count) * 8]
        previous = sha256(_CHAIN_TAG + previous + counted + piece + inputs).digest()
        digests += (previous,)
    return list(map(bytes.hex, digests))


#: The inputs field of a block no multimodal input overlaps: a count of 0.
_NONE = (0).to_bytes(8, "little")


def _inputs_field(identity: CacheIdentity, start: int, end: int) -> bytes:
    """The multimodal inputs field of the block of prompt positions ``[start, end)``: how
    many inputs overlap it, then each one's identifier (as :func:`_update_optional` feeds
    it), offset and length."""
    inputs = identity.inputs_in(start, end)
    parts = [len(inputs).to_bytes(8, "little")]
    for item in inputs:
        parts.append(_optional_bytes(item.identifier))
        parts.append(item.offset.to_bytes(8, "little", signed=True))
        parts.append(item.length.to_bytes(8, "little", signed=True))
    return b"".join(parts)


# -- from a vLLM request -----------------------------------------------------------------------

#: Adapter digests by (path, size and modification time of every file): hashed once per version.
_ADAPTER_DIGESTS: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}
_ADAPTER_LOCK = threading.Lock()


def adapter_digest(path: str | os.PathLike[str]) -> str:
    """SHA-256 (hex) of a LoRA adapter's files: every regular file under ``path`` (a directory,
    or one file), by relative name and content, in name order.

    Computed once per version of the files in a process (their sizes and modification times
    key the result); adapters are megabytes, read once. A missing path raises
    ``FileNotFoundError``.
    """
    root = Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    if not files:
        raise FileNotFoundError(f"no adapter files under {root}")
    versions = tuple(
        (str(p.relative_to(root)) if root.is_dir() else p.name, *_size_and_mtime(p)) for p in files
    )
    key = (str(root.resolve()), versions)
    with _ADAPTER_LOCK:
        known = _ADAPTER_DIGESTS.get(key)
    if known is not None:
        return known
    hasher = hashlib.sha256(b"kvsnap-adapter-v1\0")
    for file, (name, size, _) in zip(files, versions, strict=True):
        _update_optional(hasher, name)
        hasher.update(size.to_bytes(8, "little"))
        with open(file, "rb") as handle:
            while chunk := handle.read(1 << 20):
                hasher.update(chunk)
    digest = hasher.hexdigest()
    with _ADAPTER_LOCK:
        if len(_ADAPTER_DIGESTS) >= 256:
            _ADAPTER_DIGESTS.clear()
        _ADAPTER_DIGESTS[key] = digest
    return digest


def _size_and_mtime(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_size, status.st_mtime_ns


def identity_of(request: Any) -> CacheIdentity:
    """The cache identity of a vLLM ``Request``: its LoRA adapter (name and the digest of the
    files at its path), ``cache_salt`` and multimodal features (``identifier`` and
    ``mm_position``). A LoRA request whose path cannot be read raises ``OSError``: without its
    content the identity is unknown, and the caller must not match or store the prompt."""
    lora = getattr(request, "lora_request", None)
    lora_name = lora_digest = None
    if lora is not None:
        lora_name = str(lora.lora_name)
        path = getattr(lora, "lora_path", "") or getattr(lora, "path", "")
        if not path:
            raise FileNotFoundError(f"LoRA adapter {lora_name!r} names no path to hash")
        lora_digest = adapter_digest(path)
    features = getattr(request, "mm_features", None) or ()
    multimodal = tuple(
        MultimodalInput(
            str(feature.identifier),
            int(feature.mm_position.offset),
            int(feature.mm_position.length),
        )
        for feature in features
    )
    salt = getattr(request, "cache_salt", None)
    return CacheIdentity(lora_name, lora_digest, salt, multimodal)
