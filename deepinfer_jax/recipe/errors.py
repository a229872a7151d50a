"""Errors of the request layer (recipe.md §9).

- :class:`ConversionError`: a request that parses but breaks a rule of recipe.md §2 (HTTP 400).
  ``body`` is the OpenAI-style error JSON the official library returns, byte for byte:
  ``{"error":{"message":...,"type":"invalid_request_error","param":null,"code":"invalid_request_error"}}``.
- :class:`RequestBodyError`: the body is not JSON or does not match a protocol's schema (missing
  field, unknown enum value, wrong type). The official wheel raises ``ValueError("invalid request
  body: ...")`` at request construction; ours is both a ``ValueError`` and a 400 ``ConversionError``
  so a server can answer every bad request the same way.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["ConversionError", "RequestBodyError"]


class ConversionError(Exception):
    """A protocol request that is invalid or cannot be converted.

    Attributes:
        message: the human-readable reason (the official wording where the wheel has one).
        status_code: the HTTP status, 400.
        error_type, param, code: the fields of the error body.
    """

    def __init__(self, message: str, *, status_code: int = 400, param: str | None = None,
                 error_type: str = "invalid_request_error", code: str | None = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.error_type = error_type
        self.code = code

    def error_json(self) -> dict[str, Any]:
        """The error body as a dict."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    @property
    def body(self) -> str:
        """The error body as compact JSON text (non-ASCII kept raw)."""
        return json.dumps(self.error_json(), ensure_ascii=False, separators=(",", ":"))


class RequestBodyError(ConversionError, ValueError):
    """The body is not valid JSON or does not match the protocol's request schema."""

    def __init__(self, detail: str, prefix: str = "invalid request body") -> None:
        super().__init__(f"{prefix}: {detail}")
        self.detail = detail
