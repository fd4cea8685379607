"""Snapshot metadata in memory: round trips through JSON and tensors, the published schema,
problems named, newer versions refused, strict parsing."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvsnap import format as fmt
from kvsnap.errors import SnapshotCorruptError, UnsupportedVersionError
from kvsnap.format.encoded import ENCODED_FORMAT_VERSION
from kvsnap.layout import KVGeometry
from tests.support.format_versions import UNKNOWN_FORMAT_VERSION
from tests.support.store_helpers import GEOMETRIES, SOURCE, make_metadata, shared_prefix_tokens


def test_metadata_round_trips_through_json_and_tensors(metadata: fmt.SnapshotMetadata) -> None:
    text = metadata.to_json()
    assert json.loads(text)["format_version"] == fmt.FORMAT_VERSION
    rebuilt = fmt.parse_metadata_json(text).with_tensors(metadata.metadata_tensors())
    assert rebuilt == metadata
    assert rebuilt.sequences[1].prefix_hashes == metadata.sequences[1].prefix_hashes
    assert metadata.problems() == []


def test_block_hashes_tensor_holds_each_blocks_prefix_hash(metadata: fmt.SnapshotMetadata) -> None:
    hashes = metadata.metadata_tensors()[fmt.BLOCK_HASHES_TENSOR]
    assert hashes.shape == (metadata.num_blocks, 16) and hashes.dtype == np.uint8
    for record in metadata.sequences:
        for block, digest in zip(record.block_ids.tolist(), record.prefix_hashes, strict=True):
            assert hashes[block].tobytes().hex() == digest


def test_metadata_json_matches_the_published_schema(metadata: fmt.SnapshotMetadata) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = fmt.metadata_schema()
    jsonschema.validators.validator_for(schema).check_schema(schema)
    jsonschema.validate(json.loads(metadata.to_json()), schema)
    jsonschema.validate(json.loads(metadata.to_json(shard=(2, 3))), schema)
    broken = json.loads(metadata.to_json())
    broken["layout"]["dtype"] = "float7"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_source_info_defaults_are_written_and_read_back(metadata: fmt.SnapshotMetadata) -> None:
    import kvsnap

    assert kvsnap.SourceInfo() == fmt.SourceInfo("unknown", "unknown", "unknown", None, "")
    for source in (kvsnap.SourceInfo(), kvsnap.SourceInfo(model_id="x")):
        described = dataclasses.replace(metadata, source=source)
        assert described.problems() == []
        rebuilt = fmt.parse_metadata_json(described.to_json()).with_tensors(
            described.metadata_tensors()
        )
        assert rebuilt.source == source


def test_docs_publish_the_schema_the_package_uses() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "format.md").read_text()
    blocks = re.findall(r"```json\n(.*?)\n```", doc, flags=re.S)
    assert fmt.metadata_schema() in [json.loads(block) for block in blocks if '"$schema"' in block]


def test_metadata_problems_name_what_is_wrong(metadata: fmt.SnapshotMetadata) -> None:
    record = metadata.sequences[0]

    def with_record(**changes: Any) -> fmt.SnapshotMetadata:
        fields = {
            "id": record.id,
            "token_ids": record.token_ids,
            "block_ids": record.block_ids,
            "prefix_hashes": record.prefix_hashes,
        }
        fields.update(changes)
        return fmt.SnapshotMetadata(
            metadata.geometry,
            SOURCE,
            [fmt.SequenceRecord(**fields), *metadata.sequences[1:]],
            metadata.num_blocks,
            "test",
            1,
        )

    assert any(
        "blocks of" in p
        for p in with_record(
            block_ids=record.block_ids[:-1], prefix_hashes=record.prefix_hashes[:-1]
        ).problems()
    )
    assert any(
        "[0," in p for p in with_record(block_ids=record.block_ids + metadata.num_blocks).problems()
    )
    tampered = (record.prefix_hashes[0][::-1], *record.prefix_hashes[1:])
    assert any("hash chain" in p for p in with_record(prefix_hashes=tampered).problems())
    assert any("appears twice" in p for p in with_record(id=metadata.sequences[1].id).problems())
    bad_time = fmt.SnapshotMetadata(
        metadata.geometry,
        SOURCE,
        metadata.sequences,
        metadata.num_blocks,
        "t",
        1,
        created="yesterday",
    )
    assert any("ISO-8601" in p for p in bad_time.problems())
    # Two sequences claiming one block with different prefixes cannot both be right.
    first, second = metadata.sequences[0], metadata.sequences[1]
    clash = fmt.SequenceRecord(
        second.id, second.token_ids, second.block_ids.copy(), second.prefix_hashes
    )
    clash.block_ids[0] = first.block_ids[-1]
    conflicting = fmt.SnapshotMetadata(
        metadata.geometry, SOURCE, [first, clash], metadata.num_blocks, "t", 1
    )
    assert any("another sequence gave" in p for p in conflicting.problems(check_hashes=False))


def test_newer_format_versions_ask_for_an_upgrade(metadata: fmt.SnapshotMetadata) -> None:
    document = json.loads(metadata.to_json())
    document["format_version"] = UNKNOWN_FORMAT_VERSION
    document["something_new"] = {"x": 1}
    with pytest.raises(UnsupportedVersionError, match="upgrade kvsnap") as caught:
        fmt.parse_metadata_json(json.dumps(document), file="snap.safetensors")
    assert caught.value.version == UNKNOWN_FORMAT_VERSION
    assert "snap.safetensors" in str(caught.value)
    # What this kvsnap reads, every version: an encoded file's 3 as well as 1 and 2.
    assert "reads (1, 2 for parted snapshots, 3 for encoded ones)" in str(caught.value)
    # Version 3 read as an ordinary file (a URL, an index): not "newer", but how it is read.
    document["format_version"] = ENCODED_FORMAT_VERSION
    with pytest.raises(UnsupportedVersionError, match="an encoded snapshot") as caught:
        fmt.parse_metadata_json(json.dumps(document), file="snap.safetensors")
    assert "upgrade" not in str(caught.value) and "as a local file" in str(caught.value)
    assert "kvsnap convert FILE -o OUT --compress none" in str(caught.value)
    document["format_version"] = 0
    with pytest.raises(UnsupportedVersionError):
        fmt.parse_metadata_json(json.dumps(document))
    document["format_version"] = "1"
    with pytest.raises(SnapshotCorruptError, match="format_version"):
        fmt.parse_metadata_json(json.dumps(document))


def test_metadata_json_is_parsed_strictly(metadata: fmt.SnapshotMetadata) -> None:
    text = metadata.to_json()
    with pytest.raises(SnapshotCorruptError, match="duplicate"):
        fmt.parse_metadata_json(text[:-1] + ',"num_blocks":3}')
    with pytest.raises(SnapshotCorruptError, match="schema"):
        fmt.parse_metadata_json(text[:-1] + ',"unknown_key":3}')
    document = json.loads(text)
    document["layout"]["encoding"] = fmt.MLA_ENCODING
    with pytest.raises(SnapshotCorruptError, match="encoding"):
        fmt.parse_metadata_json(json.dumps(document))
    document = json.loads(text)
    document["sequences"][0]["num_blocks"] += 1
    with pytest.raises(SnapshotCorruptError, match="need"):
        fmt.parse_metadata_json(json.dumps(document))
    with pytest.raises(SnapshotCorruptError, match="JSON"):
        fmt.parse_metadata_json("[" * 100_000)


def test_geometries_survive_metadata_round_trip() -> None:
    for geometry in GEOMETRIES.values():
        meta = make_metadata(
            geometry,
            shared_prefix_tokens(np.random.default_rng(6), geometry.block_size),
            extra_blocks=2,
        )
        assert fmt.parse_metadata_json(meta.to_json()).with_tensors(meta.metadata_tensors()) == meta
    mla = KVGeometry(num_layers=1, block_size=2, dtype="bfloat16", latent_dim=4)
    assert (
        json.loads(make_metadata(mla, [np.arange(3)]).to_json())["layout"]["encoding"]
        == fmt.MLA_ENCODING
    )
