"""Strict JSON (no duplicate keys, no NaN) and the kvsnap metadata JSON Schema."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from importlib import resources
from typing import Any

from kvsnap.errors import SnapshotCorruptError


def dump_json(document: Any) -> str:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # The dict is built in C; only an object that lost a key to a duplicate is walked again.
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


#: The decoder of every strict parse: ``json.loads`` given hooks builds a new one per call, and
#: every snapshot header a process opens is parsed here (its metadata at least).
_STRICT_DECODER = json.JSONDecoder(
    object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant
)


def strict_json_loads(text: str | bytes) -> Any:
    """``json.loads`` that rejects duplicate keys and NaN/Infinity; raises ``ValueError``.

    Deeply nested input (``RecursionError``) and over-long integers are reported as
    ``ValueError`` too, so callers need one ``except``. Bytes are decoded as ``json.loads``
    decodes them (UTF-8, -16 or -32 by their first bytes).
    """
    if isinstance(text, (bytes, bytearray)):
        text = text.decode(json.detect_encoding(text), "surrogatepass")
    elif not isinstance(text, str):
        raise TypeError(f"JSON must be str or bytes, not {type(text).__name__}")
    elif text.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    try:
        return _STRICT_DECODER.decode(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


@functools.cache
def metadata_schema() -> dict[str, Any]:
    """The JSON Schema of the kvsnap metadata object (``kvsnap/schema/snapshot-v1.schema.json``)."""
    text = (
        resources.files("kvsnap").joinpath("schema", "snapshot-v1.schema.json").read_text("utf-8")
    )
    return json.loads(text)


@functools.cache
def _schema_validator() -> Any:
    import jsonschema  # imported on first use: it is the slowest import of the reader

    schema = metadata_schema()
    return jsonschema.validators.validator_for(schema)(schema)


@functools.cache
def _compiled_schema() -> Callable[[Any], Any]:
    import fastjsonschema

    # Compiled once into Python code: about 10 us a document against jsonschema's 300
    # (a chunk's metadata, on this VM), the largest part of a small file's first open.
    return fastjsonschema.compile(metadata_schema(), use_default=False, use_formats=False)


def validate_schema(document: Any, file: str | None) -> None:
    """Refuse ``document`` (:class:`SnapshotCorruptError`) unless it is valid under the kvsnap
    metadata schema. The verdict comes from the schema compiled once by ``fastjsonschema``;
    a refused document is walked by ``jsonschema`` to say where and why.

    The two agree on every document but one kind (tests/format/test_schema_verdicts.py): a
    string that matches a pattern ending in ``$`` only with a newline after it.
    ``fastjsonschema`` follows JSON Schema's ECMA-262 regular expressions, where ``$`` is the
    end of the string, and refuses it; Python's ``re``, which ``jsonschema`` uses, lets ``$``
    match before a final newline. kvsnap takes the stricter verdict."""
    import fastjsonschema

    try:
        _compiled_schema()(document)
        return
    except fastjsonschema.JsonSchemaValueException as refusal:
        error = next(iter(_schema_validator().iter_errors(document)), None)
        if error is None:
            raise SnapshotCorruptError(
                f"kvsnap metadata fails the v1 schema: {refusal.message}", file=file
            ) from None
    where = "/".join(str(part) for part in error.absolute_path) or "(top level)"
    raise SnapshotCorruptError(
        f"kvsnap metadata fails the v1 schema at {where}: {error.message}", file=file
    )
