"""Parted snapshots (format version 2): part file names and the ``.index.json`` that commits them.

A parted snapshot stores each head range of every layer in its own complete single-file
snapshot (a *part*, whose ``layout.num_kv_heads`` is the range's head count and whose metadata
carries ``part``), and is published by an index naming the parts in head order with the
xxh3-128 of each part's checksum trailer. docs/format.md, "Parted snapshots", is the
specification.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsnap.errors import SnapshotCorruptError
from kvsnap.format.constants import HEX32, METADATA_KEY, PARTS_FORMAT_VERSION
from kvsnap.format.container import specs_for
from kvsnap.format.index import GENERATION_PATTERN, check_member_name, index_json
from kvsnap.format.metadata import SnapshotMetadata
from kvsnap.format.parse import HeaderMetadata, parse_metadata_document
from kvsnap.format.schema import strict_json_loads
from kvsnap.layout import KVGeometry

#: The index key listing a parted snapshot's parts (a sharded index has ``kvsnap.shards``).
PARTS_KEY = "kvsnap.parts"
_RECORD_KEYS = ("file", "first_head", "num_heads", "trailer")


@dataclass(frozen=True)
class PartRecord:
    """One part as the index lists it: its file name (beside the index), its global heads
    ``[first_head, first_head + num_heads)`` and the xxh3-128 (32 hex digits) of its trailer."""

    file: str
    first_head: int
    num_heads: int
    trailer: str

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "first_head": self.first_head,
            "num_heads": self.num_heads,
            "trailer": self.trailer,
        }


@dataclass(frozen=True)
class PartsIndex:
    """A validated parted-snapshot index: the whole snapshot's metadata (all heads, no
    ``part``) and the parts, in head order, tiling ``[0, num_kv_heads)``."""

    metadata: HeaderMetadata
    parts: tuple[PartRecord, ...]


def part_file_name(stem: str, index: int, count: int, generation: str) -> str:
    """The file name of part ``index`` (1-based) of ``count`` of the snapshot ``stem`` written
    by the write ``generation`` (:func:`~kvsnap.format.new_generation`):
    ``{stem}-{generation}-part-00001-of-00004.safetensors``."""
    if not GENERATION_PATTERN.fullmatch(generation):
        raise ValueError(f"generation must be g and 12 hex digits, got {generation!r}")
    if not 1 <= index <= count <= 99999:
        raise ValueError(f"part {index} of {count}")
    return f"{stem}-{generation}-part-{index:05d}-of-{count:05d}.safetensors"


def is_part_of(stem: str, name: str, generation: str | None = None) -> bool:
    """Whether ``name`` is a part file name of the snapshot ``stem`` (of the write
    ``generation`` when given): with shard names, the only part files a writer may delete."""
    token = re.escape(generation) if generation is not None else r"g[0-9a-f]{12}"
    pattern = re.escape(stem) + "-" + token + r"-part-([0-9]{5})-of-([0-9]{5})\.safetensors"
    match = re.fullmatch(pattern, name)
    return match is not None and 1 <= int(match.group(1)) <= int(match.group(2))


def whole_geometry(part_geometry: KVGeometry, num_kv_heads: int) -> KVGeometry:
    """The whole snapshot's geometry, given one part's and the model's head count."""
    return dataclasses.replace(part_geometry, num_kv_heads=num_kv_heads)


def _total_size(metadata: HeaderMetadata | SnapshotMetadata, heads: Sequence[int]) -> int:
    """Bytes of the snapshot tensors of all parts, each part holding ``heads[i]`` heads."""
    return sum(
        spec.nbytes
        for count in heads
        for spec in specs_for(
            dataclasses.replace(
                metadata, geometry=dataclasses.replace(metadata.geometry, num_kv_heads=count)
            )
        )
    )


def encode_parts_index(metadata: SnapshotMetadata, parts: Sequence[PartRecord]) -> bytes:
    """The ``.index.json`` of a parted snapshot.

    ``{"metadata": {"total_size", "kvsnap": <the whole snapshot's metadata, format version 2,
    all heads, no part>, "kvsnap.parts": [{"file", "first_head", "num_heads", "trailer"}, ...]}}``:
    no ``weight_map``, because every part holds every tensor name (a slice of its heads), so
    no tensor lives in one file. ``ValueError`` when ``metadata`` is a part's or the parts do
    not tile its heads (the decoder's checks, applied before anything is written).
    """
    if metadata.part is not None:
        raise ValueError("the index stores the whole snapshot's metadata, not a part's")
    document = {
        "metadata": {
            "total_size": _total_size(metadata, [part.num_heads for part in parts]),
            METADATA_KEY: metadata.to_json_dict(format_version=PARTS_FORMAT_VERSION),
            PARTS_KEY: [part.to_json_dict() for part in parts],
        }
    }
    raw = (json.dumps(document, indent=2, ensure_ascii=True, allow_nan=False) + "\n").encode(
        "ascii"
    )
    try:
        decode_parts_index(raw)
    except SnapshotCorruptError as error:
        raise ValueError(f"cannot write this parted index: {error.detail}") from None
    return raw


