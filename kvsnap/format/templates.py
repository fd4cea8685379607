"""Metadata strings of one shape, checked against one that passed every check.

The kvsnap metadata strings of a store's chunks of one shape differ in two values only: the
creation time and the one sequence's id. The rest of the text (format and kvsnap versions,
source, layout, block count, the sequence's sizes, checksums) is the same bytes for each. A
string that passed every check of :func:`kvsnap.format.header` (strict JSON, the schema, the
semantics) is kept as a :class:`MetadataTemplate`: its text cut at those two values
(:func:`split_metadata`). Another string cut into the same text around two other JSON strings
is that document with two other leaf values; JSON is parsed token by token, so it parses the
same way, and the schema constrains those leaves by themselves only (checked on the schema
itself, :func:`_leaf_rules`: where the schema says anything else there, no template is used),
so its verdict is the verdict on those two values: a time that :data:`CREATED_PATTERN` matches
whole (what the schema's pattern and the semantic check together accept) and an id whose
length is within the schema's bounds. Per file that is two string decodes and two checks
instead of a parse, a schema walk and the semantics of the whole object.

The metadata a template gives shares the template's nested objects (``source``, ``layout``
and the like in its ``document``): nothing in kvsnap changes a parsed document.

This path only ever accepts: a string cut otherwise, a value that fails its rule, or a shape
with no template goes to the general parse, which refuses it with its own error
(tests/format/test_templates.py: the same metadata or the same error on every value around
the rules' bounds and on every edit of the text around them).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

from kvsnap.caches import BoundedLRU
from kvsnap.format.constants import CREATED_PATTERN
from kvsnap.format.parse import HeaderMetadata, SequenceShape
from kvsnap.format.schema import dump_json, metadata_schema

#: One JSON string token (its quotes included), escapes and all, unrolled (header.py's).
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_CREATED_KEY = '"created":'
_ID_KEY = '"sequences":[{"id":'

#: The text around the two values, by that text: what a string of that shape parses to.
Cut = tuple[str, str, str]


@dataclasses.dataclass(frozen=True, slots=True)
class MetadataTemplate:
    """A metadata string that passed every check, as the text around its creation time and
    its sequence's id, and what it parsed to."""

    metadata: HeaderMetadata


_TEMPLATES: BoundedLRU[Cut, MetadataTemplate] = BoundedLRU(16)


def split_metadata(text: str) -> tuple[Cut, str, str] | None:
    """``text`` cut as kvsnap writes a one-sequence metadata string (compact JSON): the text
    up to the creation time's string, between it and the first sequence's id string, and after
    that, and the two string tokens themselves; ``None`` when it is not cut that way."""
    created_at = text.find(_CREATED_KEY)
    if created_at < 0:
        return None
    created = _JSON_STRING.match(text, created_at + len(_CREATED_KEY))
    if created is None:
        return None
    id_at = text.find(_ID_KEY, created.end())
    if id_at < 0:
        return None
    sequence_id = _JSON_STRING.match(text, id_at + len(_ID_KEY))
    if sequence_id is None:
        return None
    cut = (text[: created.start()], text[created.end() : sequence_id.start()])
    return (*cut, text[sequence_id.end() :]), created.group(), sequence_id.group()


def parsed_like_known(text: str) -> HeaderMetadata | None:
    """What the general parse gives for ``text`` when a kept template has its shape and its
    two values pass their rules (see the module's docstring); ``None`` otherwise (the caller
    parses it the general way)."""
    rules = _leaf_rules()
    found = split_metadata(text) if rules is not None else None
    if found is None or rules is None:
        return None
    cut, created_token, id_token = found
    template = _TEMPLATES.get(cut)
    if template is None:
        return None
    try:
        created, sequence_id = json.loads(created_token), json.loads(id_token)
    except ValueError:
        return None
    shortest, longest = rules
    if not (
        isinstance(created, str)
        and isinstance(sequence_id, str)
        and CREATED_PATTERN.fullmatch(created)
        and shortest <= len(sequence_id) <= longest
    ):
        return None
    known = template.metadata
    document = dict(known.document, created=created)
    document["sequences"] = [dict(known.document["sequences"][0], id=sequence_id)]
    (shape,) = known.sequences
    sequences = (SequenceShape(sequence_id, shape.num_tokens, shape.num_blocks),)
    return dataclasses.replace(known, created=created, sequences=sequences, document=document)


def remember(text: str, metadata: HeaderMetadata) -> None:
    """Keep ``text``, which passed every check of the general parse as ``metadata``, as a
    template when it is kvsnap's compact encoding of a one-sequence document with a creation
    time."""
    if _leaf_rules() is None or len(metadata.sequences) != 1 or metadata.created is None:
        return
    if set(metadata.document["sequences"][0]) != {"id", "num_tokens", "num_blocks"}:
        return
    if dump_json(metadata.document) != text:
        return
    found = split_metadata(text)
    if found is not None and found[0] == _cut_of(metadata.document):
        _TEMPLATES.put(found[0], MetadataTemplate(metadata))


#: Stand-ins for the two values, which no document holds elsewhere (checked: each once).
_CREATED_MARK = "\0kvsnap-template-created\0"
_ID_MARK = "\0kvsnap-template-id\0"


def _cut_of(document: dict[str, object]) -> Cut | None:
    """The text of ``document``'s compact encoding around its top-level creation time and its
    first sequence's id, found by encoding it with those two values marked: what
    :func:`split_metadata` must find, so that the two tokens it cuts out are those values and
    not a ``"created"`` or ``"id"`` of some other object."""
    sequences = document["sequences"]
    assert isinstance(sequences, list)
    marked = dict(document, created=_CREATED_MARK)
    marked["sequences"] = [dict(sequences[0], id=_ID_MARK), *sequences[1:]]
    before, created_mark, rest = dump_json(marked).partition(dump_json(_CREATED_MARK))
    between, id_mark, after = rest.partition(dump_json(_ID_MARK))
    around = before + between + after
    if not created_mark or not id_mark or _CREATED_MARK[1:-1] in around or _ID_MARK[1:-1] in around:
        return None
    return before, between, after


@functools.cache
def _leaf_rules() -> tuple[int, int] | None:
    """The id length bounds the schema sets, when the schema constrains a creation time and a
    sequence id by themselves only, as this module's check assumes (a nullable string whose
    pattern is :data:`CREATED_PATTERN` whole; a string of bounded length; no keyword that
    relates them to anything else); ``None`` (no template is ever used) otherwise."""
    schema = metadata_schema()
    described = {"description"}
    top = set(schema) <= {"$schema", "$id", "title", *described, "type", "properties"} | {
        "additionalProperties",
        "required",
    }
    created = schema["properties"].get("created", {})
    pattern = f"^{CREATED_PATTERN.pattern}$"
    string_rule = {"type": "string", "pattern": pattern}
    created_ok = set(created) <= {"oneOf", *described} and created.get("oneOf") in (
        [{"type": "null"}, string_rule],
        [string_rule, {"type": "null"}],
    )
    sequences = schema["properties"].get("sequences", {})
    items = sequences.get("items", {})
    rule = items.get("properties", {}).get("id", {})
    shaped = (
        set(sequences) <= {"type", "items", *described}
        and set(items) <= {"type", "additionalProperties", "required", "properties", *described}
        and set(rule) <= {"type", "minLength", "maxLength", *described}
        and rule.get("type") == "string"
    )
    if not (top and created_ok and shaped):
        return None
    return int(rule.get("minLength", 0)), int(rule.get("maxLength", 1 << 62))
