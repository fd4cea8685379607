"""Slot loads (``kvsnap.pipeline.slots``): every page of every tensor in exactly one slot, in
file order, and a load's segments (what a capture writes as one piece) the maximal runs of one
tensor's consecutive pages, at their offsets in the slot."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsnap.pipeline.slots import slot_loads


@settings(max_examples=200, deadline=None)
@given(
    num_tensors=st.integers(1, 40),
    num_blocks=st.integers(1, 30),
    page_size_bytes=st.sampled_from([64, 4096, 32768]),
    pages_per_slot=st.integers(1, 90),
    extra_bytes=st.integers(0, 63),
)
def test_slots_cover_every_page_once_and_segments_are_maximal_runs(
    num_tensors, num_blocks, page_size_bytes, pages_per_slot, extra_bytes
):
    slot_bytes = pages_per_slot * page_size_bytes + extra_bytes
    loads = list(slot_loads(num_tensors, num_blocks, page_size_bytes, slot_bytes))
    flat = np.concatenate([load.page_tensors * num_blocks + load.page_positions for load in loads])
    assert flat.tolist() == list(range(num_tensors * num_blocks))  # file order, once each
    for load in loads:
        assert load.num_pages <= pages_per_slot
        assert load.page_offsets.tolist() == [i * page_size_bytes for i in range(load.num_pages)]
        pages = []
        for segment in load.segments:
            assert segment.num_pages > 0
            for position in range(segment.start, segment.stop):
                pages.append((segment.tensor, position))
            first = len(pages) - segment.num_pages
            assert segment.offset == load.page_offsets[first]
        assert pages == list(
            zip(load.page_tensors.tolist(), load.page_positions.tolist(), strict=True)
        )
        for before, after in itertools.pairwise(load.segments):
            assert before.tensor != after.tensor or before.stop != after.start  # maximal


def test_a_subset_keeps_offsets_and_splits_its_segments_at_the_gaps():
    (load,) = slot_loads(num_tensors=2, num_blocks=4, page_size_bytes=16, slot_bytes=1 << 10)
    keep = np.ones(8, dtype=bool)
    keep[[1, 4]] = False
    runs = [(s.tensor, s.start, s.stop, s.offset) for s in load.subset(keep).segments]
    assert runs == [(0, 0, 1, 0), (0, 2, 4, 32), (1, 1, 4, 80)]
