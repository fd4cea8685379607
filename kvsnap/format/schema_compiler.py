"""A JSON Schema compiled once into nested Python checks: the verdict of ``jsonschema``'s
draft 2020-12 validator (valid or not) for the keywords the kvsnap metadata schema uses, at a
small fraction of its cost per document.

``jsonschema`` walks the schema for every document it checks: it looks each keyword up,
builds a child validator per level and yields errors through generators (0.2-0.25 ms for
one chunk's metadata, the largest part of a reader's first open of a small file). Here the
walk happens once, in :func:`compile_schema`, which returns one closure per subschema that only
tests the instance. Each keyword is applied exactly as the draft (and ``jsonschema``) defines
it: ``integer`` also accepts a float with an integral value, booleans are never numbers,
``enum`` and ``const`` compare 1 and 1.0 equal but never ``True`` and 1, ``pattern`` is a search
(not an anchored match), ``minLength`` and ``maxLength`` count code points, and every keyword
except ``type``, ``enum``, ``const`` and ``oneOf`` ignores instances of types it does not apply
to. A keyword this compiler does not know raises :class:`ValueError` when the schema is
compiled, so a schema change can never leave a rule unchecked.

Only the verdict is computed: a caller that needs to say *why* a document fails asks
``jsonschema`` (the refusals are the rare path). ``tests/format/test_schema_compiler.py``
checks the verdicts equal on real metadata and thousands of altered documents.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

#: A compiled subschema: whether an instance is valid under it.
Check = Callable[[Any], bool]

#: Keywords that only annotate (no effect on validity).
_ANNOTATIONS = frozenset({"$schema", "$id", "title", "description", "$comment", "examples"})

_TYPE_TESTS: dict[str, Check] = {
    "null": lambda value: value is None,
    "boolean": lambda value: isinstance(value, bool),
    "string": lambda value: isinstance(value, str),
    "array": lambda value: isinstance(value, list),
    "object": lambda value: isinstance(value, dict),
    "number": lambda value: isinstance(value, int | float) and not isinstance(value, bool),
    "integer": lambda value: (
        (isinstance(value, int) and not isinstance(value, bool))
        or (isinstance(value, float) and value.is_integer())
    ),
}


def compile_schema(schema: Mapping[str, Any] | bool) -> Check:
    """One check per keyword of ``schema`` (and, recursively, its subschemas), combined: the
    returned function is true exactly when ``jsonschema``'s draft 2020-12 validator finds no
    error in the instance. ``ValueError`` for a keyword it does not implement."""
    if isinstance(schema, bool):
        return (lambda _value: True) if schema else (lambda _value: False)
    unknown = set(schema) - _ANNOTATIONS - set(_KEYWORDS)
    if unknown:
        raise ValueError(f"schema keywords {sorted(unknown)} are not compiled")
    checks = [
        _KEYWORDS[keyword](value, schema)
        for keyword, value in schema.items()
        if keyword in _KEYWORDS
    ]
    if not checks:
        return lambda _value: True
    if len(checks) == 1:
        return checks[0]
    return _all_of(tuple(checks))


def _all_of(checks: tuple[Check, ...]) -> Check:
    # Plain loops: a generator per level of the document costs more than the tests in it.
    def check(value: Any) -> bool:
        for test in checks:
            if not test(value):
                return False
        return True

    return check


def json_equal(one: Any, two: Any) -> bool:
    """JSON Schema equality (``enum``, ``const``): numbers by value (1 == 1.0), booleans
    distinct from numbers, arrays and objects element by element."""
    if isinstance(one, str) or isinstance(two, str):
        return bool(one == two)
    if isinstance(one, list) and isinstance(two, list):
        return len(one) == len(two) and all(map(json_equal, one, two))
    if isinstance(one, dict) and isinstance(two, dict):
        return one.keys() == two.keys() and all(json_equal(one[key], two[key]) for key in one)
    if isinstance(one, bool) or isinstance(two, bool):
        return one is two
    return bool(one == two)


def _type(types: str | list[str], _schema: Mapping[str, Any]) -> Check:
    names = [types] if isinstance(types, str) else types
    unknown = [name for name in names if name not in _TYPE_TESTS]
    if unknown:
        raise ValueError(f"schema types {unknown} are not JSON Schema types")
    tests = [_TYPE_TESTS[name] for name in names]
    if len(tests) == 1:
        return tests[0]
    return lambda value: any(test(value) for test in tests)


def _enum(allowed: list[Any], _schema: Mapping[str, Any]) -> Check:
    return lambda value: any(json_equal(choice, value) for choice in allowed)


def _const(expected: Any, _schema: Mapping[str, Any]) -> Check:
    return lambda value: json_equal(expected, value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _minimum(bound: float, _schema: Mapping[str, Any]) -> Check:
    return lambda value: not _is_number(value) or value >= bound


def _maximum(bound: float, _schema: Mapping[str, Any]) -> Check:
    return lambda value: not _is_number(value) or value <= bound


def _min_length(bound: int, _schema: Mapping[str, Any]) -> Check:
    return lambda value: not isinstance(value, str) or len(value) >= bound


def _max_length(bound: int, _schema: Mapping[str, Any]) -> Check:
    return lambda value: not isinstance(value, str) or len(value) <= bound


def _pattern(expression: str, _schema: Mapping[str, Any]) -> Check:
    search = re.compile(expression).search
    return lambda value: not isinstance(value, str) or search(value) is not None


def _required(names: list[str], _schema: Mapping[str, Any]) -> Check:
    needed = frozenset(names)
    return lambda value: not isinstance(value, dict) or needed <= value.keys()


def _properties(properties: Mapping[str, Any], _schema: Mapping[str, Any]) -> Check:
    checks = {name: compile_schema(subschema) for name, subschema in properties.items()}

    def check(value: Any) -> bool:
        if not isinstance(value, dict):
            return True
        for name, item in value.items():
            test = checks.get(name)
            if test is not None and not test(item):
                return False
        return True

    return check


def _additional_properties(extra: Mapping[str, Any] | bool, schema: Mapping[str, Any]) -> Check:
    known = frozenset(schema.get("properties", ()))
    test = compile_schema(extra)

    def check(value: Any) -> bool:
        if not isinstance(value, dict):
            return True
        for name, item in value.items():
            if name not in known and not test(item):
                return False
        return True

    return check


def _items(items: Mapping[str, Any] | bool, _schema: Mapping[str, Any]) -> Check:
    test = compile_schema(items)

    def check(value: Any) -> bool:
        if not isinstance(value, list):
            return True
        for item in value:
            if not test(item):
                return False
        return True

    return check


def _one_of(subschemas: list[Any], _schema: Mapping[str, Any]) -> Check:
    tests = [compile_schema(subschema) for subschema in subschemas]
    return lambda value: sum(1 for test in tests if test(value)) == 1


_KEYWORDS: dict[str, Callable[[Any, Mapping[str, Any]], Check]] = {
    "type": _type,
    "enum": _enum,
    "const": _const,
    "minimum": _minimum,
    "maximum": _maximum,
    "minLength": _min_length,
    "maxLength": _max_length,
    "pattern": _pattern,
    "required": _required,
    "properties": _properties,
    "additionalProperties": _additional_properties,
    "items": _items,
    "oneOf": _one_of,
}

__all__ = ["Check", "compile_schema", "json_equal"]
