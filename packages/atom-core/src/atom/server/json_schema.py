"""Whether a JSON schema is well formed: each keyword of JSON Schema's core vocabulary has a
value of the kind the specification gives it (a `type` names a JSON type, `properties`
maps names to schemas, `required` lists strings, ...). Unknown keywords are annotations
and pass, as the specification says. This catches what a client gets wrong by mistake; it
does not check that a schema can be satisfied.
"""

from __future__ import annotations

from typing import Any

JSON_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")

_SCHEMA = ("additionalProperties", "additionalItems", "not", "if", "then", "else", "contains",
           "propertyNames", "unevaluatedItems", "unevaluatedProperties")  # fmt: skip
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_list_of_strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


_COUNT = (_is_count, "a non-negative integer")
_NUMBER = (_is_number, "a number")
_TEXT = (lambda value: isinstance(value, str), "a string")
# keyword: (whether a value suits it, what it must be)
_VALUE_KINDS = {
    **dict.fromkeys(("minLength", "maxLength", "minItems", "maxItems", "minProperties",
                     "maxProperties", "minContains", "maxContains"), _COUNT),
    **dict.fromkeys(("minimum", "maximum"), _NUMBER),
    # A flag in draft 4, a number since.
    **dict.fromkeys(("exclusiveMinimum", "exclusiveMaximum"),
                    (lambda value: isinstance(value, bool) or _is_number(value),
                     "a number (or, as in draft 4, a flag)")),
    "multipleOf": (lambda value: _is_number(value) and value > 0, "a number above 0"),
    **dict.fromkeys(("$ref", "$id", "$schema", "$anchor", "$comment", "title", "description",
                     "format", "pattern"), _TEXT),
    "uniqueItems": (lambda value: isinstance(value, bool), "true or false"),
    "enum": (lambda value: isinstance(value, list), "a list"),
    "required": (_is_list_of_strings, "a list of property names (strings)"),
    "dependentRequired": (
        lambda value: isinstance(value, dict) and all(map(_is_list_of_strings, value.values())),
        "an object mapping property names to lists of property names",
    ),
}  # fmt: skip


def schema_problem(schema: Any) -> str | None:
    """What is wrong with `schema`, with where it is (`properties.x.type: ...`); None if
    nothing is."""
    return _problem(schema, "")


def _problem(schema: Any, where: str) -> str | None:
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return _at(where, f"a schema must be an object or a boolean, got {_kind(schema)}")
    for keyword, value in schema.items():
        at = f"{where}.{keyword}" if where else keyword
        problem = _keyword_problem(keyword, value, at)
        if problem is not None:
            return problem
    return None


def _keyword_problem(keyword: str, value: Any, at: str) -> str | None:
    if keyword == "type":
        return _type_problem(value, at)
    if keyword in _SCHEMA:
        return _problem(value, at)
    if keyword == "items":  # one schema, or (before draft 2020-12) one per position
        return _list_problem(value, at) if isinstance(value, list) else _problem(value, at)
    if keyword in _SCHEMA_MAP:
        if not isinstance(value, dict):
            return _at(at, f"must be an object of schemas, got {_kind(value)}")
        return next(filter(None, (_problem(s, f"{at}.{name}") for name, s in value.items())), None)
    if keyword in _SCHEMA_LIST:
        return _list_problem(value, at)
    suits, expected = _VALUE_KINDS.get(keyword, (None, ""))
    if suits is not None and not suits(value):
        return _at(at, f"must be {expected}, got {_shown(value)}")
    return None


def _type_problem(value: Any, at: str) -> str | None:
    names = value if isinstance(value, list) else [value]
    unknown = [name for name in names if not isinstance(name, str) or name not in JSON_TYPES]
    if unknown or not names or len(set(names)) != len(names):
        shown = _shown(unknown[0] if unknown else value)
        return _at(at, f"{shown} is not a JSON type nor a list of distinct ones "
                       f"({', '.join(JSON_TYPES)})")  # fmt: skip
    return None


def _list_problem(value: Any, at: str) -> str | None:
    if not isinstance(value, list) or not value:
        return _at(at, f"must be a non-empty list of schemas, got {_kind(value)}")
    return next(filter(None, (_problem(s, f"{at}.{i}") for i, s in enumerate(value))), None)


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 40 else f"{shown[:37]}..."


def _kind(value: Any) -> str:
    return "an empty list" if value == [] else type(value).__name__


def _at(where: str, problem: str) -> str:
    return f"{where}: {problem}" if where else problem
