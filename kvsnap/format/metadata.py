"""The metadata a snapshot describes itself with: source, sequences, geometry."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np

from kvsnap._version import __version__
from kvsnap.format.constants import (
    BLOCK_CHECKSUM,
    BLOCK_HASHES_TENSOR,
    CREATED_PATTERN,
    DIGEST_BYTES,
    FORMAT_VERSION,
    HEX32,
    MLA_ENCODING,
    NHD_ENCODING,
    PARTS_FORMAT_VERSION,
    TENSOR_CHECKSUM,
)
from kvsnap.format.hashing import (
    as_token_array,
    prefix_hash_chain,
)
from kvsnap.format.schema import dump_json, metadata_schema
from kvsnap.layout import KVGeometry


def canonical_encoding(geometry: KVGeometry) -> str:
    """The canonical page encoding name of a geometry: ``kvsnap-nhd-v1`` or ``kvsnap-mla-v1``."""
    return MLA_ENCODING if geometry.is_mla else NHD_ENCODING


def utc_now() -> str:
    """The current time as stored in ``created``: ISO-8601 UTC with microseconds and a ``Z``."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass(frozen=True)
class SourceInfo:
    """Where a snapshot's KV came from: engine, model and model fingerprint.

    Every field has a default meaning "not recorded": ``"unknown"`` for the engine, its
    version and the model id, ``None`` for the revision and ``""`` for the fingerprint (no
    fingerprint: a restore cannot check the model by it), so ``SourceInfo()`` and
    ``SourceInfo(model_id="x")`` are valid.
    """

    engine: str = "unknown"
    engine_version: str = "unknown"
    model_id: str = "unknown"
    model_revision: str | None = None
    model_fingerprint: str = ""


@dataclass(frozen=True)
class PartInfo:
    """Where one part of a parted snapshot sits: part ``index`` (1-based) of ``count``, holding
    global KV heads ``first_head .. first_head + its own layout.num_kv_heads`` of the model's
    ``num_kv_heads``. Stored as ``part`` in the part file's metadata (format version 2)."""

    index: int
    count: int
    first_head: int
    num_kv_heads: int

    def to_json_dict(self) -> dict[str, int]:
        return {
            "index": self.index,
            "count": self.count,
            "first_head": self.first_head,
            "num_kv_heads": self.num_kv_heads,
        }


def part_problems(part: PartInfo, geometry: KVGeometry) -> list[str]:
    """What is wrong with ``part`` for a part file of ``geometry`` (empty when it is right)."""
    found = []
    if geometry.is_mla:
        found.append("an MLA (latent) snapshot is never parted")
    elif part.first_head + geometry.num_kv_heads > part.num_kv_heads:
        found.append(
            f"part heads {part.first_head}..{part.first_head + geometry.num_kv_heads} exceed "
            f"the model's {part.num_kv_heads} KV heads"
        )
    if not 1 <= part.index <= part.count:
        found.append(f"part {part.index} of {part.count}")
    if part.first_head < 0:
        found.append(f"first_head must not be negative, got {part.first_head}")
    return found


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
        self.token_ids = as_token_array(self.token_ids)
        self.block_ids = as_token_array(self.block_ids)
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


def _json_types_match(value: Any, types: str | list[str]) -> bool:
    """Whether ``value`` is of one of the JSON Schema ``types`` (a bool is no integer)."""
    for name in [types] if isinstance(types, str) else types:
        if name == "null" and value is None:
            return True
        if name == "string" and isinstance(value, str):
            return True
        if name == "integer" and isinstance(value, int) and not isinstance(value, bool):
            return True
    return False


def _rule_problem(label: str, value: Any, rule: Mapping[str, Any]) -> str | None:
    """What is wrong with one scalar ``value`` under a schema property ``rule`` (type, enum,
    minimum, maximum, minLength, maxLength, pattern: the keywords the schema's scalars use)."""
    if "type" in rule and not _json_types_match(value, rule["type"]):
        return f"{label} must be of JSON type {rule['type']}, got {value!r}"
    if value is None:
        return None
    if "enum" in rule and value not in rule["enum"]:
        return f"{label} must be one of {rule['enum']}, got {value!r}"
    if "minimum" in rule and value < rule["minimum"]:
        return f"{label} must be at least {rule['minimum']}, got {value!r}"
    if "maximum" in rule and value > rule["maximum"]:
        return f"{label} must be at most {rule['maximum']}, got {value!r}"
    if isinstance(value, str):
        shortest, longest = rule.get("minLength", 0), rule.get("maxLength", len(value))
        if not shortest <= len(value) <= longest:
            return f"{label} must have {shortest} to {longest} characters, got {len(value)}"
        if "pattern" in rule and not re.search(rule["pattern"], value):
            return f"{label} must match {rule['pattern']}, got {value!r}"
    return None


