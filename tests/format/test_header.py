"""The v1 snapshot format in memory: hash chains, dedupe, fingerprints, metadata, header codec."""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsnap import format as fmt
from kvsnap.errors import (
    IncompatibleSnapshotError,
    KVSnapError,
    NotASnapshotError,
    SnapshotCorruptError,
    UnsupportedVersionError,
)
from kvsnap.layout import KVGeometry
from tests.support.store_helpers import GEOMETRIES, SOURCE, make_metadata, shared_prefix_tokens

# --------------------------------------------------------------------------------------------
# Prefix hash chains


def test_prefix_hash_chain_follows_its_definition() -> None:
    """Each hash is xxh3-128(previous digest ‖ token count ‖ tokens), all little-endian int64."""
    tokens = np.arange(10, dtype=np.int64) * 7919
    chain = fmt.prefix_hash_chain(tokens, 4)
    previous = bytes(16)
    for index, start in enumerate(range(0, 10, 4)):
        block = tokens[start : start + 4]
        digest = xxhash.xxh3_128_digest(
            previous
            + struct.pack("<q", len(block))
            + struct.pack(f"<{len(block)}q", *block.tolist())
        )
        assert chain[index] == digest.hex()
        previous = digest
    assert len(chain) == 3  # 4 + 4 + a partial block of 2


def test_prefix_hash_chain_is_a_prefix_identity() -> None:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 100_000, 40)
    chain = fmt.prefix_hash_chain(tokens, 8)
    # Same prefix, same hashes; one changed token changes its block and every later one.
    changed = tokens.copy()
    changed[20] += 1
    other = fmt.prefix_hash_chain(changed, 8)
    assert other[:2] == chain[:2]
    assert all(a != b for a, b in zip(other[2:], chain[2:], strict=True))
    # A partial block never equals a full one, nor a partial block of another length.
    assert fmt.prefix_hash_chain(tokens[:12], 8)[1] != fmt.prefix_hash_chain(tokens[:16], 8)[1]
    assert fmt.prefix_hash_chain(tokens[:12], 8)[1] != fmt.prefix_hash_chain(tokens[:13], 8)[1]
    # Continuing from a parent equals hashing the whole sequence.
    assert fmt.prefix_hash_chain(tokens[16:], 8, parent=chain[1]) == chain[2:]
    # The integer type of the input does not matter, only the values.
    assert fmt.prefix_hash_chain(tokens.astype(np.int32), 8) == chain
    assert fmt.prefix_hash_chain(tokens.tolist(), 8) == chain
    assert fmt.prefix_hash_chain([], 8) == []


def test_prefix_hash_chain_is_the_same_in_another_process() -> None:
    """No salted hash(): a fresh interpreter with another hash seed gets the same chain."""
    tokens = list(range(100, 137))
    code = (
        "import json; from kvsnap.format import prefix_hash_chain; "
        f"print(json.dumps(prefix_hash_chain({tokens}, 16)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    )
    assert json.loads(result.stdout) == fmt.prefix_hash_chain(tokens, 16)


def test_prefix_hash_chain_rejects_bad_input() -> None:
    with pytest.raises(TypeError):
        fmt.prefix_hash_chain(np.array([1.5, 2.0]), 4)
    with pytest.raises(ValueError):
        fmt.prefix_hash_chain(np.zeros((2, 2), dtype=np.int64), 4)
    with pytest.raises(ValueError):
        fmt.prefix_hash_chain([1, 2], 0)
    with pytest.raises(ValueError):
        fmt.prefix_hash_chain([1, 2], 4, parent="not-hex")


# --------------------------------------------------------------------------------------------
# Dedupe


def test_dedupe_blocks_stores_each_prefix_once() -> None:
    rng = np.random.default_rng(2)
    sequences = shared_prefix_tokens(rng, 4, num_sequences=6)
    sequences.append(sequences[0].copy())  # an exact duplicate shares every block
    chains = [fmt.prefix_hash_chain(tokens, 4) for tokens in sequences]
    dedupe = fmt.dedupe_blocks(chains)
    distinct = {digest for chain in chains for digest in chain}
    assert dedupe.num_blocks == len(distinct) < sum(len(chain) for chain in chains)
    for chain, ids in zip(chains, dedupe.sequence_block_ids, strict=True):
        assert ids.dtype == np.int64
        assert [dedupe.block_hashes[i] for i in ids.tolist()] == chain
    np.testing.assert_array_equal(dedupe.sequence_block_ids[-1], dedupe.sequence_block_ids[0])
    # Owners are first occurrences, and blocks are numbered in order of first appearance.
    seen: set[str] = set()
    expected_owners = []
    for sequence_index, chain in enumerate(chains):
        for position, digest in enumerate(chain):
            if digest not in seen:
                seen.add(digest)
                expected_owners.append((sequence_index, position))
    assert dedupe.owners.tolist() == [list(owner) for owner in expected_owners]


def test_dedupe_of_nothing() -> None:
    dedupe = fmt.dedupe_blocks([])
    assert dedupe.num_blocks == 0 and dedupe.owners.shape == (0, 2)


# --------------------------------------------------------------------------------------------
# Model fingerprints


CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
    "vocab_size": 1000,
}


