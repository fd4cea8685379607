"""A snapshot as the store opens it: the whole snapshot's metadata and its head-range parts.

A single-file or sharded snapshot is one part holding every head; a parted snapshot
(docs/format.md, "Parted snapshots") is one part per file its index names, in head order. The
facade (:class:`kvsnap.Snapshot`) and the restore pipeline both work over this list, so neither
asks which kind of snapshot it holds: `open_snapshot`, on the one resolver
(`kvsnap.store.files.resolve`), is the one place that tells them apart.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvsnap import format as fmt
from kvsnap.errors import SignatureError
from kvsnap.format.signing import KeyRing
from kvsnap.store.files.location import Location, locate
from kvsnap.store.files.resolve import Form, Resolved, open_retrying
from kvsnap.store.read.parts import opened_parts, whole_metadata
from kvsnap.store.read.reader import SnapshotReader

__all__ = ["HeadPart", "OpenedSnapshot", "open_held", "open_snapshot", "whole_snapshot"]


@dataclass(frozen=True)
class HeadPart:
    """One head range of an open snapshot: the reader of its file (or shards) and the global
    KV heads ``[first_head, first_head + num_heads)`` it holds. The reader's metadata is the
    part's own (its geometry has ``num_heads`` heads); an MLA snapshot is one part of 0 heads."""

    reader: SnapshotReader
    first_head: int
    num_heads: int

    @property
    def path(self) -> str:
        """The part's URL: its file, or a sharded snapshot's index."""
        return self.reader.url


@dataclass(frozen=True)
class OpenedSnapshot:
    """An open snapshot: ``path`` as the caller named it, the whole snapshot's metadata and
    format version, and its parts in head order (together they hold every head once).
    ``index`` is a parted snapshot's index, ``None`` for a single-file or sharded one."""

    path: str
    metadata: fmt.SnapshotMetadata
    format_version: int
    parts: tuple[HeadPart, ...]
    index: fmt.PartsIndex | None = None

    def signature_problems(self, keys: KeyRing) -> list[SignatureError]:
        """Why ``keys`` do not vouch for each file of every part (empty when they do)."""
        return [problem for part in self.parts for problem in part.reader.signature_problems(keys)]

    @property
    def signature_algorithm(self) -> str | None:
        """The algorithm every file is signed with, as the metadata says (``None``: unsigned)."""
        return self.metadata.signature

    def signing_key_ids(self) -> list[str | None]:
        """Per file of every part, the hex id of the key that signed it, unchecked."""
        return [key_id for part in self.parts for key_id in part.reader.signing_key_ids()]

    def close(self) -> None:
        for part in self.parts:
            part.reader.close()

    def __enter__(self) -> OpenedSnapshot:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def whole_snapshot(reader: SnapshotReader, path: str) -> OpenedSnapshot:
    """The snapshot ``reader`` opened (one file, or a sharded one) as one part of every head."""
    metadata = reader.metadata
    part = HeadPart(reader, 0, metadata.geometry.num_kv_heads)
    return OpenedSnapshot(path, metadata, reader.format_version, (part,))


def open_snapshot(
    path: str | os.PathLike[str],
    *,
    verify: bool = True,
    keys: KeyRing | None = None,
    storage_options: Mapping[str, Any] | None = None,
    read_whole_max_bytes: int = 0,
) -> OpenedSnapshot:
    """Open the snapshot at ``path`` (a local path or fsspec URL) as its head-range parts.

    ``path`` names ``NAME.safetensors`` or its index. The path is resolved once
    (`kvsnap.store.files.resolve.resolve`: at most two stats and one read of the index); a single or
    sharded snapshot opens as one `SnapshotReader`, a parted one as every part's reader, each
    part checked against the index; every data file is opened once. When a replacement removed
    a file meanwhile, it starts over (`kvsnap.store.files.resolve.open_retrying`). ``verify`` and
    ``keys`` are the readers' (checksums checked on every read; every file signed by one of
    the keys). A local file of at most ``read_whole_max_bytes`` is read whole as it opens and
    served from memory from then on (a caller about to read all of a small snapshot: one read
    instead of one per header, trailer, metadata tensor and run of pages).
    """

    def attempt(resolved: Resolved) -> OpenedSnapshot:
        if resolved.form is not Form.PARTED:
            reader = SnapshotReader.opened(
                resolved, verify=verify, keys=keys, read_whole_max_bytes=read_whole_max_bytes
            )
            return whole_snapshot(reader, str(path))
        opened = opened_parts(
            resolved, verify=verify, keys=keys, read_whole_max_bytes=read_whole_max_bytes
        )
        parts = tuple(
            HeadPart(reader, record.first_head, record.num_heads)
            for reader, record in zip(opened.readers, opened.index.parts, strict=True)
        )
        metadata = whole_metadata(opened.index, opened.readers[0])
        version = opened.index.metadata.format_version
        return OpenedSnapshot(str(path), metadata, version, parts, opened.index)

    return open_retrying(locate(path, storage_options), attempt)


def open_held(data: np.ndarray, name: str, *, verify: bool = True) -> OpenedSnapshot:
    """The single-file snapshot whose bytes are ``data`` (1-D ``uint8``, in memory), opened as
    a file read whole as it opened is, under the name ``name`` (what its errors and
    ``HeadPart.path`` say), with every check of an open of a file (``verify``: the
    reader's). Every read is served from ``data`` itself, never a copy of it: it must not
    change while the snapshot is open (pass it read-only), and closing the snapshot drops
    the readers' reference to it."""
    location = Location(name, name, held=data)
    reader = SnapshotReader.opened(Resolved.single(location), verify=verify)
    return whole_snapshot(reader, name)
