"""The hot tier's bookkeeping on real files (no CUDA needed): the ``hot_bytes`` bound, least
recently used eviction, registration on the N-th hit, and invalidation when a file is replaced,
truncated or deleted; and the store's reads never going through O_DIRECT for a page-cached
range. The registration itself and restores from registered files: tests/store/test_hot_gpu.py.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from kvsnap.store.base import tuning
from kvsnap.store.files.location import locate
from kvsnap.store.hot.residency import resident
from kvsnap.store.hot.tier import HotFile, HotTier
from kvsnap.store.read.source import Source
from kvsnap.store.write.local_file import memory_backed

PAGE = 4096


def _write(path: Path, pages: int, seed: int) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, pages * PAGE, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return data


class _Opened:
    """A file opened as a reader opens it: the descriptor and its fstat."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.fd = os.open(path, os.O_RDONLY)
        self.status = os.fstat(self.fd)

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture
def opened():
    files: list[_Opened] = []

    def open_file(path: Path) -> _Opened:
        files.append(_Opened(path))
        return files[-1]

    yield open_file
    for file in files:
        file.close()


def _tier(hot_bytes: int, register_after: int = 1) -> HotTier:
    # No CUDA registration here: the bookkeeping is the same, and the tests read the mappings
    # of files nobody truncates (the pipeline never serves an unregistered mapping).
    return HotTier(hot_bytes, register_after, register=False, serve_unregistered=True)


def _lookup(tier: HotTier, file: _Opened, **kwargs: bool) -> HotFile | None:
    entry = tier.lookup(file.path, file.fd, file.status, **kwargs)
    if entry is not None:
        tier.release(entry)
    return entry


def _mapped_bytes(entry: HotFile) -> bytes:
    assert entry.host is not None
    return entry.host.numpy().tobytes()


def test_bound_and_least_recently_used_eviction(tmp_path, opened):
    for i in range(4):
        _write(tmp_path / f"f{i}", 4, i)
    files = [opened(tmp_path / f"f{i}") for i in range(4)]
    tier = _tier(hot_bytes=12 * PAGE)  # three files of four pages
    entries = [_lookup(tier, file) for file in files[:3]]
    assert all(entry is not None for entry in entries)
    assert tier.stats().registered_bytes == 12 * PAGE
    assert _lookup(tier, files[0]) is entries[0]  # a hit: f0 is now the most recent
    fourth = _lookup(tier, files[3])
    assert fourth is not None
    stats = tier.stats()
    assert (stats.files, stats.registered_bytes, stats.evictions) == (3, 12 * PAGE, 1)
    # f1 was the least recently used: evicted and unmapped; f0 stays held.
    assert entries[1] is not None and entries[1].host is None and entries[1].retired
    assert _lookup(tier, files[0]) is entries[0]
    assert tier.stats().hits == 2


def test_registered_on_the_nth_hit_or_at_once_on_the_callers_word(tmp_path, opened):
    data = _write(tmp_path / "a", 2, 0)
    _write(tmp_path / "b", 2, 1)
    a, b = opened(tmp_path / "a"), opened(tmp_path / "b")
    tier = _tier(hot_bytes=16 * PAGE, register_after=2)
    assert _lookup(tier, a) is None
    entry = _lookup(tier, a)
    assert entry is not None and _mapped_bytes(entry) == data
    assert _lookup(tier, b, admit=True) is not None
    assert tier.stats().registrations == 2


def test_a_file_larger_than_the_bound_is_never_held(tmp_path, opened):
    _write(tmp_path / "big", 5, 0)
    tier = _tier(hot_bytes=4 * PAGE)
    assert _lookup(tier, opened(tmp_path / "big"), admit=True) is None
    assert tier.stats().registered_bytes == 0


def test_entries_in_use_are_never_evicted_and_the_bound_holds(tmp_path, opened):
    for i in range(2):
        _write(tmp_path / f"f{i}", 4, i)
    first, second = opened(tmp_path / "f0"), opened(tmp_path / "f1")
    tier = _tier(hot_bytes=6 * PAGE)
    leased = tier.lookup(first.path, first.fd, first.status)
    assert leased is not None
    # f1 would need f0's room, and f0 is being read: f1 is read, not held.
    assert _lookup(tier, second) is None
    assert tier.stats().registered_bytes == 4 * PAGE
    tier.release(leased)
    assert _lookup(tier, second) is not None
    assert leased.host is None  # evicted once idle
    assert tier.stats().registered_bytes == 4 * PAGE


