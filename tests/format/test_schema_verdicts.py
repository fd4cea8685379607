"""The metadata schema compiled by ``fastjsonschema`` gives ``jsonschema``'s verdict on real
metadata and on every one-edit change of it (but a pattern's ``$`` before a final newline,
which only ``fastjsonschema`` refuses), and a refused document is reported exactly as
``jsonschema`` words it."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvsnap import format as fmt
from kvsnap.errors import SnapshotCorruptError
from kvsnap.format.schema import validate_schema
from tests.support.store_helpers import GEOMETRIES, make_metadata

jsonschema = pytest.importorskip("jsonschema")
fastjsonschema = pytest.importorskip("fastjsonschema")

#: Values put in place of each value of a document: every JSON type, the numbers around the
#: schema's bounds, integral floats, the strings its enums, consts and patterns name.
REPLACEMENTS: list[Any] = [
    None, True, False, 0, 1, 2, -1, 1.0, 2.0, 1.5, -0.5, float("inf"), 64, 65, 256, 257,
    65535, 65536, 65537, 99999, 100000, 1048576, 1048577, 2**70, "", "x", "full", "Full",
    "bfloat16", "int4", "kvsnap-nhd-v1", "kvsnap-mla-v1", "xxh3-128", "xxh3-64", "hmac-sha256",
    "2026-12-01T22:10:00Z", "2026-12-01T22:10:00.123456Z", "2026-12-01T22:10:00Z\n",
    "2026-12-01T22:10:00.1234567Z", "x2026-12-01T22:10:00Z", "a" * 33, "-a", [], [1], ["full"],
    ["full", "sliding"], [{}], {}, {"index": 1, "count": 2}, {"a": 1},
]  # fmt: skip
#: String lengths around every minLength and maxLength of the schema.
LENGTHS = (0, 1, 2, 64, 65, 256, 257, 1024, 1025, 4096, 4097)


def documents() -> list[dict[str, Any]]:
    """Real metadata objects of every kind a file holds: plain (MLA too), reproducible,
    sharded, signed, parted, with extensions."""
    rng = np.random.default_rng(0)
    made = []
    for name in ("bf16", "mla-f8"):
        geometry = GEOMETRIES[name]
        tokens = [rng.integers(0, 1000, geometry.block_size * 2 + 1) for _ in range(2)]
        made.append(make_metadata(geometry, tokens, created=fmt.utc_now()))
    plain = made[0]
    heads = plain.geometry.num_kv_heads
    signed = dataclasses.replace(plain, signature="hmac-sha256", created=None)
    parted = dataclasses.replace(plain, part=fmt.PartInfo(2, 2, heads, 2 * heads))
    found = [item.to_json_dict() for item in (*made, signed, parted)]
    found.append(plain.to_json_dict((1, 3)))
    found.append({**plain.to_json_dict(), "extensions": {"note": [1, {"a": None}]}})
    return found


def edits(document: Any) -> Iterator[Any]:
    """Every document one edit away from ``document``: each value replaced by each of
    :data:`REPLACEMENTS` (strings also by strings of :data:`LENGTHS`), each key removed, an
    unknown key added to each object, each array emptied, cut and extended."""
    for path, value in list(_paths(document)):
        palette = list(REPLACEMENTS)
        if isinstance(value, str):
            palette += ["é" * length for length in LENGTHS]
        for replacement in palette:
            yield _replaced(document, path, replacement)
        if path:
            yield _removed(document, path)
        if isinstance(value, dict):
            yield _replaced(document, path, {**value, "unknown": 1})
        if isinstance(value, list) and value:
            yield _replaced(document, path, value[:-1])
            yield _replaced(document, path, [*value, value[0]])
            yield _replaced(document, path, [*value, 7])


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield path, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*path, index))


def _replaced(document: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return copy.deepcopy(value)
    changed = copy.deepcopy(document)
    parent = changed
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = copy.deepcopy(value)
    return changed


def _removed(document: Any, path: tuple[Any, ...]) -> Any:
    changed = copy.deepcopy(document)
    parent = changed
    for part in path[:-1]:
        parent = parent[part]
    del parent[path[-1]]
    return changed


def _fast_verdict(check: Any, document: Any) -> bool:
    try:
        check(document)
    except fastjsonschema.JsonSchemaValueException:
        return False
    return True


def _newline_after_dollar(schema: dict[str, Any], document: Any) -> bool:
    """Whether ``document`` holds a string with a final newline whose pattern ends in ``$``:
    the one kind of document ``fastjsonschema`` refuses and ``jsonschema`` accepts."""
    patterns = [node["pattern"] for node in _nodes(schema) if "pattern" in node]
    strings = [value for _, value in _paths(document) if isinstance(value, str)]
    return any(
        text.endswith("\n") and pattern.endswith("$") for text in strings for pattern in patterns
    )


def _nodes(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from _nodes(item)
    elif isinstance(value, list):
        for item in value:
            yield from _nodes(item)


def test_fastjsonschema_agrees_with_jsonschema_on_every_one_edit_document() -> None:
    schema = fmt.metadata_schema()
    reference = jsonschema.validators.validator_for(schema)(schema)
    compiled = fastjsonschema.compile(schema, use_default=False, use_formats=False)
    verdicts = {True: 0, False: 0}
    stricter = 0
    for original in documents():
        assert _fast_verdict(compiled, original) and reference.is_valid(original)
        for changed in edits(original):
            expected = reference.is_valid(changed)
            got = _fast_verdict(compiled, changed)
            if got != expected:
                # Only ever the stricter verdict, and only for a newline after a "$".
                assert expected and _newline_after_dollar(schema, changed), changed
                stricter += 1
            verdicts[expected] += 1
    # Both verdicts are common: the edits probe the schema's rules, not one side of them.
    assert verdicts[True] > 1000 and verdicts[False] > 5000, verdicts
    assert stricter > 0  # the edits do reach the one difference


def test_a_newline_after_a_patterns_end_is_refused() -> None:
    document = documents()[0]
    document["created"] = "2026-12-01T22:10:00Z\n"
    assert jsonschema.validators.validator_for(fmt.metadata_schema())(
        fmt.metadata_schema()
    ).is_valid(document)
    with pytest.raises(SnapshotCorruptError, match="fails the v1 schema"):
        validate_schema(document, "chunk.safetensors")


def test_a_refused_document_is_reported_as_jsonschema_words_it() -> None:
    document = documents()[0]
    document["layout"]["tp_size"] = 0
    schema = fmt.metadata_schema()
    error = next(jsonschema.validators.validator_for(schema)(schema).iter_errors(document))
    with pytest.raises(SnapshotCorruptError) as raised:
        validate_schema(document, "chunk.safetensors")
    assert (
        raised.value.detail
        == f"kvsnap metadata fails the v1 schema at layout/tp_size: {error.message}"
    )


def test_keywords_the_metadata_schema_uses_lightly_agree_with_jsonschema_too() -> None:
    # Overlapping oneOf branches, "number" and "boolean" types, a structured const and a
    # schema for additional properties: cases the metadata schema cannot tell apart.
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
            "n": {"type": "number", "maximum": 65536},
            "o": {"oneOf": [{"type": "integer"}, {"minimum": 0}]},
            "b": {"type": ["boolean", "null"]},
            "c": {"const": [1, {"a": True}]},
            "i": {"items": False},
        },
        "additionalProperties": {"type": "string", "minLength": 1},
    }
    reference = jsonschema.validators.validator_for(schema)(schema)
    compiled = fastjsonschema.compile(schema, use_default=False, use_formats=False)
    values = [*REPLACEMENTS, [1.0, {"a": True}], [1, {"a": 1}], [True, {"a": True}]]
    verdicts = {True: 0, False: 0}
    for name in ("n", "o", "b", "c", "i", "extra"):
        for value in values:
            document = {name: value}
            expected = reference.is_valid(document)
            assert _fast_verdict(compiled, document) is expected, document
            verdicts[expected] += 1
    assert min(verdicts.values()) > 50, verdicts
