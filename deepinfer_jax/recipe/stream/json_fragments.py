"""Incremental JSON for tool arguments: string values escaped piece by piece (recipe.md §8.7).

A string value arrives in pieces; each is escaped on its own, which is exact because JSON escaping
is per character. The escapes are serde_json's (and Python's ``ensure_ascii=False``): ``\\"``,
``\\\\``, the short forms ``\\b \\f \\n \\r \\t``, ``\\u00xx`` (lower-case hex) for the other
control characters, everything else raw.
"""

from __future__ import annotations

import re

_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f]')
_SHORT = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _one(m: re.Match[str]) -> str:
    c = m.group()
    return _SHORT.get(c) or f"\\u{ord(c):04x}"


def escape_piece(text: str) -> str:
    """Escape one piece of a JSON string value (without the surrounding quotes)."""
    if _NEEDS_ESCAPE.search(text) is None:
        return text
    return _NEEDS_ESCAPE.sub(_one, text)
