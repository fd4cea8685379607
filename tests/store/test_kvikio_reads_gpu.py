"""First touches read through kvikio's pool (skipped without CUDA, and without kvikio): the
restore is bit-exact, a flipped byte is still refused by the device, and a read that finds
its file truncated under it fails as corrupt."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvsnap.errors import RestoreIncompleteError, SnapshotCorruptError
from kvsnap.pipeline import Pipeline
from kvsnap.snapshot import Snapshot, capture
from kvsnap.store.hot.tier import configure_hot_tier
from kvsnap.store.read import kvikio_reads
from kvsnap.store.read.slot_reads import read_executor, read_threads
from tests.support.pipeline_caches import SOURCE, assert_restored, caches, flip_byte, sequences

pytestmark = pytest.mark.gpu

BLOCKS = [3, 7, 1, 9, 10, 33]


@pytest.fixture
def first_touch(monkeypatch):
    """The hot tier off (every restore reads the file), kvikio present, and a count of the
    reads kvikio started."""
    if not kvikio_reads.available(read_threads()):
        pytest.skip("kvikio is not installed")
    configure_hot_tier(0)
    started = []
    real = kvikio_reads.KvikioFile.read_async

    def counted(self, out, file_offset):
        started.append(out.nbytes)
        return real(self, out, file_offset)

    monkeypatch.setattr(kvikio_reads.KvikioFile, "read_async", counted)
    yield started
    configure_hot_tier()


def _snapshot(tmp_path):
    sources, content = caches("vllm-nhd", layers=4, device="cuda", blocks=40, head_dim=64)
    path = tmp_path / "snap.safetensors"
    capture([c.layout for c in sources], sequences([BLOCKS]), path, source=SOURCE)
    targets, _ = caches(
        "vllm-nhd", layers=4, seed=1, fill=False, device="cuda", blocks=40, head_dim=64
    )
    return path, content, targets


def test_a_first_touch_reads_through_kvikio_bit_exact(tmp_path, first_touch):
    path, content, targets = _snapshot(tmp_path)
    with Snapshot.open(path) as snap:
        Pipeline(targets[0].layout).restore(snap, {"s0": BLOCKS})
    assert first_touch, "kvikio read nothing"
    assert_restored(targets, content, BLOCKS, BLOCKS)
    # Every page read once, in pieces of one kvikio task at most.
    with Snapshot.open(path) as snap:
        geometry = snap.metadata.geometry
    page_bytes = geometry.canonical_page_size_bytes
    assert sum(first_touch) == len(BLOCKS) * len(geometry.tensor_names()) * page_bytes
    assert max(first_touch) <= kvikio_reads.TASK_BYTES


def test_a_flipped_byte_read_by_kvikio_is_refused_on_the_device(tmp_path, first_touch):
    path, _, targets = _snapshot(tmp_path)
    flip_byte(path, "layers.2.key", 1)
    with Snapshot.open(path) as snap, pytest.raises(RestoreIncompleteError) as caught:
        Pipeline(targets[0].layout).restore(snap, {"s0": BLOCKS})
    assert caught.value.failed_block_ids.tolist() == [BLOCKS[1]]
    assert first_touch


def test_a_read_past_a_truncated_end_fails_as_corrupt(tmp_path, first_touch):
    # A restore notices a truncated snapshot before it reads (the file's size is checked); this
    # is the read itself finding the file shorter than the run it was asked for.
    path = tmp_path / "data.bin"
    data = np.random.default_rng(7).integers(0, 256, 8 << 20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        handle = kvikio_reads.KvikioFile(fd, read_threads())
        whole = np.zeros(4 << 20, dtype=np.uint8)
        pool = read_executor()
        read = kvikio_reads.read_runs_async([(handle, str(path))], [(0, 1 << 20, whole)], pool)
        assert len(read.result()) == 0
        assert np.array_equal(whole, data[1 << 20 : 5 << 20])
        os.truncate(path, 3 << 20)
        cut = np.zeros(4 << 20, dtype=np.uint8)
        read = kvikio_reads.read_runs_async([(handle, str(path))], [(0, 1 << 20, cut)], pool)
        with pytest.raises(SnapshotCorruptError):
            read.result()
        handle.close()
    finally:
        os.close(fd)
