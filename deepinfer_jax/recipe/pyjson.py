"""JSON reading and the two JSON text forms the official library writes (recipe.md §4.1).

- :func:`loads`: JSON text -> Python values with the official library's number model: integers in
  ``[-2**63, 2**64)`` stay integers, other integers become floats, ``NaN``/``Infinity`` literals and
  out-of-range floats (``1e400``) are invalid. Object key order is kept, a repeated key keeps its
  first position and its last value.
- :func:`dumps_py` ("py-JSON", used in prompts): exactly ``json.dumps(value, ensure_ascii=False)``.
- :func:`dumps_v4` (used in V4 prompts): the same separators, but floats in the Rust ``ryu`` style
  (``1e-7``, ``0.00001``, ``1e+16``, ``100.0``), as the official V4 template writes them.
- :func:`dumps_compact` (output-constraint schemas): no spaces, ``ryu``-style floats.
"""

from __future__ import annotations

import json
import math
from decimal import Decimal
from typing import Any

__all__ = ["JSONValueError", "check_json_value", "dumps_compact", "dumps_py", "dumps_v4", "loads", "try_loads"]

_I64_MIN = -(2**63)
_U64_END = 2**64


class JSONValueError(ValueError):
    """Text that is not JSON under the official number model."""


def _parse_int(text: str) -> int | float:
    value = int(text)
    return value if _I64_MIN <= value < _U64_END else float(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise JSONValueError("number out of range")
    return value


def _parse_constant(text: str) -> Any:
    raise JSONValueError(f"invalid literal {text}")


_DECODER = json.JSONDecoder(parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)


def loads(text: str | bytes) -> Any:
    """Parse JSON text; raises :class:`JSONValueError` (a ``ValueError``) when it is not valid."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise JSONValueError(str(e)) from None
    try:
        return _DECODER.decode(text)
    except JSONValueError:
        raise
    except ValueError as e:  # json.JSONDecodeError, RecursionError-free cases
        raise JSONValueError(str(e)) from None
    except RecursionError:
        raise JSONValueError("recursion limit exceeded") from None


def try_loads(text: str) -> tuple[bool, Any]:
    """``(True, value)`` if ``text`` is valid JSON, else ``(False, None)``."""
    try:
        return True, loads(text)
    except JSONValueError:
        return False, None


def check_json_value(value: Any, where: str = "body") -> None:
    """Raise ``ValueError`` for a Python value with no JSON form (a cycle, a huge int, NaN, odd types).

    A value shared by two places (the same dict twice) is fine; only a container inside itself is a cycle.
    """
    path: set[int] = set()

    def visit(v: Any) -> None:
        if v is None or isinstance(v, (bool, str)):
            return
        if isinstance(v, int):
            if not _I64_MIN <= v < _U64_END:
                raise JSONValueError(f"integer is outside the JSON number range in {where}")
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise JSONValueError(f"non-finite float in {where}")
        elif isinstance(v, (dict, list, tuple)):
            if id(v) in path:
                raise JSONValueError(f"cyclic value in {where}")
            path.add(id(v))
            if isinstance(v, dict):
                for k, x in v.items():
                    if not isinstance(k, str):
                        raise JSONValueError(f"object key {k!r} is not a string in {where}")
                    visit(x)
            else:
                for x in v:
                    visit(x)
            path.discard(id(v))
        else:
            raise JSONValueError(f"{type(v).__name__} is not a JSON value in {where}")

    try:
        visit(value)
    except RecursionError:
        raise JSONValueError(f"value nested too deeply in {where}") from None


def dumps_py(value: Any) -> str:
    """Python-style JSON text: ``", "`` / ``": "`` separators, non-ASCII kept, floats as ``repr``."""
    return json.dumps(value, ensure_ascii=False)


def _float_compact(f: float) -> str:
    """Shortest round-trip float in the ``ryu`` layout: fixed for 1e-5 <= |f| < 1e16, else ``d.ddde±X``."""
    if f == 0.0:
        return "-0.0" if math.copysign(1.0, f) < 0 else "0.0"
    sign, digits, exp = Decimal(repr(f)).as_tuple()
    ds = "".join(map(str, digits)).rstrip("0")
    exp += len(digits) - len(ds)  # value = int(ds) * 10**exp
    e10 = len(ds) - 1 + exp
    neg = "-" if sign else ""
    if -5 <= e10 < 16:
        if exp >= 0:
            return f"{neg}{ds}{'0' * exp}.0"
        point = len(ds) + exp
        if point > 0:
            return f"{neg}{ds[:point]}.{ds[point:]}"
        return f"{neg}0.{'0' * -point}{ds}"
    mant = ds[0] + ("." + ds[1:] if len(ds) > 1 else "")
    return f"{neg}{mant}e{'+' if e10 > 0 else '-'}{abs(e10)}"


_ENCODE_STR = json.encoder.encode_basestring  # non-ASCII kept raw, control characters escaped


def dumps_compact(value: Any) -> str:
    """Compact JSON text (``,`` / ``:``) with Rust-style floats; key order kept."""
    parts: list[str] = []
    _write(value, parts, ",", ":")
    return "".join(parts)


def dumps_v4(value: Any) -> str:
    """Spaced JSON text (``, `` / ``: ``) with Rust-style floats; key order kept."""
    parts: list[str] = []
    _write(value, parts, ", ", ": ")
    return "".join(parts)


def _write(v: Any, out: list[str], comma: str, colon: str) -> None:
    if v is None:
        out.append("null")
    elif v is True:
        out.append("true")
    elif v is False:
        out.append("false")
    elif isinstance(v, str):
        out.append(_ENCODE_STR(v))
    elif isinstance(v, int):
        out.append(str(int(v)))
    elif isinstance(v, float):
        out.append(_float_compact(v))
    elif isinstance(v, dict):
        out.append("{")
        for i, (k, x) in enumerate(v.items()):
            if i:
                out.append(comma)
            out.append(_ENCODE_STR(k))
            out.append(colon)
            _write(x, out, comma, colon)
        out.append("}")
    elif isinstance(v, (list, tuple)):
        out.append("[")
        for i, x in enumerate(v):
            if i:
                out.append(comma)
            _write(x, out, comma, colon)
        out.append("]")
    else:
        raise TypeError(f"{type(v).__name__} is not JSON serialisable")
