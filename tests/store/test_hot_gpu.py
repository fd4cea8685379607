"""Restores from the hot tier on real CUDA (skipped without CUDA): files registered with the
driver and copied to the device without being read, never served stale after a replace, every
page still checked on the device, and ``hot_bytes`` held while many files come and go.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvsnap.errors import RestoreIncompleteError
from kvsnap.pipeline import Pipeline
from kvsnap.pipeline.snapshot_pages import SnapshotPages
from kvsnap.snapshot import Snapshot, capture
from kvsnap.store.hot.tier import configure_hot_tier, hot_tier
from kvsnap.testing.caches import same_bytes
from tests.support.pipeline_caches import SOURCE, assert_restored, caches, flip_byte, sequences

pytestmark = pytest.mark.gpu

USED = [[3, 7, 1, 9, 10, 33]]
TARGET = [0, 2, 4, 5, 6, 39]


@pytest.fixture
def tier():
    def configure(hot_bytes: int = 1 << 30, register_after: int = 1):
        return configure_hot_tier(hot_bytes, register_after)

    yield configure
    configure_hot_tier()


def _snapshot(path: Path, seed: int):
    """A snapshot of a 4-layer cache (pages of 8 heads x 64: hashed on the device), read once
    so that the page cache holds it (it was written with O_DIRECT), as a first load leaves it:
    the hot tier registers only files the page cache holds."""
    sources, content = caches("vllm-nhd", layers=4, heads=8, head_dim=64, blocks=40, seed=seed)
    capture([c.layout for c in sources], sequences(USED), path, source=SOURCE)
    path.read_bytes()
    return content


def _target():
    targets, _ = caches(
        "vllm-nhd", layers=4, heads=8, head_dim=64, blocks=40, seed=9, fill=False, device="cuda"
    )
    return targets


def _restore(targets, path) -> list[str]:
    """Restore ``path`` into ``targets``; the kinds of the steps it traced."""
    kinds: list[str] = []
    Pipeline([c.layout for c in targets]).restore(
        path, {"s0": TARGET}, trace=lambda kind, *_: kinds.append(kind)
    )
    torch.cuda.synchronize()
    return kinds


def test_a_registered_file_is_copied_without_a_read_and_restores_bit_exact(tmp_path, tier):
    tier(register_after=2)
    path = tmp_path / "snap.safetensors"
    content = _snapshot(path, seed=0)
    targets = _target()
    assert "read" in _restore(targets, path)  # first use: read, counted
    assert hot_tier().stats().files == 0
    kinds = _restore(targets, path)  # second use: registered, then copied from the mapping
    assert "read" not in kinds
    stats = hot_tier().stats()
    assert (stats.files, stats.registrations, stats.registered_bytes) == (
        1,
        1,
        path.stat().st_size,
    )
    entry = next(iter(hot_tier()._files.values()))
    assert entry.registered and entry.host is not None and entry.host.is_pinned()
    assert_restored(targets, content, USED[0], TARGET)
    fresh = _target()
    assert "read" not in _restore(fresh, path)
    assert hot_tier().stats().hits == 1
    assert_restored(fresh, content, USED[0], TARGET)


def test_a_file_replaced_while_registered_is_never_served_stale(tmp_path, tier):
    tier()
    path = tmp_path / "snap.safetensors"
    first = _snapshot(path, seed=0)
    targets = _target()
    _restore(targets, path)
    assert_restored(targets, first, USED[0], TARGET)
    assert hot_tier().stats().files == 1
    second = _snapshot(path, seed=1)  # published by rename over the registered file
    targets = _target()
    kinds = _restore(targets, path)
    assert "read" not in kinds  # the new version, registered anew
    assert_restored(targets, second, USED[0], TARGET)
    stats = hot_tier().stats()
    assert (stats.files, stats.invalidations, stats.registered_bytes) == (
        1,
        1,
        path.stat().st_size,
    )


def test_a_byte_flipped_in_a_registered_page_is_caught_on_the_device(tmp_path, tier):
    tier()
    path = tmp_path / "snap.safetensors"
    content = _snapshot(path, seed=0)
    targets = _target()
    with Snapshot.open(path) as snap:
        pipeline = Pipeline([c.layout for c in targets])
        pipeline.restore(snap, {"s0": TARGET})  # registers the file this reader opened
        # In place, under the registration: the mapped page cache now holds the flipped byte,
        # and this open snapshot's file is still the registered version.
        flip_byte(path, "layers.2.value", 1)
        with pytest.raises(RestoreIncompleteError) as caught:
            pipeline.restore(snap, {"s0": TARGET})
    assert hot_tier().stats().hits == 1
    # Snapshot block 1 holds the sequence's second block, restored into target block 2.
    assert caught.value.failed_block_ids.tolist() == [TARGET[1]]
    others = [i for i in range(len(TARGET)) if i != 1]
    assert_restored(targets, content, [USED[0][i] for i in others], [TARGET[i] for i in others])


def test_hot_bytes_is_held_under_churn(tmp_path, tier):
    paths = [tmp_path / f"snap{i}.safetensors" for i in range(6)]
    contents = [_snapshot(path, seed=i) for i, path in enumerate(paths)]
    size = max(path.stat().st_size for path in paths)
    tier(hot_bytes=int(2.5 * size))
    rng = np.random.default_rng(0)
    for index in rng.integers(0, len(paths), 24).tolist():
        targets = _target()
        _restore(targets, paths[index])
        assert_restored(targets, contents[index], USED[0], TARGET)
        stats = hot_tier().stats()
        assert stats.registered_bytes <= stats.hot_bytes
        assert stats.files <= 2
    stats = hot_tier().stats()
    assert stats.evictions > 0 and stats.hits > 0
    registered = [entry for entry in hot_tier()._files.values() if entry.registered]
    assert len(registered) == stats.files


def test_a_one_block_mla_prefix_goes_up_as_one_span_padding_included(tmp_path, tier, monkeypatch):
    # An MLA page (here 4 tokens x 576 x 2 bytes: 4.5 KiB; 18 KiB at 16 tokens) is no multiple
    # of the 4 KiB the files' tensors are aligned to, so a one-block prefix is one run of pages
    # per layer, apart by a few KiB of padding. It goes up as one span, the pages lying in the
    # device buffer as in the file, and every page is still checked and lands where it belongs.
    tier(register_after=1)
    shape = {"layers": 6, "blocks": 8, "latent_dim": 576}
    sources, content = caches("mla", seed=0, **shape)
    path = tmp_path / "mla.safetensors"
    capture([c.layout for c in sources], sequences([[5]]), path, source=SOURCE)
    path.read_bytes()
    spans: list[int] = []
    real = SnapshotPages.uploads

    def counted(self, load, page_blocks, room):
        load, uploads = real(self, load, page_blocks, room)
        spans.append(len(uploads))
        return load, uploads

    monkeypatch.setattr(SnapshotPages, "uploads", counted)
    targets, _ = caches("mla", seed=9, fill=False, device="cuda", **shape)
    pipeline = Pipeline([c.layout for c in targets])
    kinds: list[str] = []
    pipeline.restore(path, {"s0": [2]}, trace=lambda kind, *_: kinds.append(kind))
    torch.cuda.synchronize()
    assert "read" not in kinds and spans == [1]
    assert_restored(targets, content, [5], [2])

    flip_byte(path, "layers.3.latent", 0)  # in place: the registered mapping sees it
    fresh, _ = caches("mla", seed=9, fill=False, device="cuda", **shape)
    with pytest.raises(RestoreIncompleteError) as caught:
        Pipeline([c.layout for c in fresh]).restore(path, {"s0": [2]})
    assert caught.value.failed_block_ids.tolist() == [2]
    for cache in fresh:
        for name in cache.views:
            got = cache.logical(name)[torch.tensor([2])]
            if name == "layers.3.latent":
                assert not got.view(torch.uint8).any()  # the refused page was not written
            else:
                assert same_bytes(got, cache.expected(content, name, torch.tensor([5])))