def test_model_fingerprint_ignores_volatile_keys_and_order() -> None:
    base = fmt.model_fingerprint(CONFIG)
    assert len(base) == 32 and int(base, 16) >= 0
    noisy = dict(reversed(list(CONFIG.items())))
    noisy.update(
        _name_or_path="/home/someone/model",
        transformers_version="5.24.0",
        torch_dtype="bfloat16",
        _attn_implementation="sdpa",
        use_cache=False,
    )
    noisy["rope_scaling"] = {"factor": 8.0, "rope_type": "llama3", "_internal": 1}
    assert fmt.model_fingerprint(noisy) == base
    assert fmt.model_fingerprint({**CONFIG, "num_hidden_layers": 3}) != base
    assert (
        fmt.model_fingerprint({**CONFIG, "rope_scaling": {"rope_type": "llama3", "factor": 4.0}})
        != base
    )


def test_model_fingerprint_of_a_transformers_config() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        **{key: CONFIG[key] for key in ("hidden_size", "num_hidden_layers", "vocab_size")}
    )
    twin = transformers.LlamaConfig.from_dict(config.to_dict())
    twin._name_or_path = "elsewhere"
    assert (
        fmt.model_fingerprint(config)
        == fmt.model_fingerprint(twin)
        == fmt.model_fingerprint(config.to_dict())
    )
    other = transformers.LlamaConfig(hidden_size=128, num_hidden_layers=2, vocab_size=1000)
    assert fmt.model_fingerprint(other) != fmt.model_fingerprint(config)


def test_model_fingerprint_refuses_values_without_a_stable_text() -> None:
    with pytest.raises(TypeError, match="hidden"):
        fmt.model_fingerprint({"hidden": object()})


# --------------------------------------------------------------------------------------------
# Metadata


@pytest.fixture
def metadata() -> fmt.SnapshotMetadata:
    rng = np.random.default_rng(3)
    geometry = GEOMETRIES["bf16"]
    return make_metadata(
        geometry, shared_prefix_tokens(rng, geometry.block_size), created=fmt.utc_now()
    )


def test_metadata_round_trips_through_json_and_tensors(metadata: fmt.SnapshotMetadata) -> None:
    text = metadata.to_json()
    assert json.loads(text)["format_version"] == fmt.FORMAT_VERSION
    rebuilt = fmt.SnapshotMetadata.from_json(text, metadata.metadata_tensors())
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
        rebuilt = fmt.SnapshotMetadata.from_json(described.to_json(), described.metadata_tensors())
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
    document["format_version"] = 3
    document["something_new"] = {"x": 1}
    with pytest.raises(UnsupportedVersionError, match="upgrade kvsnap") as caught:
        fmt.parse_metadata_json(json.dumps(document), file="snap.safetensors")
    assert caught.value.version == 3 and "snap.safetensors" in str(caught.value)
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


