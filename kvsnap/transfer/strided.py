"""Page copies that are a transpose: one numpy assignment between strided views per batch.

vLLM's CPU attention backend keeps each head's keys dim-major inside a block, so the canonical
token-major page reaches the cache as element-sized fragments: 2,048 fragments of 2 bytes per
page of 32 tokens x 2 heads x 32 dims. Copied one index per fragment (a gather and a scatter of
fragment-sized elements, :func:`~kvsnap.transfer.cpu.copy_page_fragments`) that is ~10 ns per
2 bytes. But such a page is a regular pattern: taken in canonical order, its fragments walk the
cache with constant strides (``base + t*stride_t + h*stride_h + d*stride_d``). A
:class:`StridedPattern`, found once per page table group (:func:`find_strided_pattern`),
describes the page as an array of that shape on both sides; :func:`copy_strided_pages` then
views every page of a copy as one numpy array per side (the pages are indices into an axis of
word-sized steps over the address range) and copies them with one assignment per batch of
pages, in numpy's strided loops.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

#: Pages a strided batch gathers before scattering them (a batch's bytes at most): small
#: enough that the gathered pages are still in the CPU's cache when they are scattered.
BATCH_BYTES = 1 << 20
#: Patterns of more axes are left to the fragment gather: each axis adds a loop level to
#: numpy's copy, and the layouts kvsnap meets need at most 5 (an AMX-ordered value block).
MAX_AXES = 8


@dataclass(frozen=True)
class StridedPattern:
    """A page table group's page as an array of fragments of ``fragment_bytes`` each.

    The fragment at multi-index ``i`` over ``shape`` (C order is canonical order) lies
    ``local_origin + sum(i * local_strides)`` bytes from a page's local base (the address of
    the group's first fragment) and ``canonical_origin + sum(i * canonical_strides)`` bytes
    from its canonical base. The canonical side is contiguous: ``canonical_strides`` are the C
    strides of ``shape`` in fragments. Strides and origins may be negative.
    """

    fragment_bytes: int
    shape: tuple[int, ...]
    local_strides: tuple[int, ...]
    canonical_strides: tuple[int, ...]
    local_origin: int
    canonical_origin: int

    @property
    def page_bytes(self) -> int:
        return self.fragment_bytes * int(np.prod(self.shape))


def find_strided_pattern(
    fragment_bytes: int, local_offsets: np.ndarray, canonical_offsets: np.ndarray
) -> StridedPattern | None:
    """The :class:`StridedPattern` of a fragment group, or ``None`` when it has none.

    One exists when the group's fragments, ordered by canonical offset, tile a contiguous
    canonical range and their local offsets are an affine function of a multi-index in C
    order (what a transpose of the canonical page is), in at most :data:`MAX_AXES` axes.
    """
    if len(local_offsets) < 2:
        return None
    order = np.argsort(canonical_offsets, kind="stable")
    canonical, local = canonical_offsets[order], local_offsets[order]
    if (np.diff(canonical) != fragment_bytes).any():
        return None  # the canonical side has gaps or overlaps: not a whole contiguous page
    axes = affine_axes(local)
    if axes is None or len(axes[0]) > MAX_AXES:
        return None
    shape, local_strides = axes
    canonical_strides = tuple(
        fragment_bytes * int(np.prod(shape[axis + 1 :])) for axis in range(len(shape))
    )
    return StridedPattern(
        fragment_bytes,
        shape,
        local_strides,
        canonical_strides,
        int(local[0]),
        int(canonical[0]),
    )


def affine_axes(values: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """``(shape, strides)`` with ``values.reshape(shape)[i] == values[0] + sum(i * strides)``
    for every multi-index ``i``, fewest axes first; ``None`` when no such shape exists or a
    stride would be 0 (two fragments at one place).

    Works inwards out: the innermost axis is the longest run of equal steps from the start;
    if the values are affine in any shape, that run ends exactly where the innermost axis of
    the fewest-axes shape does, and every row of that length repeats its steps.
    """
    shape: list[int] = []
    strides: list[int] = []
    rest = values
    while len(rest) > 1:
        step = int(rest[1] - rest[0])
        if step == 0:
            return None
        breaks = np.flatnonzero(np.diff(rest) != step)
        length = int(breaks[0]) + 1 if len(breaks) else len(rest)
        if len(rest) % length or len(shape) >= MAX_AXES:
            return None
        rows = rest.reshape(-1, length)
        if (rows != rows[:, :1] + step * np.arange(length, dtype=rows.dtype)).any():
            return None
        shape.append(length)
        strides.append(step)
        rest = rows[:, 0]
    return tuple(reversed(shape)), tuple(reversed(strides))


def copy_strided_pages(
    pattern: StridedPattern, src_bases: np.ndarray, dst_bases: np.ndarray, src_is_local: bool
) -> None:
    """For every page ``i``, copy the pattern's fragments from the page at ``src_bases[i]`` to
    the page at ``dst_bases[i]`` (host addresses of each page's first group fragment); the
    source is the cache side when ``src_is_local``, else the canonical side.

    Both sides are numpy views of the address ranges they touch, whose first axis steps one
    word at a time so that every page base is an index; a batch of pages is one gather into a
    temporary and one scatter. Destination pages must not overlap each other or the sources.
    """
    if len(src_bases) == 0:
        return
    local_side = (pattern.local_origin, pattern.local_strides)
    canonical_side = (pattern.canonical_origin, pattern.canonical_strides)
    src_side, dst_side = (
        (local_side, canonical_side) if src_is_local else (canonical_side, local_side)
    )
    src_origins = src_bases + src_side[0]
    dst_origins = dst_bases + dst_side[0]
    word = common_word(pattern, src_origins, dst_origins)
    src_view, src_index = pages_view(pattern, src_origins, src_side[1], word)
    dst_view, dst_index = pages_view(pattern, dst_origins, dst_side[1], word)
    per_batch = max(1, BATCH_BYTES // pattern.page_bytes)
    for start in range(0, len(src_index), per_batch):
        stop = start + per_batch
        dst_view[dst_index[start:stop]] = src_view[src_index[start:stop]]


def common_word(pattern: StridedPattern, *origins: np.ndarray) -> int:
    """The widest word (8/4/2/1 bytes) dividing the fragment size, every stride and every
    page origin's distance from the lowest of its side: the step of both views' page axis."""
    combined = pattern.fragment_bytes
    for stride in (*pattern.local_strides, *pattern.canonical_strides):
        combined |= abs(stride)
    for side in origins:
        combined |= int(np.bitwise_or.reduce(side - side.min()))
    return min(combined & -combined, 8)


def fragment_dtype(size: int) -> np.dtype:
    """An element of ``size`` bytes: an unsigned integer where one fits, else raw bytes (one
    ``memcpy`` per fragment; measured faster than a trailing axis of words for 64-256 bytes)."""
    if size in (1, 2, 4, 8):
        return np.dtype(f"u{size}")
    return np.dtype((np.void, size))


def pages_view(
    pattern: StridedPattern, origins: np.ndarray, strides: tuple[int, ...], word: int
) -> tuple[np.ndarray, np.ndarray]:
    """A view of host memory whose element ``[k, *i]`` is the fragment at multi-index ``i`` of
    the page whose origin is ``origins.min() + k * word``, and each page's ``k``."""
    first, last = int(origins.min()), int(origins.max())
    extents = [(count - 1) * stride for count, stride in zip(pattern.shape, strides, strict=True)]
    below = sum(min(0, extent) for extent in extents)
    above = sum(max(0, extent) for extent in extents)
    low, high = first + below, last + above + pattern.fragment_bytes
    buffer = memoryview((ctypes.c_uint8 * (high - low)).from_address(low))
    view = np.ndarray(
        ((last - first) // word + 1, *pattern.shape),
        dtype=fragment_dtype(pattern.fragment_bytes),
        buffer=buffer,
        offset=-below,
        strides=(word, *strides),
    )
    return view, (origins - first) // word
