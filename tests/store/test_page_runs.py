"""Where a slot's pages lie in a snapshot's files, as runs (``slot_reads.page_runs``): what a
hot restore uploads as one copy each. Checked against a page-by-page walk on random slots,
the usual one-run slot included."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsnap.store.read.slot_reads import TensorExtents, page_runs


def _walk(files, file_offsets, page_offsets, page):
    """Runs by hand: a page continues the run before it when it follows it in one file and
    in the slot."""
    runs = []
    for index in range(len(files)):
        if runs and (
            files[index] == files[index - 1]
            and file_offsets[index] == file_offsets[index - 1] + page
            and page_offsets[index] == page_offsets[index - 1] + page
        ):
            runs[-1][4] = index + 1
            continue
        runs.append([files[index], file_offsets[index], page_offsets[index], index, index + 1])
    return runs


@st.composite
def _slots(draw):
    page = draw(st.sampled_from([256, 4096]))
    num_tensors = draw(st.integers(1, 5))
    num_blocks = draw(st.integers(1, 8))
    num_files = draw(st.integers(1, 3))
    file_of = np.array([draw(st.integers(0, num_files - 1)) for _ in range(num_tensors)])
    begin = np.arange(num_tensors, dtype=np.int64) * num_blocks * page + 64
    if draw(st.booleans()):
        # The usual slot: pages in file order, no gap.
        count = draw(st.integers(1, num_tensors * num_blocks))
        start = draw(st.integers(0, num_tensors * num_blocks - count))
        flat = np.arange(start, start + count)
        tensors, blocks = np.divmod(flat, num_blocks)
        offsets = np.arange(count, dtype=np.int64) * page
    else:
        count = draw(st.integers(1, 12))
        tensors = np.array([draw(st.integers(0, num_tensors - 1)) for _ in range(count)])
        blocks = np.array([draw(st.integers(0, num_blocks - 1)) for _ in range(count)])
        gapless = draw(st.booleans())
        steps = [1 if gapless else draw(st.sampled_from([1, 1, 1, 2])) for _ in range(count)]
        offsets = (np.cumsum(steps) - steps[0]).astype(np.int64) * page
    extents = TensorExtents([None] * num_files, file_of, begin, page)
    return extents, tensors.astype(np.int64), blocks.astype(np.int64), offsets


@settings(max_examples=300, deadline=None)
@given(_slots())
def test_runs_are_the_maximal_runs_consecutive_in_one_file_and_in_the_slot(slot):
    extents, tensors, blocks, offsets = slot
    page = extents.page_size_bytes
    runs = page_runs(extents, tensors, blocks, offsets)
    files = extents.file_of[tensors]
    file_offsets = extents.begin[tensors] + blocks * page
    got = [list(row) for row in runs.rows()]
    assert got == _walk(files.tolist(), file_offsets.tolist(), offsets.tolist(), page)


def test_pages_spanning_a_run_s_bytes_out_of_order_are_several_runs():
    # First and last page a whole run apart in the file and in the slot, the middle swapped.
    extents = TensorExtents([None], np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), 256)
    blocks = np.array([0, 2, 1, 3], dtype=np.int64)
    runs = page_runs(extents, np.zeros(4, dtype=np.int64), blocks, np.arange(4) * 256)
    assert [(start, stop) for *_, start, stop in runs.rows()] == [(0, 1), (1, 2), (2, 3), (3, 4)]