def test_a_file_replaced_by_rename_is_never_served_from_the_old_mapping(tmp_path, opened):
    path = tmp_path / "snap"
    old = _write(path, 3, 0)
    tier = _tier(hot_bytes=64 * PAGE)
    before = _lookup(tier, opened(path))
    assert before is not None and _mapped_bytes(before) == old
    new = _write(tmp_path / "next", 3, 1)
    os.replace(tmp_path / "next", path)
    after = _lookup(tier, opened(path))
    assert after is not None and after is not before
    assert _mapped_bytes(after) == new
    stats = tier.stats()
    # The old version is dropped (unmapped) when the name is seen pointing elsewhere.
    assert (stats.files, stats.invalidations) == (1, 1)
    assert before.host is None


def test_truncated_and_deleted_files_are_dropped(tmp_path, opened):
    for name in ("cut", "gone", "kept"):
        _write(tmp_path / name, 4, len(name))
    tier = _tier(hot_bytes=64 * PAGE)
    cut, gone, kept = (opened(tmp_path / name) for name in ("cut", "gone", "kept"))
    entries = [_lookup(tier, file) for file in (cut, gone, kept)]
    os.truncate(tmp_path / "cut", 2 * PAGE)
    os.unlink(tmp_path / "gone")
    assert tier.prune() == 2
    assert [entry.host is None for entry in entries if entry is not None] == [True, True, False]
    assert tier.stats().registered_bytes == 4 * PAGE
    # The truncated file, opened again, is a new version: a miss, then held anew.
    again = opened(tmp_path / "cut")
    assert tier.lookup(again.path, again.fd, again.status) is not None
    assert tier.stats().misses == 4


def test_forget_drops_a_leased_entry_once_its_lease_ends(tmp_path, opened):
    _write(tmp_path / "f", 2, 0)
    file = opened(tmp_path / "f")
    tier = _tier(hot_bytes=64 * PAGE)
    leased = tier.lookup(file.path, file.fd, file.status)
    assert leased is not None
    tier.forget(file.path)
    assert leased.host is not None  # still being read
    assert tier.stats().registered_bytes == 2 * PAGE
    tier.release(leased)
    assert leased.host is None
    assert tier.stats().registered_bytes == 0


def test_a_page_cached_range_is_never_read_through_o_direct(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("needs O_DIRECT")
    if memory_backed(str(tmp_path)):
        pytest.skip("a file in memory cannot leave the page cache")
    monkeypatch.setattr(tuning, "COLD_READS_DIRECT", True)
    path = tmp_path / "snap"
    data = _write(path, 64, 0)
    source = Source(locate(path, None))
    try:
        if source._direct_fd is None:
            pytest.skip("this filesystem refuses O_DIRECT")
        # The O_DIRECT descriptor swapped for one on a file of zeros: whatever is read through
        # it shows up as zeros, whatever is read through the page cache as the file's bytes.
        zeros = tmp_path / "zeros"
        zeros.write_bytes(bytes(len(data)))
        os.close(source._direct_fd)
        source._direct_fd = os.open(zeros, os.O_RDONLY)
        out = np.frombuffer(mmap.mmap(-1, len(data)), dtype=np.uint8)  # page-aligned
        source.read_into(0, memoryview(out))
        assert out.tobytes() == data  # page-cached: through the page cache
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        source.read_into(0, memoryview(out))
        assert out.tobytes() == bytes(len(data))  # cold, aligned: through O_DIRECT
    finally:
        source.close()


def test_cold_reads_through_the_page_cache_open_no_o_direct_descriptor(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "COLD_READS_DIRECT", False)
    path = tmp_path / "snap"
    data = _write(path, 8, 0)
    source = Source(locate(path, None))
    try:
        assert source._direct_fd is None
        assert source.read(0, len(data)) == data
    finally:
        source.close()


def test_residency_is_told_without_reading(tmp_path):
    if memory_backed(str(tmp_path)):
        pytest.skip("a file in memory cannot leave the page cache")
    path = tmp_path / "snap"
    data = _write(path, 16, 0)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert resident(fd, 0, len(data)) is True  # just written: in the page cache
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert resident(fd, 0, len(data)) is False  # asking read nothing in
        assert os.pread(fd, PAGE, 3 * PAGE) == data[3 * PAGE : 4 * PAGE]
        assert resident(fd, 3 * PAGE + 5, 100) is True
    finally:
        os.close(fd)


def test_a_file_the_page_cache_does_not_hold_is_not_registered_until_it_does(tmp_path, opened):
    if memory_backed(str(tmp_path)):
        pytest.skip("a file in memory cannot leave the page cache")
    path = tmp_path / "snap"
    data = _write(path, 16, 0)
    file = opened(path)
    os.fsync(file.fd)
    os.posix_fadvise(file.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    tier = _tier(hot_bytes=64 * PAGE)
    assert _lookup(tier, file, admit=True) is None
    assert os.pread(file.fd, len(data), 0) == data  # read once: now page-cached
    entry = _lookup(tier, file, admit=True)
    assert entry is not None and _mapped_bytes(entry) == data
