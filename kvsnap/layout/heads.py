"""Head ranges: which global KV heads a rank holds, and a rank's cache seen as a part's cache.

A parted snapshot (docs/format.md, "Parted snapshots") stores each head range
``[first_head, first_head + num_heads)`` of every layer in its own file, whose canonical page is
``(block_size, num_heads, head_dim)``. :func:`part_layout` describes a rank's cache in that part
geometry: its copy runs restricted to the heads of the range and re-addressed onto the part's
canonical page, so the ordinary capture and restore machinery moves exactly those heads.
:func:`part_assignments` says which TP rank writes which part.

Both :func:`head_range` and :func:`part_layout` are cached: an engine calls them per request,
and the second call for the same layout object is a dictionary lookup. The re-addressed copy
runs are cached separately by mapping, so a layout rebuilt over the same tensors (or every layer
of one layout, which usually share a mapping) pays the unrolling once.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from kvsnap.caches import register_cache_clear
from kvsnap.errors import LayoutError
from kvsnap.layout.cache import CacheLayout, PageRef
from kvsnap.layout.geometry import KVGeometry
from kvsnap.layout.mapping import CanonicalPageMapping, CopyRun, fold_fragments, head_shard

_T = TypeVar("_T")

__all__ = ["PartAssignment", "head_range", "part_assignments", "part_geometry", "part_layout"]


@dataclass(frozen=True)
class PartAssignment:
    """One part of a parted snapshot: global heads ``[first_head, first_head + num_heads)``,
    written by TP rank ``writer_rank``. ``index`` is the part's 1-based number."""

    index: int
    first_head: int
    num_heads: int
    writer_rank: int


def part_assignments(geometry: KVGeometry, tp_size: int) -> list[PartAssignment]:
    """Which TP rank writes which part when every rank writes its own heads.

    One part per distinct head group of :func:`~kvsnap.layout.mapping.head_shard`: with
    ``tp_size <= num_kv_heads`` rank ``r`` writes heads ``[r*H/tp, (r+1)*H/tp)``; with more ranks
    than heads, the first rank of each replication group writes its one head. An MLA geometry
    is never parted (every rank holds the whole latent): the plan is empty, and the caller
    writes a plain snapshot from one rank. ``LayoutError`` when the heads do not split evenly.
    """
    if tp_size < 1:
        raise LayoutError(f"tp_size must be at least 1, got {tp_size}")
    if geometry.is_mla:
        return []
    parts: list[PartAssignment] = []
    for rank in range(tp_size):
        shard = head_shard(geometry.num_kv_heads, rank, tp_size)
        if shard.writer_index == 0:
            parts.append(
                PartAssignment(len(parts) + 1, shard.first_head, shard.num_local_heads, rank)
            )
    return parts


def part_geometry(geometry: KVGeometry, num_heads: int) -> KVGeometry:
    """``geometry`` with ``num_heads`` KV heads: the geometry of a part holding that many."""
    if geometry.is_mla:
        raise LayoutError("MLA (latent) caches are never parted: every rank holds the whole latent")
    return dataclasses.replace(geometry, num_kv_heads=num_heads)


def head_range(layout: CacheLayout) -> tuple[int, int]:
    """The global KV heads ``[first, end)`` ``layout``'s rank holds, read from its copy runs.

    ``LayoutError`` for an MLA layout (no heads) or a rank whose heads are not one contiguous
    range the same in every layer and part.
    """
    return _cached(layout, ("range",), lambda: _head_range(layout))


def part_layout(layout: CacheLayout, first_head: int, num_heads: int) -> CacheLayout | None:
    """``layout``'s cache seen as a cache of the part geometry (``num_kv_heads=num_heads``).

    Every page reference keeps only the bytes of global heads ``[first_head, first_head +
    num_heads)`` this rank holds, re-addressed onto the part's canonical page; writer election
    is dropped (each part layout writes every block it holds). ``None`` when the rank holds none
    of those heads. The rank may hold a subset of the range (a restore at a larger TP size
    fills only its heads) or a superset (a restore at a smaller TP size takes the part's heads
    out of its own). The result is cached per layout object and head range.
    """
    geometry = layout.geometry
    part_geometry(geometry, num_heads)  # refuses MLA
    end = first_head + num_heads
    if num_heads < 1 or first_head < 0 or end > geometry.num_kv_heads:
        raise LayoutError(
            f"heads {first_head}..{end} are not a range of the model's "
            f"{geometry.num_kv_heads} KV heads"
        )
    return _cached(
        layout, ("part", first_head, num_heads), lambda: _part_layout(layout, first_head, num_heads)
    )


# --------------------------------------------------------------------------------------------
# Caching per layout object


_CACHE: dict[int, tuple[weakref.ref[CacheLayout], dict[tuple[object, ...], object]]] = {}
# Reentrant: a weak reference made under it may run a collection whose callback (_forget)
# takes it again on the same thread.
_CACHE_LOCK = threading.RLock()


def _cached(layout: CacheLayout, key: tuple[object, ...], compute: Callable[[], _T]) -> _T:
    """``compute()`` once per (layout object, key); the entry goes when the layout does."""
    layout_id = id(layout)
    with _CACHE_LOCK:
        entry = _CACHE.get(layout_id)
        if entry is not None and entry[0]() is layout and key in entry[1]:
            return entry[1][key]  # type: ignore[return-value]
    value = compute()
    with _CACHE_LOCK:
        entry = _CACHE.get(layout_id)
        if entry is None or entry[0]() is not layout:
            # CacheLayout is an unhashable dataclass: keyed by id, guarded by a weak reference.
            entry = (weakref.ref(layout, lambda _, key=layout_id: _forget(key)), {})
            _CACHE[layout_id] = entry
        entry[1][key] = value
    return value


