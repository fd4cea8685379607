"""The process-wide caches: the one bounded LRU they are made of, and ``kvsnap.clear_caches()``
emptying every one of them after real captures, opens and restores filled them."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

import kvsnap
from kvsnap.caches import BoundedLRU, register_cache_clear
from kvsnap.format import canonical, container, header
from kvsnap.layout import cache as layout_cache
from kvsnap.layout import heads, mapping
from kvsnap.snapshot import Snapshot
from kvsnap.store.hot import tier as hot
from kvsnap.store.hot.tier import HotTier
from kvsnap.store.read import checksums, opening
from kvsnap.transfer import policy
from tests.support.parts_helpers import (
    TARGETS,
    caches,
    parted_snapshot,
    restore_map,
    restored_exactly,
)


def test_the_least_recently_used_entry_goes_first_and_the_bound_holds() -> None:
    lru: BoundedLRU[str, int] = BoundedLRU(3)
    for number, key in enumerate("abc"):
        lru.put(key, number)
    assert lru.get("a") == 0  # now the most recently used
    lru.put("d", 3)
    assert "b" not in lru and [lru.get(key) for key in "acd"] == [0, 2, 3] and len(lru) == 3
    lru.put("c", 20)  # replacing a value keeps one entry, now the most recent
    lru.put("e", 4)
    assert "a" not in lru and lru.get("c") == 20 and len(lru) == 3
    with pytest.raises(ValueError, match="at least 1"):
        BoundedLRU(0)


def test_threads_putting_and_getting_at_once_never_pass_the_bound() -> None:
    lru: BoundedLRU[tuple[int, int], int] = BoundedLRU(50)
    sizes: list[int] = []
    start = threading.Barrier(8)

    def work(thread: int) -> None:
        start.wait()
        for number in range(2000):
            lru.put((thread, number), number)
            found = lru.get((thread, number - 1))
            assert found is None or found == number - 1
            sizes.append(len(lru))

    threads = [threading.Thread(target=work, args=(thread,)) for thread in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert max(sizes) <= 50 and len(lru) == 50


def test_clear_caches_calls_what_registered_and_forgets_dropped_lrus() -> None:
    calls: list[int] = []
    register_cache_clear(lambda: calls.append(1))
    dropped: BoundedLRU[int, int] = BoundedLRU(2)
    dropped.put(1, 1)
    del dropped  # a dropped LRU is not kept alive by the registry, nor called
    kept: BoundedLRU[int, int] = BoundedLRU(2)
    kept.put(1, 1)
    kvsnap.clear_caches()
    assert calls == [1] and len(kept) == 0


def test_clear_caches_empties_every_process_wide_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = HotTier(1 << 30, 1, register=False, serve_unregistered=True)
    monkeypatch.setattr(hot, "_TIER", tier)
    path = tmp_path / "snap.safetensors"
    content = parted_snapshot(path)  # part layouts, copy runs, file placements
    targets = caches("vllm-nhd", 1, 8)
    with Snapshot.open(path) as snapshot:  # headers
        snapshot.restore([rank.layout for rank in targets], restore_map())  # checksum tables
        part = snapshot.part_files()[0]
    assert restored_exactly(targets, content) and len(TARGETS)
    policy.current_policy()  # the transfer policy, read from the calibration once
    with open(part, "rb") as file:
        leased = tier.lookup(part, file.fileno(), os.fstat(file.fileno()))
        assert leased is not None
        tier.release(leased)
    raw = Path(part).read_bytes()
    # kvsnap's own headers are taken as the packing of their metadata (format/canonical.py):
    # the general decode, which any other header gets, fills its table of checked entries.
    length = header.header_length(raw[:8], len(raw))
    header.decode_header(raw[: 8 + length], len(raw))
    lru_functions = [
        container._packing,
        container._cached_file_layouts,
        container._cached_specs,
        mapping.strided_page_runs,
        layout_cache._writes_a_byte_twice,
        heads._heads_of,
        heads._part_mapping,
        policy._cached_policy,
    ]
    filled = {function.__name__: function.cache_info().currsize for function in lru_functions}
    assert all(filled.values()), filled
    assert len(opening._HEADER_CACHE) and len(checksums._TABLES) and heads._CACHE
    assert len(header._CHECKED_ENTRIES) and len(container._RECENT_LAYOUTS)
    assert len(canonical._PACKINGS)
    assert tier.stats().files == 1

    kvsnap.clear_caches()

    assert [function.cache_info().currsize for function in lru_functions] == [0] * 8
    assert len(opening._HEADER_CACHE) == 0 and len(checksums._TABLES) == 0
    assert len(header._CHECKED_ENTRIES) == 0 and len(container._RECENT_LAYOUTS) == 0
    assert heads._CACHE == {} and tier.stats().files == 0
    assert len(canonical._PACKINGS) == 0
    # Everything is worked out again on the next use, to the same result.
    again = caches("vllm-nhd", 1, 8)
    with Snapshot.open(path) as snapshot:
        snapshot.restore([rank.layout for rank in again], restore_map())
    assert restored_exactly(again, content)
