"""Parted snapshots end to end on CPU caches of random bytes: part layouts of every layout kind,
capture from TP=2, restore at TP=1, 2 and 4 bit-exact, and reading a parted snapshot as one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvsnap import format as fmt
from kvsnap import layout as L
from kvsnap.errors import LayoutError, NotASnapshotError, RestoreIncompleteError
from kvsnap.parted import capture_part
from kvsnap.pipeline import Pipeline
from kvsnap.snapshot import Snapshot, capture
from kvsnap.store import SnapshotReader
from kvsnap.testing.caches import make_cache, same_bytes
from tests.support.parts_helpers import (
    NUM_BLOCKS,
    SOURCE,
    TARGETS,
    TP_KINDS,
    caches,
    filled,
    geometry,
    parted_snapshot,
    restore_map,
    restored_exactly,
    sequences,
)


def test_part_plan_gives_each_head_group_one_writer() -> None:
    plan = L.part_assignments(geometry(8), 2)
    assert [(p.index, p.first_head, p.num_heads, p.writer_rank) for p in plan] == [
        (1, 0, 4, 0),
        (2, 4, 4, 1),
    ]
    # More ranks than heads: the first rank of each replication group writes its head.
    plan = L.part_assignments(geometry(2), 8)
    assert [(p.first_head, p.num_heads, p.writer_rank) for p in plan] == [(0, 1, 0), (1, 1, 4)]
    assert (
        len(L.part_assignments(geometry(8), 1)) == 1
        and L.part_assignments(geometry(8), 1)[0].num_heads == 8
    )
    mla = L.KVGeometry(num_layers=2, block_size=4, dtype="float16", latent_dim=16)
    assert L.part_assignments(mla, 4) == []
    with pytest.raises(LayoutError, match="evenly"):
        L.part_assignments(geometry(8), 3)


@pytest.mark.parametrize("kind", TP_KINDS)
def test_head_range_reads_the_heads_each_rank_holds(kind: str) -> None:
    assert [L.head_range(rank.layout) for rank in caches(kind, 4, 8)] == [
        (0, 2),
        (2, 4),
        (4, 6),
        (6, 8),
    ]
    assert [L.head_range(rank.layout) for rank in caches(kind, 4, 2)] == [
        (0, 1),
        (0, 1),
        (1, 2),
        (1, 2),
    ]


def test_part_layout_is_none_without_the_heads_and_cached() -> None:
    rank0 = caches("vllm-nhd", 4, 8)[0].layout  # heads 0..2
    assert L.part_layout(rank0, 4, 4) is None
    part = L.part_layout(rank0, 0, 4)  # a superset part: this rank fills heads 0..2 of it
    assert part is not None and part.geometry.num_kv_heads == 4
    assert L.part_layout(rank0, 0, 4) is part
    assert all(ref.mapping.num_writers == 1 for ref in part.refs)
    assert part.ref("layers.0.key").mapping.local_bytes == 4 * 2 * 8 * 2  # tokens, heads, dim
    with pytest.raises(LayoutError, match="not a range"):
        L.part_layout(rank0, 6, 4)


@pytest.mark.parametrize("heads", [8, 2])
@pytest.mark.parametrize("kind", TP_KINDS)
def test_tp2_parts_restore_bit_exact_at_tp_1_2_4(tmp_path: Path, kind: str, heads: int) -> None:
    path = tmp_path / "parted.safetensors"
    content = parted_snapshot(path, kind, heads)
    with Snapshot.open(path) as snap:
        assert snap.index is not None and len(snap.parts) == 2
        for tp in (1, 2, 4):
            ranks = caches(kind, tp, heads)
            snap.restore([rank.layout for rank in ranks], restore_map())
            assert restored_exactly(ranks, content), f"TP {tp}"


@pytest.mark.parametrize("kind", ["flat-paged", "contiguous"])
def test_tp1_only_layouts_restore_parts_and_capture_a_superset(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "parted.safetensors"
    content = parted_snapshot(path, "vllm-hnd", 8)
    target = caches(kind, 1, 8)
    with Snapshot.open(path) as snap:
        snap.restore(target[0].layout, restore_map())
    assert restored_exactly(target, content)
    # The TP=1 cache holds every head: its part layouts capture any head range.
    again = tmp_path / "again.safetensors"
    plan = L.part_assignments(geometry(8), 4)
    generation = fmt.new_generation()
    restored_seqs = [
        seq.__class__(seq.id, seq.token_ids, restore_map()[seq.id]) for seq in sequences(1)
    ]
    records = [
        capture_part(
            target[0].layout,
            restored_seqs,
            again,
            part=part,
            count=len(plan),
            generation=generation,
            source=SOURCE,
        ).record
        for part in plan
    ]
    from kvsnap.store.write.parts_index import publish_parts_index

    publish_parts_index(again, records)
    with Snapshot.open(path) as first, Snapshot.open(again) as second:
        assert len(second.parts) == 4
        comparison = first.compare(second)
        assert comparison.ok, comparison.report()


def test_a_parted_snapshot_reads_as_the_plain_one(tmp_path: Path) -> None:
    ranks, content = filled("vllm-nhd", 2, 8)
    layouts = [rank.layout for rank in ranks]
    plain, parted = tmp_path / "plain.safetensors", tmp_path / "parted.safetensors"
    capture(layouts, sequences(1), plain, source=SOURCE, reproducible=True)
    result = capture(layouts, sequences(1), parted, source=SOURCE, per_rank_parts=True)
    assert result.path == str(parted) + ".index.json"
    with Snapshot.open(plain) as one, Snapshot.open(result.path) as other:
        assert other.format_version == 2 and one.format_version == 1
        assert other.geometry == one.geometry and other.sequences == one.sequences
        assert other.verify() == []
        for name in one.geometry.tensor_names():
            assert same_bytes(other.read_tensor(name), one.read_tensor(name))
        assert same_bytes(
            other.sequence_kv("b", "layers.1.value"), one.sequence_kv("b", "layers.1.value")
        )
        assert other.tensor_stats("layers.0.key") == one.tensor_stats("layers.0.key")
        assert one.compare(other).ok
        assert other.part_files() == sorted(other.part_files()) and len(other.part_files()) == 2
    # Each part opens as what it is: a snapshot of its heads.
    with Snapshot.open(other.part_files()[1]) as part:
        assert part.geometry.num_kv_heads == 4 and part.metadata.part == fmt.PartInfo(2, 2, 4, 8)
        assert same_bytes(
            part.read_tensor("layers.0.key"), content.pages["layers.0.key"][:NUM_BLOCKS, :, 4:]
        )
    with pytest.raises(NotASnapshotError, match="parted snapshot"):
        SnapshotReader(result.path)


def test_a_rank_reads_only_the_parts_holding_its_heads(tmp_path: Path) -> None:
    path = tmp_path / "parted.safetensors"
    content = parted_snapshot(path, "vllm-nhd", 8)
    with Snapshot.open(path) as snap:
        part2 = snap.part_files()[1]
        with SnapshotReader(part2) as reader:
            _, entry = reader.locate("layers.0.key")
        with open(part2, "r+b") as file:  # every page of part 2's first tensor is damaged
            file.seek(entry.begin)
            file.write(bytes(entry.nbytes))
        rank0, rank1 = caches("vllm-nhd", 2, 8)
        # TP=2 rank 0 holds heads 0..4: part 1 only, so the damage is never read.
        Pipeline(rank0.layout).restore(snap, restore_map())
        assert restored_exactly([rank0], content)
        with pytest.raises(RestoreIncompleteError) as caught:
            Pipeline(rank1.layout).restore(snap, restore_map())
        assert sorted(caught.value.failed_block_ids.tolist()) == list(range(NUM_BLOCKS))


def test_restore_blocks_and_the_warm_pipeline(tmp_path: Path) -> None:
    path = tmp_path / "parted.safetensors"
    content = parted_snapshot(path, "vllm-hnd", 8)
    ranks = caches("vllm-nhd", 4, 8)
    pipeline = Pipeline([rank.layout for rank in ranks])
    with Snapshot.open(path) as snap:
        for _ in range(2):
            pipeline.restore_blocks(
                snap,
                np.arange(NUM_BLOCKS),
                np.array(restore_map()["a"].tolist() + restore_map()["b"].tolist()),
            )
        # Warm: the second call reused the per-part pipelines and their part layouts.
        kept = dict(pipeline._part_pipelines)
        pipeline.restore(snap, restore_map())
        assert pipeline._part_pipelines == kept and len(kept) == 2
    assert restored_exactly(ranks, content)


def test_mla_is_never_parted(tmp_path: Path) -> None:
    cache = make_cache("mla", num_layers=2, num_blocks=4, block_size=4, latent_dim=16)
    seqs = [sequences(0)[1]]
    seqs = [seqs[0].__class__("b", seqs[0].token_ids, np.arange(4))]
    with pytest.raises(LayoutError, match="MLA"):
        capture(cache.layout, seqs, tmp_path / "mla.safetensors", per_rank_parts=True)
    with pytest.raises(LayoutError, match="MLA"):
        L.part_layout(cache.layout, 0, 1)


def test_random_content_of_part_layouts_matches_the_logical_views() -> None:
    # An independent oracle: a part layout's copy runs, applied by hand, land each head of the
    # range where the part's canonical page puts it.
    rank = caches("vllm-hnd", 2, 8)[1]  # heads 4..8
    gen = torch.Generator().manual_seed(3)
    for view in rank.views.values():
        view.copy_(
            torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=gen).to(view.dtype)
        )
    part = L.part_layout(rank.layout, 6, 2)
    assert part is not None
    ref = part.ref("layers.1.value")
    tensor = part.tensors[ref.tensor_index]
    base = tensor.tensor.untyped_storage()
    raw = torch.frombuffer(bytearray(bytes(base)), dtype=torch.uint8)
    block = 5
    page = torch.zeros(part.geometry.canonical_page_size_bytes, dtype=torch.uint8)
    start = tensor.data_ptr - base.data_ptr() + block * tensor.block_stride_bytes
    for run in ref.mapping.runs:
        for i in range(run.num_fragments):
            local = start + run.local_offset + i * run.local_stride
            canonical = run.canonical_offset + i * run.canonical_stride
            page[canonical : canonical + run.fragment_size] = raw[local : local + run.fragment_size]
    expected = rank.logical("layers.1.value")[block][:, 2:4].contiguous()
    assert same_bytes(page.view(torch.float16).reshape(expected.shape), expected)


def test_progress_of_a_parted_restore_and_verify_reaches_the_total(tmp_path: Path) -> None:
    path = tmp_path / "parted.safetensors"
    parted_snapshot(path, "vllm-nhd", 8)
    ranks = caches("vllm-nhd", 1, 8)
    seen: list[tuple[int, int]] = []
    with Snapshot.open(path) as snap:
        result = snap.restore(
            ranks[0].layout, restore_map(), progress=lambda done, total: seen.append((done, total))
        )
        total = snap.kv_bytes
        assert result.num_bytes == total and result.num_blocks == NUM_BLOCKS
        assert [done for done, _ in seen] == sorted(done for done, _ in seen)
        assert seen[-1] == (total, total) and {t for _, t in seen} == {total}
        checked: list[tuple[int, int]] = []
        assert snap.verify(progress=lambda done, total: checked.append((done, total))) == []
        assert checked[-1] == (total, total)


def test_one_rank_makes_one_part_and_unverified_opens_read_the_same(tmp_path: Path) -> None:
    ranks, content = filled("vllm-nhd", 1, 8)
    path = tmp_path / "one.safetensors"
    capture(ranks[0].layout, sequences(1), path, source=SOURCE, per_rank_parts=True)
    with Snapshot.open(path, verify=False) as snap:
        assert snap.index is not None and len(snap.parts) == 1
        assert snap.index.parts[0].num_heads == 8
        assert same_bytes(snap.read_tensor("layers.1.key"), content.pages["layers.1.key"])


def test_every_snapshot_is_a_list_of_head_range_parts(tmp_path: Path) -> None:
    ranks, content = filled("vllm-nhd", 2, 8)
    layouts = [rank.layout for rank in ranks]
    plain, parted = tmp_path / "plain.safetensors", tmp_path / "parted.safetensors"
    capture(layouts, sequences(1), plain, source=SOURCE)
    capture(layouts, sequences(1), parted, source=SOURCE, per_rank_parts=True)
    with Snapshot.open(plain) as one, Snapshot.open(parted) as other:
        # A single file is one part holding every head, read through the one reader.
        assert one.index is None and one.part_files() == [str(plain)]
        [whole] = one.parts
        assert (whole.first_head, whole.num_heads) == (0, 8) and one.reader is whole.reader
        # A parted snapshot is one part per file; its reader is its first part's, no error.
        assert [(p.first_head, p.num_heads) for p in other.parts] == [(0, 4), (4, 4)]
        assert other.reader is other.parts[0].reader
        assert other.reader.metadata.part == fmt.PartInfo(1, 2, 0, 8)
        for part in other.parts:
            heads = slice(part.first_head, part.first_head + part.num_heads)
            assert same_bytes(
                part.reader.read_tensor("layers.1.value"),
                content.pages["layers.1.value"][:NUM_BLOCKS, :, heads],
            )


def test_a_snapshot_made_from_a_reader_restores_as_one_opened(tmp_path: Path) -> None:
    ranks, content = filled("vllm-hnd", 1, 8)
    path = tmp_path / "plain.safetensors"
    capture(ranks[0].layout, sequences(1), path, source=SOURCE)
    target = caches("vllm-nhd", 2, 8)
    with Snapshot(SnapshotReader(path), str(path)) as snap:
        assert [(p.first_head, p.num_heads) for p in snap.parts] == [(0, 8)]
        snap.restore([rank.layout for rank in target], restore_map())
    assert restored_exactly(target, content)


def test_a_pipeline_restores_a_parted_snapshot_named_by_its_path(tmp_path: Path) -> None:
    path = tmp_path / "parted.safetensors"
    content = parted_snapshot(path, "vllm-nhd", 8)
    target = caches("packed", 4, 8)
    result = Pipeline([rank.layout for rank in target]).restore(str(path), restore_map())
    assert result.num_sequences == 2 and result.num_blocks == NUM_BLOCKS
    assert restored_exactly(target, content)


def test_failed_pages_of_every_part_make_one_error(tmp_path: Path) -> None:
    path = tmp_path / "parted.safetensors"
    content = parted_snapshot(path, "vllm-nhd", 8)
    with Snapshot.open(path) as snap:
        damaged = {}  # part file -> the snapshot block damaged in it
        for part, block in zip(snap.part_files(), (2, 9), strict=True):
            with SnapshotReader(part) as reader:
                _, entry = reader.locate("layers.1.key")
                page = reader.page_size_bytes("layers.1.key")
            with open(part, "r+b") as file:
                file.seek(entry.begin + block * page + 3)
                byte = file.read(1)
                file.seek(-1, 1)
                file.write(bytes([byte[0] ^ 1]))
            damaged[part] = block
        (target,) = caches("vllm-nhd", 1, 8)
        with pytest.raises(RestoreIncompleteError) as caught:
            snap.restore(target.layout, restore_map())
    error = caught.value
    assert error.file == str(path)
    assert error.failed_block_ids.tolist() == sorted(int(TARGETS[b]) for b in damaged.values())
    assert all(part in str(error) for part in damaged)
    assert error.result.num_blocks == NUM_BLOCKS
    # Every other page was written.
    good = [b for b in range(NUM_BLOCKS) if b not in damaged.values()]
    for name in content.geometry.tensor_names():
        expected = target.expected(content, name, torch.tensor(good))
        assert same_bytes(target.logical(name)[torch.from_numpy(TARGETS[good])], expected), name
