"""Checked reading of raw deployment settings (TOML values): ``ShardingError`` names the offending field.

Shared by the sharding preset (``config.sharding``) and the EPLB settings (``config.eplb``); plain
Python, no JAX.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ShardingError"]


class ShardingError(ValueError):
    """A bad preset, mesh or layout; ``field`` names the offending setting (e.g. ``mesh.shape``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def int_field(field: str, value: Any, low: int) -> int:
    """``value`` as an int >= ``low`` (bools and floats refused), else ShardingError naming ``field``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ShardingError(field, f"must be an integer, got {value!r}")
    if value < low:
        raise ShardingError(field, f"must be >= {low}, got {value!r}")
    return int(value)


def str_field(field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ShardingError(field, f"must be a string, got {value!r}")
    return value


def table_field(field: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ShardingError(field, f"must be a table, got {value!r}")
    return value


def no_extra(field: str, raw: Mapping[str, Any], known: Sequence[str]) -> None:
    """ShardingError naming the first key of ``raw`` that is not in ``known``."""
    extra = sorted(set(raw) - set(known))
    if extra:
        where = f"{field}." if field else ""
        raise ShardingError(f"{where}{extra[0]}", f"unknown setting (known: {', '.join(known)})")
