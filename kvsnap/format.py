"""The kvsnap snapshot format, version 1: a safetensors container with kvsnap metadata.

This module is pure bytes-in-memory: metadata dataclasses, the JSON schema, the exact file
layout (which tensor goes where, padding, sharding), header encoding and strict header
decoding, prefix hash chains, block dedupe, model fingerprints and checksums. All file and
object-store I/O lives in :mod:`kvsnap.store`. ``docs/format.md`` is the prose specification.

A snapshot file, in file order::

    u64 little-endian N | N bytes of header JSON, padded with spaces so data starts 4096-aligned
    sequences.{j}.token_ids   I64 (num_tokens,)            for every sequence j
    sequences.{j}.block_ids   I64 (num_blocks_of_seq,)     indices into the block axis
    kvsnap.block_hashes       U8  (num_blocks, 16)         prefix hash of every snapshot block
    layers.{i}.{part}         model dtype (num_blocks, *canonical_page_shape), each 4096-aligned
    kvsnap.block_checksums    U64 (num_layer_tensors, num_blocks)   xxh3-64 of every page
    kvsnap.checksums          U8  (rows, 16)               xxh3-128 trailer (see below)

with ``kvsnap.padding.<next tensor>`` (U8 zeros) wherever the next tensor needs alignment.
Everything in the header is known before the first data byte, so a writer streams the file
strictly front to back; the data-dependent checksums go to the last two tensors. The trailer
``kvsnap.checksums`` holds, as 16-byte xxh3-128 digests: row 0 the header bytes
``[0, data_start)``; then one row per tensor in file order (padding and the trailer excluded) —
for a layer tensor the digest of its row of ``kvsnap.block_checksums`` (little-endian u64),
for any other tensor the digest of its bytes; and last the digest of all previous rows. Every
byte of the file is therefore covered: the header and tensors by the trailer, the trailer by
its last row, padding by being required zero.
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import resources
from typing import Any

import numpy as np
import xxhash

from kvsnap._version import __version__
from kvsnap.errors import NotASnapshotError, SnapshotCorruptError, UnsupportedVersionError
from kvsnap.layout import SAFETENSORS_DTYPES, KVGeometry, LayoutError

#: The format version this module writes; readers accept every version in SUPPORTED_VERSIONS.
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
#: ``__metadata__`` key holding the kvsnap JSON (safetensors metadata values must be strings).
METADATA_KEY = "kvsnap"
#: File offsets of the data region and of every layer tensor are multiples of this (O_DIRECT).
DATA_ALIGNMENT = 4096
#: Largest header accepted (safetensors' own limit), checked before anything is allocated.
MAX_HEADER_BYTES = 100_000_000
#: Largest sharded-snapshot index file accepted.
MAX_INDEX_BYTES = 64 << 20
DIGEST_BYTES = 16
TENSOR_CHECKSUM = "xxh3-128"
BLOCK_CHECKSUM = "xxh3-64"

BLOCK_HASHES_TENSOR = "kvsnap.block_hashes"
BLOCK_CHECKSUMS_TENSOR = "kvsnap.block_checksums"
CHECKSUMS_TENSOR = "kvsnap.checksums"
PADDING_PREFIX = "kvsnap.padding."

NHD_ENCODING = "kvsnap-nhd-v1"
MLA_ENCODING = "kvsnap-mla-v1"

#: Root parent of every prefix hash chain.
ROOT_DIGEST = bytes(DIGEST_BYTES)
#: Stored in ``kvsnap.block_hashes`` for blocks that no sequence references.
NO_HASH = bytes(DIGEST_BYTES)

#: Element size of every safetensors dtype kvsnap writes.
ELEMENT_SIZES: dict[str, int] = {
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F16": 2,
    "BF16": 2,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}

_HEX32 = re.compile(r"[0-9a-f]{32}")
_CREATED = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?Z")
_HEADER_PREFIX = struct.Struct("<Q")


def canonical_encoding(geometry: KVGeometry) -> str:
    """The canonical page encoding name of a geometry: ``kvsnap-nhd-v1`` or ``kvsnap-mla-v1``."""
    return MLA_ENCODING if geometry.is_mla else NHD_ENCODING


def utc_now() -> str:
    """The current time as stored in ``created``: ISO-8601 UTC with microseconds and a ``Z``."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --------------------------------------------------------------------------------------------
# Prefix hashes, dedupe, fingerprints


def _as_token_array(token_ids: np.ndarray | Sequence[int]) -> np.ndarray:
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
    tokens = _as_token_array(token_ids)
    if parent is None:
        previous = ROOT_DIGEST
    else:
        if not _HEX32.fullmatch(parent):
            raise ValueError(f"parent must be a 32-digit lowercase hex digest, got {parent!r}")
        previous = bytes.fromhex(parent)
    raw = memoryview(tokens).cast("B")
    chain = []
    for start in range(0, len(tokens), block_size):
        count = min(block_size, len(tokens) - start)
        hasher = xxhash.xxh3_128()
        hasher.update(previous)
        hasher.update(count.to_bytes(8, "little"))
        hasher.update(raw[start * 8 : (start + count) * 8])
        previous = hasher.digest()
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


#: Config keys left out of :func:`model_fingerprint`, besides every key starting with ``_``:
#: they change with the loading code or the runtime settings, never with the weights' meaning.
#: The dtype is excluded because the snapshot's KV dtype is checked on its own (the layout).
VOLATILE_CONFIG_KEYS = frozenset(
    {
        "name_or_path",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "attn_implementation",
        "use_cache",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "torchscript",
    }
)


