"""Strict JSON Schema normalisation for ``strict: true`` tools and ``json_schema`` formats (recipe.md §2.1).

The official library reads a strict schema into a closed set of node kinds and writes it back, so
only the keywords each kind knows survive, in a fixed order, and every object becomes closed:

========== ===================================================================================
kind        kept keywords, in output order
========== ===================================================================================
string      type, description, pattern, format, enum (strings)
number      type, description, const, default, minimum, maximum, exclusiveMinimum,
integer     exclusiveMaximum, multipleOf (integers for ``integer``, any number for ``number``)
boolean     type, description
null        type, description
array       type, items (required), description
object      type, properties, additionalProperties (always false), required (every property,
            in property order), description
type list   type (e.g. ``["string", "null"]``), description
anyOf       anyOf, description
$ref        $ref  (``$defs`` / ``definitions`` are dropped, as the official library does)
========== ===================================================================================

A node is chosen by ``type`` if present, else ``anyOf``, else ``$ref``. Errors: a malformed schema
(wrong value types, unknown type name, a node without ``type``/``anyOf``/``$ref``) is reported as
``<prefix>: <serde-style message>``; the rule errors (``additionalProperties`` true, an object without
properties, ``required`` not naming every property, a duplicate or unknown required name, a
non-object top level) are reported bare, with the official wording.
"""

from __future__ import annotations

from typing import Any

from deepinfer_jax.recipe.body import unexpected
from deepinfer_jax.recipe.errors import ConversionError

__all__ = ["normalize_json_schema", "normalize_tool_parameters"]

_TYPES = ("object", "string", "number", "integer", "boolean", "array", "null")
_NUMERIC_FIELDS = ("const", "default", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")


class _ParseError(Exception):
    """A schema that does not match the node model (wrapped with a prefix by the caller)."""


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise _ParseError(f"invalid type: {unexpected(v)}, expected a string")
    return v


def _number(v: Any, integer: bool) -> Any:
    if integer:
        if isinstance(v, bool) or not isinstance(v, int):
            raise _ParseError(f"invalid type: {unexpected(v)}, expected i64")
        if not -(2**63) <= v < 2**63:
            raise _ParseError(f"invalid value: integer `{v}`, expected i64")
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _ParseError(f"invalid type: {unexpected(v)}, expected a JSON number")
    return v


def _parse(node: Any) -> dict[str, Any]:
    """Read one node into its kept keywords (a dict in output order, ``additionalProperties`` pending)."""
    if not isinstance(node, dict) or not any(node.get(k) is not None for k in ("type", "anyOf", "$ref")):
        raise _ParseError("one of `type`, `anyOf`, `$ref` field is required")
    desc = node.get("description")
    desc = None if desc is None else _str(desc)
    kind = node.get("type")
    if kind is not None:
        if isinstance(kind, list):
            out: dict[str, Any] = {"type": kind}
            if desc is not None:
                out["description"] = desc
            return out
        if not isinstance(kind, str) or kind not in _TYPES:
            if not isinstance(kind, str):
                raise _ParseError(f"invalid type: {unexpected(kind)}, expected a string")
            raise _ParseError(f"unknown variant `{kind}`, expected one of {', '.join(f'`{t}`' for t in _TYPES)}")
        return _parse_typed(node, kind, desc)
    if node.get("anyOf") is not None:
        items = node["anyOf"]
        if not isinstance(items, list):
            raise _ParseError(f"invalid type: {unexpected(items)}, expected a sequence")
        out = {"anyOf": [_parse(x) for x in items]}
        if desc is not None:
            out["description"] = desc
        return out
    return {"$ref": _str(node["$ref"])}


def _parse_typed(node: dict[str, Any], kind: str, desc: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": kind}
    if kind == "string":
        if desc is not None:
            out["description"] = desc
        for key in ("pattern", "format", "enum"):
            v = node.get(key)
            if v is None:
                continue
            if key == "pattern":
                out[key] = _str(v)
            elif key == "format":
                if not isinstance(v, (str, dict)):
                    raise _ParseError(f"invalid type: {unexpected(v)}, expected string or map")
                out[key] = v
            else:
                if not isinstance(v, list):
                    raise _ParseError(f"invalid type: {unexpected(v)}, expected a sequence")
                out[key] = [_str(x) for x in v]
    elif kind in ("number", "integer"):
        if desc is not None:
            out["description"] = desc
        for key in _NUMERIC_FIELDS:
            if node.get(key) is not None:
                out[key] = _number(node[key], kind == "integer")
    elif kind == "array":
        if node.get("items") is None:
            raise _ParseError("missing field `items`")
        out["items"] = _parse(node["items"])
        if desc is not None:
            out["description"] = desc
    elif kind == "object":
        props = node.get("properties")
        if props is not None and not isinstance(props, dict):
            raise _ParseError(f"invalid type: {unexpected(props)}, expected a map")
        out["properties"] = None if props is None else {k: _parse(v) for k, v in props.items()}
        extra = node.get("additionalProperties")
        if extra is not None and not isinstance(extra, bool):
            raise _ParseError(f"invalid type: {unexpected(extra)}, expected a boolean")
        out["additionalProperties"] = extra
        req = node.get("required")
        if req is not None:
            if not isinstance(req, list):
                raise _ParseError(f"invalid type: {unexpected(req)}, expected a sequence")
            req = [_str(x) for x in req]
        out["required"] = req
        if desc is not None:
            out["description"] = desc
    else:  # boolean, null
        if desc is not None:
            out["description"] = desc
    return out


def _close(node: dict[str, Any], top: bool) -> dict[str, Any]:
    """Apply the object rules (depth first) and fill ``additionalProperties`` / ``required``."""
    if "anyOf" in node:
        node["anyOf"] = [_close(x, False) for x in node["anyOf"]]
        return node
    kind = node.get("type")
    if kind == "array":
        node["items"] = _close(node["items"], False)
    if kind != "object":
        return node
    props = node["properties"]
    if not props and not top:
        raise ConversionError("An object with no properties is not allowed.")
    props = props or {}
    if node["additionalProperties"] is True:
        raise ConversionError("additionalProperties should not be true")
    req = node["required"]
    if req is not None:
        seen: set[str] = set()
        for name in req:
            if name in seen:
                raise ConversionError(f"Duplicate required property '{name}'")
            seen.add(name)
            if name not in props:
                raise ConversionError(f"Required property '{name}' not found in object")
        if len(seen) != len(props):
            raise ConversionError("Required properties must match all properties in the object")
    out: dict[str, Any] = {"type": "object", "properties": {k: _close(v, False) for k, v in props.items()},
                           "additionalProperties": False, "required": list(props)}
    if "description" in node:
        out["description"] = node["description"]
    return out


def normalize_tool_parameters(parameters: Any) -> dict[str, Any]:
    """Normalised parameters of a strict tool (None -> an empty closed object)."""
    if parameters is None:
        return {"type": "object", "properties": {}, "additionalProperties": False, "required": []}
    try:
        node = _parse(parameters)
    except _ParseError as e:
        raise ConversionError(f"Invalid tool parameters schema : {e}") from None
    if node.get("type") != "object":
        raise ConversionError("The top level of the function parameters schema must be an object.")
    return _close(node, True)


def normalize_json_schema(schema: Any) -> dict[str, Any]:
    """Normalised schema of a strict ``json_schema`` response format (the top level must be an object
    with properties)."""
    try:
        node = _parse(schema)
    except _ParseError as e:
        raise ConversionError(f"Invalid json schema: {e}") from None
    if node.get("type") != "object":
        raise ConversionError("The top level of the json schema must be an object.")
    return _close(node, False)
