"""The strided page copy (``kvsnap/transfer/strided.py``): pages that are a transpose of the
canonical page, recognized from a group's fragment offsets and copied as strided views, equal
the fragment-by-fragment copy in both directions; fragments in no such pattern are left to the
gather."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsnap.transfer import strided
from kvsnap.transfer.cpu import copy_page_fragments
from kvsnap.transfer.strided import affine_axes, copy_strided_pages, find_strided_pattern


def _transposed_page(
    rng: np.random.Generator, shape: tuple[int, ...], size: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """A page of ``shape`` fragments of ``size`` bytes: canonical offsets in C order, local
    offsets with the axes in a random memory order, some reversed, and random gaps between
    them (a dim-major key block inside a larger plane), and the bytes one local block spans."""
    memory_order = rng.permutation(len(shape))  # innermost first
    strides = np.zeros(len(shape), dtype=np.int64)
    extent = size
    for axis in memory_order:
        strides[axis] = extent + size * int(rng.integers(0, 3))
        extent = int(strides[axis]) * shape[axis]
    strides *= rng.choice([-1, 1], len(shape))
    index = np.indices(shape).reshape(len(shape), -1)
    local = (strides[:, None] * index).sum(axis=0)
    local -= local.min()
    canonical = np.arange(index.shape[1], dtype=np.int64) * size
    return local, canonical, extent + size * int(rng.integers(0, 4))


def _copy_by_fragment(
    source: np.ndarray,
    destination: np.ndarray,
    src_bases: np.ndarray,
    src_offsets: np.ndarray,
    dst_bases: np.ndarray,
    dst_offsets: np.ndarray,
    size: int,
) -> None:
    """The reference: every fragment of every page as its own byte slice."""
    for src_base, dst_base in zip(src_bases.tolist(), dst_bases.tolist(), strict=True):
        for src_offset, dst_offset in zip(src_offsets.tolist(), dst_offsets.tolist(), strict=True):
            s = src_base + src_offset - source.ctypes.data
            d = dst_base + dst_offset - destination.ctypes.data
            destination[d : d + size] = source[s : s + size]


@settings(max_examples=80, deadline=None)
@given(
    size=st.sampled_from([1, 2, 4]),
    shape=st.lists(st.integers(1, 7), min_size=2, max_size=4).map(tuple),
    num_pages=st.integers(1, 6),
    shift=st.integers(0, 7),
    batch_bytes=st.sampled_from([1, 300, 1 << 20]),
    seed=st.integers(0, 2**32 - 1),
)
def test_strided_copy_equals_the_fragment_copy_both_ways(
    size: int,
    shape: tuple[int, ...],
    num_pages: int,
    shift: int,
    batch_bytes: int,
    seed: int,
) -> None:
    """Element sizes 1/2/4, odd axis lengths, blocks and staging pages in any order, addresses
    off any alignment, fragments listed in any order with offsets relative to the first (so
    some negative, as a page table keeps them), batches splitting the pages unevenly."""
    rng = np.random.default_rng(seed)
    local, canonical, block_bytes = _transposed_page(rng, shape, size)
    listed = rng.permutation(len(local))
    local, canonical = local[listed], canonical[listed]
    local_offsets, canonical_offsets = local - local[0], canonical - canonical[0]
    pattern = find_strided_pattern(size, local_offsets, canonical_offsets)
    if len(local) < 2:
        assert pattern is None
        return
    assert pattern is not None and int(np.prod(pattern.shape)) == len(local)

    num_blocks = num_pages + 3
    page_bytes = len(local) * size
    cache_bytes = rng.integers(0, 256, num_blocks * block_bytes + 16, dtype=np.uint8)
    staging_bytes = rng.integers(0, 256, num_pages * page_bytes + 16, dtype=np.uint8)
    blocks = rng.choice(num_blocks, num_pages, replace=False)
    slots = rng.permutation(num_pages)
    local_bases = cache_bytes.ctypes.data + shift + blocks * block_bytes + local[0]
    canonical_bases = staging_bytes.ctypes.data + 8 - shift + slots * page_bytes + canonical[0]

    previous = strided.BATCH_BYTES
    strided.BATCH_BYTES = batch_bytes
    try:
        for src_is_local in (False, True):  # restore (staging -> cache), then capture
            if src_is_local:
                source, destination = cache_bytes, staging_bytes
                bases = (local_bases, canonical_bases)
                offsets = (local_offsets, canonical_offsets)
            else:
                source, destination = staging_bytes, cache_bytes
                bases = (canonical_bases, local_bases)
                offsets = (canonical_offsets, local_offsets)
            before = destination.copy()
            _copy_by_fragment(source, destination, bases[0], offsets[0], bases[1], offsets[1], size)
            expected = destination.copy()
            destination[:] = before
            copy_strided_pages(pattern, bases[0], bases[1], src_is_local)
            assert np.array_equal(destination, expected)
            # The gather it replaces agrees.
            destination[:] = before
            copy_page_fragments(bases[0], offsets[0], bases[1], offsets[1], size)
            assert np.array_equal(destination, expected)
    finally:
        strided.BATCH_BYTES = previous


def test_fragments_in_no_strided_pattern_are_refused() -> None:
    size = 2
    canonical = np.arange(4, dtype=np.int64) * size
    # Local steps 1, 2, 2: no shape makes these offsets affine.
    assert find_strided_pattern(size, np.array([0, 1, 3, 5]) * size, canonical) is None
    # A rank's head slice: the canonical side has gaps (the other ranks' heads).
    slice_canonical = np.array([0, 1, 4, 5], dtype=np.int64) * size
    assert find_strided_pattern(size, canonical, slice_canonical) is None
    # Two fragments at one cache place.
    assert find_strided_pattern(size, np.array([0, 0, 2, 2]) * size, canonical) is None
    # A transpose is recognized whatever the sign of its strides.
    local = np.array([0, -6, 2, -4, 4, -2], dtype=np.int64) * size
    pattern = find_strided_pattern(size, local, np.arange(6, dtype=np.int64) * size)
    assert pattern is not None
    assert (pattern.shape, pattern.local_strides) == ((3, 2), (4, -12))


def test_affine_axes_find_the_fewest_axes() -> None:
    assert affine_axes(np.arange(12, dtype=np.int64) * 3) == ((12,), (3,))
    # Dim-major keys of 4 tokens x 3 dims: canonical order (token, dim), cache d * 4 + t.
    tokens, dims = np.indices((4, 3))
    assert affine_axes((dims * 4 + tokens).ravel()) == ((4, 3), (1, 4))
    assert affine_axes(np.array([0, 5, 10, 16], dtype=np.int64)) is None