def _canonical_config(value: Any, path: str) -> Any:
    """A JSON-ready copy of a config value with volatile keys removed, recursively."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int | float):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "to_dict") and not isinstance(value, Mapping):
        value = value.to_dict()
    if isinstance(value, Mapping):
        result = {}
        for key, item in value.items():
            name = str(key) if isinstance(key, int | str) else None
            if name is None:
                raise TypeError(
                    f"model config key {key!r} at {path or 'top level'} is not a string"
                )
            if name.startswith("_") or name in VOLATILE_CONFIG_KEYS:
                continue
            result[name] = _canonical_config(item, f"{path}.{name}" if path else name)
        return result
    if isinstance(value, list | tuple):
        return [_canonical_config(item, f"{path}[{index}]") for index, item in enumerate(value)]
    # torch dtypes and enums have stable names; anything else has no stable text form.
    module = type(value).__module__
    if module == "torch" and type(value).__name__ == "dtype":
        return str(value)
    if hasattr(value, "value") and hasattr(type(value), "__members__"):
        return _canonical_config(value.value, path)
    raise TypeError(
        f"model config value at {path or 'top level'} has unsupported type {type(value).__name__}"
    )


def model_fingerprint(config: Mapping[str, Any]) -> str:
    """A stable 32-digit hex fingerprint of a model config.

    ``config`` is a mapping (``config.to_dict()``; a transformers ``PretrainedConfig`` is also
    accepted). Keys starting with ``_`` and :data:`VOLATILE_CONFIG_KEYS` are dropped at every
    nesting level, the rest is serialized as JSON with sorted keys and hashed with xxh3-128.
    Two configs that differ only in volatile keys (load path, transformers version, dtype,
    attention implementation, runtime output flags) share a fingerprint; any other difference
    changes it.
    """
    canonical = _canonical_config(config, "")
    if not isinstance(canonical, dict):
        raise TypeError(f"model_fingerprint needs a mapping, got {type(config).__name__}")
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return xxhash.xxh3_128_hexdigest(text.encode())


# --------------------------------------------------------------------------------------------
# Checksums


def block_digests(pages: np.ndarray | memoryview, page_bytes: int) -> np.ndarray:
    """xxh3-64 of every ``page_bytes`` page of a contiguous buffer, as a uint64 array."""
    view = memoryview(pages).cast("B")
    if page_bytes <= 0 or len(view) % page_bytes:
        raise ValueError(f"{len(view)} bytes are not a whole number of {page_bytes}-byte pages")
    digest = xxhash.xxh3_64_intdigest
    return np.array(
        [digest(view[start : start + page_bytes]) for start in range(0, len(view), page_bytes)],
        dtype=np.uint64,
    )


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


# --------------------------------------------------------------------------------------------
# Metadata


@dataclass(frozen=True)
class SourceInfo:
    """Where a snapshot's KV came from: engine, model and model fingerprint."""

    engine: str
    engine_version: str
    model_id: str
    model_revision: str | None
    model_fingerprint: str


@dataclass(frozen=True)
class Problem:
    """One thing :meth:`kvsnap.store.SnapshotReader.verify` found wrong.

    ``tensor`` and ``block`` locate it when it concerns one tensor or one block of a tensor.
    """

    tensor: str | None
    block: int | None
    message: str


@dataclass(eq=False)
class SequenceRecord:
    """One sequence in a snapshot: its token ids, its snapshot block ids and their prefix hashes.

    ``block_ids[i]`` is the snapshot block holding tokens ``i*block_size ..``; blocks shared
    with other sequences appear in several records. ``prefix_hashes[i]`` is the prefix hash of
    block ``i`` (see :func:`prefix_hash_chain`). Arrays are stored as int64.
    """

    id: str
    token_ids: np.ndarray
    block_ids: np.ndarray
    prefix_hashes: tuple[str, ...]

    def __post_init__(self) -> None:
        self.token_ids = _as_token_array(self.token_ids)
        self.block_ids = _as_token_array(self.block_ids)
        self.prefix_hashes = tuple(self.prefix_hashes)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SequenceRecord):
            return NotImplemented
        return (
            self.id == other.id
            and np.array_equal(self.token_ids, other.token_ids)
            and np.array_equal(self.block_ids, other.block_ids)
            and self.prefix_hashes == other.prefix_hashes
        )

    __hash__ = None  # type: ignore[assignment]


def _geometry_json(geometry: KVGeometry) -> dict[str, Any]:
    return {
        "num_layers": geometry.num_layers,
        "num_kv_heads": geometry.num_kv_heads,
        "head_dim": geometry.head_dim,
        "latent_dim": geometry.latent_dim,
        "block_size": geometry.block_size,
        "dtype": geometry.dtype,
        "encoding": canonical_encoding(geometry),
        "attention_types": list(geometry.attention_types),
    }


