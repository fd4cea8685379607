"""Parted snapshots on disk: each form replacing the others removes exactly the old files, a
failed parted write leaves the old snapshot intact, and foreign files are never removed."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

import kvsnap.parted
import kvsnap.store.read.parts
from kvsnap import format as fmt
from kvsnap import layout as L
from kvsnap.errors import SnapshotCorruptError
from kvsnap.parted import capture_part
from kvsnap.snapshot import Snapshot, capture
from kvsnap.store.files.part_files import discard_parts
from kvsnap.store.write.parts_index import publish_parts_index
from kvsnap.testing.caches import same_bytes
from tests.support.parts_helpers import SOURCE, filled, sequences

SHARD_BYTES = 4096  # small enough to shard the test snapshots


def _layouts(seed: int = 1):
    ranks, content = filled("vllm-nhd", 2, 8, seed)
    return [rank.layout for rank in ranks], content


def _write(path: Path, form: str, seed: int = 1):
    layouts, content = _layouts(seed)
    if form == "parted":
        capture(layouts, sequences(seed), path, source=SOURCE, per_rank_parts=True)
    else:
        shards = SHARD_BYTES if form == "sharded" else None
        capture(layouts, sequences(seed), path, source=SOURCE, max_shard_bytes=shards)
    return content


def _files(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir()}


def _expected_files(path: Path, form: str) -> set[str]:
    """The files a snapshot of ``form`` at ``path`` consists of, read from its own index."""
    if form == "single":
        return {path.name}
    index = Path(str(path) + ".index.json")
    raw = index.read_bytes()
    files = (
        [part.file for part in fmt.decode_parts_index(raw).parts]
        if form == "parted"
        else list(fmt.decode_index(raw).files)
    )
    return {index.name, *files}


def _holds(path: Path, content) -> bool:
    with Snapshot.open(path) as snap:
        return snap.verify() == [] and all(
            same_bytes(snap.read_tensor(name), content.pages[name])
            for name in snap.geometry.tensor_names()
        )


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("single", "parted"),
        ("sharded", "parted"),
        ("parted", "parted"),
        ("parted", "single"),
        ("parted", "sharded"),
    ],
)
def test_a_write_replacing_another_form_removes_exactly_the_old_files(
    tmp_path: Path, old: str, new: str
) -> None:
    path = tmp_path / "snap.safetensors"
    bystander = tmp_path / "other.safetensors"
    _write(bystander, "parted", seed=5)
    kept = _files(tmp_path)
    _write(path, old, seed=1)
    assert _files(tmp_path) == kept | _expected_files(path, old)
    content = _write(path, new, seed=2)
    assert _files(tmp_path) == kept | _expected_files(path, new)
    assert _holds(path, content)
    assert _holds(bystander, _layouts(5)[1])


def test_a_failed_parted_write_leaves_the_old_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "snap.safetensors"
    old = _write(path, "parted", seed=1)
    before = _files(tmp_path)
    calls = []

    def second_part_fails(*args, **kwargs):
        calls.append(kwargs["part"].index)
        if kwargs["part"].index == 2:
            raise OSError("disk gone")
        return capture_part(*args, **kwargs)

    monkeypatch.setattr(kvsnap.parted, "capture_part", second_part_fails)
    layouts, _ = _layouts(seed=2)
    with pytest.raises(OSError, match="disk gone"):
        capture(layouts, sequences(2), path, source=SOURCE, per_rank_parts=True)
    assert calls == [1, 2]
    # Part 1 of the failed write was published under its own name, then discarded.
    assert _files(tmp_path) == before
    assert _holds(path, old)


def test_discard_parts_removes_one_generation_only(tmp_path: Path) -> None:
    path = tmp_path / "snap.safetensors"
    old = _write(path, "parted", seed=1)
    before = _files(tmp_path)
    layouts, _ = _layouts(seed=2)
    plan = L.part_assignments(layouts[0].geometry, 2)
    generation = fmt.new_generation()
    written = [
        capture_part(
            layouts[part.writer_rank],
            sequences(2),
            path,
            part=part,
            count=len(plan),
            generation=generation,
        )
        for part in plan
    ]
    # The parts are durable and named by no index: readers still find the old snapshot.
    assert _files(tmp_path) == before | {item.record.file for item in written}
    assert _holds(path, old)
    removed = discard_parts(path, generation)
    assert sorted(Path(url).name for url in removed) == sorted(w.record.file for w in written)
    assert _files(tmp_path) == before and _holds(path, old)


def test_the_index_publish_checks_its_parts(tmp_path: Path) -> None:
    path = tmp_path / "snap.safetensors"
    layouts, content = _layouts(seed=1)
    plan = L.part_assignments(layouts[0].geometry, 2)
    generation = fmt.new_generation()
    records = [
        capture_part(
            layouts[part.writer_rank],
            sequences(1),
            path,
            part=part,
            count=2,
            generation=generation,
            source=SOURCE,
        ).record
        for part in plan
    ]
    with pytest.raises(ValueError, match="expected a name ending -part-00001-of-00002"):
        publish_parts_index(path, records[::-1])
    assert not Path(str(path) + ".index.json").exists()
    wrong = dataclasses.replace(records[1], trailer="0" * 32)
    with pytest.raises(SnapshotCorruptError, match="trailer digest"):
        publish_parts_index(path, [records[0], wrong])
    assert not Path(str(path) + ".index.json").exists()
    index = publish_parts_index(path, records)
    assert index == str(path) + ".index.json" and _holds(path, content)


def test_a_copied_index_never_gets_foreign_parts_deleted(tmp_path: Path) -> None:
    theirs, ours = tmp_path / "theirs.safetensors", tmp_path / "ours.safetensors"
    content = _write(theirs, "parted", seed=3)
    shutil.copy(str(theirs) + ".index.json", str(ours) + ".index.json")
    before = _files(tmp_path)
    _write(ours, "single", seed=4)
    # Our (copied) index is replaced by the single file; their parts are not ours by name.
    assert _files(tmp_path) == (before - {"ours.safetensors.index.json"}) | {"ours.safetensors"}
    assert _holds(theirs, content)


def test_an_open_racing_a_replacement_starts_over_and_finds_the_new_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "snap.safetensors"
    _write(path, "parted", seed=1)
    real_open_once = kvsnap.store.read.parts._open_once
    attempts = []

    def replaced_meanwhile(*args, **kwargs):
        if replaced:  # the writer's own check of its parts, or the reader's next attempt
            attempts.append(1)
        else:  # the reader has read the old index; a writer now replaces the snapshot
            replaced.append(None)
            replaced.append(_write(path, "parted", seed=2))
            attempts.clear()
        return real_open_once(*args, **kwargs)

    replaced: list = []
    monkeypatch.setattr(kvsnap.store.read.parts, "_open_once", replaced_meanwhile)
    with Snapshot.open(path) as snap:
        assert len(attempts) == 1  # the retry, after the first attempt found a part gone
        assert all(
            same_bytes(snap.read_tensor(name), replaced[1].pages[name])
            for name in snap.geometry.tensor_names()
        )


def test_an_index_is_published_only_over_the_snapshots_own_parts(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs.safetensors"
    _write(theirs, "parted", seed=3)
    records = list(fmt.decode_parts_index(Path(str(theirs) + ".index.json").read_bytes()).parts)
    with pytest.raises(ValueError, match=r"is not a part file name of ours\.safetensors"):
        publish_parts_index(tmp_path / "ours.safetensors", records)
    assert not (tmp_path / "ours.safetensors.index.json").exists()