def schema_field_problems(metadata: SnapshotMetadata) -> list[str]:
    """What the JSON Schema would reject in ``metadata``'s JSON, found on its fields directly.

    The limits are read from the schema itself (so they cannot drift from it); what
    :meth:`SnapshotMetadata.to_json_dict` derives (format version, encoding, checksums,
    sequence counts) is valid by construction. The reader still validates every header it
    opens with the full schema.
    """
    rules = metadata_schema()["properties"]
    source, layout = rules["source"]["properties"], rules["layout"]["properties"]
    geometry = metadata.geometry
    checks: list[tuple[str, Any, Mapping[str, Any]]] = [
        ("kvsnap_version", metadata.kvsnap_version, rules["kvsnap_version"]),
        ("num_blocks", metadata.num_blocks, rules["num_blocks"]),
        ("capture_encoding", metadata.capture_encoding, layout["capture_encoding"]),
        ("tp_size", metadata.tp_size, layout["tp_size"]),
        ("dtype", geometry.dtype, layout["dtype"]),
    ]
    for field in ("engine", "engine_version", "model_id", "model_revision", "model_fingerprint"):
        checks.append((f"source.{field}", getattr(metadata.source, field), source[field]))
    for field in ("num_layers", "num_kv_heads", "head_dim", "latent_dim", "block_size"):
        checks.append((field, getattr(geometry, field), layout[field]))
    item = layout["attention_types"]["items"]
    # Layers share a few kinds: each distinct one checked once.
    checks += [
        ("attention_types[]", kind, item) for kind in dict.fromkeys(geometry.attention_types)
    ]
    sequence_id = rules["sequences"]["items"]["properties"]["id"]
    checks += [("sequence id", record.id, sequence_id) for record in metadata.sequences]
    if metadata.part is not None:
        part = rules["part"]["properties"]
        for field in ("index", "count", "first_head", "num_kv_heads"):
            checks.append((f"part.{field}", getattr(metadata.part, field), part[field]))
    found = [
        problem
        for label, value, rule in checks
        if (problem := _rule_problem(label, value, rule)) is not None
    ]
    created = metadata.created
    if created is not None and not (
        isinstance(created, str) and CREATED_PATTERN.fullmatch(created)
    ):
        found.append(f"created must be ISO-8601 UTC like 2026-01-31T12:00:00Z, got {created!r}")
    return found


@dataclass(eq=False)
class SnapshotMetadata:
    """Everything a snapshot says about itself besides the KV pages.

    ``num_blocks`` is the length of every layer tensor's block axis; each sequence's
    ``block_ids`` index into it. ``created`` is an ISO-8601 UTC time (:func:`utc_now`) or
    ``None`` for a reproducible snapshot. :meth:`to_json` and :meth:`metadata_tensors` give
    what a snapshot file stores; `kvsnap.format.parse_metadata_json(text).with_tensors(tensors)`
    rebuilds the object from them.
    """

    geometry: KVGeometry
    source: SourceInfo
    sequences: list[SequenceRecord]
    num_blocks: int
    capture_encoding: str
    tp_size: int
    kvsnap_version: str = __version__
    created: str | None = None
    #: Set in the metadata of one part of a parted snapshot (its ``geometry`` is the part's).
    part: PartInfo | None = None
    #: When every file of the snapshot ends with a signature
    #: (:data:`~kvsnap.format.constants.SIGNATURE_TENSOR`), its algorithm:
    #: ``"hmac-sha256-blake3"`` (pages bound by their BLAKE3 digests), or
    #: ``"hmac-sha256"`` (older files: pages bound by xxh3-64 only); ``None`` when unsigned.
    signature: str | None = None

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
            and self.part == other.part
            and self.signature == other.signature
        )

    __hash__ = None  # type: ignore[assignment]

    @property
    def format_version(self) -> int:
        """The version a file of this metadata is written in: 2 for a part, 1 otherwise."""
        return FORMAT_VERSION if self.part is None else PARTS_FORMAT_VERSION

    def to_json_dict(
        self, shard: tuple[int, int] | None = None, *, format_version: int | None = None
    ) -> dict[str, Any]:
        """The metadata as the JSON object of :data:`METADATA_KEY` (``shard``: (index, count)).

        ``format_version`` overrides :attr:`format_version` (a parted snapshot's index stores
        the whole snapshot's metadata, no ``part``, as version 2)."""
        layout = _geometry_json(self.geometry)
        layout["capture_encoding"] = self.capture_encoding
        layout["tp_size"] = self.tp_size
        document: dict[str, Any] = {
            "format_version": format_version or self.format_version,
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
        if self.part is not None:
            document["part"] = self.part.to_json_dict()
        if self.signature is not None:
            document["signature"] = self.signature
        return document

    def to_json(self, shard: tuple[int, int] | None = None) -> str:
        """The exact string stored under ``__metadata__["kvsnap"]`` (compact, key order fixed)."""
        return dump_json(self.to_json_dict(shard))

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

        Checks every field against the limits of the JSON Schema (types, ranges, lengths,
        patterns: :func:`schema_field_problems`, without running a schema validator, which
        cost ~3 ms per small capture), sequence ids (unique), block counts against token
        counts, block ids against ``num_blocks``, hash formats, and with ``check_hashes`` that
        each sequence's prefix hashes are :func:`prefix_hash_chain` of its tokens.
        """
        found = schema_field_problems(self)
        geometry = self.geometry
        if self.part is not None and not any(p.startswith("part.") for p in found):
            found += part_problems(self.part, geometry)
        seen: set[str] = set()
        for record in self.sequences:
            name = f"sequence {record.id!r}"
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
            elif not all(isinstance(h, str) and HEX32.fullmatch(h) for h in record.prefix_hashes):
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
        return found