@dataclass(eq=False)
class SnapshotMetadata:
    """Everything a snapshot says about itself besides the KV pages.

    ``num_blocks`` is the length of every layer tensor's block axis; each sequence's
    ``block_ids`` index into it. ``created`` is an ISO-8601 UTC time (:func:`utc_now`) or
    ``None`` for a reproducible snapshot. :meth:`to_json` and :meth:`metadata_tensors` give
    what a snapshot file stores; :meth:`from_json` rebuilds the object from them.
    """

    geometry: KVGeometry
    source: SourceInfo
    sequences: list[SequenceRecord]
    num_blocks: int
    capture_encoding: str
    tp_size: int
    kvsnap_version: str = __version__
    created: str | None = None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SnapshotMetadata):
            return NotImplemented
        return (
            self.geometry == other.geometry
            and self.source == other.source
            and self.sequences == other.sequences
            and self.num_blocks == other.num_blocks
            and self.capture_encoding == other.capture_encoding
            and self.tp_size == other.tp_size
            and self.kvsnap_version == other.kvsnap_version
            and self.created == other.created
        )

    __hash__ = None  # type: ignore[assignment]

    def to_json_dict(self, shard: tuple[int, int] | None = None) -> dict[str, Any]:
        """The metadata as the JSON object of :data:`METADATA_KEY` (``shard``: (index, count))."""
        layout = _geometry_json(self.geometry)
        layout["capture_encoding"] = self.capture_encoding
        layout["tp_size"] = self.tp_size
        document: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "kvsnap_version": self.kvsnap_version,
            "created": self.created,
            "source": {
                "engine": self.source.engine,
                "engine_version": self.source.engine_version,
                "model_id": self.source.model_id,
                "model_revision": self.source.model_revision,
                "model_fingerprint": self.source.model_fingerprint,
            },
            "layout": layout,
            "num_blocks": self.num_blocks,
            "sequences": [
                {
                    "id": record.id,
                    "num_tokens": record.num_tokens,
                    "num_blocks": len(record.block_ids),
                }
                for record in self.sequences
            ],
            "checksums": {"tensor": TENSOR_CHECKSUM, "block": BLOCK_CHECKSUM},
        }
        if shard is not None:
            document["shard"] = {"index": shard[0], "count": shard[1]}
        return document

    def to_json(self, shard: tuple[int, int] | None = None) -> str:
        """The exact string stored under ``__metadata__["kvsnap"]`` (compact, key order fixed)."""
        return _dump_json(self.to_json_dict(shard))

    def metadata_tensors(self) -> dict[str, np.ndarray]:
        """The non-KV tensors this metadata implies, in file order.

        ``sequences.{j}.token_ids`` and ``sequences.{j}.block_ids`` (int64) per sequence, then
        ``kvsnap.block_hashes`` (uint8, ``(num_blocks, 16)``): the prefix hash digest of each
        snapshot block, zero for blocks no sequence references. Raises ``ValueError`` when two
        sequences give the same block different hashes.
        """
        tensors: dict[str, np.ndarray] = {}
        hashes = np.zeros((self.num_blocks, DIGEST_BYTES), dtype=np.uint8)
        assigned = np.zeros(self.num_blocks, dtype=bool)
        for index, record in enumerate(self.sequences):
            tensors[f"sequences.{index}.token_ids"] = record.token_ids
            tensors[f"sequences.{index}.block_ids"] = record.block_ids
            for block, digest in zip(record.block_ids.tolist(), record.prefix_hashes, strict=True):
                row = np.frombuffer(bytes.fromhex(digest), dtype=np.uint8)
                if assigned[block] and not np.array_equal(hashes[block], row):
                    raise ValueError(
                        f"sequence {record.id!r} gives snapshot block {block} prefix hash "
                        f"{digest}, another sequence gave {hashes[block].tobytes().hex()}"
                    )
                hashes[block] = row
                assigned[block] = True
        tensors[BLOCK_HASHES_TENSOR] = hashes
        return tensors

    def problems(self, *, check_hashes: bool = True) -> list[str]:
        """Every inconsistency of this metadata, as messages (empty when it is writable).

        Checks sequence ids (unique, non-empty), block counts against token counts, block ids
        against ``num_blocks``, hash formats, and with ``check_hashes`` that each sequence's
        prefix hashes are :func:`prefix_hash_chain` of its tokens.
        """
        found: list[str] = []
        geometry = self.geometry
        if self.num_blocks < 0:
            found.append(f"num_blocks must not be negative, got {self.num_blocks}")
        if self.tp_size < 1:
            found.append(f"tp_size must be at least 1, got {self.tp_size}")
        if not self.capture_encoding:
            found.append("capture_encoding must not be empty")
        if self.created is not None and not _CREATED.fullmatch(self.created):
            found.append(
                f"created must be ISO-8601 UTC like 2026-01-31T12:00:00Z, got {self.created!r}"
            )
        seen: set[str] = set()
        for record in self.sequences:
            name = f"sequence {record.id!r}"
            if not record.id or len(record.id) > 1024:
                found.append(f"{name}: ids must have 1 to 1024 characters")
            if record.id in seen:
                found.append(f"{name} appears twice")
            seen.add(record.id)
            needed = math.ceil(record.num_tokens / geometry.block_size)
            if len(record.block_ids) != needed:
                found.append(
                    f"{name}: {record.num_tokens} tokens need {needed} blocks of "
                    f"{geometry.block_size}, got {len(record.block_ids)}"
                )
            if len(record.block_ids) and (
                record.block_ids.min() < 0 or record.block_ids.max() >= self.num_blocks
            ):
                found.append(f"{name}: block ids must lie in [0, {self.num_blocks})")
            if len(record.prefix_hashes) != len(record.block_ids):
                found.append(
                    f"{name}: {len(record.prefix_hashes)} prefix hashes for "
                    f"{len(record.block_ids)} blocks"
                )
            elif not all(isinstance(h, str) and _HEX32.fullmatch(h) for h in record.prefix_hashes):
                found.append(f"{name}: prefix hashes must be 32-digit lowercase hex")
            elif check_hashes and list(record.prefix_hashes) != prefix_hash_chain(
                record.token_ids, geometry.block_size
            ):
                found.append(f"{name}: prefix hashes are not the hash chain of its token ids")
        if not found:
            try:
                self.metadata_tensors()
            except ValueError as error:
                found.append(str(error))
        try:
            _validate_schema(self.to_json_dict(), None)
        except SnapshotCorruptError as error:
            found.append(error.detail)
        return found

    @classmethod
    def from_json(
        cls, text: str, tensors: Mapping[str, np.ndarray], *, file: str | None = None
    ) -> SnapshotMetadata:
        """Rebuild metadata from its JSON string and its :meth:`metadata_tensors`.

        Raises :class:`UnsupportedVersionError` for a newer format, and
        :class:`SnapshotCorruptError` (naming ``file``) for anything inconsistent.
        """
        return parse_metadata_json(text, file=file).with_tensors(tensors, file=file)


