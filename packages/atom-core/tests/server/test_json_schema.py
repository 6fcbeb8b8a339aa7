"""`schema_problem` names the first malformed keyword of a tool's schema and where it is,
and lets well-formed schemas of every draft through."""

from __future__ import annotations

import pytest

from atom.server.json_schema import schema_problem

WELL_FORMED = {
    "plain object": {"type": "object", "properties": {"x": {"type": "string"}}},
    "boolean subschemas": {"properties": {"x": True, "y": False}, "additionalProperties": False},
    "type list": {"type": ["integer", "null"]},
    "draft 4 flags": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
    "positional items": {"type": "array", "items": [{"type": "string"}, {"type": "number"}]},
    "refs and combinators": {"$defs": {"a": {"enum": [1, "b", None]}},
                             "anyOf": [{"$ref": "#/$defs/a"}, {"not": {"const": 3}}]},
    "unknown keywords": {"x-order": 3, "examples": [{}], "default": "v"},
}  # fmt: skip

MALFORMED = {
    "unknown type": ({"type": "objekt"}, "type: 'objekt' is not a JSON type"),
    "repeated types": ({"type": ["string", "string"]}, "is not a JSON type nor a list of dis"),
    "type not a name": ({"type": {"name": "string"}}, "type: {'name': 'string'} is not"),
    "properties a list": ({"properties": ["x"]}, "properties: must be an object of schemas"),
    "deep bad type": ({"properties": {"a": {"items": {"type": 1}}}},
                      "properties.a.items.type: 1 is not"),
    "subschema a string": ({"properties": {"a": "string"}},
                           "properties.a: a schema must be an object or a boolean"),
    "required a string": ({"required": "x"}, "required: must be a list of property names"),
    "empty anyOf": ({"anyOf": []}, "anyOf: must be a non-empty list of schemas"),
    "negative minItems": ({"minItems": -1}, "minItems: must be a non-negative integer, got -1"),
    "flag as a count": ({"maxLength": True}, "maxLength: must be a non-negative integer"),
    "zero multipleOf": ({"multipleOf": 0}, "multipleOf: must be a number above 0"),
    "enum not a list": ({"enum": "a"}, "enum: must be a list"),
    "description a number": ({"description": 5}, "description: must be a string"),
}  # fmt: skip


@pytest.mark.parametrize("case", WELL_FORMED)
def test_well_formed_schemas_pass(case):
    assert schema_problem(WELL_FORMED[case]) is None


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_schemas_are_named(case):
    schema, problem = MALFORMED[case]
    assert problem in (schema_problem(schema) or "")
