"""The cluster policies' one error type: bad input names the field it is about.

``PolicyInputError`` is a ``ValueError`` (so callers that catch ``ValueError`` keep working) with
``field``: the argument or setting at fault, also the first word of the message.
"""

from __future__ import annotations

import math

__all__ = ["PolicyInputError", "check_int", "check_nonempty", "check_number"]


class PolicyInputError(ValueError):
    """Invalid input to a cluster policy; ``field`` names the argument or setting."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def check_int(field: str, value, minimum: int | None = 0, maximum: int | None = None) -> int:
    """``value`` as an int in ``[minimum, maximum]`` (bool refused), else ``PolicyInputError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PolicyInputError(field, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise PolicyInputError(field, f"must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise PolicyInputError(field, f"must be <= {maximum}, got {value!r}")
    return value


def check_number(field: str, value, minimum: float | None = 0.0, maximum: float | None = None,
                 strict: bool = False) -> float:
    """``value`` as a finite float in range (``strict``: ``> minimum``), else ``PolicyInputError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PolicyInputError(field, f"must be a finite number, got {value!r}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise PolicyInputError(field, f"must be {'>' if strict else '>='} {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise PolicyInputError(field, f"must be <= {maximum}, got {value!r}")
    return float(value)


def check_nonempty(field: str, items) -> None:
    if len(items) == 0:
        raise PolicyInputError(field, "needs at least one entry")
