"""The container: which tensor goes where in a file (specs, padding, sharding, header bytes)."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvsnap.caches import BoundedLRU, register_cache_clear
from kvsnap.dtypes import KV_DTYPES, SAFETENSORS_TYPES
from kvsnap.format.constants import (
    BLOCK_CHECKSUMS_TENSOR,
    BLOCK_HASHES_TENSOR,
    CHECKSUMS_TENSOR,
    DATA_ALIGNMENT,
    DIGEST_BYTES,
    HEADER_PREFIX,
    METADATA_KEY,
    PADDING_PREFIX,
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


def is_layer_tensor(name: str) -> bool:
    """Whether ``name`` is a KV page tensor (``layers.{i}.{part}``)."""
    return name.startswith("layers.")


def is_container_tensor(name: str) -> bool:
    """Padding, the per-file checksum trailer and the signature: part of one file, not of the
    snapshot."""
    return name in (CHECKSUMS_TENSOR, SIGNATURE_TENSOR) or name.startswith(PADDING_PREFIX)


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
        """Entries with a trailer row, in row order (after the header's row 0)."""
        return list(self.layer_entries)

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
_EntryTables = tuple[dict[str, TensorEntry], tuple[TensorEntry, ...], dict[str, int]]
_ENTRY_TABLES: BoundedLRU[int, tuple[tuple[TensorEntry, ...], _EntryTables]] = BoundedLRU(64)


def _entry_tables(entries: tuple[TensorEntry, ...]) -> _EntryTables:
    """The entries by name, the layer entries in file order and their trailer rows, worked
    out once per entries tuple (kept with the tuple, so its id is not reused meanwhile)."""
    known = _ENTRY_TABLES.get(id(entries))
    if known is not None and known[0] is entries:
        return known[1]
    layers = tuple(entry for entry in entries if not is_container_tensor(entry.name))
    tables = (
        {entry.name: entry for entry in entries},
        layers,
        {entry.name: row for row, entry in enumerate(layers, start=1)},
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


class _Packing:
    """Where ``specs`` go in a file, relative to its data start, and their header entries as
    JSON: everything of :func:`pack_file` but the metadata string, which changes per snapshot
    (ids, time) while the specs repeat for every capture of one shape."""

    def __init__(self, specs: tuple[TensorSpec, ...], signed: bool) -> None:
        trailer = TensorSpec(CHECKSUMS_TENSOR, "U8", (len(specs) + 2, DIGEST_BYTES))
        signature = [TensorSpec(SIGNATURE_TENSOR, "U8", (SIGNATURE_BYTES,))] if signed else []
        relative: list[TensorEntry] = []
        offset = 0
        for spec in [*specs, trailer, *signature]:
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
def _packing(specs: tuple[TensorSpec, ...], signed: bool = False) -> _Packing:
    return _Packing(specs, signed)


register_cache_clear(_packing.cache_clear)


def _pack(packing: _Packing, kvsnap_json: str) -> FileLayout:
    metadata = dump_json({"__metadata__": {"format": "pt", METADATA_KEY: kvsnap_json}})
    body = f"{metadata[:-1]},{packing.entries_json}}}".encode("ascii")
    data_start = -(-(HEADER_PREFIX.size + len(body)) // DATA_ALIGNMENT) * DATA_ALIGNMENT
    padded = body + b" " * (data_start - HEADER_PREFIX.size - len(body))
    header = HEADER_PREFIX.pack(len(padded)) + padded
    return FileLayout(header, packing.placed(data_start), kvsnap_json)


def pack_file(specs: Sequence[TensorSpec], kvsnap_json: str, signed: bool = False) -> FileLayout:
    """Lay out one file holding ``specs`` in order, plus padding and its checksum trailer, and
    with ``signed`` the signature after the trailer (:data:`SIGNATURE_TENSOR`).

    Offsets relative to the data start do not depend on the header length, and the data
    start is a multiple of :data:`DATA_ALIGNMENT`, so aligning relative offsets aligns file
    offsets. The header is padded with spaces (which JSON ignores) up to that multiple. The
    placement of a sequence of specs is computed once per process and reused, and so are the
    last few layouts (a reader packs a file's header twice as it checks it: for its bounds and
    against its bytes).
    """
    packing = _packing(tuple(specs), signed)
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
    signed: bool,
) -> tuple[_Packing, ...]:
    """The packings of a snapshot's files: pure in its arguments, so computed once each."""
    groups = split_shards(snapshot_specs(geometry, num_blocks, shapes), max_shard_bytes)
    return tuple(_packing(tuple(group), signed) for group in groups)


register_cache_clear(_cached_file_layouts.cache_clear)


def file_layouts(
    metadata: SnapshotMetadata, max_shard_bytes: int | None = None
) -> list[FileLayout]:
    """The exact layout of every file of a snapshot: one, or one per shard.

    Everything but the headers' metadata JSON depends only on the geometry, the block count,
    the sequences' shapes and ``max_shard_bytes``; it is computed once per process for each.
    """
    shapes = tuple((record.num_tokens, len(record.block_ids)) for record in metadata.sequences)
    signed = metadata.signature is not None
    packings = _cached_file_layouts(
        metadata.geometry, int(metadata.num_blocks), shapes, max_shard_bytes, signed
    )
    if len(packings) == 1:
        return [_pack(packings[0], metadata.to_json())]
    count = len(packings)
    return [
        _pack(packing, metadata.to_json((index + 1, count)))
        for index, packing in enumerate(packings)
    ]
