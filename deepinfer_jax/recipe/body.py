"""Reading a request body against a protocol schema (the parse step before conversion).

The official library first deserialises the body into typed structs (serde) and only then converts
it; a schema mismatch is a :class:`~deepinfer_jax.recipe.errors.RequestBodyError` (a ``ValueError``)
whose wording follows serde's: ``missing field `x```, ``invalid type: string "x", expected u32``,
``unknown variant `x`, expected one of `a`, `b```. The helpers here check one field at a time; the
converters call them for every field before any semantic rule (so schema errors win, as in the wheel).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepinfer_jax.recipe.errors import RequestBodyError
from deepinfer_jax.recipe.pyjson import JSONValueError, check_json_value, loads

__all__ = ["MISSING", "expect", "field", "parse_body", "unexpected", "variant"]


class _Missing:
    __repr__ = lambda self: "MISSING"


MISSING: Any = _Missing()

_INT_RANGES = {"u8": (0, 2**8), "u16": (0, 2**16), "u32": (0, 2**32), "u64": (0, 2**64), "i64": (-(2**63), 2**63),
               "usize": (0, 2**64)}


def parse_body(body: Any) -> dict[str, Any]:
    """A dict body as is (checked to be JSON-like), or JSON text / bytes parsed."""
    if isinstance(body, (str, bytes, bytearray)):
        try:
            body = loads(body)
        except JSONValueError as e:
            raise RequestBodyError(str(e), prefix="invalid JSON request") from None
    else:
        try:
            check_json_value(body)
        except JSONValueError as e:
            raise RequestBodyError(str(e)) from None
    return body


def _rust_debug(s: str) -> str:
    out = ['"']
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{{{ord(ch):x}}}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def unexpected(value: Any) -> str:
    """serde's description of a value of the wrong type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        text = repr(value)
        return f"floating point `{text}`"
    if isinstance(value, str):
        return f"string {_rust_debug(value)}"
    if isinstance(value, dict):
        return "map"
    return "sequence"


def expect(value: Any, kind: str, expected: str | None = None) -> Any:
    """Check ``value`` against ``kind`` (str, bool, f32, f64, u8..u64, i64, list, map, any).

    ``expected`` overrides the "expected ..." wording (e.g. ``struct X``).
    """
    if kind == "any":
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise RequestBodyError(f"invalid type: {unexpected(value)}, expected {expected or 'a string'}")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise RequestBodyError(f"invalid type: {unexpected(value)}, expected {expected or 'a boolean'}")
        return value
    if kind in ("f32", "f64"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RequestBodyError(f"invalid type: {unexpected(value)}, expected {expected or kind}")
        return float(value)
    if kind in _INT_RANGES:
        lo, hi = _INT_RANGES[kind]
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestBodyError(f"invalid type: {unexpected(value)}, expected {expected or kind}")
        if not lo <= value < hi:
            raise RequestBodyError(f"invalid value: integer `{value}`, expected {expected or kind}")
        return value
    if kind == "list":
        if not isinstance(value, list):
            raise RequestBodyError(f"invalid type: {unexpected(value)}, expected {expected or 'a sequence'}")
        return value
    if kind == "map":
        if not isinstance(value, dict):
            raise RequestBodyError(f"invalid type: {unexpected(value)}, expected {expected or 'a map'}")
        return value
    raise ValueError(f"unknown kind {kind!r}")


def field(obj: dict[str, Any], key: str, kind: str, *, required: bool = False, nullable: bool = True,
          expected: str | None = None) -> Any:
    """``obj[key]`` checked against ``kind``; :data:`MISSING` if absent (``required``: an error).

    A JSON null counts as absent for optional (``nullable``) fields, as serde's ``Option`` does.
    """
    if key not in obj:
        if required:
            raise RequestBodyError(f"missing field `{key}`")
        return MISSING
    value = obj[key]
    if value is None and nullable and not required:
        return MISSING
    return expect(value, kind, expected)


def typed(obj: Any, expected: str | None = None, *, check: bool = True) -> dict[str, Any]:
    """An internally tagged object: (with ``check``) a map, which must have a ``type`` field."""
    if check:
        expect(obj, "map", expected)
    if "type" not in obj:
        raise RequestBodyError("missing field `type`")
    return obj


def variant(value: Any, options: Sequence[str]) -> str:
    """An enum tag: ``value`` must be one of ``options``."""
    if not isinstance(value, str):
        raise RequestBodyError(f"invalid type: {unexpected(value)}, expected a string")
    if value not in options:
        listed = f"`{options[0]}`" if len(options) == 1 else "one of " + ", ".join(f"`{o}`" for o in options)
        raise RequestBodyError(f"unknown variant `{value}`, expected {listed}")
    return value
