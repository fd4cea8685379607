"""One process per TP rank over a real gloo group: capture TP=2, restore at TP=1 and TP=2.

The ranks are spawned interpreters joined by ``torch.distributed`` (gloo, file rendezvous), as
``torchrun`` would start them; each holds only its own heads. The parent checks the published
snapshot against the content every rank was built from, restores it in-process at TP=1, and
kills a rank in the middle of a capture to show that the previous snapshot survives.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import kvsnap
from kvsnap.store import SnapshotReader
from kvsnap.testing.caches import same_bytes
from tests.support.distributed_child import Case, run_ranks


def _published_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if not p.name.startswith("."))


@pytest.fixture(scope="module")
def tp2_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("tp2")
    path = tmp / "snap" / "prefix.safetensors"
    path.parent.mkdir()
    reports = run_ranks(tmp, "capture", 2, path)
    assert [report.get("error") for report in reports] == [None, None], reports
    # Each rank wrote its own part: the two halves of the KV bytes.
    assert [report["num_parts"] for report in reports] == [2, 2]
    assert reports[0]["part_bytes"] == reports[1]["part_bytes"] == reports[0]["num_bytes"] // 2
    assert reports[0]["part_path"] != reports[1]["part_path"]
    return path


def test_tp2_capture_holds_every_head_of_every_block(tp2_snapshot: Path) -> None:
    case = Case()
    content = case.content()
    inverse = np.argsort(case.device_blocks())
    with kvsnap.Snapshot.open(tp2_snapshot) as snapshot:
        assert snapshot.verify() == []
        assert snapshot.geometry == case.geometry()
        assert snapshot.metadata.tp_size == 2
        for sequence in case.sequences():
            record = snapshot.sequence(sequence.id)
            assert np.array_equal(record.token_ids, sequence.token_ids)
            stored_pages = torch.as_tensor(inverse[sequence.block_ids])
            for name, pages in content.pages.items():
                stored = snapshot.read_tensor(name)[torch.as_tensor(record.block_ids)]
                assert same_bytes(stored, pages[stored_pages]), (sequence.id, name)


def test_tp2_capture_restores_at_tp1_in_one_process(tp2_snapshot: Path) -> None:
    case = Case()
    cache = case.cache(0, 1)
    content = case.content()
    inverse = np.argsort(case.device_blocks())
    with kvsnap.Snapshot.open(tp2_snapshot) as snapshot:
        targets = {}
        free = np.random.default_rng(3).permutation(case.num_blocks)
        for sequence in case.sequences():
            targets[sequence.id], free = (
                free[: len(sequence.block_ids)],
                free[len(sequence.block_ids) :],
            )
        snapshot.restore(cache.layout, targets)
    for sequence in case.sequences():
        pages = torch.as_tensor(inverse[sequence.block_ids])
        for name in content.pages:
            restored = cache.logical(name)[torch.as_tensor(targets[sequence.id])]
            assert same_bytes(restored, content.pages[name][pages]), (sequence.id, name)


@pytest.mark.parametrize("world", [1, 2])
def test_tp2_capture_restores_at_tp1_and_tp2_across_processes(
    tp2_snapshot: Path, tmp_path: Path, world: int
) -> None:
    reports = run_ranks(tmp_path, "restore", world, tp2_snapshot)
    for report in reports:
        assert report.get("error") is None, report
        assert report["mismatched"] == [], report


def test_ranks_agree_on_blocks_a_damaged_part_failed(tp2_snapshot: Path, tmp_path: Path) -> None:
    copy = tmp_path / "snap" / tp2_snapshot.name
    copy.parent.mkdir()
    for file in tp2_snapshot.parent.iterdir():
        (copy.parent / file.name).write_bytes(file.read_bytes())
    with kvsnap.Snapshot.open(copy) as snapshot:
        second_part = snapshot.part_files()[1]
    with SnapshotReader(second_part) as reader:
        _, entry = reader.locate("layers.1.value")
    with open(second_part, "r+b") as file:  # one byte of one page of part 2
        file.seek(entry.begin + entry.nbytes // 3)
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0xFF]))
    rank0, rank1 = run_ranks(tmp_path, "restore", 2, copy)
    # Rank 0's heads are all in part 1: every page of it is restored ...
    assert rank0["mismatched"] == []
    # ... and rank 1 could not restore one block; both ranks report it, for both to recompute.
    assert "RestoreIncompleteError" in rank1["error"] and "RestoreIncompleteError" in rank0["error"]
    assert len(rank1["failed_block_ids"]) == 1
    assert rank0["failed_block_ids"] == rank1["failed_block_ids"]


def test_a_rank_killed_mid_capture_leaves_the_previous_snapshot(
    tp2_snapshot: Path, tmp_path: Path
) -> None:
    path = tmp_path / "snap" / "prefix.safetensors"
    path.parent.mkdir()
    old = run_ranks(tmp_path, "capture", 2, path, case={"seed": 5})
    assert [report.get("error") for report in old] == [None, None]
    before = {name: (path.parent / name).read_bytes() for name in _published_files(path)}

    reports = run_ranks(tmp_path, "capture", 2, path, case={"seed": 6}, die_on_rank=1)
    assert reports[1] is None  # killed
    assert "RankFailedError" in reports[0]["error"], reports[0]
    # The old snapshot is exactly as it was, and still reads as the seed-5 content.
    assert {name: (path.parent / name).read_bytes() for name in _published_files(path)} == before
    with kvsnap.Snapshot.open(path) as snapshot:
        assert snapshot.verify() == []
        first = Case(seed=5).content().pages["layers.0.key"]
        inverse = np.argsort(Case(seed=5).device_blocks())
        sequence = Case(seed=5).sequences()[0]
        stored = snapshot.read_tensor("layers.0.key")[
            torch.as_tensor(snapshot.sequence("first").block_ids)
        ]
        assert same_bytes(stored, first[torch.as_tensor(inverse[sequence.block_ids])])


@pytest.mark.parametrize(
    ("case", "world"), [({"kind": "mla", "latent_dim": 32}, 2), ({}, 1)], ids=["mla-tp2", "tp1"]
)
def test_mla_and_single_rank_groups_write_one_plain_snapshot(
    tmp_path: Path, case: dict[str, Any], world: int
) -> None:
    path = tmp_path / "snap" / "plain.safetensors"
    path.parent.mkdir()
    reports = run_ranks(tmp_path, "capture", world, path, case=case)
    assert [report.get("error") for report in reports] == [None] * world, reports
    assert [report["num_parts"] for report in reports] == [0] * world
    # Rank 0 wrote every block (an MLA rank elected for half of them alone would not).
    assert reports[0]["part_bytes"] == reports[0]["num_bytes"] > 0
    assert _published_files(path) == [path.name]
    spec = Case(**case)
    inverse = np.argsort(spec.device_blocks())
    with kvsnap.Snapshot.open(path) as snapshot:
        assert snapshot.format_version == 1 and snapshot.verify() == []
        for sequence in spec.sequences():
            blocks = torch.as_tensor(snapshot.sequence(sequence.id).block_ids)
            for name, pages in spec.content().pages.items():
                stored = snapshot.read_tensor(name)[blocks]
                assert same_bytes(stored, pages[torch.as_tensor(inverse[sequence.block_ids])])
    restored = run_ranks(tmp_path, "restore", 2, path, case=case)
    assert [(r["error"], r["mismatched"]) for r in restored] == [(None, [])] * 2


def test_connector_worker_at_tp2_saves_parted_chunks_a_tp1_worker_loads(tmp_path: Path) -> None:
    from kvsnap.engines.vllm import ChunkLoad, KVSnapConnectorMetadata, LoadSpec
    from tests.support.distributed_child import (
        WORKER_BLOCK,
        WORKER_HEAD_DIM,
        worker_cells,
        worker_for,
    )

    store = tmp_path / "store"
    blocks = [9, 2, 14, 5, 7]  # five blocks: chunks of 2, 2 and 1
    reports = run_ranks(tmp_path, "worker-save", 2, store, blocks=blocks)
    assert [report.get("error") for report in reports] == [None, None], reports
    assert [report["finished"] for report in reports] == [["r1"], ["r1"]]
    paths = reports[0]["paths"]
    assert len(paths) == 3
    # Every chunk is one parted snapshot: an index and one part per rank, nothing else (the
    # second request's identical saves wrote nothing).
    files = sorted(str(p) for p in store.rglob("*") if p.is_file())
    assert len(files) == 3 * 3 and not any(Path(name).name.startswith(".") for name in files)
    assert reports[0]["first_files"] == reports[1]["first_files"] == files
    cells = worker_cells()
    for path in paths:
        with kvsnap.Snapshot.open(path) as snapshot:
            assert len(snapshot.part_files()) == 2 and snapshot.verify() == []
    # A TP=1 engine loads the chunks into other blocks: every byte as the TP=2 engine held it.
    target = [0, 1, 3, 4, 6]
    loader = worker_for(str(store), [torch.zeros_like(layer) for layer in cells], 0, 1, None)
    chunks, start = [], 0
    for path in paths:
        with kvsnap.Snapshot.open(path) as snapshot:
            count = snapshot.num_blocks
            (checked,) = snapshot.metadata.sequences  # what the scheduler's check reads
        chunks.append(
            ChunkLoad(path, np.arange(count), np.asarray(target[start : start + count]), checked)
        )
        start += count
    loader.start_load_kv(
        KVSnapConnectorMetadata(loads=[LoadSpec("r3", tuple(chunks), len(blocks) * WORKER_BLOCK)])
    )
    assert loader.get_block_ids_with_load_errors() == set()
    assert loader.cache is not None
    for layer, cache in zip(cells, loader.cache.caches, strict=True):
        restored = cache.permute(0, 2, 1, 3)  # back to [blocks, tokens, heads, key ‖ value]
        assert same_bytes(restored[target], layer[blocks]), WORKER_HEAD_DIM
    # A parted chunk that is not the one the scheduler checked (here: the scheduler's check read
    # the second chunk's sequence, the first chunk's file is what the name holds now) loads
    # nothing: a miss, its blocks reported for recomputing.
    for cache in loader.cache.caches:
        cache[target] = 0
    first = chunks[0]
    other = ChunkLoad(first.path, first.snapshot_blocks, first.target_blocks, chunks[1].checked)
    loader.start_load_kv(
        KVSnapConnectorMetadata(loads=[LoadSpec("r4", (other,), 2 * WORKER_BLOCK)])
    )
    assert loader.get_block_ids_with_load_errors() == set(target[:2])
    assert not any(cache[target].any() for cache in loader.cache.caches)
