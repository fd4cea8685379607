"""How a hot restore's pages go up: runs of one file apart by at most a page of padding are
joined into one span, the pages then lying in the slot as in the file (real snapshot files;
the hot tier's uploads themselves run on CUDA: tests/store/test_hot_gpu.py)."""

from __future__ import annotations

import numpy as np

from kvsnap.pipeline.slots import SlotLoad, slot_loads
from kvsnap.pipeline.snapshot_pages import hot_spans
from kvsnap.snapshot import capture
from kvsnap.store import SnapshotReader
from kvsnap.store.read.slot_reads import PageRuns
from tests.support.pipeline_caches import SOURCE, caches, sequences


def _load_and_runs(path, snapshot_blocks: list[int]):
    """The one slot load of ``snapshot_blocks`` of every tensor, its runs, and the file."""
    reader = SnapshotReader(path)
    page = reader.metadata.geometry.canonical_page_size_bytes
    names = reader.tensor_names()
    blocks = np.array(snapshot_blocks, dtype=np.int64)
    (load,) = slot_loads(len(names), len(blocks), page, 1 << 30)
    page_blocks = blocks[load.page_positions]
    runs = reader.page_runs(load.page_tensors, page_blocks, load.page_offsets)
    where = reader.extents().begin[load.page_tensors] + page_blocks * page
    reader.close()
    return load, runs, page, where, path.read_bytes()


def _slot_from_spans(spans, file_bytes: bytes, extent: int) -> bytes:
    slot = bytearray(extent)
    for file, begin, length, slot_offset in spans:
        assert file == 0
        slot[slot_offset : slot_offset + length] = file_bytes[begin : begin + length]
    return bytes(slot)


def _assert_pages_in_place(load: SlotLoad, page: int, where, file_bytes: bytes, slot: bytes):
    for offset, at in zip(load.page_offsets.tolist(), where.tolist(), strict=True):
        assert slot[offset : offset + page] == file_bytes[at : at + page]


def test_a_one_block_mla_prefix_is_one_span_with_the_padding(tmp_path):
    # MLA pages of 4 tokens x 576 x 2 bytes (4.5 KiB) are no multiple of the files' alignment:
    # one run per layer, a little padding between them.
    sources, _ = caches("mla", layers=6, blocks=8, latent_dim=576)
    path = tmp_path / "mla.safetensors"
    capture([c.layout for c in sources], sequences([[5]]), path, source=SOURCE)
    load, runs, page, where, file_bytes = _load_and_runs(path, [0])
    assert len(runs.starts) == 6

    joined, spans = hot_spans(load, runs, page, room=1 << 20)
    assert len(spans) == 1
    (_, begin, length, _), padding = spans[0], int(np.diff(where).max()) - page
    assert 0 < padding < page and length == int(where[-1]) + page - begin
    assert np.all(np.diff(joined.page_offsets) > 0)
    slot = _slot_from_spans(spans, file_bytes, length)
    _assert_pages_in_place(joined, page, where, file_bytes, slot)
    assert np.array_equal(joined.page_tensors, load.page_tensors)
    assert np.array_equal(joined.page_positions, load.page_positions)


def test_runs_stay_apart_where_the_padding_would_not_fit_the_room(tmp_path):
    sources, _ = caches("mla", layers=6, blocks=8, latent_dim=576)
    path = tmp_path / "mla.safetensors"
    capture([c.layout for c in sources], sequences([[5]]), path, source=SOURCE)
    load, runs, page, where, file_bytes = _load_and_runs(path, [0])

    same, spans = hot_spans(load, runs, page, room=load.num_bytes(page))
    assert same is load and len(spans) == 6
    slot = _slot_from_spans(spans, file_bytes, load.num_bytes(page))
    _assert_pages_in_place(load, page, where, file_bytes, slot)


def test_blocks_a_page_apart_are_joined_and_farther_ones_are_not(tmp_path):
    sources, _ = caches("vllm-nhd", layers=2, heads=4, head_dim=64, blocks=12)
    path = tmp_path / "snap.safetensors"
    capture([c.layout for c in sources], sequences([list(range(10))]), path, source=SOURCE)
    # Snapshot blocks 3 and 5 are one page apart in each tensor (block 4 between them); block
    # 9 is three pages past 5; tensors follow each other in the file.
    load, runs, page, where, file_bytes = _load_and_runs(path, [3, 5, 9])
    joined, spans = hot_spans(load, runs, page, room=1 << 30)
    tensors = 4
    assert len(runs.starts) == 3 * tensors
    assert len(spans) == 2 * tensors  # 3 and 5 joined in each tensor, 9 alone
    slot_bytes = max(offset + length for _, _, length, offset in spans)
    slot = _slot_from_spans(spans, file_bytes, slot_bytes)
    _assert_pages_in_place(joined, page, where, file_bytes, slot)


def test_runs_stay_apart_where_the_padding_would_misalign_a_page():
    # Pages of 4,608 bytes packed from 0 are 512-byte aligned; a gap of 520 bytes would leave
    # the second run's pages 8-byte aligned only, a gap of 512 keeps them as aligned.
    page = 4608
    load = SlotLoad(np.arange(2), np.zeros(2, dtype=np.int64), np.arange(2) * page)
    for gap, joined in ((520, False), (512, True), (page + 512, False)):
        runs = PageRuns(
            files=np.zeros(2, dtype=np.int64),
            file_offsets=np.array([4096, 4096 + page + gap]),
            slot_offsets=np.array([0, page]),
            starts=np.array([0, 1]),
            stops=np.array([1, 2]),
        )
        out, spans = hot_spans(load, runs, page, room=1 << 20)
        assert (len(spans) == 1) is joined
        if joined:
            assert out.page_offsets.tolist() == [0, page + gap]
        else:
            assert out is load