def is_parts_index(raw: bytes) -> bool:
    """Whether the index bytes ``raw`` are a parted snapshot's (they list ``kvsnap.parts``);
    ``False`` for anything else, including bytes that are no index at all."""
    if PARTS_KEY.encode() not in raw:
        return False
    try:
        document = strict_json_loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return False
    return (
        isinstance(document, dict)
        and isinstance(document.get("metadata"), dict)
        and PARTS_KEY in document["metadata"]
    )


def _document(raw: bytes, file: str | None) -> dict[str, Any]:
    """A parted index's ``metadata`` object, with exactly its keys."""
    document = index_json(raw, file)
    if set(document) != {"metadata"} or set(document["metadata"]) != {
        "total_size",
        METADATA_KEY,
        PARTS_KEY,
    }:
        raise SnapshotCorruptError("parted index has unexpected or missing keys", file=file)
    return document["metadata"]


def _record(entry: Any, number: int, count: int, file: str | None) -> PartRecord:
    """Part ``number`` (1-based) of ``count`` as the index lists it, structurally checked."""
    if not isinstance(entry, dict) or tuple(entry) != _RECORD_KEYS:
        raise SnapshotCorruptError(
            f"part {number} must be an object with keys {', '.join(_RECORD_KEYS)}", file=file
        )
    name, first, heads, trailer = (entry[key] for key in _RECORD_KEYS)
    check_member_name("part", number, name, f"-part-{number:05d}-of-{count:05d}.safetensors", file)
    if not all(isinstance(value, int) and not isinstance(value, bool) for value in (first, heads)):
        raise SnapshotCorruptError(
            f"part {number}: first_head and num_heads must be integers", file=file
        )
    if not isinstance(trailer, str) or not HEX32.fullmatch(trailer):
        raise SnapshotCorruptError(f"part {name} has no valid trailer digest", file=file)
    return PartRecord(name, first, heads, trailer)


def decode_parts_index(raw: bytes, file: str | None = None) -> PartsIndex:
    """Parse and check a parted snapshot's index: its keys, the whole metadata (version 2, no
    ``shard`` or ``part``, not MLA), part names (one stem, numbered in order), trailer digests,
    heads tiling ``[0, num_kv_heads)`` in order, and ``total_size``."""
    extra = _document(raw, file)
    metadata = parse_metadata_document(extra[METADATA_KEY], file=file)
    if metadata.format_version != PARTS_FORMAT_VERSION:
        raise SnapshotCorruptError(
            f"a parted index must have format_version {PARTS_FORMAT_VERSION}", file=file
        )
    if metadata.shard is not None or metadata.part is not None:
        raise SnapshotCorruptError("index metadata must carry no shard or part key", file=file)
    if metadata.geometry.is_mla:
        raise SnapshotCorruptError("an MLA (latent) snapshot is never parted", file=file)
    entries = extra[PARTS_KEY]
    if not isinstance(entries, list) or not entries:
        raise SnapshotCorruptError("kvsnap.parts must be a non-empty list", file=file)
    parts = tuple(
        _record(entry, number, len(entries), file) for number, entry in enumerate(entries, 1)
    )
    suffix = len(f"-part-00001-of-{len(parts):05d}.safetensors")
    if len({part.file[:-suffix] for part in parts}) != 1:
        raise SnapshotCorruptError("part names do not share one stem and generation", file=file)
    end = 0
    for part in parts:
        if part.first_head != end or part.num_heads < 1:
            raise SnapshotCorruptError(
                f"part {part.file} holds heads {part.first_head}.."
                f"{part.first_head + part.num_heads}, expected heads from {end}: the parts "
                "must tile the KV heads in order",
                file=file,
            )
        end += part.num_heads
    if end != metadata.geometry.num_kv_heads:
        raise SnapshotCorruptError(
            f"the parts hold heads 0..{end}, the snapshot has {metadata.geometry.num_kv_heads}",
            file=file,
        )
    total = _total_size(metadata, [part.num_heads for part in parts])
    if extra["total_size"] != total:
        raise SnapshotCorruptError(
            f"total_size {extra['total_size']!r} is not the parts' tensor bytes ({total})",
            file=file,
        )
    return PartsIndex(metadata, parts)