def _dump_json(document: Any) -> str:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def strict_json_loads(text: str | bytes) -> Any:
    """``json.loads`` that rejects duplicate keys and NaN/Infinity; raises ``ValueError``.

    Deeply nested input (``RecursionError``) and over-long integers are reported as
    ``ValueError`` too, so callers need one ``except``.
    """
    try:
        return json.loads(
            text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant
        )
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


@functools.cache
def metadata_schema() -> dict[str, Any]:
    """The JSON Schema of the kvsnap metadata object (``kvsnap/schema/snapshot-v1.schema.json``)."""
    text = (
        resources.files("kvsnap").joinpath("schema", "snapshot-v1.schema.json").read_text("utf-8")
    )
    return json.loads(text)


@functools.cache
def _schema_validator() -> Any:
    import jsonschema  # imported on first use: it is the slowest import of the reader

    schema = metadata_schema()
    return jsonschema.validators.validator_for(schema)(schema)


def _validate_schema(document: Any, file: str | None) -> None:
    error = next(iter(_schema_validator().iter_errors(document)), None)
    if error is not None:
        where = "/".join(str(part) for part in error.absolute_path) or "(top level)"
        raise SnapshotCorruptError(
            f"kvsnap metadata fails the v1 schema at {where}: {error.message}", file=file
        )


def _int(value: Any) -> int:
    # The schema accepts 3.0 as an integer; a kvsnap writer never emits one.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{value!r} is not an integer")
    return value


@dataclass(frozen=True)
class SequenceShape:
    """A sequence as the header JSON describes it: id and sizes, no arrays."""

    id: str
    num_tokens: int
    num_blocks: int


@dataclass(frozen=True)
class HeaderMetadata:
    """The kvsnap JSON of a snapshot file, validated: everything except the tensor contents.

    It fixes the exact file layout (:func:`snapshot_specs`) before any data is read.
    """

    geometry: KVGeometry
    source: SourceInfo
    sequences: tuple[SequenceShape, ...]
    num_blocks: int
    capture_encoding: str
    tp_size: int
    kvsnap_version: str
    created: str | None
    shard: tuple[int, int] | None
    document: dict[str, Any]

    def unsharded_document(self) -> dict[str, Any]:
        """The JSON object without the ``shard`` key, as a sharded snapshot's index stores it."""
        return {key: value for key, value in self.document.items() if key != "shard"}

    def with_tensors(
        self, tensors: Mapping[str, np.ndarray], *, file: str | None = None
    ) -> SnapshotMetadata:
        """The full :class:`SnapshotMetadata`, given its
        :meth:`SnapshotMetadata.metadata_tensors`."""
        hashes = np.asarray(tensors[BLOCK_HASHES_TENSOR], dtype=np.uint8)
        if hashes.shape != (self.num_blocks, DIGEST_BYTES):
            raise SnapshotCorruptError(
                f"shape {hashes.shape}, expected {(self.num_blocks, DIGEST_BYTES)}",
                file=file,
                tensor=BLOCK_HASHES_TENSOR,
            )
        hex_rows = hashes.tobytes().hex()
        records = []
        for index, shape in enumerate(self.sequences):
            tokens = np.asarray(tensors[f"sequences.{index}.token_ids"], dtype=np.int64)
            blocks = np.asarray(tensors[f"sequences.{index}.block_ids"], dtype=np.int64)
            if tokens.shape != (shape.num_tokens,) or blocks.shape != (shape.num_blocks,):
                raise SnapshotCorruptError(
                    f"sequence {shape.id!r}: tensors hold {tokens.shape[0]} tokens and "
                    f"{blocks.shape[0]} blocks, the metadata says {shape.num_tokens} and "
                    f"{shape.num_blocks}",
                    file=file,
                    tensor=f"sequences.{index}.block_ids",
                )
            if len(blocks) and (blocks.min() < 0 or blocks.max() >= self.num_blocks):
                bad = int(np.flatnonzero((blocks < 0) | (blocks >= self.num_blocks))[0])
                raise SnapshotCorruptError(
                    f"sequence {shape.id!r}: block id {int(blocks[bad])} at position {bad} is "
                    f"outside [0, {self.num_blocks})",
                    file=file,
                    tensor=f"sequences.{index}.block_ids",
                )
            chain = tuple(hex_rows[32 * block : 32 * block + 32] for block in blocks.tolist())
            records.append(SequenceRecord(shape.id, tokens, blocks, chain))
        return SnapshotMetadata(
            geometry=self.geometry,
            source=self.source,
            sequences=records,
            num_blocks=self.num_blocks,
            capture_encoding=self.capture_encoding,
            tp_size=self.tp_size,
            kvsnap_version=self.kvsnap_version,
            created=self.created,
        )


def check_version(document: Any, file: str | None = None) -> int:
    """The ``format_version`` of a parsed kvsnap JSON object; refuses what this kvsnap can't
    read (:class:`UnsupportedVersionError`, saying to upgrade for newer versions)."""
    if not isinstance(document, dict):
        raise SnapshotCorruptError("kvsnap metadata is not a JSON object", file=file)
    version = document.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise SnapshotCorruptError(
            f"kvsnap metadata has no integer format_version ({version!r})", file=file
        )
    if version not in SUPPORTED_VERSIONS:
        writer = document.get("kvsnap_version")
        by = f" by kvsnap {writer}" if isinstance(writer, str) else ""
        if version > max(SUPPORTED_VERSIONS):
            message = (
                f"snapshot format version {version} (written{by}) is newer than this kvsnap "
                f"{__version__} can read (up to {max(SUPPORTED_VERSIONS)}): upgrade kvsnap"
            )
        else:
            message = f"snapshot format version {version}{by} is not a kvsnap format version"
        raise UnsupportedVersionError(message, file=file, version=version)
    return version