# --------------------------------------------------------------------------------------------
# The container


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_layout_aligns_data_and_layers_and_tiles_the_file(name: str) -> None:
    geometry = GEOMETRIES[name]
    meta = make_metadata(
        geometry, shared_prefix_tokens(np.random.default_rng(4), geometry.block_size)
    )
    (layout,) = fmt.plan_files(meta)
    assert layout.data_start % fmt.DATA_ALIGNMENT == 0
    position = layout.data_start
    for entry in layout.entries:
        assert entry.begin == position
        position = entry.end
        if fmt.is_layer_tensor(entry.name):
            assert entry.begin % fmt.DATA_ALIGNMENT == 0
            assert entry.shape == (meta.num_blocks, *geometry.canonical_page_shape)
        if entry.dtype in ("I64", "U64"):
            assert entry.begin % 8 == 0
        if entry.name.startswith(fmt.PADDING_PREFIX):
            assert 0 < entry.nbytes < fmt.DATA_ALIGNMENT
    assert layout.entries[-1].name == fmt.CHECKSUMS_TENSOR
    assert layout.by_name[fmt.CHECKSUMS_TENSOR].shape == (len(layout.checksummed()) + 2, 16)
    # The header is what decode_header accepts, and the layout is what it recomputes.
    decoded = fmt.decode_header(layout.header, layout.file_size)
    recomputed, first, stop = fmt.expected_layout(decoded)
    assert recomputed == layout and (first, stop) == (0, len(fmt.specs_for(meta)))
    assert layout.header.endswith(b" ") or (len(layout.header) - 8) % fmt.DATA_ALIGNMENT == 0


def test_sharding_keeps_file_order_and_bounds(metadata: fmt.SnapshotMetadata) -> None:
    specs = fmt.specs_for(metadata)
    limit = max(spec.nbytes for spec in specs if fmt.is_layer_tensor(spec.name)) + 1
    layouts = fmt.plan_files(metadata, limit)
    assert len(layouts) > 2
    held = [entry.name for layout in layouts for entry in layout.checksummed()]
    assert held == [spec.name for spec in specs]
    for index, layout in enumerate(layouts, start=1):
        assert (
            sum(entry.nbytes for entry in layout.checksummed()) <= limit
            or len(layout.checksummed()) == 1
        )
        assert json.loads(layout.kvsnap_json)["shard"] == {"index": index, "count": len(layouts)}
    assert len(fmt.plan_files(metadata, 10**12)) == 1
    with pytest.raises(ValueError):
        fmt.plan_files(metadata, 0)


def test_trailer_round_trip_and_self_check() -> None:
    digests = [xxhash.xxh3_128_digest(bytes([i])) for i in range(5)]
    raw = fmt.encode_trailer(digests)
    assert fmt.decode_trailer(raw) == digests
    for position in range(0, len(raw), 7):
        flipped = bytearray(raw)
        flipped[position] ^= 0x10
        with pytest.raises(SnapshotCorruptError, match="trailer"):
            fmt.decode_trailer(bytes(flipped), file="x")


def test_header_length_limits() -> None:
    terabytes = struct.pack("<Q", 1 << 40)
    with pytest.raises(NotASnapshotError, match="header length"):
        fmt.header_length(terabytes, 1 << 41, file="big")
    with pytest.raises(SnapshotCorruptError, match="truncated"):
        fmt.header_length(struct.pack("<Q", 5000), 4000, file="short")
    with pytest.raises(NotASnapshotError, match="too short"):
        fmt.header_length(b"\x01\x02", 2)
    with pytest.raises(NotASnapshotError):
        fmt.header_length(bytes(8), 100)


