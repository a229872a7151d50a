"""What every protocol projection produces: stream events with their SSE framing."""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any

json_str = encode_basestring  # a JSON string literal, exactly as ``dumps`` writes one (C-accelerated)


def dumps(obj: Any) -> str:
    """Compact JSON as the official ``to_json()`` writes it (serde_json: no spaces, UTF-8 kept)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class StreamEvent:
    """One protocol stream event: ``data`` (the JSON object) and ``event`` (its SSE name or None).

    Projections may pass the serialised form too (``json``), built from templates on the hot path;
    it must equal ``dumps(data)``.
    """

    __slots__ = ("_json", "data", "event")

    def __init__(self, data: dict[str, Any], event: str | None = None, json: str | None = None) -> None:
        self.data = data
        self.event = event
        self._json = json

    def to_json(self) -> str:
        if self._json is None:
            self._json = dumps(self.data)
        return self._json

    def sse(self) -> str:
        """The event as one SSE message (``event:`` line when named, then ``data:``)."""
        head = f"event: {self.event}\n" if self.event else ""
        return f"{head}data: {self.to_json()}\n\n"

    def __repr__(self) -> str:
        return f"StreamEvent({self.event!r}, {self.to_json()})"
