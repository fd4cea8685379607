"""A worker keeps the chunks it loaded open for their next load, and serves a kept chunk only
while its file is the version it opened: a chunk replaced by a rename is opened anew (and,
being another chunk than the one the scheduler checked, loads nothing: a miss), a byte changed
in place (the modification time put back) is refused by the page checks, and a removed
chunk's descriptor is closed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from kvsnap.engines.vllm import KVSnapConnectorMetadata, LoadSpec, read_events
from kvsnap.engines.vllm.open_chunks import CHECKED_CHUNKS
from tests.support.file_versions import count_snapshot_opens, rewrite_in_place_keeping_times
from tests.support.vllm_worker_helpers import (
    cache_blocks,
    chunk_load,
    distinct_chunk_saves,
    load_saves,
    make_worker,
    stored_chunks,
)

TARGET = [9, 10, 11, 12]


def _scrub(worker: Any, blocks: list[int]) -> None:
    assert worker.cache is not None
    for cache in worker.cache.caches:
        cache[blocks] = 0


def _equal(worker: Any, loaded: list[int], saved: list[int]) -> bool:
    return all(
        torch.equal(a.view(torch.int16), b.view(torch.int16))
        for a, b in zip(cache_blocks(worker, loaded), cache_blocks(worker, saved), strict=True)
    )


def test_a_worker_keeps_the_chunks_it_loaded_open_and_serves_them_only_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = make_worker(tmp_path)
    saves = stored_chunks(worker, "writer", [1, 2, 3, 4])
    CHECKED_CHUNKS.clear()
    opened = count_snapshot_opens(monkeypatch)
    paths = [spec.path for spec in saves]

    load_saves(worker, saves, TARGET)
    assert opened == paths and len(worker._kept) == 2
    assert _equal(worker, TARGET, [1, 2, 3, 4])

    # The next load of the same chunks opens nothing, bit-exact; the scheduler's record of a
    # hit (a touch: the change time moves) leaves them the same version.
    _scrub(worker, TARGET)
    assert worker.store.touch(paths[0])
    load_saves(worker, saves, TARGET)
    assert opened == paths
    assert _equal(worker, TARGET, [1, 2, 3, 4])

    # Another chunk (the second one, valid and signed as any) renamed over the first chunk's
    # name: the kept chunk is not served, the new file is opened, and it is not the chunk the
    # scheduler checked for this request. Nothing of it is loaded: a miss, every block of the
    # request from there on reported for recomputing, the file left where it is.
    original = tmp_path / "original.safetensors"
    shutil.copyfile(paths[0], original)
    replacement = tmp_path / "replacement.safetensors"
    shutil.copyfile(paths[1], replacement)
    os.replace(replacement, paths[0])
    _scrub(worker, TARGET)
    loads = tuple(
        chunk_load(spec, blocks) for spec, blocks in zip(saves, ([9, 10], [11, 12]), strict=True)
    )
    worker.start_load_kv(KVSnapConnectorMetadata(loads=[LoadSpec("swapped", loads, 0)]))
    assert opened == [*paths, paths[0]]
    assert worker.get_block_ids_with_load_errors() == set(TARGET)
    assert all(not cache[TARGET].any() for cache in cache_blocks(worker, list(range(16))))
    (miss,) = [
        event for event in read_events(tmp_path / "events.jsonl") if event["event"] == "miss"
    ]
    assert miss["request"] == "swapped" and miss["path"] == paths[0] and miss["blocks"] == 4
    assert "not the" in miss["reason"] and Path(paths[0]).exists()
    os.replace(original, paths[0])

    # A byte changed in place with the modification time put back: the kept chunk is taken
    # (the same version by its times) and its page checks refuse the changed page.
    load_saves(worker, saves, TARGET)
    opened.clear()
    rewrite_in_place_keeping_times(Path(paths[1]), flip=True)
    worker.start_load_kv(KVSnapConnectorMetadata(loads=[LoadSpec("again", loads, 0)]))
    assert opened == []
    assert worker.get_block_ids_with_load_errors() == {11, 12}
    assert len(worker._kept) == 0  # a failed load keeps nothing open

    # A kept chunk whose file is removed is closed once another chunk is kept anew.
    load_saves(worker, saves[:1], [9, 10])
    (kept,) = (entry[0] for entry in worker._kept._open.values())
    os.unlink(paths[0])
    others = distinct_chunk_saves(worker, "other", seed=5)
    worker.wait_for_save(KVSnapConnectorMetadata(saves=others))
    worker.wait_for_writes()
    load_saves(worker, others, [13, 14])
    assert kept.parts[0].reader.local_files() is None
    assert paths[0] not in worker._kept._open
    worker.shutdown()
    assert len(worker._kept) == 0
