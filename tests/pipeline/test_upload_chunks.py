"""How a restore slot is cut into pieces that go up to the device one after the other
(``kvsnap.pipeline.slot_pieces.upload_chunks``): every page in exactly one piece, whole and in
order, pieces no smaller than the minimum and no more of them than the slot's share."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsnap.pipeline.options import MIN_UPLOAD_CHUNK_BYTES, UPLOAD_CHUNKS_PER_SLOT
from kvsnap.pipeline.slot_pieces import slot_extent, upload_chunks
from kvsnap.pipeline.slots import slot_loads


@st.composite
def _slots(draw):
    """Page offsets of a slot: consecutive pages, with pages a host check refused dropped."""
    page_bytes = draw(st.sampled_from([256, 4096, 16 << 10, 1 << 20, 3 << 20]))
    num_pages = draw(st.integers(1, 300))
    offsets = np.arange(num_pages, dtype=np.int64) * page_bytes
    keep = np.array(draw(st.lists(st.booleans(), min_size=num_pages, max_size=num_pages)))
    keep[draw(st.integers(0, num_pages - 1))] = True
    return offsets[keep], page_bytes


@settings(max_examples=200, deadline=None)
@given(_slots())
def test_every_page_goes_up_whole_in_exactly_one_piece(slot):
    offsets, page_bytes = slot
    chunks = upload_chunks(offsets, page_bytes)
    assert chunks[0][0] == 0 and chunks[-1][1] == len(offsets)
    end = int(offsets[-1]) + page_bytes
    for (first, stop, low, high), following in zip(chunks, [*chunks[1:], None], strict=True):
        assert first < stop
        assert low == offsets[first] and high == offsets[stop - 1] + page_bytes
        if following is not None:
            assert following[0] == stop and following[2] >= high
    assert len(chunks) <= UPLOAD_CHUNKS_PER_SLOT
    if len(offsets) == end // page_bytes:  # no page refused: the pieces are even
        if end >= 2 * MIN_UPLOAD_CHUNK_BYTES + page_bytes:
            assert len(chunks) > 1
        for _, _, low, high in chunks[:-1]:
            assert high - low >= MIN_UPLOAD_CHUNK_BYTES


def test_a_large_slot_goes_up_in_even_pieces():
    page_bytes = 64 << 10
    load = next(
        slot_loads(num_tensors=64, num_blocks=16, page_size_bytes=page_bytes, slot_bytes=64 << 20)
    )
    chunks = upload_chunks(load.page_offsets, page_bytes)
    piece = (64 << 20) // UPLOAD_CHUNKS_PER_SLOT
    assert [(high - low) for _, _, low, high in chunks] == [piece] * UPLOAD_CHUNKS_PER_SLOT
    assert slot_extent(load, page_bytes) == 64 << 20


def test_a_slot_extent_reaches_past_a_refused_page():
    page_bytes = 4096
    load = next(
        slot_loads(num_tensors=2, num_blocks=4, page_size_bytes=page_bytes, slot_bytes=1 << 20)
    )
    keep = np.ones(load.num_pages, dtype=bool)
    keep[2] = False
    # Seven pages kept, but the last one still sits at the eighth page's offset.
    assert slot_extent(load.subset(keep), page_bytes) == 8 * page_bytes
    assert slot_extent(load.subset(np.zeros(load.num_pages, dtype=bool)), page_bytes) == 0
