"""The writer checks metadata without a JSON Schema validator (~3 ms per small capture), yet
refuses everything the schema refuses, and every header it writes validates against the
schema."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvsnap import format as fmt
from kvsnap.format import schema
from kvsnap.layout import KVGeometry
from kvsnap.store import SnapshotReader
from tests.support.store_helpers import (
    GEOMETRIES,
    SOURCE,
    make_metadata,
    random_pages,
    write_snapshot,
)

jsonschema = pytest.importorskip("jsonschema")


def build(geometry: KVGeometry, seed: int) -> tuple[fmt.SnapshotMetadata, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(0, 1000, geometry.block_size * 3 + 1) for _ in range(2)]
    metadata = make_metadata(geometry, tokens, created=fmt.utc_now())
    return metadata, random_pages(rng, metadata)


def schema_accepts(metadata: fmt.SnapshotMetadata) -> bool:
    """The full schema's verdict on ``metadata``'s JSON object (as the reader applies it)."""
    validator = jsonschema.validators.validator_for(fmt.metadata_schema())
    return validator(fmt.metadata_schema()).is_valid(metadata.to_json_dict())


def kvsnap_documents(path: Path) -> list[dict[str, Any]]:
    """The kvsnap metadata object in the header of each data file in ``path``'s directory."""
    documents = []
    for file in sorted(path.parent.glob("*.safetensors")):
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        documents.append(json.loads(header["__metadata__"]["kvsnap"]))
    return documents