def parse_metadata_json(text: str, *, file: str | None = None) -> HeaderMetadata:
    """Parse and strictly validate a kvsnap metadata JSON string (version, schema, semantics)."""
    try:
        document = strict_json_loads(text)
    except ValueError as error:
        raise SnapshotCorruptError(
            f"kvsnap metadata is not valid JSON ({error})", file=file
        ) from None
    return parse_metadata_document(document, file=file)


def parse_metadata_document(document: Any, *, file: str | None = None) -> HeaderMetadata:
    """:func:`parse_metadata_json` for an already parsed JSON object."""
    check_version(document, file)
    _validate_schema(document, file)
    try:
        layout = document["layout"]
        geometry = KVGeometry(
            num_layers=_int(layout["num_layers"]),
            block_size=_int(layout["block_size"]),
            dtype=layout["dtype"],
            num_kv_heads=_int(layout["num_kv_heads"]),
            head_dim=_int(layout["head_dim"]),
            latent_dim=_int(layout["latent_dim"]),
            attention_types=tuple(layout["attention_types"]),
        )
        if layout["encoding"] != canonical_encoding(geometry):
            raise ValueError(
                f"encoding {layout['encoding']!r} does not match the geometry "
                f"({canonical_encoding(geometry)})"
            )
        if len(layout["attention_types"]) != geometry.num_layers:
            raise ValueError(
                f"attention_types names {len(layout['attention_types'])} layers, "
                f"there are {geometry.num_layers}"
            )
        num_blocks = _int(document["num_blocks"])
        sequences = []
        seen: set[str] = set()
        for entry in document["sequences"]:
            shape = SequenceShape(entry["id"], _int(entry["num_tokens"]), _int(entry["num_blocks"]))
            if shape.id in seen:
                raise ValueError(f"sequence id {shape.id!r} appears twice")
            seen.add(shape.id)
            needed = math.ceil(shape.num_tokens / geometry.block_size)
            if shape.num_blocks != needed:
                raise ValueError(
                    f"sequence {shape.id!r}: {shape.num_tokens} tokens need {needed} blocks, "
                    f"the metadata says {shape.num_blocks}"
                )
            sequences.append(shape)
        created = document["created"]
        if created is not None and not _CREATED.fullmatch(created):
            raise ValueError(f"created {created!r} is not ISO-8601 UTC")
        shard = None
        if "shard" in document:
            shard = (_int(document["shard"]["index"]), _int(document["shard"]["count"]))
            if shard[0] > shard[1]:
                raise ValueError(f"shard {shard[0]} of {shard[1]}")
        source = document["source"]
        return HeaderMetadata(
            geometry=geometry,
            source=SourceInfo(
                engine=source["engine"],
                engine_version=source["engine_version"],
                model_id=source["model_id"],
                model_revision=source["model_revision"],
                model_fingerprint=source["model_fingerprint"],
            ),
            sequences=tuple(sequences),
            num_blocks=num_blocks,
            capture_encoding=layout["capture_encoding"],
            tp_size=_int(layout["tp_size"]),
            kvsnap_version=document["kvsnap_version"],
            created=created,
            shard=shard,
            document=document,
        )
    except (ValueError, LayoutError) as error:
        raise SnapshotCorruptError(f"kvsnap metadata is inconsistent: {error}", file=file) from None


# --------------------------------------------------------------------------------------------
# The container: which tensor goes where


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to place in a file: name, safetensors dtype, shape, required start alignment."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    alignment: int = 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ELEMENT_SIZES[self.dtype]


