"""Checks of non-strict tool parameter schemas (recipe.md §2.1).

The official library validates a non-strict tool's ``parameters`` against the JSON Schema
meta-schema and then requires ``type: "object"`` at the top. This module checks the meta-schema
rules that matter in practice (value kinds of the common keywords, sub-schemas, non-negative
counts, the ``type`` names) with the official messages, e.g.::

    Invalid schema for function 'f': 5 is not of types "boolean", "object"
    Invalid schema for function 'f': schema must be a JSON Schema of 'type: "object"', got 'type: "array"'.

When a schema has several problems, the official library may report a different one first.
"""

from __future__ import annotations

from typing import Any

from deepinfer_jax.recipe.errors import ConversionError
from deepinfer_jax.recipe.pyjson import dumps_compact

__all__ = ["check_tool_parameters"]

_SIMPLE_TYPES = ("array", "boolean", "integer", "null", "number", "object", "string")
_SCHEMA_KEYS = ("items", "additionalProperties", "not", "contains", "propertyNames", "additionalItems",
                "unevaluatedProperties", "unevaluatedItems", "if", "then", "else")
_SCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LIST_KEYS = ("allOf", "anyOf", "oneOf", "prefixItems")
_COUNT_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
               "maxContains")
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_STRING_KEYS = ("title", "description", "pattern", "format", "$ref", "$id", "$schema", "$comment", "$anchor")
_BOOL_KEYS = ("uniqueItems", "deprecated", "readOnly", "writeOnly")


class _Invalid(Exception):
    pass


def _show(v: Any) -> str:
    return dumps_compact(v)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check(schema: Any) -> None:
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise _Invalid(f'{_show(schema)} is not of types "boolean", "object"')
    for key, v in schema.items():
        if key == "type":
            ok = v in _SIMPLE_TYPES if isinstance(v, str) else (
                isinstance(v, list) and len(v) > 0 and all(isinstance(t, str) and t in _SIMPLE_TYPES for t in v)
                and len(set(v)) == len(v))
            if not ok:
                raise _Invalid(f"{_show(v)} is not valid under any of the schemas listed in the 'anyOf' keyword")
        elif key in _SCHEMA_KEYS:
            _check(v)
        elif key in _SCHEMA_MAP_KEYS:
            if not isinstance(v, dict):
                raise _Invalid(f'{_show(v)} is not of type "object"')
            for sub in v.values():
                _check(sub)
        elif key in _SCHEMA_LIST_KEYS:
            if not isinstance(v, list):
                raise _Invalid(f'{_show(v)} is not of type "array"')
            if not v:
                raise _Invalid(f"{_show(v)} has less than 1 item")
            for sub in v:
                _check(sub)
        elif key == "required":
            if not isinstance(v, list):
                raise _Invalid(f'{_show(v)} is not of type "array"')
            for name in v:
                if not isinstance(name, str):
                    raise _Invalid(f'{_show(name)} is not of type "string"')
        elif key == "enum":
            if not isinstance(v, list):
                raise _Invalid(f'{_show(v)} is not of type "array"')
        elif key in _COUNT_KEYS:
            if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
                raise _Invalid(f'{_show(v)} is not of type "integer"')
            if v < 0:
                raise _Invalid(f"{_show(v)} is less than the minimum of 0")
        elif key in _NUMBER_KEYS:
            if not _is_number(v):
                raise _Invalid(f'{_show(v)} is not of type "number"')
        elif key == "multipleOf":
            if not _is_number(v):
                raise _Invalid(f'{_show(v)} is not of type "number"')
            if v <= 0:
                raise _Invalid(f"{_show(v)} is less than or equal to the minimum of 0")
        elif key in _STRING_KEYS:
            if not isinstance(v, str):
                raise _Invalid(f'{_show(v)} is not of type "string"')
        elif key in _BOOL_KEYS and not isinstance(v, bool):
            raise _Invalid(f'{_show(v)} is not of type "boolean"')


def check_tool_parameters(name: str, parameters: Any) -> None:
    """400 unless ``parameters`` is a valid JSON Schema whose top-level ``type`` is ``"object"``."""
    try:
        _check(parameters)
    except _Invalid as e:
        raise ConversionError(f"Invalid schema for function '{name}': {e}") from None
    kind = parameters.get("type") if isinstance(parameters, dict) else None
    if kind != "object":
        raise ConversionError(f"Invalid schema for function '{name}': schema must be a JSON Schema of "
                              f"'type: \"object\"', got 'type: {_show(kind)}'.")
