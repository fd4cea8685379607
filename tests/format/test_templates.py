"""Metadata strings parsed from the template of one of their shape
(``kvsnap/format/templates.py``): the same metadata as the whole parse for every string it
takes, and nothing taken that the whole parse refuses."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from kvsnap.caches import clear_caches
from kvsnap.errors import KVSnapError
from kvsnap.format import templates
from kvsnap.format.header import parse_kvsnap_json_whole
from tests.support.store_helpers import GEOMETRIES, make_metadata

CREATED = "2026-12-02T08:00:00.123456Z"

#: Creation times around the schema's pattern: whole, fractions of 0 to 7 digits, a final
#: newline (refused: ECMA-262's ``$``), spaces, other digits, an empty string.
_TIMES = [
    CREATED,
    "2026-12-02T08:00:00Z",
    "2026-12-02T08:00:00.1Z",
    "2026-12-02T08:00:00.1234567Z",
    "2026-12-02T08:00:00Z\n",
    " 2026-12-02T08:00:00Z",
    "2026-12-2T08:00:00Z",
    "２０26-12-02T08:00:00Z",
    "2026-12-02t08:00:00z",
    "",
]
#: Sequence ids around the schema's length bounds (1..1024 code points) and escapes.
_IDS = ["x", "", "x" * 1024, "x" * 1025, "é" * 1024, "é" * 1025, '"', "\\", "\ud800", "a\nb"]
#: Raw tokens in place of a value: not strings, strings escaped another way, broken strings.
_TOKENS = ["null", "5", "true", '"\\u0041"', '"\\x"', '"\x01"', '"abc', '""""']


def _outcome(text: str) -> Any:
    try:
        return parse_kvsnap_json_whole(text, "t")
    except KVSnapError as error:
        return (type(error).__name__, str(error))


def _template_text() -> str:
    clear_caches()
    tokens = np.arange(2 * GEOMETRIES["bf16"].block_size)
    text = make_metadata(GEOMETRIES["bf16"], [tokens], created=CREATED).to_json()
    templates.remember(text, parse_kvsnap_json_whole(text, "t"))
    return text


def test_every_value_and_edit_gets_the_whole_parse_verdict() -> None:
    text = _template_text()
    found = templates.split_metadata(text)
    assert found is not None
    (before, between, after), created, sequence_id = found
    assert templates.parsed_like_known(text) == parse_kvsnap_json_whole(text, "t")
    candidates = [
        before + json.dumps(time) + between + json.dumps(name) + after
        for time in _TIMES
        for name in _IDS
    ]
    candidates += [before + token + between + sequence_id + after for token in _TOKENS]
    candidates += [before + created + between + token + after for token in _TOKENS]
    # One character changed, dropped or doubled anywhere in the text around the values.
    rng = np.random.default_rng(12)
    for position in rng.integers(0, len(text), 300).tolist():
        edit = str(rng.choice(["0", "9", '"', "}", " ", "x"]))
        candidates += [
            text[:position] + edit + text[position + 1 :],
            text[:position] + text[position + 1 :],
            text[:position] + text[position] + text[position:],
        ]
    taken = 0
    for candidate in candidates:
        known = templates.parsed_like_known(candidate)
        whole = _outcome(candidate)
        if known is not None:
            taken += 1
            assert known == whole, candidate
    # The valid times and ids (and the \u0041 escape) are taken; the rest left to the parse.
    accepted = sum(not isinstance(_outcome(candidate), tuple) for candidate in candidates)
    assert taken >= 4 * 6 and taken <= accepted


def test_strings_of_other_shapes_and_reproducible_ones_get_no_template() -> None:
    text = _template_text()
    other = make_metadata(
        GEOMETRIES["bf16"], [np.arange(3 * GEOMETRIES["bf16"].block_size)], created=CREATED
    ).to_json()
    assert templates.parsed_like_known(other) is None  # another block count
    reproducible = make_metadata(GEOMETRIES["bf16"], [np.arange(8)], created=None).to_json()
    templates.remember(reproducible, parse_kvsnap_json_whole(reproducible, "t"))
    assert templates.split_metadata(reproducible) is None
    two = make_metadata(GEOMETRIES["bf16"], [np.arange(8), np.arange(9)], created=CREATED)
    templates.remember(two.to_json(), parse_kvsnap_json_whole(two.to_json(), "t"))
    assert templates.parsed_like_known(two.to_json()) is None
    assert templates.parsed_like_known(text) is not None
