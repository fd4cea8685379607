"""Prefix hash chains, block dedupe, page checksums and digests, and the checksum trailer."""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import numpy as np
import xxhash

from kvsnap.caches import register_cache_clear
from kvsnap.errors import SnapshotCorruptError
from kvsnap.format.constants import (
    CHECKSUMS_TENSOR,
    DIGEST_BYTES,
    HEX32,
    PAGE_DIGEST_BYTES,
    ROOT_DIGEST,
)

_TOKEN_DTYPE = np.dtype("<i8")


def as_token_array(token_ids: np.ndarray | Sequence[int]) -> np.ndarray:
    """``token_ids`` as a one-dimensional contiguous little-endian int64 array (the array
    itself when it is one already); ``ValueError``/``TypeError`` for other shapes and types."""
    if (
        isinstance(token_ids, np.ndarray)
        and token_ids.dtype == _TOKEN_DTYPE
        and token_ids.ndim == 1
        and token_ids.flags.c_contiguous
    ):
        return token_ids
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {tokens.shape}")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got {tokens.dtype}")
    return np.ascontiguousarray(tokens, dtype="<i8")


def prefix_hash_chain(
    token_ids: np.ndarray | Sequence[int], block_size: int, parent: str | None = None
) -> list[str]:
    """The prefix hash of every block of a token sequence, as 32-digit hex strings.

    Block ``i`` covers tokens ``[i*block_size, (i+1)*block_size)``; the last block may be
    partial. Its hash is ``xxh3_128(previous ‖ count ‖ tokens)``: ``previous`` the 16-byte
    digest of block ``i-1`` (of ``parent`` for block 0, 16 zero bytes when ``parent`` is
    ``None``), ``count`` the block's token count as a little-endian int64 (so a partial block
    never collides with a full one), ``tokens`` the block's token ids as little-endian int64.
    The chain therefore identifies the whole prefix, is identical on every machine and in
    every process (no salted ``hash``), and two sequences share block ``i``'s hash exactly
    when they share the first ``i+1`` blocks of tokens.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = as_token_array(token_ids)
    if parent is None:
        previous = ROOT_DIGEST
    else:
        if not HEX32.fullmatch(parent):
            raise ValueError(f"parent must be a 32-digit lowercase hex digest, got {parent!r}")
        previous = bytes.fromhex(parent)
    raw = memoryview(tokens).cast("B")
    chain = []
    step = block_size * 8
    full_count = min(block_size, len(tokens)).to_bytes(8, "little")  # used by full blocks
    digest = xxhash.xxh3_128_digest
    # One digest call per block over the joined input: the same bytes as three updates.
    for start in range(0, len(raw), step):
        piece = raw[start : start + step]
        count = full_count if len(piece) == step else (len(piece) // 8).to_bytes(8, "little")
        previous = digest(b"".join((previous, count, piece)))
        chain.append(previous.hex())
    return chain


@dataclass(frozen=True)
class BlockDedupe:
    """Unique snapshot blocks of several sequences, found by prefix hash.

    Snapshot block ``b`` has prefix hash ``block_hashes[b]``; blocks are numbered in order of
    first appearance (sequence by sequence, position by position). ``sequence_block_ids[s]``
    are sequence ``s``'s snapshot block ids, and ``owners[b] = (s, p)`` is the first sequence
    and block position holding block ``b`` — where a capture copies it from.
    """

    block_hashes: tuple[str, ...]
    sequence_block_ids: list[np.ndarray]
    owners: np.ndarray  # (num_blocks, 2) int64: sequence index, block position

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


def dedupe_blocks(hash_chains: Sequence[Sequence[str]]) -> BlockDedupe:
    """Number the unique blocks of ``hash_chains`` (one prefix hash chain per sequence).

    Equal hashes mean equal prefixes, so each distinct hash becomes one snapshot block,
    stored once however many sequences share it. See :class:`BlockDedupe` for the result.
    """
    index_of: dict[str, int] = {}
    owners: list[tuple[int, int]] = []
    per_sequence = []
    for sequence_index, chain in enumerate(hash_chains):
        ids = np.empty(len(chain), dtype=np.int64)
        for position, digest in enumerate(chain):
            block = index_of.get(digest)
            if block is None:
                block = len(owners)
                index_of[digest] = block
                owners.append((sequence_index, position))
            ids[position] = block
        per_sequence.append(ids)
    owner_array = np.array(owners, dtype=np.int64).reshape(len(owners), 2)
    return BlockDedupe(tuple(index_of), per_sequence, owner_array)


def block_digests(pages: np.ndarray | memoryview, page_bytes: int) -> np.ndarray:
    """xxh3-64 of every ``page_bytes`` page of a contiguous buffer, as a uint64 array."""
    view = memoryview(pages).cast("B")
    if page_bytes <= 0 or len(view) % page_bytes:
        raise ValueError(f"{len(view)} bytes are not a whole number of {page_bytes}-byte pages")
    count = len(view) // page_bytes
    # The pages as slices kept per shape, hashed by map: no Python frame per page.
    pages_of = map(view.__getitem__, _page_slices(count, page_bytes))
    return np.fromiter(map(xxhash.xxh3_64_intdigest, pages_of), dtype=np.uint64, count=count)


_DIGEST = operator.methodcaller("digest")


def page_digests(pages: np.ndarray | memoryview, page_bytes: int) -> np.ndarray:
    """BLAKE3-256 (plain hash mode) of every ``page_bytes`` page of a contiguous buffer, as a
    ``(pages, 32)`` uint8 array: what a signed file binds each page with
    (``kvsnap.page_digests``). ``blake3`` releases the GIL while it hashes a page, so read and
    write threads hash side by side."""
    view = memoryview(pages).cast("B")
    if page_bytes <= 0 or len(view) % page_bytes:
        raise ValueError(f"{len(view)} bytes are not a whole number of {page_bytes}-byte pages")
    count = len(view) // page_bytes
    pages_of = map(view.__getitem__, _page_slices(count, page_bytes))
    joined = b"".join(map(_DIGEST, map(blake3.blake3, pages_of)))
    return np.frombuffer(joined, dtype=np.uint8).reshape(count, PAGE_DIGEST_BYTES)


def page_digest_failures(
    pages: np.ndarray | memoryview, page_bytes: int, stored: np.ndarray
) -> np.ndarray:
    """The indices of the pages of ``pages`` whose BLAKE3-256 differs from ``stored`` (one
    32-byte row per page), sorted."""
    return np.flatnonzero((page_digests(pages, page_bytes) != stored).any(axis=1))


@functools.lru_cache(maxsize=64)
def _page_slices(count: int, page_bytes: int) -> tuple[slice, ...]:
    """The slices of ``count`` consecutive ``page_bytes`` pages (buffers of one shape share
    them)."""
    return tuple(
        slice(start, start + page_bytes) for start in range(0, count * page_bytes, page_bytes)
    )


register_cache_clear(_page_slices.cache_clear)


def digest128(data: bytes | memoryview | np.ndarray) -> bytes:
    """xxh3-128 of a contiguous buffer, as its 16-byte canonical (big-endian) digest."""
    return xxhash.xxh3_128_digest(
        memoryview(data).cast("B") if not isinstance(data, bytes) else data
    )


def layer_tensor_digest(block_checksum_row: np.ndarray) -> bytes:
    """The trailer digest of a layer tensor: xxh3-128 of its block checksums (little-endian u64)."""
    return xxhash.xxh3_128_digest(np.ascontiguousarray(block_checksum_row, dtype="<u8").tobytes())


def encode_trailer(digests: Sequence[bytes]) -> bytes:
    """The bytes of ``kvsnap.checksums``: the given 16-byte digests, then the digest of them."""
    body = b"".join(digests)
    if len(body) != DIGEST_BYTES * len(digests):
        raise ValueError("every trailer digest must be 16 bytes")
    return body + xxhash.xxh3_128_digest(body)


def decode_trailer(raw: bytes, file: str | None = None) -> list[bytes]:
    """The digests stored in ``kvsnap.checksums``, after checking its own last row."""
    if len(raw) < 2 * DIGEST_BYTES or len(raw) % DIGEST_BYTES:
        raise SnapshotCorruptError(
            f"{len(raw)} bytes is not a valid trailer", file=file, tensor=CHECKSUMS_TENSOR
        )
    body, own = raw[:-DIGEST_BYTES], raw[-DIGEST_BYTES:]
    if xxhash.xxh3_128_digest(body) != own:
        raise SnapshotCorruptError(
            "checksum trailer does not match its own digest", file=file, tensor=CHECKSUMS_TENSOR
        )
    return [body[start : start + DIGEST_BYTES] for start in range(0, len(body), DIGEST_BYTES)]
