"""The file container and its header codec: the file layout, sharding, header limits, broken
offsets and dtypes refused, hypothesis-mutated and random headers raising only typed errors, and
errors that name their location."""

from __future__ import annotations

import dataclasses
import json
import pickle
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsnap import format as fmt
from kvsnap.caches import clear_caches
from kvsnap.errors import (
    IncompatibleSnapshotError,
    KVSnapError,
    NotASnapshotError,
    SnapshotCorruptError,
    UnsupportedVersionError,
)
from tests.support.store_helpers import GEOMETRIES, make_metadata, shared_prefix_tokens

# --------------------------------------------------------------------------------------------
# The container


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_layout_aligns_data_and_layers_and_tiles_the_file(name: str) -> None:
    geometry = GEOMETRIES[name]
    meta = make_metadata(
        geometry, shared_prefix_tokens(np.random.default_rng(4), geometry.block_size)
    )
    (layout,) = fmt.file_layouts(meta)
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
    assert _expected_either_way(decoded, layout.header) == (recomputed, first, stop)
    assert layout.header.endswith(b" ") or (len(layout.header) - 8) % fmt.DATA_ALIGNMENT == 0


def test_a_header_checked_as_bytes_gets_what_its_entry_checks_give(
    metadata: fmt.SnapshotMetadata,
) -> None:
    """``expected_layout`` given a header's bytes (what a reader does) takes a header equal to
    its repacking as it is, and only then: every shard of a sharded snapshot, a signed file and
    headers edited in one entry get the same layout, run or error as the entry-by-entry path."""
    signed = dataclasses.replace(metadata, signature="hmac-sha256")
    specs = fmt.specs_for(metadata)
    limit = max(spec.nbytes for spec in specs if fmt.is_layer_tensor(spec.name)) + 1
    layouts = [*fmt.file_layouts(metadata, limit), *fmt.file_layouts(signed)]
    assert len(layouts) > 3
    for layout in layouts:
        decoded = fmt.decode_header(layout.header, layout.file_size)
        found, _, _ = _expected_either_way(decoded, layout.header)
        assert found == layout
    (whole,) = fmt.file_layouts(metadata)
    decoded = fmt.decode_header(whole.header, whole.file_size)
    at = whole.header.index(b'"layers.0.value"')
    for edit in (b'"dtype":"F16"', b'"shape":[9,', b'"data_offsets":[1,'):
        field = edit.split(b":")[0]
        start = whole.header.index(field, at)
        end = start + len(edit)
        edited = whole.header[:start] + edit + whole.header[end:]
        assert len(edited) == len(whole.header) and edited != whole.header
        # The decoded entries stay the intact file's: only the bytes compared differ.
        found, _, _ = _expected_either_way(decoded, edited)
        assert found.header == whole.header != edited
    # Two entries' names swapped (the same bytes but for them, far into the header): it decodes,
    # and both paths refuse it for the order of its tensors.
    first = whole.header.index(b'"layers.0.value"')
    second = whole.header.index(b'"layers.1.value"')
    swapped = (
        whole.header[:first]
        + b'"layers.1.value"'
        + whole.header[first + 16 : second]
        + b'"layers.0.value"'
        + whole.header[second + 16 :]
    )
    clear_caches()
    refused = fmt.decode_header(swapped, whole.file_size)
    with pytest.raises(SnapshotCorruptError, match="out of place"):
        _expected_either_way(refused, swapped)


def test_sharding_keeps_file_order_and_bounds(metadata: fmt.SnapshotMetadata) -> None:
    specs = fmt.specs_for(metadata)
    limit = max(spec.nbytes for spec in specs if fmt.is_layer_tensor(spec.name)) + 1
    layouts = fmt.file_layouts(metadata, limit)
    assert len(layouts) > 2
    held = [entry.name for layout in layouts for entry in layout.checksummed()]
    assert held == [spec.name for spec in specs]
    for index, layout in enumerate(layouts, start=1):
        assert (
            sum(entry.nbytes for entry in layout.checksummed()) <= limit
            or len(layout.checksummed()) == 1
        )
        assert json.loads(layout.kvsnap_json)["shard"] == {"index": index, "count": len(layouts)}
    assert len(fmt.file_layouts(metadata, 10**12)) == 1
    with pytest.raises(ValueError):
        fmt.file_layouts(metadata, 0)


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
    """The general decode and layout check of ``header``, checked to agree with
    :func:`kvsnap.format.canonical_header` (which a reader tries first); raises the general
    path's error."""
    try:
        canonical = fmt.canonical_header(header, file_size, file="fuzz")
    except KVSnapError as error:
        canonical = error
    try:
        decoded = fmt.decode_header(header, file_size, file="fuzz")
        layout, _, _ = _expected_either_way(decoded, header)
        if layout.header != header:
            raise SnapshotCorruptError("header differs", file="fuzz")
    except KVSnapError as error:
        # Refused the general way: the canonical check refused it with the same error, or
        # left it to the general decode.
        assert canonical is None or (
            type(canonical) is type(error) and str(canonical) == str(error)
        ), (canonical, error)
        raise
    if canonical is not None:
        assert not isinstance(canonical, KVSnapError), canonical
        assert canonical == (dataclasses.replace(decoded, entries=layout.entries), layout)


