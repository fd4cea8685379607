"""The container: which tensor goes where in a file (specs, padding, sharding, header bytes)."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvsnap.caches import BoundedLRU, register_cache_clear
from kvsnap.dtypes import KV_DTYPES, SAFETENSORS_TYPES
from kvsnap.errors import SnapshotCorruptError
from kvsnap.format.constants import (
    BLOCK_CHECKSUMS_TENSOR,
    BLOCK_HASHES_TENSOR,
    CHECKSUMS_TENSOR,
    DATA_ALIGNMENT,
    DIGEST_BYTES,
    HEADER_PREFIX,
    METADATA_KEY,
    PADDING_PREFIX,
    PAGE_DIGEST_BYTES,
    PAGE_DIGESTS_TENSOR,
    SIGNATURE_ALGORITHM,
    SIGNATURE_BYTES,
    SIGNATURE_TENSOR,
)
from kvsnap.format.metadata import (
    SnapshotMetadata,
)
from kvsnap.format.parse import (
    HeaderMetadata,
)
from kvsnap.format.schema import dump_json
from kvsnap.layout import KVGeometry


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to place in a file: name, safetensors dtype, shape, required start alignment."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    alignment: int = 1

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * SAFETENSORS_TYPES[self.dtype].size


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


#: The signature tensor of a signed file, ordinary or encoded: the signing key's id and the
#: HMAC-SHA256 (:mod:`kvsnap.format.signing`).
SIGNATURE_SPEC = TensorSpec(SIGNATURE_TENSOR, "U8", (SIGNATURE_BYTES,))


class DeclaredTensor(Protocol):
    """A tensor as a header declares it or a format implies it: name, dtype and shape."""

    @property
    def name(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


def check_declared_as(found: DeclaredTensor, expected: DeclaredTensor, file: str | None) -> None:
    """Refuse (:class:`SnapshotCorruptError` naming the tensor) a tensor a file's header
    declares (``found``) with another dtype or shape than its metadata implies (``expected``)."""
    if (found.dtype, tuple(found.shape)) != (expected.dtype, tuple(expected.shape)):
        raise SnapshotCorruptError(
            f"is {found.dtype} {tuple(found.shape)}, "
            f"the metadata implies {expected.dtype} {tuple(expected.shape)}",
            file=file,
            tensor=found.name,
        )


def is_layer_tensor(name: str) -> bool:
    """Whether ``name`` is a KV page tensor (``layers.{i}.{part}``)."""
    return name.startswith("layers.")


def is_container_tensor(name: str) -> bool:
    """Padding, the per-file checksum trailer, the signature and a signed file's page digests:
    part of one file, not of the snapshot."""
    return name in _PER_FILE or name.startswith(PADDING_PREFIX)


_PER_FILE = frozenset((CHECKSUMS_TENSOR, SIGNATURE_TENSOR, PAGE_DIGESTS_TENSOR))


def is_signed_bytes_tensor(name: str) -> bool:
    """Whether a file signed with :data:`SIGNATURE_ALGORITHM` signs tensor ``name``'s bytes
    directly: every tensor but the layer tensors (bound through their page digests), the
    padding and the signature itself."""
    return not (
        name.startswith("layers.") or name.startswith(PADDING_PREFIX) or name == SIGNATURE_TENSOR
    )


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

    @property
    def by_name(self) -> dict[str, TensorEntry]:
        """Every entry by name (shared by the layouts of one shape: do not change it)."""
        return _entry_tables(self.entries)[0]

    def checksummed(self) -> list[TensorEntry]:
        """Entries with a trailer row, in row order (after the header's row 0): the snapshot's
        tensors in this file, then a signed file's page digests."""
        return list(_entry_tables(self.entries)[3])

    @property
    def checksum_rows(self) -> dict[str, int]:
        """Each checksummed entry's trailer row by name (row 0 is the header's); shared by the
        layouts of one shape, so a reader opening a file builds no table (do not change it)."""
        return _entry_tables(self.entries)[2]

    @property
    def layer_entries(self) -> tuple[TensorEntry, ...]:
        """The snapshot's tensors in this file, in file order (without padding, trailer and
        signature); shared by the layouts of one shape."""
        return _entry_tables(self.entries)[1]


#: What :class:`FileLayout` derives from its entries, by the entries tuple itself: the layouts
#: of one shape and data start share one tuple (:meth:`_Packing.placed`), and a chunk store
#: opens thousands of files of a few shapes.
_EntryTables = tuple[
    dict[str, TensorEntry], tuple[TensorEntry, ...], dict[str, int], tuple[TensorEntry, ...]
]
_ENTRY_TABLES: BoundedLRU[int, tuple[tuple[TensorEntry, ...], _EntryTables]] = BoundedLRU(64)


def _entry_tables(entries: tuple[TensorEntry, ...]) -> _EntryTables:
    """The entries by name, the snapshot's tensors in file order, the trailer rows of those
    and of a signed file's page digests, and those entries in row order; worked out once per
    entries tuple (kept with the tuple, so its id is not reused meanwhile)."""
    known = _ENTRY_TABLES.get(id(entries))
    if known is not None and known[0] is entries:
        return known[1]
    layers = tuple(entry for entry in entries if not is_container_tensor(entry.name))
    rowed = layers + tuple(entry for entry in entries if entry.name == PAGE_DIGESTS_TENSOR)
    tables = (
        {entry.name: entry for entry in entries},
        layers,
        {entry.name: row for row, entry in enumerate(rowed, start=1)},
        rowed,
    )
    _ENTRY_TABLES.put(id(entries), (entries, tables))
    return tables


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
    dtype = KV_DTYPES[geometry.dtype].safetensors
    page_shape = geometry.canonical_page_shape
    names = geometry.tensor_names()
    for name in names:
        specs.append(TensorSpec(name, dtype, (num_blocks, *page_shape), DATA_ALIGNMENT))
    specs.append(TensorSpec(BLOCK_CHECKSUMS_TENSOR, "U64", (len(names), num_blocks), 8))
    return specs


def specs_for(metadata: SnapshotMetadata | HeaderMetadata) -> list[TensorSpec]:
    """:func:`snapshot_specs` of a metadata object (worked out once per process for each
    geometry, block count and sequence shapes: a reader opening many files of one shape asks
    again for every header)."""
    if isinstance(metadata, SnapshotMetadata):
        shapes = tuple((record.num_tokens, len(record.block_ids)) for record in metadata.sequences)
    else:
        shapes = tuple((shape.num_tokens, shape.num_blocks) for shape in metadata.sequences)
    return list(_cached_specs(metadata.geometry, int(metadata.num_blocks), shapes))


@functools.lru_cache(maxsize=256)
def _cached_specs(
    geometry: KVGeometry, num_blocks: int, shapes: tuple[tuple[int, int], ...]
) -> tuple[TensorSpec, ...]:
    return tuple(snapshot_specs(geometry, num_blocks, shapes))


register_cache_clear(_cached_specs.cache_clear)


def file_specs(
    specs: Sequence[TensorSpec], signature: str | None, num_blocks: int
) -> list[TensorSpec]:
    """Every tensor of one file holding the snapshot tensors ``specs``, in file order, padding
    excluded: ``specs``; with ``signature`` :data:`SIGNATURE_ALGORITHM`, the page digests of
    the file's layer tensors (``(layer tensors, num_blocks, 32)``, with a trailer row); the
    checksum trailer; with any ``signature``, the signature."""
    digests = []
    if signature == SIGNATURE_ALGORITHM:
        layers = sum(1 for spec in specs if is_layer_tensor(spec.name))
        shape = (layers, num_blocks, PAGE_DIGEST_BYTES)
        digests = [TensorSpec(PAGE_DIGESTS_TENSOR, "U8", shape)]
    rows = len(specs) + len(digests) + 2
    trailer = TensorSpec(CHECKSUMS_TENSOR, "U8", (rows, DIGEST_BYTES))
    signed = [SIGNATURE_SPEC] if signature else []
    return [*specs, *digests, trailer, *signed]


class _Packing:
    """Where ``specs`` go in a file, relative to its data start, and their header entries as
    JSON: everything of :func:`pack_file` but the metadata string, which changes per snapshot
    (ids, time) while the specs repeat for every capture of one shape."""

    def __init__(self, specs: tuple[TensorSpec, ...], signature: str | None, blocks: int) -> None:
        relative: list[TensorEntry] = []
        offset = 0
        for spec in file_specs(specs, signature, blocks):
            aligned = -(-offset // spec.alignment) * spec.alignment
            if aligned > offset:
                relative.append(
                    TensorEntry(
                        PADDING_PREFIX + spec.name, "U8", (aligned - offset,), offset, aligned
                    )
                )
            relative.append(
                TensorEntry(spec.name, spec.dtype, spec.shape, aligned, aligned + spec.nbytes)
            )
            offset = aligned + spec.nbytes
        self.relative = tuple(relative)
        entries = {
            entry.name: {
                "dtype": entry.dtype,
                "shape": list(entry.shape),
                "data_offsets": [entry.begin, entry.end],
            }
            for entry in relative
        }
        # The header object without its braces: "name":{...},... (there is always a trailer).
        self.entries_json = dump_json(entries)[1:-1]
        self._placed: dict[int, tuple[TensorEntry, ...]] = {}

    def placed(self, data_start: int) -> tuple[TensorEntry, ...]:
        """The entries at absolute offsets in a file whose data starts at ``data_start``."""
        entries = self._placed.get(data_start)
        if entries is None:
            entries = tuple(
                TensorEntry(e.name, e.dtype, e.shape, e.begin + data_start, e.end + data_start)
                for e in self.relative
            )
            if len(self._placed) >= 8:  # headers of one shape round to few data starts
                self._placed.clear()
            self._placed[data_start] = entries
        return entries


@functools.lru_cache(maxsize=512)
def _packing(
    specs: tuple[TensorSpec, ...], signature: str | None = None, num_blocks: int = 0
) -> _Packing:
    # Only the page digests' shape depends on the block count.
    return _Packing(specs, signature, num_blocks if signature == SIGNATURE_ALGORITHM else 0)


register_cache_clear(_packing.cache_clear)


def _pack(packing: _Packing, kvsnap_json: str) -> FileLayout:
    metadata = dump_json({"__metadata__": {"format": "pt", METADATA_KEY: kvsnap_json}})
    body = f"{metadata[:-1]},{packing.entries_json}}}".encode("ascii")
    data_start = -(-(HEADER_PREFIX.size + len(body)) // DATA_ALIGNMENT) * DATA_ALIGNMENT
    padded = body + b" " * (data_start - HEADER_PREFIX.size - len(body))
    header = HEADER_PREFIX.pack(len(padded)) + padded
    return FileLayout(header, packing.placed(data_start), kvsnap_json)


def pack_file(
    specs: Sequence[TensorSpec],
    kvsnap_json: str,
    signature: str | None = None,
    num_blocks: int = 0,
) -> FileLayout:
    """Lay out one file holding ``specs`` in order, plus padding and its checksum trailer, and
    with ``signature`` (the metadata's algorithm) the signature after the trailer
    (:data:`SIGNATURE_TENSOR`), for :data:`SIGNATURE_ALGORITHM` with the page digests of the
    file's layer tensors (``num_blocks`` blocks) before it (:func:`file_specs`).

    Offsets relative to the data start do not depend on the header length, and the data
    start is a multiple of :data:`DATA_ALIGNMENT`, so aligning relative offsets aligns file
    offsets. The header is padded with spaces (which JSON ignores) up to that multiple. The
    placement of a sequence of specs is computed once per process and reused, and so are the
    last few layouts (a reader packs a file's header twice as it checks it: for its bounds and
    against its bytes).
    """
    packing = _packing(tuple(specs), signature, num_blocks)
    key = (packing, kvsnap_json)
    layout = _RECENT_LAYOUTS.get(key)
    if layout is None:
        layout = _pack(packing, kvsnap_json)
        _RECENT_LAYOUTS.put(key, layout)
    return layout


#: The last layouts :func:`pack_file` made, by their packing and metadata string.
_RECENT_LAYOUTS: BoundedLRU[tuple[_Packing, str], FileLayout] = BoundedLRU(8)


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


@functools.lru_cache(maxsize=256)
def _cached_file_layouts(
    geometry: KVGeometry,
    num_blocks: int,
    shapes: tuple[tuple[int, int], ...],
    max_shard_bytes: int | None,
    signature: str | None,
) -> tuple[_Packing, ...]:
    """The packings of a snapshot's files: pure in its arguments, so computed once each."""
    groups = split_shards(snapshot_specs(geometry, num_blocks, shapes), max_shard_bytes)
    return tuple(_packing(tuple(group), signature, num_blocks) for group in groups)


register_cache_clear(_cached_file_layouts.cache_clear)


def file_layouts(
    metadata: SnapshotMetadata, max_shard_bytes: int | None = None
) -> list[FileLayout]:
    """The exact layout of every file of a snapshot: one, or one per shard.

    Everything but the headers' metadata JSON depends only on the geometry, the block count,
    the sequences' shapes and ``max_shard_bytes``; it is computed once per process for each.
    """
    shapes = tuple((record.num_tokens, len(record.block_ids)) for record in metadata.sequences)
    packings = _cached_file_layouts(
        metadata.geometry, int(metadata.num_blocks), shapes, max_shard_bytes, metadata.signature
    )
    if len(packings) == 1:
        return [_pack(packings[0], metadata.to_json())]
    count = len(packings)
    return [
        _pack(packing, metadata.to_json((index + 1, count)))
        for index, packing in enumerate(packings)
    ]
