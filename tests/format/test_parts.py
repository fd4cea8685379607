"""The parted format (version 2): part metadata, the parts index, and every way an index or its
parts can be wrong, each refused with a clear error."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from pathlib import Path

import pytest

import kvsnap
from kvsnap import format as fmt
from kvsnap.errors import (
    NotASnapshotError,
    SnapshotCorruptError,
    SnapshotIOError,
    UnsupportedVersionError,
)
from kvsnap.format import parse
from kvsnap.snapshot import Snapshot, capture
from tests.support.parts_helpers import SOURCE, filled, parted_snapshot, sequences

INDEX = ".index.json"


def _index(path: Path) -> dict:
    return json.loads(Path(str(path) + INDEX).read_text())


def _write_index(path: Path, document: dict) -> None:
    Path(str(path) + INDEX).write_text(json.dumps(document, indent=2))


@pytest.fixture
def parted(tmp_path: Path) -> Path:
    path = tmp_path / "snap.safetensors"
    parted_snapshot(path, "vllm-nhd", 8)
    return path


def test_part_metadata_round_trips_as_version_2(parted: Path) -> None:
    with Snapshot.open(parted) as snap:
        part_file = snap.part_files()[1]
        whole = snap.metadata
    with Snapshot.open(part_file) as part:
        meta = part.metadata
    assert meta.part == fmt.PartInfo(index=2, count=2, first_head=4, num_kv_heads=8)
    document = json.loads(meta.to_json())
    assert document["format_version"] == 2 and document["part"] == {
        "index": 2,
        "count": 2,
        "first_head": 4,
        "num_kv_heads": 8,
    }
    header = fmt.parse_metadata_json(meta.to_json())
    assert header.part == meta.part and header.format_version == 2
    # Plain snapshots stay version 1 and carry no part: their bytes never change.
    plain = dataclasses.replace(whole, part=None)
    assert json.loads(plain.to_json())["format_version"] == 1 and "part" not in plain.to_json()


def test_part_metadata_rules(parted: Path) -> None:
    with Snapshot.open(parted) as snap:
        part_file = snap.part_files()[0]
    with Snapshot.open(part_file) as part:
        document = json.loads(part.metadata.to_json())
    version_1 = dict(document, format_version=1)
    with pytest.raises(SnapshotCorruptError, match="format_version 2"):
        fmt.parse_metadata_document(version_1)
    with pytest.raises(SnapshotCorruptError, match="never a shard"):
        fmt.parse_metadata_document(dict(document, shard={"index": 1, "count": 2}))
    too_many = dict(document, part=dict(document["part"], first_head=6))
    with pytest.raises(SnapshotCorruptError, match="exceed the model's 8 KV heads"):
        fmt.parse_metadata_document(too_many)
    beyond = dict(document, part=dict(document["part"], index=3))
    with pytest.raises(SnapshotCorruptError, match="part 3 of 2"):
        fmt.parse_metadata_document(beyond)


def test_a_kvsnap_reading_only_version_1_asks_for_an_upgrade(
    parted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Snapshot.open(parted) as snap:
        part_file = snap.part_files()[0]
    monkeypatch.setattr(parse, "SUPPORTED_VERSIONS", (1,))
    kvsnap.clear_caches()  # decode the header again
    with pytest.raises(UnsupportedVersionError, match=r"format version 2 .*upgrade kvsnap"):
        Snapshot.open(part_file)
    with pytest.raises(UnsupportedVersionError, match="upgrade kvsnap"):
        Snapshot.open(parted)


def test_index_round_trips(parted: Path) -> None:
    raw = Path(str(parted) + INDEX).read_bytes()
    index = fmt.decode_parts_index(raw)
    assert [(part.first_head, part.num_heads) for part in index.parts] == [(0, 4), (4, 4)]
    assert index.metadata.format_version == 2 and index.metadata.part is None
    assert index.metadata.geometry.num_kv_heads == 8
    document = json.loads(raw)
    assert "weight_map" not in document and set(document["metadata"]) == {
        "total_size",
        "kvsnap",
        "kvsnap.parts",
    }
    with Snapshot.open(parted) as snap:
        metadata = snap.metadata
        sizes = sum(Path(path).stat().st_size for path in snap.part_files())
    assert fmt.encode_parts_index(metadata, index.parts) == raw
    assert 0 < document["metadata"]["total_size"] < sizes
    assert fmt.is_parts_index(raw) and not fmt.is_parts_index(b'{"metadata": {}}')


def _mutated(document: dict, change) -> dict:
    copy = json.loads(json.dumps(document))
    change(copy)
    return copy


INDEX_DAMAGE = {
    "heads not tiling": (
        lambda d: d["metadata"]["kvsnap.parts"][1].update(first_head=5),
        "must tile the KV heads",
    ),
    "heads short of the model's": (
        lambda d: d["metadata"]["kvsnap.parts"][1].update(num_heads=3),
        "the parts hold heads 0..7, the snapshot has 8",
    ),
    "a part missing from the list": (
        lambda d: d["metadata"]["kvsnap.parts"].pop(),
        "expected a name ending -part-00001-of-00001",
    ),
    "a bad trailer digest": (
        lambda d: d["metadata"]["kvsnap.parts"][0].update(trailer="zz"),
        "no valid trailer digest",
    ),
    "a weight map": (lambda d: d.update(weight_map={}), "unexpected or missing keys"),
    "version 1 metadata": (
        lambda d: d["metadata"]["kvsnap"].update(format_version=1),
        "format_version 2",
    ),
    "a part key in the index metadata": (
        lambda d: d["metadata"]["kvsnap"].update(
            part={"index": 1, "count": 1, "first_head": 0, "num_kv_heads": 8}
        ),
        "no shard or part",
    ),
    "a wrong total size": (
        lambda d: d["metadata"].update(total_size=d["metadata"]["total_size"] + 1),
        "total_size",
    ),
    "a path in a part name": (
        lambda d: d["metadata"]["kvsnap.parts"][0].update(
            file="../" + d["metadata"]["kvsnap.parts"][0]["file"]
        ),
        "is named",
    ),
}


@pytest.mark.parametrize("damage", sorted(INDEX_DAMAGE))
def test_every_damaged_index_is_refused(parted: Path, damage: str) -> None:
    change, message = INDEX_DAMAGE[damage]
    _write_index(parted, _mutated(_index(parted), change))
    with pytest.raises(SnapshotCorruptError, match=message):
        Snapshot.open(parted)


def test_a_wrong_trailer_digest_names_the_part(parted: Path) -> None:
    document = _index(parted)
    document["metadata"]["kvsnap.parts"][1]["trailer"] = "0" * 32
    _write_index(parted, document)
    with pytest.raises(SnapshotCorruptError, match="trailer digest") as caught:
        Snapshot.open(parted)
    assert caught.value.file is not None and "part-00002-of-00002" in caught.value.file


def test_a_missing_part_file_makes_the_snapshot_corrupt_naming_it(parted: Path) -> None:
    part = Path(parted.parent / _index(parted)["metadata"]["kvsnap.parts"][0]["file"])
    part.unlink()
    with pytest.raises(SnapshotCorruptError, match="the index names this file") as caught:
        Snapshot.open(parted)
    assert caught.value.file is not None and "part-00001-of-00002" in caught.value.file
    parted.with_name(parted.name + INDEX).unlink()
    with pytest.raises(SnapshotIOError, match="no such file"):  # no snapshot at all: a bad path
        Snapshot.open(parted)


def test_a_part_of_another_snapshot_is_refused(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    ranks, _ = filled("vllm-nhd", 2, 8)
    layouts = [rank.layout for rank in ranks]
    capture(layouts, sequences(1), ours, source=SOURCE, per_rank_parts=True)
    other_model = dataclasses.replace(SOURCE, model_id="another-model")
    capture(layouts, sequences(1), theirs, source=other_model, per_rank_parts=True)
    mine, foreign = _index(ours), _index(theirs)
    # Their part 2 under the name our index gives it: the trailer digest differs.
    shutil.copy(
        tmp_path / foreign["metadata"]["kvsnap.parts"][1]["file"],
        tmp_path / mine["metadata"]["kvsnap.parts"][1]["file"],
    )
    with pytest.raises(SnapshotCorruptError, match="trailer digest"):
        Snapshot.open(ours)
    # Even with the digest the index names, a part whose metadata differs is refused.
    mine["metadata"]["kvsnap.parts"][1]["trailer"] = foreign["metadata"]["kvsnap.parts"][1][
        "trailer"
    ]
    _write_index(ours, mine)
    with pytest.raises(SnapshotCorruptError, match="differs from the index's"):
        Snapshot.open(ours)


def test_parts_disagreeing_on_sequences_are_refused(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    ranks, _ = filled("vllm-nhd", 2, 8)
    layouts = [rank.layout for rank in ranks]
    capture(layouts, sequences(1), ours, source=SOURCE, per_rank_parts=True, reproducible=True)
    # Same lengths, other token ids: every JSON field agrees, the sequence tensors do not.
    capture(layouts, sequences(7), theirs, source=SOURCE, per_rank_parts=True, reproducible=True)
    mine, foreign = _index(ours), _index(theirs)
    shutil.copy(
        tmp_path / foreign["metadata"]["kvsnap.parts"][1]["file"],
        tmp_path / mine["metadata"]["kvsnap.parts"][1]["file"],
    )
    mine["metadata"]["kvsnap.parts"][1]["trailer"] = foreign["metadata"]["kvsnap.parts"][1][
        "trailer"
    ]
    _write_index(ours, mine)
    with pytest.raises(SnapshotCorruptError, match=r"sequences .* differ from part 1's"):
        Snapshot.open(ours)


def test_swapped_parts_are_refused(parted: Path) -> None:
    document = _index(parted)
    first, second = document["metadata"]["kvsnap.parts"]
    # Part 2's file listed first (renamed to part 1's name, and the other way round).
    one, two = parted.parent / first["file"], parted.parent / second["file"]
    one.rename(parted.parent / "tmp")
    two.rename(one)
    (parted.parent / "tmp").rename(two)
    first["trailer"], second["trailer"] = second["trailer"], first["trailer"]
    _write_index(parted, document)
    with pytest.raises(SnapshotCorruptError, match=r"is not part 1 of 2 holding heads 0\.\.4"):
        Snapshot.open(parted)


def test_encoding_refuses_what_decoding_would(parted: Path) -> None:
    raw = Path(str(parted) + INDEX).read_bytes()
    index = fmt.decode_parts_index(raw)
    with Snapshot.open(parted) as snap:
        metadata = snap.metadata
    bad = [index.parts[0], dataclasses.replace(index.parts[1], first_head=3)]
    with pytest.raises(ValueError, match="must tile"):
        fmt.encode_parts_index(metadata, bad)
    with Snapshot.open(snap.part_files()[0]) as part:
        with pytest.raises(ValueError, match="not a part's"):
            fmt.encode_parts_index(part.metadata, index.parts)


def test_part_names(parted: Path) -> None:
    generation = "g0123456789ab"
    name = fmt.part_file_name("snap", 2, 4, generation)
    assert name == "snap-g0123456789ab-part-00002-of-00004.safetensors"
    assert fmt.is_part_of("snap", name) and fmt.is_part_of("snap", name, generation)
    assert not fmt.is_part_of("snap", name, "g000000000000")
    assert not fmt.is_part_of("other", name) and not fmt.is_shard_of("snap", name)
    assert not fmt.is_part_of("snap", "snap-g0123456789ab-part-00005-of-00004.safetensors")
    with pytest.raises(ValueError):
        fmt.part_file_name("snap", 1, 2, "nope")
    with pytest.raises(NotASnapshotError):
        fmt.decode_parts_index(b"not json")


def test_a_version_2_file_without_a_part_is_refused(tmp_path: Path) -> None:
    ranks, _ = filled("vllm-nhd", 1, 8)
    path = tmp_path / "plain.safetensors"
    capture(ranks[0].layout, sequences(1), path, source=SOURCE)
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    at = data.index(b'\\"format_version\\":1', 8, 8 + length) + len(b'\\"format_version\\":1') - 1
    data[at : at + 1] = b"2"
    header = bytes(data[: 8 + length])
    begin, end = fmt.locate_trailer(header)
    rows = fmt.decode_trailer(bytes(data[begin:end]))
    data[begin:end] = fmt.encode_trailer([fmt.digest128(header), *rows[1:]])
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorruptError, match="format_version 2 without a part key"):
        Snapshot.open(path)
