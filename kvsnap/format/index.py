"""Sharded snapshots: shard file names and the ``.index.json`` that commits them."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from kvsnap.errors import NotASnapshotError, SnapshotCorruptError
from kvsnap.format.constants import (
    HEX32,
    MAX_INDEX_BYTES,
    METADATA_KEY,
)
from kvsnap.format.container import (
    FileLayout,
    TensorSpec,
    specs_for,
)
from kvsnap.format.metadata import (
    SnapshotMetadata,
)
from kvsnap.format.parse import (
    HeaderMetadata,
    parse_metadata_document,
)
from kvsnap.format.schema import strict_json_loads

#: A write's generation token in shard names: ``g`` and 12 lowercase hex digits.
GENERATION_PATTERN = re.compile(r"g[0-9a-f]{12}")


def new_generation() -> str:
    """A fresh generation token for the shard names of one write (``g`` + 12 hex digits)."""
    return "g" + secrets.token_hex(6)


def shard_file_name(stem: str, index: int, count: int, generation: str | None = None) -> str:
    """The file name of shard ``index`` (1-based) of ``count`` of the snapshot ``stem``.

    ``{stem}-{generation}-00001-of-00004.safetensors`` with a generation token (what kvsnap
    writes: every write gets new names, so a replacement never touches a shard an older index
    names), ``{stem}-00001-of-00004.safetensors`` without (the Hugging Face convention, what
    the first kvsnap versions wrote; still read).
    """
    if generation is not None:
        if not GENERATION_PATTERN.fullmatch(generation):
            raise ValueError(f"generation must be g and 12 hex digits, got {generation!r}")
        stem = f"{stem}-{generation}"
    return f"{stem}-{index:05d}-of-{count:05d}.safetensors"


def is_shard_of(stem: str, name: str) -> bool:
    """Whether ``name`` is a shard file name of the snapshot ``stem`` by kvsnap's naming
    (:func:`shard_file_name`, with or without a generation token): the only shard files a
    writer of ``stem`` may ever delete."""
    pattern = re.escape(stem) + r"(-g[0-9a-f]{12})?-([0-9]{5})-of-([0-9]{5})\.safetensors"
    match = re.fullmatch(pattern, name)
    return match is not None and 1 <= int(match.group(2)) <= int(match.group(3))


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
        for entry in layout.layer_entries:  # the snapshot's tensors, not the per-file ones
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


def index_json(raw: bytes, file: str | None) -> dict[str, Any]:
    """An index file's JSON object (of a sharded or a parted snapshot): bounded in size,
    strictly parsed, with a ``metadata`` object; :class:`NotASnapshotError` otherwise."""
    if len(raw) > MAX_INDEX_BYTES:
        raise NotASnapshotError(f"index of {len(raw)} bytes exceeds {MAX_INDEX_BYTES}", file=file)
    try:
        document = strict_json_loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise NotASnapshotError(f"index is not valid JSON ({error})", file=file) from None
    if not isinstance(document, dict) or not isinstance(document.get("metadata"), dict):
        raise NotASnapshotError("index has no metadata object", file=file)
    return document


def _index_document(raw: bytes, file: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The index's JSON object and its ``metadata`` object, structurally checked."""
    document = index_json(raw, file)
    extra = document["metadata"]
    if METADATA_KEY not in extra:
        raise NotASnapshotError("index without kvsnap metadata", file=file)
    return document, extra


def check_member_name(kind: str, number: int, name: object, suffix: str, file: str | None) -> None:
    """An index's file ``number`` (a shard or a part) must be a printable name (no NUL or other
    control character) of a file in the index's directory, ending ``suffix``."""
    if (
        not isinstance(name, str)
        or not name.endswith(suffix)
        or "/" in name
        or name.startswith(".")
        or not name.isprintable()
    ):
        raise SnapshotCorruptError(
            f"{kind} {number} is named {name!r}, expected a name ending {suffix}", file=file
        )


def _check_shard_names(shards: dict[str, Any], file: str | None) -> None:
    """Shard ``i`` of ``n`` must be a printable name (no NUL or other control character) ending
    ``-{i:05d}-of-{n:05d}.safetensors`` in this directory, all with one stem, each with a
    32-digit trailer digest."""
    count = len(shards)
    for index, name in enumerate(shards, start=1):
        check_member_name("shard", index, name, f"-{index:05d}-of-{count:05d}.safetensors", file)
        digest = shards[name]
        if not isinstance(digest, str) or not HEX32.fullmatch(digest):
            raise SnapshotCorruptError(f"shard {name} has no valid trailer digest", file=file)
    if len({name[: -len(f"-00001-of-{count:05d}.safetensors")] for name in shards}) != 1:
        raise SnapshotCorruptError("shard names do not share one stem", file=file)


def _check_weight_map(
    weight_map: dict[str, Any], specs: list[TensorSpec], files: tuple[str, ...], file: str | None
) -> None:
    """The weight map lists every snapshot tensor in file order, on shards in shard order."""
    expected = [spec.name for spec in specs]
    if list(weight_map) != expected:
        raise SnapshotCorruptError(
            "weight_map does not list exactly the snapshot's tensors in order", file=file
        )
    position = {name: index for index, name in enumerate(files)}
    if not all(isinstance(value, str) and value in position for value in weight_map.values()):
        raise SnapshotCorruptError("weight_map names a file that is not a shard", file=file)
    order = [position[weight_map[name]] for name in expected]
    if order != sorted(order) or sorted(set(order)) != list(range(len(files))):
        raise SnapshotCorruptError(
            "weight_map does not assign tensors to shards in order", file=file
        )


def decode_index(raw: bytes, file: str | None = None) -> ShardIndex:
    """Parse and check a sharded snapshot's index (structure, names, kvsnap metadata)."""
    document, extra = _index_document(raw, file)
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
    _check_shard_names(shards, file)
    files = tuple(shards)
    specs = specs_for(metadata)
    if extra["total_size"] != sum(spec.nbytes for spec in specs):
        raise SnapshotCorruptError(
            f"total_size {extra['total_size']!r} is not the tensors' size", file=file
        )
    _check_weight_map(weight_map, specs, files, file)
    return ShardIndex(metadata, files, tuple(shards[name] for name in files), dict(weight_map))