@pytest.mark.parametrize("created", [None, "2026-12-02T08:00:00.123456Z"])
def test_the_canonical_check_agrees_with_the_general_decode_on_every_byte_flip(
    created: str | None,
) -> None:
    """Every header kvsnap writes for an unsharded file (plain, signed, of every geometry) is
    taken by :func:`kvsnap.format.canonical_header` with the general decode's result, a shard
    is left to the general decode, and each header with any one byte changed, or with the file
    one byte shorter or longer, gets the same result or the same error both ways."""
    taken = 0
    for name in sorted(GEOMETRIES):
        meta = make_metadata(
            GEOMETRIES[name],
            shared_prefix_tokens(np.random.default_rng(7), GEOMETRIES[name].block_size),
        )
        signed = dataclasses.replace(meta, signature="hmac-sha256")
        limit = max(s.nbytes for s in fmt.specs_for(meta) if fmt.is_layer_tensor(s.name)) + 1
        for layout in [*fmt.file_layouts(meta), *fmt.file_layouts(signed)]:
            assert fmt.canonical_header(layout.header, layout.file_size) is not None
            taken += 1
        for shard in fmt.file_layouts(meta, limit):
            assert fmt.canonical_header(shard.header, shard.file_size) is None
            _decode_and_check(shard.header, shard.file_size)
    # With a creation time, the flips that keep the metadata valid and the header the packing
    # of it are taken from the kept packing of the intact header (only the two per-file
    # values escaped anew); a file of another sequence id of the same shape too.
    clear_caches()
    intact = make_metadata(GEOMETRIES["bf16"], [np.arange(40)], created=created)
    (layout,) = fmt.file_layouts(intact)
    _decode_and_check(layout.header, layout.file_size)
    renamed = dataclasses.replace(intact.sequences[0], id="another-id")
    (other,) = fmt.file_layouts(dataclasses.replace(intact, sequences=[renamed]))
    assert len(other.header) == len(layout.header) and other.header != layout.header
    _decode_and_check(other.header, other.file_size)
    rng = np.random.default_rng(11)
    outcomes = set()
    for position in range(len(layout.header)):
        flipped = bytearray(layout.header)
        flipped[position] ^= 1 << int(rng.integers(0, 8))
        for header, size in ((bytes(flipped), layout.file_size), (layout.header, 0)):
            size = size or layout.file_size + int(rng.choice([-1, 1]))
            try:
                _decode_and_check(header, size)
                outcomes.add("accepted")
            except KVSnapError as error:
                outcomes.add(type(error).__name__)
    assert taken >= 2 * len(GEOMETRIES)
    # Flips land in the JSON, the metadata string and the padding: some decode, most not.
    assert {"SnapshotCorruptError", "NotASnapshotError"} <= outcomes


def _expected_either_way(
    decoded: fmt.DecodedHeader, header: bytes
) -> tuple[fmt.FileLayout, int, int]:
    """``expected_layout`` of ``decoded``, checked to give the same layout and run, or the same
    error, whether it is given the header bytes (an exact header skips the entry-by-entry
    checks) or not."""
    outcomes: list[Any] = []
    for bytes_given in (None, header):
        try:
            outcomes.append(fmt.expected_layout(decoded, file="fuzz", header=bytes_given))
        except KVSnapError as error:
            outcomes.append(error)
    plain, fast = outcomes
    if isinstance(plain, KVSnapError):
        assert type(fast) is type(plain) and str(fast) == str(plain)
        raise plain
    assert fast == plain
    return plain


def _valid_header(metadata: fmt.SnapshotMetadata) -> tuple[dict[str, Any], int]:
    (layout,) = fmt.file_layouts(metadata)
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
    (layout,) = fmt.file_layouts(metadata)
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


# --------------------------------------------------------------------------------------------
# Tensor entries decoded once per layout


