"""The page table: every (rank, tensor) of the caches a process holds, as rows of one table.

Each row's copy runs are unrolled once into fragments and grouped: rows whose fragments have
the same size and the same relative offsets (every layer of one layout; every TP rank's head
slice, which differs only by where it starts) share one :class:`FragmentGroup`. A row then
needs only its base address, block stride and the two offsets its fragments start at. A slot's
pages turn into per-group arrays of page base addresses with a handful of numpy calls — no
Python loop over layers, ranks or blocks — and one kernel launch per group copies them all.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvsnap.layout import CacheLayout, CanonicalPageMapping
from kvsnap.transfer.plan import Direction
from kvsnap.transfer.strided import StridedPattern, find_strided_pattern


@dataclass(frozen=True)
class FragmentGroup:
    """Fragments of ``fragment_bytes`` each, at ``local_offsets`` from a row's local base and
    ``canonical_offsets`` from its canonical base (both start at 0). ``strided``: the page as
    a strided array on both sides, where it is one (a transpose of the canonical page; looked
    for in tables of host-memory caches only, whose copies use it)."""

    fragment_bytes: int
    local_offsets: np.ndarray
    canonical_offsets: np.ndarray
    strided: StridedPattern | None = None

    @property
    def num_fragments(self) -> int:
        return len(self.local_offsets)

    @functools.cached_property
    def offset_bits(self) -> int:
        """The bitwise or of the fragment size and every offset: its lowest set bit bounds
        the alignment of every fragment."""
        return self.fragment_bytes | _or_all(self.local_offsets) | _or_all(self.canonical_offsets)


@dataclass(frozen=True)
class GroupCopy:
    """One group's pages of a slot: page ``i``'s fragments go from ``src_bases[i]`` plus the
    group's source offsets to ``dst_bases[i]`` plus its destination offsets; it is part of
    the slot's page ``slot_pages[i]`` (a rank's share of it, or all of it)."""

    group: FragmentGroup
    src_bases: np.ndarray
    dst_bases: np.ndarray
    direction: Direction
    slot_pages: np.ndarray
    #: A number whose lowest set bit divides every address the copy touches (its bases, the
    #: group's offsets and the fragment size): worked out from the table's rows, not by a pass
    #: over the pages. ``None``: not known.
    address_bits: int | None = None

    @property
    def src_offsets(self) -> np.ndarray:
        if self.direction is Direction.DEVICE_TO_HOST:
            return self.group.local_offsets
        return self.group.canonical_offsets

    @property
    def dst_offsets(self) -> np.ndarray:
        if self.direction is Direction.DEVICE_TO_HOST:
            return self.group.canonical_offsets
        return self.group.local_offsets

    @property
    def num_pages(self) -> int:
        return len(self.src_bases)

    @property
    def num_bytes(self) -> int:
        return self.num_pages * self.group.num_fragments * self.group.fragment_bytes


class GroupRows:
    """The rows of one group, as arrays indexed by row (``local_base``, ``block_stride``,
    ``canonical_base``, set by :meth:`freeze`), and a ``(tensor, rank) -> row`` map (``row_of``,
    -1 where the tensor has no row of this group on that rank)."""

    def __init__(self, group: FragmentGroup, num_tensors: int, num_ranks: int) -> None:
        self.group = group
        self.row_of = np.full((num_tensors, num_ranks), -1, dtype=np.int64)
        self._rows: list[tuple[int, int, int, int, int]] = []

    def add(
        self,
        tensor: int,
        rank: int,
        local_base: int,
        block_stride: int,
        canonical_base: int,
        writers: tuple[int, int],
    ) -> None:
        self.row_of[tensor, rank] = len(self._rows)
        self._rows.append((local_base, block_stride, canonical_base, *writers))

    def freeze(self) -> None:
        table = np.array(self._rows, dtype=np.int64).reshape(-1, 5)
        self.local_base, self.block_stride, self.canonical_base = (
            table[:, 0],
            table[:, 1],
            table[:, 2],
        )
        self.num_writers, self.writer_index = table[:, 3], table[:, 4]
        # Every local address is a row's base plus a multiple of its block stride, every
        # canonical one a staging address plus a row's canonical base: this bounds them all.
        self.address_bits = _or_all(self.local_base | self.block_stride | self.canonical_base)
        # Tensors with a row in this group, and which ranks have one: most groups hold every
        # rank of every tensor, and then the lookup is a plain broadcast.
        self.dense = bool((self.row_of >= 0).all())

    def shifted(self, delta: int) -> GroupRows:
        """These rows for caches moved by ``delta`` bytes: only the local bases change."""
        rows = copy.copy(self)
        rows.local_base = self.local_base + delta
        rows.address_bits = self.address_bits | abs(delta)
        return rows


def _or_all(values: np.ndarray) -> int:
    return int(np.bitwise_or.reduce(values)) if len(values) else 0


_SPLITS: dict[bytes, list[tuple[int, np.ndarray, np.ndarray, int, int]]] = {}


def _split(mapping: CanonicalPageMapping) -> list[tuple[int, np.ndarray, np.ndarray, int, int]]:
    """A mapping's fragments per size: ``(size, local and canonical offsets relative to the
    first, first local offset, first canonical offset)``. Worked out once per mapping: engines
    that allocate new caches per call (transformers) rebuild only the base addresses."""
    cached = _SPLITS.get(mapping.digest)
    if cached is not None:
        return cached
    local, canonical, sizes = mapping.fragments()
    split = []
    for size in np.unique(sizes).tolist():
        chosen = sizes == size
        local_of, canonical_of = local[chosen], canonical[chosen]
        split.append(
            (
                int(size),
                local_of - local_of[0],
                canonical_of - canonical_of[0],
                int(local_of[0]),
                int(canonical_of[0]),
            )
        )
    if len(_SPLITS) > 4096:  # bounded: layouts of a process share a handful of mappings
        _SPLITS.clear()
    _SPLITS[mapping.digest] = split
    return split


class PageTable:
    """Rows for every rank of ``layouts`` (one device) and every canonical tensor.

    Raises ``ValueError`` when the layouts do not share one geometry and one device.
    """

    def __init__(self, layouts: Sequence[CacheLayout]) -> None:
        if not layouts:
            raise ValueError("a page table needs at least one layout")
        self.geometry = layouts[0].geometry
        self.device = layouts[0].device
        for layout in layouts:
            if layout.geometry != self.geometry or layout.device != self.device:
                raise ValueError("a page table's layouts share one geometry and one device")
        self.names = self.geometry.tensor_names()
        self.page_size_bytes = self.geometry.canonical_page_size_bytes
        groups: dict[tuple[int, bytes, bytes], GroupRows] = {}
        for rank, layout in enumerate(layouts):
            for tensor, name in enumerate(self.names):
                self._add_rows(groups, layout, name, tensor, rank, len(layouts))
        for rows in groups.values():
            rows.freeze()
        self._groups = list(groups.values())

    def _add_rows(
        self,
        groups: dict[tuple[int, bytes, bytes], GroupRows],
        layout: CacheLayout,
        name: str,
        tensor: int,
        rank: int,
        num_ranks: int,
    ) -> None:
        ref = layout.ref(name)
        cache = layout.tensors[ref.tensor_index]
        writers = (ref.mapping.num_writers, ref.mapping.writer_index)
        for size, relative_local, relative_canonical, local_start, canonical_start in _split(
            ref.mapping
        ):
            key = (size, relative_local.tobytes(), relative_canonical.tobytes())
            rows = groups.get(key)
            if rows is None:
                strided = None
                if self.device.type == "cpu":
                    strided = find_strided_pattern(size, relative_local, relative_canonical)
                group = FragmentGroup(size, relative_local, relative_canonical, strided)
                rows = groups[key] = GroupRows(group, len(self.names), num_ranks)
            rows.add(
                tensor,
                rank,
                cache.data_ptr + local_start,
                cache.block_stride_bytes,
                canonical_start,
                writers,
            )

    def rebased(self, delta: int) -> PageTable:
        """This table for the same caches moved ``delta`` bytes as a whole (every tensor of
        every rank), as transformers allocates a new cache per call: the rows are shifted,
        nothing is worked out again."""
        table = copy.copy(self)
        table._groups = [rows.shifted(delta) for rows in self._groups]
        return table

    @property
    def groups(self) -> list[FragmentGroup]:
        return [rows.group for rows in self._groups]

    @property
    def group_rows(self) -> list[GroupRows]:
        """Every group with its rows (read-only: a loader working out its own copy plan from
        them, :mod:`kvsnap.pipeline.held_load`)."""
        return list(self._groups)

    def copies(
        self,
        direction: Direction,
        page_tensors: np.ndarray,
        device_blocks: np.ndarray,
        staging_addresses: np.ndarray,
        snapshot_blocks: np.ndarray | None = None,
    ) -> list[GroupCopy]:
        """Per group, the page bases that move page ``i`` (tensor ``page_tensors[i]``, device
        block ``device_blocks[i]``) to or from the canonical page at ``staging_addresses[i]``.

        At device to host only each block's elected writer copies it; ``snapshot_blocks``
        (default: ``device_blocks``) number the blocks the way writer election keys on.
        """
        copies = []
        staging_bits = _or_all(staging_addresses)
        for rows in self._groups:
            row = rows.row_of[page_tensors]  # (pages, ranks)
            pages = np.broadcast_to(np.arange(len(page_tensors))[:, None], row.shape)
            keep = row >= 0 if not rows.dense else None
            if direction is Direction.DEVICE_TO_HOST and (rows.num_writers > 1).any():
                keys = device_blocks if snapshot_blocks is None else snapshot_blocks
                elected = keys[:, None] % rows.num_writers[row] == rows.writer_index[row]
                keep = elected if keep is None else keep & elected
            if keep is None:
                row, pages = row.reshape(-1), pages.reshape(-1)
            else:
                row, pages = row[keep], pages[keep]
            if not len(row):
                continue
            local = rows.local_base[row] + device_blocks[pages] * rows.block_stride[row]
            canonical = staging_addresses[pages] + rows.canonical_base[row]
            bits = rows.address_bits | staging_bits | rows.group.offset_bits
            if direction is Direction.DEVICE_TO_HOST:
                copies.append(GroupCopy(rows.group, local, canonical, direction, pages, bits))
            else:
                copies.append(GroupCopy(rows.group, canonical, local, direction, pages, bits))
        return copies
