"""Several snapshots restored as one job (``Pipeline.restore_chunks``): a prompt's prefix
stored as chunk files, each its own snapshot, plain or parted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvsnap import format as fmt
from kvsnap.errors import RestoreIncompleteError
from kvsnap.pipeline import Pipeline, SequenceBlocks
from kvsnap.pipeline.pipeline import Pipeline as WarmPipeline
from kvsnap.snapshot import Snapshot, capture
from kvsnap.store import SnapshotReader
from kvsnap.store.read.source import Source
from kvsnap.testing.caches import random_content, same_bytes
from tests.support.parts_helpers import SOURCE, caches

#: Three chunks of a prompt: (first device block, number of blocks) of the source cache.
CHUNKS = [(0, 4), (4, 4), (8, 3)]


def _store_chunks(tmp_path: Path, tp: int, heads: int) -> tuple[list[Path], dict, list]:
    """The source ranks filled with random content, and one snapshot file per chunk (parted
    when ``tp`` > 1: every rank its own heads)."""
    source = caches("vllm-nhd", tp, heads)
    content = random_content(source[0].layout.geometry, 12, torch.Generator().manual_seed(4))
    for rank in source:
        rank.fill(content)
    paths = []
    for number, (first, count) in enumerate(CHUNKS):
        tokens = np.arange(first * 4, (first + count) * 4)
        sequence = SequenceBlocks("chunk", tokens, np.arange(first, first + count))
        path = tmp_path / f"chunk{number}.safetensors"
        capture([r.layout for r in source], [sequence], path, source=SOURCE, per_rank_parts=tp > 1)
        paths.append(path)
    return paths, content.pages, source


@pytest.mark.parametrize(("tp", "target_tp"), [(1, 1), (2, 1), (2, 2), (1, 2)])
def test_chunks_restore_as_one_job_bit_exact(tmp_path: Path, tp: int, target_tp: int) -> None:
    paths, pages, _ = _store_chunks(tmp_path, tp, 4)
    target = caches("vllm-nhd", target_tp, 4)
    pipeline = Pipeline([rank.layout for rank in target])
    moves = []
    real = WarmPipeline._move_in

    def counted(self, items, *args):  # type: ignore[no-untyped-def]
        moves.append(len(items))
        return real(self, items, *args)

    destination = np.array([11, 3, 7, 0, 9, 1, 5, 2, 10, 4, 6])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(WarmPipeline, "_move_in", counted)
        snapshots = [Snapshot.open(path) for path in paths]
        jobs, start = [], 0
        for snapshot, (_, count) in zip(snapshots, CHUNKS, strict=True):
            jobs.append((snapshot, np.arange(count), destination[start : start + count]))
            start += count
        result = pipeline.restore_chunks(jobs)
        for snapshot in snapshots:
            snapshot.close()
    # One staging loop per head range: all chunks of one job.
    assert moves == [3] * tp
    assert result.num_blocks == 11
    for rank in target:
        for name, expected in pages.items():
            restored = rank.logical(name)[torch.as_tensor(destination)]
            assert same_bytes(restored, expected[:11, :, rank.heads]), name


def test_a_damaged_chunk_fails_only_its_blocks(tmp_path: Path) -> None:
    paths, pages, _ = _store_chunks(tmp_path, 1, 4)
    with SnapshotReader(paths[1]) as reader:
        _, entry = reader.locate("layers.1.key")
    page_bytes = entry.nbytes // 4
    with open(paths[1], "r+b") as file:  # the second page of the middle chunk
        file.seek(entry.begin + page_bytes + 5)
        byte = file.read(1)
        file.seek(-1, 1)
        file.write(bytes([byte[0] ^ 1]))
    (target,) = caches("vllm-nhd", 1, 4)
    destination = np.arange(11)
    with pytest.raises(RestoreIncompleteError) as caught:
        with (
            Snapshot.open(paths[0]) as a,
            Snapshot.open(paths[1]) as b,
            Snapshot.open(paths[2]) as c,
        ):
            Pipeline(target.layout).restore_chunks(
                [
                    (a, np.arange(4), destination[:4]),
                    (b, np.arange(4), destination[4:8]),
                    (c, np.arange(3), destination[8:]),
                ]
            )
    assert caught.value.failed_block_ids.tolist() == [5]
    for name, expected in pages.items():
        restored = target.logical(name)
        good = [block for block in range(11) if block != 5]
        assert same_bytes(restored[good], expected[good]), name
    assert not same_bytes(target.logical("layers.1.key")[[5]], pages["layers.1.key"][[5]])


def test_a_reopened_chunk_reuses_its_checked_block_checksums(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths, _, _ = _store_chunks(tmp_path, 1, 4)
    loads = []
    real = Source.read

    def counted(self, offset, size, *, tensor=None):  # type: ignore[no-untyped-def]
        if tensor == fmt.BLOCK_CHECKSUMS_TENSOR:
            loads.append(self.url)
        return real(self, offset, size, tensor=tensor)

    monkeypatch.setattr(Source, "read", counted)
    pages = (np.array([0, 3, 2]), np.array([1, 3, 0]))
    with SnapshotReader(paths[0]) as first:
        expected = first.stored_checksums(*pages)
    with SnapshotReader(paths[0]) as again, SnapshotReader(paths[1]) as other:
        assert np.array_equal(again.stored_checksums(*pages), expected)
        other.stored_checksums(*pages)
    # Read and checked once per file version: the reopened chunk reused the first reader's.
    assert loads == [str(paths[0]), str(paths[1])]


def test_plain_and_parted_chunks_restore_in_one_call(tmp_path: Path) -> None:
    paths, pages, source = _store_chunks(tmp_path, 2, 4)
    # The first chunk again, as a plain snapshot of every head.
    first, count = CHUNKS[0]
    tokens = np.arange(first * 4, (first + count) * 4)
    sequence = SequenceBlocks("chunk", tokens, np.arange(first, first + count))
    paths[0] = tmp_path / "plain0.safetensors"
    capture([r.layout for r in source], [sequence], paths[0], source=SOURCE)
    target = caches("vllm-nhd", 2, 4)
    moved: list[list[str]] = []
    real = WarmPipeline._move_in

    def recorded(self, moves, *args):  # type: ignore[no-untyped-def]
        moved.append([Path(move.file).name for move in moves])
        return real(self, moves, *args)

    destination = np.array([11, 3, 7, 0, 9, 1, 5, 2, 10, 4, 6])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(WarmPipeline, "_move_in", recorded)
        snapshots = [Snapshot.open(path) for path in paths]
        jobs, start = [], 0
        for snapshot, (_, count) in zip(snapshots, CHUNKS, strict=True):
            jobs.append((snapshot, np.arange(count), destination[start : start + count]))
            start += count
        result = Pipeline([rank.layout for rank in target]).restore_chunks(jobs)
        for snapshot in snapshots:
            snapshot.close()
    # The plain chunk moves through the target's own pipeline, each head range of the parted
    # chunks through the pipeline over its heads: one staging loop each, every chunk's part.
    assert [len(names) for names in moved] == [1, 2, 2]
    assert moved[0] == ["plain0.safetensors"]
    assert all("-part-00001-" in name for name in moved[1])
    assert all("-part-00002-" in name for name in moved[2])
    assert result.num_blocks == 11
    for rank in target:
        for name, expected in pages.items():
            restored = rank.logical(name)[torch.as_tensor(destination)]
            assert same_bytes(restored, expected[:11, :, rank.heads]), name
