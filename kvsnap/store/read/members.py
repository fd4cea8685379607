"""What a reader checks and loads of its member files beyond one file's header: each shard
against its index, a parted index refused (a reader opens one file or a sharded snapshot;
``Snapshot.open`` opens the parts), a single file's trailer digest, and the metadata tensors
it loads as it opens."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from kvsnap import format as fmt
from kvsnap.caches import register_cache_clear
from kvsnap.errors import NotASnapshotError, SnapshotCorruptError
from kvsnap.store.files.location import Location
from kvsnap.store.files.resolve import Resolved
from kvsnap.store.read.source import OpenFile

__all__ = [
    "check_shard",
    "loaded_metadata",
    "metadata_names",
    "parted_index_refused",
    "trailer_digest",
]


def check_shard(
    index: fmt.ShardIndex,
    number: int,
    location: Location,
    header: fmt.DecodedHeader,
    layout: fmt.FileLayout,
    specs: Sequence[fmt.TensorSpec],
    position: int,
) -> int:
    """Check that the file at ``location`` (its ``header`` and ``layout``) is shard ``number``
    of ``index``: its number, its metadata the index's, and the tensors the index assigns it,
    which start at ``specs[position]``. Returns the position of the next shard's first."""
    count = len(index.files)
    if header.metadata.shard != (number, count):
        raise SnapshotCorruptError(
            f"claims to be shard {header.metadata.shard}, "
            f"the index lists it as {number} of {count}",
            file=location.url,
        )
    if header.metadata.unsharded_document() != index.metadata.document:
        raise SnapshotCorruptError("metadata differs from the index's", file=location.url)
    held = [entry.name for entry in layout.layer_entries]
    expected = [spec.name for spec in specs[position : position + len(held)]]
    if held != expected or any(index.weight_map[name] != location.name for name in held):
        raise SnapshotCorruptError(
            "holds other tensors than the index assigns it", file=location.url
        )
    return position + len(held)


def parted_index_refused(resolved: Resolved) -> NotASnapshotError:
    """What a reader raises when asked to open a parted snapshot's index."""
    assert resolved.index_location is not None
    return NotASnapshotError(
        "is the index of a parted snapshot (one file per head range): open it with "
        "kvsnap.Snapshot.open, or open one part file",
        file=resolved.index_location.url,
    )


def trailer_digest(open_files: Sequence[OpenFile]) -> str:
    """xxh3-128 (32 hex digits) of a single-file snapshot's checksum trailer, read from the
    file."""
    if len(open_files) != 1:
        raise ValueError("trailer_digest is defined for a single-file snapshot")
    open_file = open_files[0]
    entry = open_file.layout.by_name[fmt.CHECKSUMS_TENSOR]
    raw = open_file.source.read(entry.begin, entry.nbytes, tensor=fmt.CHECKSUMS_TENSOR)
    return xxhash.xxh3_128_hexdigest(raw)


def loaded_metadata(
    header: fmt.HeaderMetadata, read_checked: Callable[[str], bytes], url: str
) -> fmt.SnapshotMetadata:
    """``header`` (the metadata a header holds) completed with its metadata tensors (every
    sequence's token and block ids, the block hashes), each read with ``read_checked``."""
    tensors: dict[str, np.ndarray] = {}
    for name in metadata_names(len(header.sequences)):
        raw = read_checked(name)
        dtype = np.dtype("<i8") if name.startswith("sequences.") else np.dtype(np.uint8)
        array = np.frombuffer(raw, dtype=dtype)
        tensors[name] = (
            array.reshape(-1, fmt.DIGEST_BYTES) if name == fmt.BLOCK_HASHES_TENSOR else array
        )
    return header.with_tensors(tensors, file=url)


@functools.lru_cache(maxsize=16)
def metadata_names(sequences: int) -> tuple[str, ...]:
    """The metadata tensors of a snapshot of ``sequences`` sequences, in file order."""
    parts = ("token_ids", "block_ids")
    per_sequence = [f"sequences.{index}.{part}" for index in range(sequences) for part in parts]
    return (*per_sequence, fmt.BLOCK_HASHES_TENSOR)


register_cache_clear(metadata_names.cache_clear)
