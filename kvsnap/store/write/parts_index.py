"""A parted snapshot's commit point: its index published over parts already durable, then what
the replaced snapshot owned removed (docs/format.md, "Parted snapshots")."""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvsnap import format as fmt
from kvsnap.store.files import overwrite, publish
from kvsnap.store.files.location import INDEX_SUFFIX, io_error, locate
from kvsnap.store.read.parts import parts_index_bytes

__all__ = ["publish_parts_index"]


def publish_parts_index(path: str | os.PathLike[str], records: Sequence[fmt.PartRecord]) -> str:
    """Publish the index of the parted snapshot at ``path`` (``NAME.safetensors``) naming the
    durable parts ``records`` (in head order), then remove what the snapshot it replaces
    owned (its old index's shards or parts, or the single file ``NAME.safetensors``), never
    one of ``records``. The index goes through :func:`~kvsnap.store.publish_bytes` (local) or
    a temporary name and a move (fsspec; one put on object stores). Returns the index's URL.
    Checked first as :func:`parts_index_bytes` checks; on any error nothing is published."""
    location = locate(path, None)
    raw = parts_index_bytes(path, records)
    index = location.with_suffix(INDEX_SUFFIX)
    stale = overwrite.stale_files(
        location, [location.sibling(record.file) for record in records], sharded=True
    )
    try:
        publish.publish_to(index, raw)
    except OSError as error:
        raise io_error("publishing the parted index", index.url, error) from error
    overwrite.remove_quietly(stale)
    return index.url
