"""Strict JSON (no duplicate keys, no NaN) and the kvsnap metadata JSON Schema."""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

from kvsnap.errors import SnapshotCorruptError
from kvsnap.format.schema_compiler import Check, compile_schema


def dump_json(document: Any) -> str:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def strict_json_loads(text: str | bytes) -> Any:
    """``json.loads`` that rejects duplicate keys and NaN/Infinity; raises ``ValueError``.

    Deeply nested input (``RecursionError``) and over-long integers are reported as
    ``ValueError`` too, so callers need one ``except``.
    """
    try:
        return json.loads(
            text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant
        )
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
def _compiled_schema() -> Check:
    return compile_schema(metadata_schema())


def validate_schema(document: Any, file: str | None) -> None:
    """Refuse ``document`` (:class:`SnapshotCorruptError`) unless it is valid under the kvsnap
    metadata schema. The verdict comes from the schema compiled once
    (:mod:`kvsnap.format.schema_compiler`: the same verdict as ``jsonschema`` at a tenth of its
    cost); a refused document is walked by ``jsonschema`` to say where and why."""
    if _compiled_schema()(document):
        return
    error = next(iter(_schema_validator().iter_errors(document)), None)
    if error is None:
        # Unreachable while the two agree (tests/format/test_schema_compiler.py): refuse
        # rather than accept on the word of the check that disagrees.
        raise SnapshotCorruptError("kvsnap metadata fails the v1 schema", file=file)
    where = "/".join(str(part) for part in error.absolute_path) or "(top level)"
    raise SnapshotCorruptError(
        f"kvsnap metadata fails the v1 schema at {where}: {error.message}", file=file
    )