def _one_layout_headers(model_ids: list[str]) -> list[fmt.FileLayout]:
    """One file layout per model id: one sequence of 13 random tokens each, so every header
    differs in its metadata string only."""
    geometry = GEOMETRIES["bf16"]
    layouts = []
    for index, model_id in enumerate(model_ids):
        tokens = [np.random.default_rng(index).integers(0, 1000, 13)]
        metadata = make_metadata(geometry, tokens, created=f"2026-12-01T22:1{index}:00Z")
        source = dataclasses.replace(metadata.source, model_id=model_id)
        (layout,) = fmt.file_layouts(dataclasses.replace(metadata, source=source))
        layouts.append(layout)
    return layouts


def _decoded_fresh(header: bytes, file_size: int) -> fmt.DecodedHeader | KVSnapError:
    """``header`` decoded with no entries kept from earlier headers (or the error)."""
    clear_caches()
    try:
        return fmt.decode_header(header, file_size)
    except KVSnapError as error:
        return error


def _decoded_after(
    seen: fmt.FileLayout, header: bytes, file_size: int
) -> fmt.DecodedHeader | KVSnapError:
    """``header`` decoded right after ``seen``'s header (of the same layout) was."""
    clear_caches()
    fmt.decode_header(seen.header, seen.file_size)
    try:
        return fmt.decode_header(header, file_size)
    except KVSnapError as error:
        return error


def test_files_of_one_layout_share_their_decoded_entries() -> None:
    names = ["model-a", "model-b", "model-" + "c" * 300, "model-" + "d" * 4000]
    first, second, longer, longest = _one_layout_headers(names)
    assert first.header != second.header and len(first.header) == len(second.header)
    clear_caches()
    decoded = [fmt.decode_header(layout.header, layout.file_size) for layout in (first, second)]
    assert decoded[1].entries is decoded[0].entries  # decoded once, for the first file
    assert decoded[1] == _decoded_fresh(second.header, second.file_size)
    assert decoded[1].metadata.source.model_id == "model-b"
    # A longer metadata string with the same data start (less padding) shares them too; one
    # that moves the data start has entries of its own.
    assert longer.data_start == first.data_start < longest.data_start
    for layout in (longer, longest):
        after = _decoded_after(first, layout.header, layout.file_size)
        assert after == _decoded_fresh(layout.header, layout.file_size)
        assert isinstance(after, fmt.DecodedHeader)
        assert (after.entries == decoded[0].entries) is (layout is longer)


def _edited(header: bytes, old: bytes, new: bytes, after: int = 0) -> bytes:
    """``header`` with the first ``old`` at or after ``after`` replaced by ``new`` (same
    length)."""
    assert len(old) == len(new)
    at = header.index(old, after)
    return header[:at] + new + header[at + len(old) :]


def test_a_header_differing_in_one_entry_is_not_served_the_cached_decode() -> None:
    seen, layout = _one_layout_headers(["model-a", "model-b"])
    header, size = layout.header, layout.file_size
    entries = header.index(b'"sequences.0.token_ids":')
    value = header.index(b'"layers.1.value"', entries)
    swapped_names = _edited(
        _edited(header, b'"layers.0.value"', b'"layers.1.xalue"', entries),
        b'"layers.1.value"',
        b'"layers.0.value"',
        value,
    )
    cases = {
        "a shape": _edited(header, b'"shape":[4,', b'"shape":[5,', entries),
        "a dtype": _edited(header, b'"dtype":"BF16"', b'"dtype":"F16 "', entries),
        "an offset": _edited(header, b'"data_offsets":[0,', b'"data_offsets":[1,', entries),
        "a name (decodes; the layout check refuses it)": swapped_names,
        "a duplicate name": _edited(header, b'"layers.0.value"', b'"layers.0.key"  ', entries),
        "the padding": header[:-1] + b"\n",
        "invalid UTF-8 in the metadata": _edited(header, b"model-b", b"\xed\xa0\x80el-b"),
        "the file size": header,
        "the data start": struct.pack("<Q", len(header) - 8 + fmt.DATA_ALIGNMENT)
        + header[8:]
        + b" " * fmt.DATA_ALIGNMENT,
    }
    for what, changed in cases.items():
        file_size = size + 8 if what == "the file size" else size
        fresh = _decoded_fresh(changed, file_size)
        after = _decoded_after(seen, changed, file_size)
        if isinstance(fresh, KVSnapError):
            assert type(after) is type(fresh) and str(after) == str(fresh), what
        else:
            assert after == fresh, what
    swapped = _decoded_after(seen, swapped_names, size)
    assert isinstance(swapped, fmt.DecodedHeader) and swapped.entries != seen.entries
    assert isinstance(_decoded_fresh(cases["a shape"], size), SnapshotCorruptError)
