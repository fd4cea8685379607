"""Strict parsing of the kvsnap metadata JSON into :class:`HeaderMetadata`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsnap._version import __version__
from kvsnap.errors import LayoutError, SnapshotCorruptError, UnsupportedVersionError
from kvsnap.format.constants import (
    BLOCK_HASHES_TENSOR,
    CREATED_PATTERN,
    DIGEST_BYTES,
    PARTS_FORMAT_VERSION,
    SUPPORTED_VERSIONS,
)
from kvsnap.format.encoded import ENCODED_FORMAT_VERSION
from kvsnap.format.metadata import (
    PartInfo,
    SequenceRecord,
    SnapshotMetadata,
    SourceInfo,
    canonical_encoding,
    part_problems,
)
from kvsnap.format.schema import strict_json_loads, validate_schema
from kvsnap.layout import KVGeometry


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
    #: Set in one part file of a parted snapshot (format version 2).
    part: PartInfo | None = None
    #: The signature algorithm when the file ends with a signature, else ``None``.
    signature: str | None = None

    @property
    def format_version(self) -> int:
        return int(self.document["format_version"])

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
            part=self.part,
            signature=self.signature,
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
        if version == ENCODED_FORMAT_VERSION:
            # kvsnap.Snapshot.open (or Pipeline.restore) of a local file reads it; this is
            # another way in.
            message = (
                f"an encoded snapshot (format version {version}, written{by}): kvsnap opens "
                "one as a local file, with Snapshot.open, Pipeline.restore or its commands, "
                "not through a URL, an index or a reader of ordinary snapshots; decode it "
                "into an ordinary one with kvsnap convert FILE -o OUT --compress none"
            )
        elif version > max(SUPPORTED_VERSIONS):
            message = (
                f"snapshot format version {version} (written{by}) is newer than those this "
                f"kvsnap {__version__} reads ({_read_versions()}): upgrade kvsnap"
            )
        else:
            message = f"snapshot format version {version}{by} is not a kvsnap format version"
        raise UnsupportedVersionError(message, file=file, version=version)
    return version


def _read_versions() -> str:
    """The format versions this kvsnap reads, as the refusal of a newer one names them: the
    ordinary reader's, and the encoded files' (which :func:`kvsnap.Snapshot.open` reads)."""
    kinds = {PARTS_FORMAT_VERSION: " for parted snapshots"}
    named = [f"{version}{kinds.get(version, '')}" for version in SUPPORTED_VERSIONS]
    return ", ".join([*named, f"{ENCODED_FORMAT_VERSION} for encoded ones"])


def parse_metadata_json(text: str, *, file: str | None = None) -> HeaderMetadata:
    """Parse and strictly validate a kvsnap metadata JSON string (version, schema, semantics)."""
    try:
        document = strict_json_loads(text)
    except ValueError as error:
        raise SnapshotCorruptError(
            f"kvsnap metadata is not valid JSON ({error})", file=file
        ) from None
    return parse_metadata_document(document, file=file)


def _parse_geometry(layout: dict[str, Any]) -> KVGeometry:
    """The :class:`KVGeometry` of a schema-valid ``layout`` object; ``ValueError`` when its
    encoding or attention types contradict it."""
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
    return geometry


def _parse_sequences(entries: list[dict[str, Any]], block_size: int) -> tuple[SequenceShape, ...]:
    """The sequences of a schema-valid ``sequences`` list: unique ids, and
    ``ceil(num_tokens / block_size)`` blocks each (``ValueError`` otherwise)."""
    sequences = []
    seen: set[str] = set()
    for entry in entries:
        shape = SequenceShape(entry["id"], _int(entry["num_tokens"]), _int(entry["num_blocks"]))
        if shape.id in seen:
            raise ValueError(f"sequence id {shape.id!r} appears twice")
        seen.add(shape.id)
        needed = math.ceil(shape.num_tokens / block_size)
        if shape.num_blocks != needed:
            raise ValueError(
                f"sequence {shape.id!r}: {shape.num_tokens} tokens need {needed} blocks, "
                f"the metadata says {shape.num_blocks}"
            )
        sequences.append(shape)
    return tuple(sequences)


def _parse_shard(document: dict[str, Any]) -> tuple[int, int] | None:
    if "shard" not in document:
        return None
    shard = (_int(document["shard"]["index"]), _int(document["shard"]["count"]))
    if shard[0] > shard[1]:
        raise ValueError(f"shard {shard[0]} of {shard[1]}")
    return shard


def _parse_part(document: dict[str, Any], geometry: KVGeometry) -> PartInfo | None:
    """The ``part`` of a schema-valid document: only in version 2, never with ``shard``, its
    heads inside the model's (``ValueError`` otherwise)."""
    if "part" not in document:
        return None
    if document["format_version"] != PARTS_FORMAT_VERSION:
        raise ValueError(f"a part needs format_version {PARTS_FORMAT_VERSION}")
    if "shard" in document:
        raise ValueError("a part file is never a shard")
    raw = document["part"]
    part = PartInfo(
        _int(raw["index"]), _int(raw["count"]), _int(raw["first_head"]), _int(raw["num_kv_heads"])
    )
    problems = part_problems(part, geometry)
    if problems:
        raise ValueError("; ".join(problems))
    return part


def parse_metadata_document(document: Any, *, file: str | None = None) -> HeaderMetadata:
    """:func:`parse_metadata_json` for an already parsed JSON object."""
    check_version(document, file)
    validate_schema(document, file)
    try:
        layout = document["layout"]
        geometry = _parse_geometry(layout)
        created = document["created"]
        if created is not None and not CREATED_PATTERN.fullmatch(created):
            raise ValueError(f"created {created!r} is not ISO-8601 UTC")
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
            sequences=_parse_sequences(document["sequences"], geometry.block_size),
            num_blocks=_int(document["num_blocks"]),
            capture_encoding=layout["capture_encoding"],
            tp_size=_int(layout["tp_size"]),
            kvsnap_version=document["kvsnap_version"],
            created=created,
            shard=_parse_shard(document),
            document=document,
            part=_parse_part(document, geometry),
            signature=document.get("signature"),
        )
    except (ValueError, LayoutError) as error:
        raise SnapshotCorruptError(f"kvsnap metadata is inconsistent: {error}", file=file) from None