@dataclass(frozen=True)
class TensorEntry:
    """A tensor placed in a file: ``[begin, end)`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def is_layer_tensor(name: str) -> bool:
    """Whether ``name`` is a KV page tensor (``layers.{i}.{part}``)."""
    return name.startswith("layers.")


def is_container_tensor(name: str) -> bool:
    """Padding and the per-file checksum trailer: part of one file, not of the snapshot."""
    return name == CHECKSUMS_TENSOR or name.startswith(PADDING_PREFIX)


@dataclass(frozen=True)
class FileLayout:
    """The exact layout of one snapshot file: header bytes and every tensor's place.

    ``header`` is the file's first ``data_start`` bytes (length prefix, JSON, space padding).
    ``entries`` are in file order and tile ``[data_start, file_size)`` exactly.
    """

    header: bytes
    entries: tuple[TensorEntry, ...]
    kvsnap_json: str

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def file_size(self) -> int:
        return self.entries[-1].end if self.entries else self.data_start

    @functools.cached_property
    def by_name(self) -> dict[str, TensorEntry]:
        return {entry.name: entry for entry in self.entries}

    def checksummed(self) -> list[TensorEntry]:
        """Entries with a trailer row, in row order (after the header's row 0)."""
        return [entry for entry in self.entries if not is_container_tensor(entry.name)]


def snapshot_specs(
    geometry: KVGeometry, num_blocks: int, sequences: Iterable[tuple[int, int]]
) -> list[TensorSpec]:
    """Every snapshot tensor in file order, padding and trailer excluded.

    ``sequences`` gives ``(num_tokens, num_blocks)`` per sequence.
    """
    specs = []
    for index, (num_tokens, seq_blocks) in enumerate(sequences):
        specs.append(TensorSpec(f"sequences.{index}.token_ids", "I64", (num_tokens,), 8))
        specs.append(TensorSpec(f"sequences.{index}.block_ids", "I64", (seq_blocks,), 8))
    specs.append(TensorSpec(BLOCK_HASHES_TENSOR, "U8", (num_blocks, DIGEST_BYTES)))
    dtype = SAFETENSORS_DTYPES[geometry.dtype]
    page_shape = geometry.canonical_page_shape
    names = geometry.tensor_names()
    for name in names:
        specs.append(TensorSpec(name, dtype, (num_blocks, *page_shape), DATA_ALIGNMENT))
    specs.append(TensorSpec(BLOCK_CHECKSUMS_TENSOR, "U64", (len(names), num_blocks), 8))
    return specs


def specs_for(metadata: SnapshotMetadata | HeaderMetadata) -> list[TensorSpec]:
    """:func:`snapshot_specs` of a metadata object."""
    if isinstance(metadata, SnapshotMetadata):
        shapes = [(record.num_tokens, len(record.block_ids)) for record in metadata.sequences]
    else:
        shapes = [(shape.num_tokens, shape.num_blocks) for shape in metadata.sequences]
    return snapshot_specs(metadata.geometry, metadata.num_blocks, shapes)


def _header_json(entries: Sequence[TensorEntry], data_start: int, kvsnap_json: str) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt", METADATA_KEY: kvsnap_json}}
    for entry in entries:
        header[entry.name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [entry.begin - data_start, entry.end - data_start],
        }
    return _dump_json(header).encode("ascii")


def pack_file(specs: Sequence[TensorSpec], kvsnap_json: str) -> FileLayout:
    """Lay out one file holding ``specs`` in order, plus padding and its checksum trailer.

    Offsets relative to the data start do not depend on the header length, and the data
    start is a multiple of :data:`DATA_ALIGNMENT`, so aligning relative offsets aligns file
    offsets. The header is padded with spaces (which JSON ignores) up to that multiple.
    """
    trailer = TensorSpec(CHECKSUMS_TENSOR, "U8", (len(specs) + 2, DIGEST_BYTES))
    relative: list[TensorEntry] = []
    offset = 0
    for spec in [*specs, trailer]:
        aligned = -(-offset // spec.alignment) * spec.alignment
        if aligned > offset:
            relative.append(
                TensorEntry(PADDING_PREFIX + spec.name, "U8", (aligned - offset,), offset, aligned)
            )
        relative.append(
            TensorEntry(spec.name, spec.dtype, spec.shape, aligned, aligned + spec.nbytes)
        )
        offset = aligned + spec.nbytes
    body = _header_json(relative, 0, kvsnap_json)
    data_start = -(-(_HEADER_PREFIX.size + len(body)) // DATA_ALIGNMENT) * DATA_ALIGNMENT
    padded = body + b" " * (data_start - _HEADER_PREFIX.size - len(body))
    header = _HEADER_PREFIX.pack(len(padded)) + padded
    entries = tuple(
        TensorEntry(e.name, e.dtype, e.shape, e.begin + data_start, e.end + data_start)
        for e in relative
    )
    return FileLayout(header, entries, kvsnap_json)


def split_shards(
    specs: Sequence[TensorSpec], max_shard_bytes: int | None
) -> list[list[TensorSpec]]:
    """Greedy sharding in file order: a shard closes when the next tensor would push its tensor
    bytes past ``max_shard_bytes``; a tensor larger than that gets a shard of its own."""
    if max_shard_bytes is None:
        return [list(specs)]
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def plan_files(metadata: SnapshotMetadata, max_shard_bytes: int | None = None) -> list[FileLayout]:
    """The exact layout of every file of a snapshot: one, or one per shard."""
    groups = split_shards(specs_for(metadata), max_shard_bytes)
    if len(groups) == 1:
        return [pack_file(groups[0], metadata.to_json())]
    count = len(groups)
    return [
        pack_file(group, metadata.to_json((index + 1, count))) for index, group in enumerate(groups)
    ]


def shard_file_name(stem: str, index: int, count: int) -> str:
    """``{stem}-00001-of-00004.safetensors`` (1-based, the Hugging Face convention)."""
    return f"{stem}-{index:05d}-of-{count:05d}.safetensors"


# --------------------------------------------------------------------------------------------
# Decoding a header, strictly


def header_length(prefix: bytes, file_size: int, file: str | None = None) -> int:
    """The JSON length from the 8-byte prefix, checked against the limits and the file size."""
    if file_size < _HEADER_PREFIX.size or len(prefix) < _HEADER_PREFIX.size:
        raise NotASnapshotError(f"{file_size} bytes is too short for a safetensors file", file=file)
    (length,) = _HEADER_PREFIX.unpack(prefix[: _HEADER_PREFIX.size])
    if length < 2 or length > MAX_HEADER_BYTES:
        raise NotASnapshotError(
            f"header length {length} is outside 2..{MAX_HEADER_BYTES}: not a safetensors file",
            file=file,
        )
    if _HEADER_PREFIX.size + length > file_size:
        raise SnapshotCorruptError(
            f"header claims {length} bytes, the file holds {file_size - _HEADER_PREFIX.size} after "
            "the length prefix (truncated?)",
            file=file,
        )
    return length


@dataclass(frozen=True)
class DecodedHeader:
    """A header that parsed as safetensors with kvsnap metadata, before layout checks."""

    metadata: HeaderMetadata
    kvsnap_json: str
    entries: tuple[TensorEntry, ...]  # file order, absolute offsets
    data_start: int


def decode_header(header: bytes, file_size: int, file: str | None = None) -> DecodedHeader:
    """Parse a file's first ``8 + N`` bytes as a kvsnap safetensors header.

    Checks, in order: JSON object (strict), ``__metadata__`` with kvsnap metadata (else
    :class:`NotASnapshotError`), format version (:class:`UnsupportedVersionError`), the v1
    schema and its semantics, then every tensor entry: known dtype, non-negative integer
    shape, offsets matching the shape, and tensors tiling the data region with no gap or
    overlap up to exactly the end of the file (:class:`SnapshotCorruptError`).
    """
    data_start = len(header)
    body = header[_HEADER_PREFIX.size :]
    if body[:1] != b"{":
        raise NotASnapshotError("header does not start with '{': not a safetensors file", file=file)
    try:
        document = strict_json_loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise NotASnapshotError(f"header is not valid JSON ({error})", file=file) from None
    if not isinstance(document, dict):
        raise NotASnapshotError("header is not a JSON object", file=file)
    extra = document.get("__metadata__")
    if not isinstance(extra, dict) or not isinstance(extra.get(METADATA_KEY), str):
        raise NotASnapshotError("a safetensors file without kvsnap metadata", file=file)
    if set(extra) != {"format", METADATA_KEY} or extra["format"] != "pt":
        raise SnapshotCorruptError(f"unexpected __metadata__ keys {sorted(extra)}", file=file)
    kvsnap_json = extra[METADATA_KEY]
    try:
        metadata_document = strict_json_loads(kvsnap_json)
    except ValueError as error:
        raise SnapshotCorruptError(
            f"kvsnap metadata is not valid JSON ({error})", file=file
        ) from None
    metadata = parse_metadata_document(metadata_document, file=file)
    if data_start % DATA_ALIGNMENT:
        raise SnapshotCorruptError(
            f"data starts at {data_start}, not a multiple of {DATA_ALIGNMENT}", file=file
        )
    entries = []
    for name, spec in document.items():
        if name == "__metadata__":
            continue
        entries.append(_decode_entry(name, spec, data_start, file))
    entries.sort(key=lambda entry: (entry.begin, entry.end))
    position = data_start
    for entry in entries:
        if entry.begin != position:
            kind = (
                "overlaps the previous tensor"
                if entry.begin < position
                else "leaves a gap before it"
            )
            raise SnapshotCorruptError(
                f"starts at {entry.begin}: {kind} (expected {position})",
                file=file,
                tensor=entry.name,
            )
        position = entry.end
    if position != file_size:
        if position > file_size:
            message = f"tensors end at byte {position}, the file has {file_size} bytes (truncated)"
        else:
            message = (
                f"tensors end at byte {position}, the file has {file_size} bytes (trailing data)"
            )
        raise SnapshotCorruptError(message, file=file)
    return DecodedHeader(metadata, kvsnap_json, tuple(entries), data_start)


def _decode_entry(name: str, spec: Any, data_start: int, file: str | None) -> TensorEntry:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise SnapshotCorruptError(
            "entry must have exactly dtype, shape and data_offsets", file=file, tensor=name
        )
    dtype = spec["dtype"]
    if not isinstance(dtype, str) or dtype not in ELEMENT_SIZES:
        raise SnapshotCorruptError(
            f"dtype {dtype!r} is not one kvsnap writes", file=file, tensor=name
        )
    shape = spec["shape"]
    if not isinstance(shape, list) or not all(
        isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 for dim in shape
    ):
        raise SnapshotCorruptError(
            f"shape {shape!r} is not a list of non-negative integers", file=file, tensor=name
        )
    offsets = spec["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(value, int) and not isinstance(value, bool) for value in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise SnapshotCorruptError(
            f"data_offsets {offsets!r} are not [begin, end] with begin <= end",
            file=file,
            tensor=name,
        )
    nbytes = math.prod(shape) * ELEMENT_SIZES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise SnapshotCorruptError(
            f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, "
            f"{dtype} {tuple(shape)} needs {nbytes}",
            file=file,
            tensor=name,
        )
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def expected_layout(decoded: DecodedHeader, file: str | None = None) -> tuple[FileLayout, int, int]:
    """The layout this file must have, recomputed from its metadata; checked against the header.

    The file's snapshot tensors must be a contiguous run of :func:`specs_for` (all of them
    for an unsharded file). Repacking that run with the file's own metadata string must give
    back the header byte for byte, so any header this module did not write is refused.
    Returns ``(layout, first, stop)``: the run is ``specs_for(metadata)[first:stop]``.
    """
    metadata = decoded.metadata
    specs = specs_for(metadata)
    position = {spec.name: index for index, spec in enumerate(specs)}
    held = [entry for entry in decoded.entries if not is_container_tensor(entry.name)]
    unknown = [entry.name for entry in held if entry.name not in position]
    if unknown:
        raise SnapshotCorruptError(
            "unexpected tensor (the metadata implies no such tensor)", file=file, tensor=unknown[0]
        )
    first = position[held[0].name] if held else 0
    stop = first + len(held)
    run = specs[first:stop]
    for entry, spec in zip(held, run, strict=False):
        if entry.name != spec.name:
            raise SnapshotCorruptError(
                f"out of place: expected {spec.name} here", file=file, tensor=entry.name
            )
    if len(run) != len(held):
        raise SnapshotCorruptError("more tensors than the metadata implies", file=file)
    if metadata.shard is None and (first, stop) != (0, len(specs)):
        missing = specs[stop].name if stop < len(specs) else specs[0].name
        raise SnapshotCorruptError("missing (the metadata implies it)", file=file, tensor=missing)
    layout = pack_file(run, decoded.kvsnap_json)
    found = {entry.name: entry for entry in decoded.entries}
    for entry in layout.entries:
        actual = found.get(entry.name)
        if actual is None:
            raise SnapshotCorruptError(
                "missing (the metadata implies it)", file=file, tensor=entry.name
            )
        if (actual.dtype, actual.shape) != (entry.dtype, entry.shape):
            raise SnapshotCorruptError(
                f"is {actual.dtype} {actual.shape}, "
                f"the metadata implies {entry.dtype} {entry.shape}",
                file=file,
                tensor=entry.name,
            )
        if (actual.begin, actual.end) != (entry.begin, entry.end):
            raise SnapshotCorruptError(
                f"lies at [{actual.begin}, {actual.end}), "
                f"the format puts it at [{entry.begin}, {entry.end})",
                file=file,
                tensor=entry.name,
            )
    if len(found) != len(layout.entries):
        extra = sorted(set(found) - set(layout.by_name))
        raise SnapshotCorruptError(
            "unexpected tensor", file=file, tensor=extra[0] if extra else None
        )
    return layout, first, stop


# --------------------------------------------------------------------------------------------
# Sharded snapshots: the index


def encode_index(
    metadata: SnapshotMetadata,
    files: Sequence[str],
    layouts: Sequence[FileLayout],
    trailers: Sequence[bytes],
) -> bytes:
    """The ``.index.json`` of a sharded snapshot (Hugging Face's layout plus kvsnap keys).

    ``{"metadata": {"total_size", "kvsnap": <metadata object>, "kvsnap.shards": {file:
    xxh3-128 of that file's trailer}}, "weight_map": {tensor: file}}``; the shard digests bind
    the index to the exact shard contents, so shards of different snapshots never mix.
    """
    weight_map: dict[str, str] = {}
    total = 0
    for name, layout in zip(files, layouts, strict=True):
        for entry in layout.checksummed():
            weight_map[entry.name] = name
            total += entry.nbytes
    document = {
        "metadata": {
            "total_size": total,
            METADATA_KEY: metadata.to_json_dict(),
            "kvsnap.shards": {
                name: xxhash.xxh3_128_hexdigest(trailer)
                for name, trailer in zip(files, trailers, strict=True)
            },
        },
        "weight_map": weight_map,
    }
    return (json.dumps(document, indent=2, ensure_ascii=True, allow_nan=False) + "\n").encode(
        "ascii"
    )


@dataclass(frozen=True)
class ShardIndex:
    """A validated sharded-snapshot index: shard file names (in order) and what each must hold."""

    metadata: HeaderMetadata
    files: tuple[str, ...]
    trailer_digests: tuple[str, ...]
    weight_map: dict[str, str]


def decode_index(raw: bytes, file: str | None = None) -> ShardIndex:
    """Parse and check a sharded snapshot's index (structure, names, kvsnap metadata)."""
    if len(raw) > MAX_INDEX_BYTES:
        raise NotASnapshotError(f"index of {len(raw)} bytes exceeds {MAX_INDEX_BYTES}", file=file)
    try:
        document = strict_json_loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise NotASnapshotError(f"index is not valid JSON ({error})", file=file) from None
    if not isinstance(document, dict) or not isinstance(document.get("metadata"), dict):
        raise NotASnapshotError("index has no metadata object", file=file)
    extra = document["metadata"]
    if METADATA_KEY not in extra:
        raise NotASnapshotError("index without kvsnap metadata", file=file)
    metadata = parse_metadata_document(extra[METADATA_KEY], file=file)
    if metadata.shard is not None:
        raise SnapshotCorruptError("index metadata must not carry a shard key", file=file)
    shards = extra.get("kvsnap.shards")
    weight_map = document.get("weight_map")
    if set(document) != {"metadata", "weight_map"} or set(extra) != {
        "total_size",
        METADATA_KEY,
        "kvsnap.shards",
    }:
        raise SnapshotCorruptError("index has unexpected keys", file=file)
    if not isinstance(shards, dict) or not shards or not isinstance(weight_map, dict):
        raise SnapshotCorruptError("index needs kvsnap.shards and weight_map objects", file=file)
    files = tuple(shards)
    count = len(files)
    for index, name in enumerate(files, start=1):
        suffix = f"-{index:05d}-of-{count:05d}.safetensors"
        if (
            not isinstance(name, str)
            or not name.endswith(suffix)
            or "/" in name
            or name.startswith(".")
        ):
            raise SnapshotCorruptError(
                f"shard {index} is named {name!r}, expected a name ending {suffix}", file=file
            )
        digest = shards[name]
        if not isinstance(digest, str) or not _HEX32.fullmatch(digest):
            raise SnapshotCorruptError(f"shard {name} has no valid trailer digest", file=file)
    if len({name[: -len(f"-00001-of-{count:05d}.safetensors")] for name in files}) != 1:
        raise SnapshotCorruptError("shard names do not share one stem", file=file)
    specs = specs_for(metadata)
    if extra["total_size"] != sum(spec.nbytes for spec in specs):
        raise SnapshotCorruptError(
            f"total_size {extra['total_size']!r} is not the tensors' size", file=file
        )
    expected = [spec.name for spec in specs]
    if list(weight_map) != expected:
        raise SnapshotCorruptError(
            "weight_map does not list exactly the snapshot's tensors in order", file=file
        )
    if not all(value in shards for value in weight_map.values()):
        raise SnapshotCorruptError("weight_map names a file that is not a shard", file=file)
    order = [files.index(weight_map[name]) for name in expected]
    if order != sorted(order) or sorted(set(order)) != list(range(count)):
        raise SnapshotCorruptError(
            "weight_map does not assign tensors to shards in order", file=file
        )
    return ShardIndex(metadata, files, tuple(shards[name] for name in files), dict(weight_map))