def test_a_writer_runs_no_schema_validator(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    metadata, pages = build(GEOMETRIES["bf16"], seed=1)

    def no_validator() -> None:
        raise AssertionError("the writer ran the JSON Schema validator")

    with monkeypatch.context() as patch:
        patch.setattr(schema, "_schema_validator", no_validator)
        info = write_snapshot(tmp_path / "snap.safetensors", metadata, pages)
    with SnapshotReader(info.path) as reader:  # the reader validates with the full schema
        assert reader.verify() == [] and reader.metadata == metadata


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize("shape", ["one file", "shards", "part"])
def test_every_written_header_validates_against_the_schema(
    tmp_path: Path, name: str, shape: str
) -> None:
    geometry = GEOMETRIES[name]
    if shape == "part" and geometry.is_mla:
        pytest.skip("an MLA snapshot is never parted")
    metadata, pages = build(geometry, seed=2)
    options: dict[str, Any] = {}
    if shape == "shards":
        options["max_shard_bytes"] = metadata.num_blocks * geometry.canonical_page_size_bytes
    if shape == "part":
        heads = geometry.num_kv_heads
        metadata = dataclasses.replace(metadata, part=fmt.PartInfo(2, 2, heads, 2 * heads))
    write_snapshot(tmp_path / "snap.safetensors", metadata, pages, **options)
    documents = kvsnap_documents(tmp_path / "snap.safetensors")
    assert len(documents) > 1 if shape == "shards" else len(documents) == 1
    for document in documents:
        jsonschema.validate(document, fmt.metadata_schema())


def test_the_fields_checks_refuse_exactly_what_the_schema_refuses() -> None:
    metadata, _ = build(GEOMETRIES["bf16"], seed=3)
    geometry = metadata.geometry
    record = metadata.sequences[0]

    def with_source(**changes: Any) -> fmt.SnapshotMetadata:
        return dataclasses.replace(metadata, source=dataclasses.replace(SOURCE, **changes))

    def with_geometry(**changes: Any) -> fmt.SnapshotMetadata:
        return dataclasses.replace(metadata, geometry=dataclasses.replace(geometry, **changes))

    def with_first_id(new_id: Any) -> fmt.SnapshotMetadata:
        first = fmt.SequenceRecord(new_id, record.token_ids, record.block_ids, record.prefix_hashes)
        return dataclasses.replace(metadata, sequences=[first, *metadata.sequences[1:]])

    def with_part(**changes: Any) -> fmt.SnapshotMetadata:
        part = fmt.PartInfo(1, 2, 0, 2 * geometry.num_kv_heads)
        return dataclasses.replace(metadata, part=dataclasses.replace(part, **changes))

    refused = {
        "engine too long": with_source(engine="e" * 257),
        "engine not a string": with_source(engine=5),
        "engine_version too long": with_source(engine_version="v" * 257),
        "model_id too long": with_source(model_id="m" * 4097),
        "model_revision too long": with_source(model_revision="r" * 257),
        "fingerprint too long": with_source(model_fingerprint="f" * 257),
        "empty kvsnap_version": dataclasses.replace(metadata, kvsnap_version=""),
        "long kvsnap_version": dataclasses.replace(metadata, kvsnap_version="1" * 65),
        "empty capture_encoding": dataclasses.replace(metadata, capture_encoding=""),
        "long capture_encoding": dataclasses.replace(metadata, capture_encoding="c" * 257),
        "tp_size 0": dataclasses.replace(metadata, tp_size=0),
        "tp_size too large": dataclasses.replace(metadata, tp_size=65537),
        "tp_size a bool": dataclasses.replace(metadata, tp_size=True),
        "num_blocks a numpy int": dataclasses.replace(
            metadata, num_blocks=np.int64(metadata.num_blocks)
        ),
        "too many layers": with_geometry(num_layers=65537, attention_types=("full",) * 65537),
        "block_size too large": with_geometry(block_size=1048577),
        "head_dim too large": with_geometry(head_dim=1048577),
        "attention type not lowercase": with_geometry(
            attention_types=("Full",) * geometry.num_layers
        ),
        "empty sequence id": with_first_id(""),
        "sequence id too long": with_first_id("i" * 1025),
        "created not ISO-8601": dataclasses.replace(metadata, created="yesterday"),
        "part index 0": with_part(index=0),
        "part count too large": with_part(count=100000, index=2),
        "part first_head negative": with_part(first_head=-1),
    }
    for what, bad in refused.items():
        assert not schema_accepts(bad), what
        assert bad.problems(check_hashes=False), what
    accepted = {
        "longest engine": with_source(engine="e" * 256, model_id="m" * 4096),
        "longest kvsnap_version": dataclasses.replace(metadata, kvsnap_version="1" * 64),
        "largest tp_size": dataclasses.replace(metadata, tp_size=65536),
        "longest sequence id": with_first_id("i" * 1024),
        "no revision": with_source(model_revision=None),
        "reproducible": dataclasses.replace(metadata, created=None),
        "a part": with_part(),
    }
    for what, good in accepted.items():
        assert schema_accepts(good), what
        assert good.problems() == [], what


def test_file_plans_are_reused_per_shape_and_match_a_fresh_packing() -> None:
    first, _ = build(GEOMETRIES["f16-32k"], seed=4)
    # Another capture of the same shape: other tokens, ids and time, same geometry and sizes.
    second, _ = build(GEOMETRIES["f16-32k"], seed=5)
    second.sequences[0].id = "another-id"
    for max_shard_bytes in (None, first.num_blocks * first.geometry.canonical_page_size_bytes):
        plans = [fmt.file_layouts(metadata, max_shard_bytes) for metadata in (first, second)]
        assert len(plans[0]) == len(plans[1]) and (len(plans[0]) > 1) == bool(max_shard_bytes)
        for one, other in zip(*plans, strict=True):
            assert one.entries is other.entries  # placed once, not per capture
            assert one.header != other.header
        for metadata, layouts in zip((first, second), plans, strict=True):
            for layout in layouts:
                assert layout.header == fresh_header(layout, metadata)


def fresh_header(layout: fmt.FileLayout, metadata: fmt.SnapshotMetadata) -> bytes:
    """The header bytes of ``layout`` built from scratch: JSON of the metadata and entries,
    space-padded to the data start."""
    start = layout.data_start
    document: dict[str, Any] = {"__metadata__": {"format": "pt", "kvsnap": layout.kvsnap_json}}
    for entry in layout.entries:
        document[entry.name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [entry.begin - start, entry.end - start],
        }
    body = json.dumps(document, separators=(",", ":")).encode()
    assert start % fmt.DATA_ALIGNMENT == 0 and 8 + len(body) <= start
    assert json.loads(layout.kvsnap_json)["sequences"][0]["id"] == metadata.sequences[0].id
    return struct.pack("<Q", start - 8) + body + b" " * (start - 8 - len(body))


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_strict_json_loads_parses_as_json_loads_and_refuses_what_json_allows(name: str) -> None:
    """The one strict parser (kept decoder, duplicates found from the dict's size) reads real
    metadata, as str and as bytes of every encoding ``json.loads`` reads, exactly as
    ``json.loads`` does; and refuses a duplicate key at any depth (naming it), NaN and the
    infinities, a byte-order mark, deep nesting (as ``ValueError``) and a non-text argument."""
    geometry = GEOMETRIES[name]
    metadata = make_metadata(geometry, [np.arange(2 * geometry.block_size + 3)])
    text = metadata.to_json()
    expected = json.loads(text)
    assert schema.strict_json_loads(text) == expected
    for encoding in ("utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"):
        assert schema.strict_json_loads(text.encode(encoding)) == expected
    assert schema.strict_json_loads(bytearray(text.encode())) == expected
    nested_duplicate = text.replace('"layout":{', '"layout":{"dtype":"x",', 1)
    for duplicated, key in (
        (text[:-1] + ',"num_blocks":3}', "num_blocks"),
        (nested_duplicate, "dtype"),
        ('{"a":[{"b":1,"c":2,"b":1}]}', "b"),
    ):
        with pytest.raises(ValueError, match=f"duplicate key '{key}'"):
            schema.strict_json_loads(duplicated)
    for constant in ("NaN", "Infinity", "-Infinity"):
        with pytest.raises(ValueError, match="not valid JSON"):
            schema.strict_json_loads(f'{{"x":{constant}}}')
    with pytest.raises(ValueError, match="BOM"):
        schema.strict_json_loads("\ufeff" + text)
    with pytest.raises(ValueError, match="nested too deeply"):
        schema.strict_json_loads("[" * 100_000)
    with pytest.raises(TypeError):
        schema.strict_json_loads(memoryview(text.encode()))  # type: ignore[arg-type]