def _forget(layout_id: int) -> None:
    with _CACHE_LOCK:
        entry = _CACHE.get(layout_id)
        if entry is not None and entry[0]() is None:
            del _CACHE[layout_id]


@register_cache_clear
def _forget_every_layout() -> None:
    with _CACHE_LOCK:
        _CACHE.clear()


# --------------------------------------------------------------------------------------------
# The work


def _head_bytes(geometry: KVGeometry) -> int:
    return geometry.head_dim * geometry.element_size


def _pieces(
    mapping: CanonicalPageMapping, head_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The mapping unrolled into pieces that each lie in one (token, head) row of the
    canonical page: ``(local offsets, canonical offsets, sizes)``. A fragment of whole rows
    becomes one piece per row; a fragment inside one row (a layout that interleaves a head's
    dimensions, such as vLLM's CPU cache) stays as it is."""
    local, canonical, sizes = mapping.fragments()
    whole_rows = (canonical % head_bytes == 0) & (sizes % head_bytes == 0)
    one_row = canonical // head_bytes == (canonical + sizes - 1) // head_bytes
    if not (whole_rows | one_row).all():
        raise LayoutError(
            "copy runs cross a head's row part-way: the layout cannot be cut into head ranges"
        )
    counts = np.where(whole_rows, sizes // head_bytes, 1)
    piece_sizes = np.repeat(np.where(whole_rows, head_bytes, sizes), counts)
    steps = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(
        np.cumsum(counts) - counts, counts
    )
    offsets = steps * piece_sizes
    return np.repeat(local, counts) + offsets, np.repeat(canonical, counts) + offsets, piece_sizes


# Every layer of a cache usually shares one mapping: its heads are worked out once.
@functools.lru_cache(maxsize=256)
def _heads_of(
    mapping: CanonicalPageMapping, num_kv_heads: int, head_bytes: int
) -> tuple[int, int] | None:
    """The range ``[first, end)`` of heads ``mapping`` holds; ``None`` when they are not one
    non-empty contiguous range."""
    _, canonical, _ = _pieces(mapping, head_bytes)
    heads = np.unique(canonical // head_bytes % num_kv_heads)
    if not len(heads) or heads[-1] - heads[0] + 1 != len(heads):
        return None
    return int(heads[0]), int(heads[-1]) + 1


register_cache_clear(_heads_of.cache_clear)


def _head_range(layout: CacheLayout) -> tuple[int, int]:
    geometry = layout.geometry
    if geometry.is_mla:
        raise LayoutError("an MLA (latent) layout holds no KV heads")
    ranges = set()
    for ref in layout.refs:
        heads = _heads_of(ref.mapping, geometry.num_kv_heads, _head_bytes(geometry))
        if heads is None:
            raise LayoutError(f"{ref.name}: the heads this rank holds are not a contiguous range")
        ranges.add(heads)
    if len(ranges) != 1:
        raise LayoutError(f"layers and parts of one rank hold different heads: {sorted(ranges)}")
    return ranges.pop()


@functools.lru_cache(maxsize=256)
def _part_mapping(
    mapping: CanonicalPageMapping,
    num_kv_heads: int,
    head_bytes: int,
    first_head: int,
    num_heads: int,
) -> CanonicalPageMapping | None:
    """``mapping`` restricted to heads ``[first_head, +num_heads)`` on the part's page."""
    local, canonical, sizes = _pieces(mapping, head_bytes)
    row, within = canonical // head_bytes, canonical % head_bytes
    token, head = row // num_kv_heads, row % num_kv_heads
    keep = (head >= first_head) & (head < first_head + num_heads)
    if not keep.any():
        return None
    moved = (token * num_heads + head - first_head) * head_bytes + within
    page_bytes = mapping.canonical_page_size_bytes // num_kv_heads * num_heads
    runs: list[CopyRun] = []
    for size in np.unique(sizes[keep]):  # fold_fragments folds equal-size fragments
        same = keep & (sizes == size)
        runs += fold_fragments(local[same], moved[same], int(size))
    return CanonicalPageMapping(page_bytes, tuple(runs))


register_cache_clear(_part_mapping.cache_clear)


def _part_layout(layout: CacheLayout, first_head: int, num_heads: int) -> CacheLayout | None:
    geometry = layout.geometry
    target = part_geometry(geometry, num_heads)
    refs = []
    for ref in layout.refs:
        mapping = _part_mapping(
            ref.mapping, geometry.num_kv_heads, _head_bytes(geometry), first_head, num_heads
        )
        if mapping is None:
            refs.append(None)
            continue
        refs.append(PageRef(ref.tensor_index, ref.layer, ref.part, mapping))
    if all(ref is None for ref in refs):
        return None
    if any(ref is None for ref in refs):
        raise LayoutError(
            f"some layers of this rank hold heads of {first_head}..{first_head + num_heads}, "
            "others none"
        )
    return CacheLayout(
        geometry=target,
        tensors=layout.tensors,
        refs=[ref for ref in refs if ref is not None],
        encoding=layout.encoding,
        tp_rank=layout.tp_rank,
        tp_size=layout.tp_size,
    )
