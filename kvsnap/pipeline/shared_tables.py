"""The page tables kept per process: one per shape of caches, rebased when caches move.

Building a `PageTable` and checking whether the fused copy serves it takes milliseconds for
many ranks; an engine passes the same caches on every call, and transformers allocates a new
``DynamicCache`` per restore that differs only by where it lies. So tables are kept per shape
(addresses relative to the first tensor), in a `BoundedLRU` of ``MAX_SHARED_TABLES`` entries,
and a table is rebased onto a moved cache with one addition per fragment group.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from kvsnap.caches import BoundedLRU, register_cache_clear
from kvsnap.layout import CacheLayout, PageRef
from kvsnap.pipeline.fused import fused_unavailable
from kvsnap.transfer.page_table import PageTable
from kvsnap.transfer.plan import Direction

#: Page tables kept by the process-wide cache (each a few arrays of addresses, no tensors).
MAX_SHARED_TABLES = 32


class _TableKey:
    """A page table's key (:func:`layout_key` of every layout) with its hash worked out once:
    the key of 80 layers x 8 ranks is ~1,300 tuples, and the LRU hashes a key twice a lookup
    (~0.1 ms of every call when it was a plain tuple). Kept per set of layout objects
    (:func:`_tables_key`), so a warm call's lookup finds the very key object, hash and all."""

    __slots__ = ("_hash", "parts")

    def __init__(self, parts: tuple[object, ...]) -> None:
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _TableKey) and (
            other is self or (other._hash == self._hash and other.parts == self.parts)
        )


_TABLES: BoundedLRU[_TableKey, _SharedEntry] = BoundedLRU(MAX_SHARED_TABLES)
#: Per set of layout objects, their table key (see :func:`_tables_key`); per list of page
#: references, its part of the key. Both bounded like ``_SPLITS`` in the page table.
_LAYOUT_KEYS: dict[tuple[int, ...], tuple[list[weakref.ref], _TableKey, int]] = {}
_REFS_KEYS: dict[int, tuple[list[PageRef], tuple[object, ...]]] = {}
_MAX_KEYS = 256


def _forget_keys() -> None:
    _LAYOUT_KEYS.clear()
    _REFS_KEYS.clear()


register_cache_clear(_forget_keys)


def layout_key(layout: CacheLayout, base: int = 0) -> tuple[object, ...]:
    """Everything a page table depends on: addresses (as offsets from ``base``), strides, block
    counts and copy runs."""
    return (
        layout.encoding,
        layout.tp_rank,
        layout.tp_size,
        layout.geometry,
        str(layout.device),
        tuple((t.data_ptr - base, t.num_blocks, t.block_stride_bytes) for t in layout.tensors),
        _refs_key(layout.refs),
    )


def _refs_key(refs: list[PageRef]) -> tuple[object, ...]:
    """The copy runs part of :func:`layout_key`, worked out once per list: layouts rebased onto
    a new cache (:class:`~kvsnap.layout.cache.LayoutTemplate`) share their template's list."""
    known = _REFS_KEYS.get(id(refs))
    if known is not None and known[0] is refs:
        return known[1]
    key = tuple((ref.tensor_index, ref.layer, ref.part, ref.mapping.digest) for ref in refs)
    if len(_REFS_KEYS) >= _MAX_KEYS:
        _REFS_KEYS.clear()
    _REFS_KEYS[id(refs)] = (refs, key)
    return key


def _tables_key(layouts: Sequence[CacheLayout]) -> tuple[_TableKey, int]:
    """The key of ``layouts``' page table with every address relative to the first tensor's,
    and that tensor's address. Caches that differ only by where they lie as a whole (a
    ``DynamicCache`` allocated anew per restore) share one key, so one table, rebased. Kept
    per set of layout objects: an engine passes the same layouts on every call."""
    ids = tuple(map(id, layouts))
    known = _LAYOUT_KEYS.get(ids)
    if known is not None and all(map(_refers_to, known[0], layouts)):
        return known[1], known[2]
    base = layouts[0].tensors[0].data_ptr
    key = _TableKey(tuple(layout_key(layout, base) for layout in layouts))
    if len(_LAYOUT_KEYS) >= _MAX_KEYS:
        _LAYOUT_KEYS.clear()
    _LAYOUT_KEYS[ids] = ([weakref.ref(layout) for layout in layouts], key, base)
    return key, base


def _refers_to(reference: weakref.ref, layout: CacheLayout) -> bool:
    return reference() is layout


def shared_page_table(layouts: Sequence[CacheLayout], direction: Direction) -> PageTable | None:
    """The process-wide page table of ``layouts``, or ``None`` where the fused copy cannot
    serve them in ``direction`` (:func:`~kvsnap.pipeline.movers.fused_unavailable`). Both are
    worked out once per layout shape (the tiling check of many ranks takes milliseconds);
    caches moved as a whole get the table rebased onto their address. The least recently
    used shapes past ``MAX_SHARED_TABLES`` are dropped."""
    key, base = _tables_key(layouts)
    entry = _TABLES.get(key)
    if entry is None:
        entry = _SharedEntry(layouts, base)
        _TABLES.put(key, entry)
    return entry.table_for(direction, base)


class _SharedEntry:
    """One layout shape's page table (built at ``base``) and, per direction, whether the fused
    copy serves it.

    Everything is worked out at once, so the cache never holds the caches' tensors.
    """

    def __init__(self, layouts: Sequence[CacheLayout], base: int) -> None:
        self._usable = {
            direction: fused_unavailable(layouts, direction) is None for direction in Direction
        }
        self._table = PageTable(layouts) if any(self._usable.values()) else None
        self._base = base
        #: The last rebased table and its base: a caller alternating between two caches
        #: rebases each time, one reusing a cache rebases once.
        self._last: tuple[int, PageTable | None] = (base, self._table)

    def table_for(self, direction: Direction, base: int) -> PageTable | None:
        if not self._usable[direction] or self._table is None:
            return None
        last_base, table = self._last
        if last_base != base:
            table = self._table.rebased(base - self._base)
            self._last = (base, table)
        return table