def _encode(header: dict[str, Any], pad_to: int = fmt.DATA_ALIGNMENT) -> bytes:
    body = json.dumps(header).encode()
    total = -(-(8 + len(body)) // pad_to) * pad_to
    body += b" " * (total - 8 - len(body))
    return struct.pack("<Q", len(body)) + body


def _decode_and_check(header: bytes, file_size: int) -> None:
    decoded = fmt.decode_header(header, file_size, file="fuzz")
    layout, _, _ = fmt.expected_layout(decoded, file="fuzz")
    if layout.header != header:
        raise SnapshotCorruptError("header differs", file="fuzz")


def _valid_header(metadata: fmt.SnapshotMetadata) -> tuple[dict[str, Any], int]:
    (layout,) = fmt.plan_files(metadata)
    return json.loads(layout.header[8:]), layout.file_size - layout.data_start


def test_offsets_that_overlap_or_leave_gaps_are_refused(metadata: fmt.SnapshotMetadata) -> None:
    header, data_size = _valid_header(metadata)
    name = "layers.1.key"
    for delta, message in ((-8, "overlaps"), (8, "gap")):
        broken = json.loads(json.dumps(header))
        begin, end = broken[name]["data_offsets"]
        broken[name]["data_offsets"] = [begin + delta, end + delta]
        raw = _encode(broken)
        with pytest.raises(SnapshotCorruptError, match=message) as caught:
            _decode_and_check(raw, len(raw) + data_size)
        assert caught.value.tensor in (
            name,
            "layers.1.value",
            fmt.PADDING_PREFIX + "layers.1.value",
        )


def test_wrong_dtype_strings_name_the_tensor(metadata: fmt.SnapshotMetadata) -> None:
    header, data_size = _valid_header(metadata)
    for dtype in ("F8_E4M3FNUZ", "bf16", "", 7, None, "I64"):
        broken = json.loads(json.dumps(header))
        broken["layers.0.value"]["dtype"] = dtype
        raw = _encode(broken)
        with pytest.raises(SnapshotCorruptError) as caught:
            _decode_and_check(raw, len(raw) + data_size)
        assert caught.value.tensor == "layers.0.value"


def test_a_safetensors_header_without_kvsnap_metadata_is_not_a_snapshot() -> None:
    raw = _encode({"weight": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
    with pytest.raises(NotASnapshotError, match="without kvsnap metadata"):
        fmt.decode_header(raw, len(raw) + 8)


# Hypothesis: mutated and random headers raise only kvsnap's typed errors.

_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=12),
)
_json = st.recursive(
    _json_leaf,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
_MUTATION_KEYS = ("dtype", "shape", "data_offsets")
# Weighted towards mutations that get past the first checks; Hypothesis favours the ends of
# integer ranges, so the disruptive "metadata" replacement sits in the middle.
_KINDS = ["entry"] * 8 + ["drop", "add", "metadata", "kvsnap", "size"] + ["kvsnap-key"] * 6


@st.composite
def _mutated_headers(draw: st.DrawFn) -> tuple[bytes, int]:
    geometry = draw(st.sampled_from(sorted(GEOMETRIES)))
    meta = make_metadata(
        GEOMETRIES[geometry],
        shared_prefix_tokens(np.random.default_rng(5), GEOMETRIES[geometry].block_size),
    )
    header, data_size = _valid_header(meta)
    kvsnap = json.loads(header["__metadata__"]["kvsnap"])
    names = [name for name in header if name != "__metadata__"]
    for _ in range(draw(st.integers(1, 4))):
        kind = _KINDS[draw(st.integers(0, len(_KINDS) - 1))]
        if kind == "entry":
            name = draw(st.sampled_from(names))
            if name in header and isinstance(header[name], dict):
                header[name][draw(st.sampled_from(_MUTATION_KEYS))] = draw(_json)
        elif kind == "drop" and names:
            header.pop(draw(st.sampled_from(names)), None)
        elif kind == "add":
            header[draw(st.text(max_size=10))] = draw(_json)
        elif kind == "kvsnap":
            path = draw(
                st.sampled_from(
                    ["layout", "sequences", "num_blocks", "source", "checksums", "created"]
                )
            )
            kvsnap[path] = draw(_json)
        elif kind == "kvsnap-key":
            section = draw(st.sampled_from(["layout", "source"]))
            if isinstance(kvsnap.get(section), dict):
                key = draw(st.sampled_from(sorted(kvsnap[section]) or ["x"]))
                kvsnap[section][key] = draw(_json)
        elif kind == "metadata":
            header["__metadata__"] = draw(_json)
        else:
            data_size += draw(st.integers(-100, 100))
    if isinstance(header.get("__metadata__"), dict) and "kvsnap" in header["__metadata__"]:
        header["__metadata__"]["kvsnap"] = json.dumps(kvsnap)
    raw = _encode(header, pad_to=draw(st.sampled_from([1, 8] + [fmt.DATA_ALIGNMENT] * 6)))
    return raw, len(raw) + max(0, data_size)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutated_headers())
def test_mutated_headers_raise_only_typed_errors(case: tuple[bytes, int]) -> None:
    header, file_size = case
    try:
        _decode_and_check(header, file_size)
    except KVSnapError:
        pass


@settings(max_examples=250, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 1 << 45))
def test_random_bytes_raise_only_typed_errors(junk: bytes, file_size: int) -> None:
    with pytest.raises(KVSnapError):
        length = fmt.header_length(junk[:8], max(file_size, len(junk)), file="junk")
        fmt.decode_header(junk[: 8 + length], max(file_size, len(junk)), file="junk")


