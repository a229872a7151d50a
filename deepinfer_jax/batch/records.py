"""The OpenAI batch-file format: one input line -> a ``BatchRecord`` (or a line error), results -> output lines.

Input line (as the OpenAI Batch API and vLLM's ``run_batch`` read it)::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

``url`` is one of ``URLS`` (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
``/v1/messages``); ``method`` must be ``POST``; ``custom_id`` a non-empty string; ``body`` an object.

Output line::

    {"id": "batch_req_<line>", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "<the body's id>", "body": {...}}, "error": null}

``<line>`` is the 1-based input line number (what resuming and merging key on). A request the
protocol refuses has ``response.status_code`` 400 and the protocol's error JSON as its body
(``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the field); a line that is
not a request at all (not JSON, a missing or bad field, a duplicate ``custom_id``) or a generation
that failed has ``response: null`` and ``error: {"code", "message", "param", "line"}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["URLS", "BatchRecord", "LineError", "error_line", "is_ok", "line_of", "parse_line", "response_line"]

#: Endpoint -> protocol (``chat.prepare``'s names, plus "completions" for ``completions.prepare_completion``).
URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses",
        "/v1/messages": "messages"}


class LineError(ValueError):
    """An input line that is not a valid batch request; ``param`` names the field, ``code`` the kind."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_line") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


@dataclass(frozen=True)
class BatchRecord:
    """One input line: its 1-based number, ``custom_id`` (None when the line has no valid one), and
    either the request (``protocol``, ``body``) or the ``error`` that makes it an error record."""

    line: int
    custom_id: str | None
    protocol: str | None = None
    body: dict | None = None
    error: LineError | None = None


def parse_line(text: str | bytes, line: int) -> BatchRecord:
    """Parse one input line; never raises (a bad line becomes a record carrying its ``LineError``)."""
    try:
        obj = json.loads(text)
    except ValueError as e:  # UnicodeDecodeError is one too
        return BatchRecord(line, None, error=LineError(f"line {line} is not valid JSON: {e}"))
    if not isinstance(obj, dict):
        return BatchRecord(line, None, error=LineError(f"line {line} must be a JSON object, got "
                                                       f"{type(obj).__name__}"))
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return BatchRecord(line, None, error=LineError(f"custom_id must be a non-empty string, got {cid!r}",
                                                       "custom_id"))
    try:
        protocol, body = _request(obj)
    except LineError as e:
        return BatchRecord(line, cid, error=e)
    return BatchRecord(line, cid, protocol, body)


def _request(obj: dict) -> tuple[str, dict]:
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise LineError(f"unknown field {unknown[0]!r} (a line has custom_id, method, url, body)", unknown[0])
    if obj.get("method") != "POST":
        raise LineError(f"method must be 'POST', got {obj.get('method')!r}", "method")
    url = obj.get("url")
    if url not in URLS:
        raise LineError(f"url must be one of {sorted(URLS)}, got {url!r}", "url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise LineError(f"body must be a JSON object, got {type(body).__name__}", "body")
    if body.get("stream"):
        raise LineError("body.stream must be false or absent: batch results are whole responses", "body.stream")
    return URLS[url], body


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"


def response_line(record: BatchRecord, status_code: int, body: dict) -> str:
    """The output line of a request the endpoint answered (200 with the protocol's response, or 400)."""
    rid = body.get("id") if isinstance(body.get("id"), str) else f"req_{record.line}"
    return _line({"id": f"batch_req_{record.line}", "custom_id": record.custom_id,
                  "response": {"status_code": status_code, "request_id": rid, "body": body}, "error": None})


def error_line(record: BatchRecord, code: str, message: str, param: str | None = None) -> str:
    """The output line of a record that got no response (bad line, duplicate, failed generation)."""
    return _line({"id": f"batch_req_{record.line}", "custom_id": record.custom_id, "response": None,
                  "error": {"code": code, "message": message, "param": param, "line": record.line}})


def line_of(output: dict) -> int:
    """The input line number an output record answers (from its ``id``); ValueError if it has none."""
    rid = output.get("id") if isinstance(output, dict) else None
    if not isinstance(rid, str) or not rid.startswith("batch_req_") or not rid[10:].isdigit():
        raise ValueError(f"not a batch output record (id {rid!r})")
    return int(rid[10:])


def is_ok(output_text: str) -> bool:
    """Whether an output line is a 200 response."""
    obj = json.loads(output_text)
    return (obj.get("response") or {}).get("status_code") == 200