# Ids and names are text, whatever they hold: rich-markup brackets, quotes, escapes, unicode.
_MARKUP = st.sampled_from(["[/]", "[/i]", "[bold]", "[/x]", "\\[", "[", "]", '"', "\\", "é"])
_TEXT = st.lists(st.one_of(_MARKUP, st.text(max_size=6)), min_size=1, max_size=5).map("".join)
_ID = _TEXT.filter(bool)


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(_ID, min_size=5, max_size=5, unique=True), model_id=_TEXT)
def test_markup_bearing_ids_round_trip_through_a_file_header(ids: list[str], model_id: str) -> None:
    geometry = GEOMETRIES["bf16"]
    metadata = make_metadata(geometry, shared_prefix_tokens(np.random.default_rng(6), 4))
    for record, new_id in zip(metadata.sequences, ids, strict=True):
        record.id = new_id
    metadata.source = fmt.SourceInfo(engine="e[/]", model_id=model_id)
    assert metadata.problems() == []
    (layout,) = fmt.plan_files(metadata)
    decoded = fmt.decode_header(layout.header, layout.file_size, file="a[/x]/snap[v2]")
    rebuilt = decoded.metadata.with_tensors(metadata.metadata_tensors())
    assert rebuilt == metadata
    assert [record.id for record in rebuilt.sequences] == ids
    assert rebuilt.source.model_id == model_id


# --------------------------------------------------------------------------------------------
# Errors


def test_errors_name_their_location_and_survive_pickling() -> None:
    error = SnapshotCorruptError(
        "xxh3-64 mismatch", file="a.safetensors", tensor="layers.2.key", block=7
    )
    assert str(error) == "a.safetensors, tensor layers.2.key, block 7: xxh3-64 mismatch"
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is SnapshotCorruptError and str(copy) == str(error)
    assert (copy.file, copy.tensor, copy.block, copy.detail) == (
        "a.safetensors",
        "layers.2.key",
        7,
        "xxh3-64 mismatch",
    )
    incompatible = IncompatibleSnapshotError("8 KV heads vs 4", snapshot=8, target=4)
    assert pickle.loads(pickle.dumps(incompatible)).target == 4
    assert isinstance(UnsupportedVersionError("x", version=3), KVSnapError)


def test_geometries_survive_metadata_round_trip() -> None:
    for geometry in GEOMETRIES.values():
        meta = make_metadata(
            geometry,
            shared_prefix_tokens(np.random.default_rng(6), geometry.block_size),
            extra_blocks=2,
        )
        assert fmt.SnapshotMetadata.from_json(meta.to_json(), meta.metadata_tensors()) == meta
    mla = KVGeometry(num_layers=1, block_size=2, dtype="bfloat16", latent_dim=4)
    assert (
        json.loads(make_metadata(mla, [np.arange(3)]).to_json())["layout"]["encoding"]
        == fmt.MLA_ENCODING
    )
