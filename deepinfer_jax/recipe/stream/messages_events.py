"""Messages projection: internal events to Anthropic-style Messages stream events (recipe.md §8.9).

``message_start``, then content blocks: ``thinking`` (``thinking_delta``s, closed by a
``signature_delta`` carrying the signature, by default the response id), ``text`` (``text_delta``s)
and ``tool_use`` (``input_json_delta``s); a ``ping`` follows the first block start. The end is
``message_delta`` (stop reason ``end_turn`` / ``max_tokens`` / ``tool_use`` / ``stop_sequence`` /
``refusal``, and usage) and ``message_stop``. Usage reports ``input_tokens`` as prompt minus cache
hits and the hits as ``cache_read_input_tokens``. SSE event names are the event types.
"""

from __future__ import annotations

import json
from typing import Any

from deepinfer_jax.recipe.stream.events import (
    ContentDelta,
    Event,
    Finish,
    ReasoningDelta,
    Start,
    ToolArgsDelta,
    ToolCallStart,
)
from deepinfer_jax.recipe.stream.options import StreamOptions
from deepinfer_jax.recipe.stream.protocol import StreamEvent, dumps, json_str

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}


def messages_usage(prompt_tokens: int, cache_hit_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"input_tokens": max(prompt_tokens - cache_hit_tokens, 0), "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cache_hit_tokens, "output_tokens": output_tokens, "service_tier": "standard"}


class MessagesProjection:
    """Turns internal events into Messages stream events."""

    sse_done_data = None

    def __init__(self, options: StreamOptions) -> None:
        self.id = options.response_id
        self.model = options.model
        self.signature = options.messages_signature if options.messages_signature is not None else options.response_id
        self.thinking = options.thinking
        self.index = -1
        self.block: str | None = None
        self.pinged = False
        self.usage = messages_usage(0, 0, 0)

    @staticmethod
    def _ev(data: dict[str, Any]) -> StreamEvent:
        return StreamEvent(data, data["type"])

    def _delta(self, kind: str, field: str, text: str) -> StreamEvent:
        """A ``content_block_delta`` of the open block, serialised from a template."""
        return StreamEvent({"type": "content_block_delta", "index": self.index, "delta": {"type": kind, field: text}},
                           "content_block_delta",
                           f'{{"type":"content_block_delta","index":{self.index},"delta":{{"type":"{kind}",'
                           f'"{field}":{json_str(text)}}}}}')

    def _close(self, out: list[StreamEvent]) -> None:
        if self.block is None:
            return
        if self.block == "thinking":
            out.append(self._ev({"type": "content_block_delta", "index": self.index,
                                 "delta": {"type": "signature_delta", "signature": self.signature}}))
        out.append(self._ev({"type": "content_block_stop", "index": self.index}))
        self.block = None

    def _open(self, out: list[StreamEvent], block: dict[str, Any]) -> None:
        self._close(out)
        self.index += 1
        self.block = block["type"]
        out.append(self._ev({"type": "content_block_start", "index": self.index, "content_block": block}))
        if not self.pinged:
            self.pinged = True
            out.append(self._ev({"type": "ping"}))

    def project(self, ev: Event) -> list[StreamEvent]:
        t = type(ev)
        if t is ContentDelta and self.block == "text":
            return [self._delta("text_delta", "text", ev.text)]
        if t is ReasoningDelta and self.block == "thinking":
            return [self._delta("thinking_delta", "thinking", ev.text)]
        if t is ToolArgsDelta:
            return [self._delta("input_json_delta", "partial_json", ev.text)]
        out: list[StreamEvent] = []
        if type(ev) is ContentDelta:
            if self.block != "text":
                self._open(out, {"type": "text", "text": ""})
            out.append(self._delta("text_delta", "text", ev.text))
        elif type(ev) is ReasoningDelta:
            if self.block != "thinking":
                self._open(out, {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta("thinking_delta", "thinking", ev.text))
        elif type(ev) is ToolArgsDelta:
            out.append(self._delta("input_json_delta", "partial_json", ev.text))
        elif type(ev) is ToolCallStart:
            self._open(out, {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
        elif type(ev) is Start:
            self.usage = messages_usage(ev.prompt_tokens, ev.cache_hit_tokens, 0)
            out.append(self._ev({"type": "message_start", "message": {
                "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": self.usage}}))
            if self.thinking:  # a thinking-mode message always opens with a thinking block
                self._open(out, {"type": "thinking", "thinking": "", "signature": ""})
        elif type(ev) is Finish:
            self._close(out)
            reason = "stop_sequence" if ev.stop_sequence is not None else STOP_REASONS[ev.reason]
            u = ev.usage
            out.append(self._ev({"type": "message_delta",
                                 "delta": {"stop_reason": reason, "stop_sequence": ev.stop_sequence},
                                 "usage": messages_usage(u.prompt_tokens, u.cache_hit_tokens, u.completion_tokens)}))
            out.append(self._ev({"type": "message_stop"}))
        else:
            raise TypeError(f"not a stream event: {ev!r}")
        return out


class MessagesAccumulator:
    """Builds the final ``message`` object from Messages stream events."""

    def __init__(self, id: str, model: str, created: int = 0, prompt_tokens: int = 0, cache_hit_tokens: int = 0) -> None:
        self.message: dict[str, Any] = {"id": id, "type": "message", "role": "assistant", "model": model,
                                        "content": [], "stop_reason": None, "stop_sequence": None,
                                        "usage": messages_usage(prompt_tokens, cache_hit_tokens, 0)}
        self.json_parts: dict[int, list[str]] = {}

    def accumulate(self, event: StreamEvent) -> None:
        data = event.data
        kind = data["type"]
        content = self.message["content"]
        if kind == "content_block_start":
            content.append(dict(data["content_block"]))
            if data["content_block"]["type"] == "tool_use":
                self.json_parts[len(content) - 1] = []
        elif kind == "content_block_delta":
            block = content[data["index"]]
            delta = data["delta"]
            t = delta["type"]
            if t == "text_delta":
                block["text"] += delta["text"]
            elif t == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif t == "signature_delta":
                block["signature"] += delta["signature"]
            elif t == "input_json_delta":
                self.json_parts[data["index"]].append(delta["partial_json"])
        elif kind == "content_block_stop":
            parts = self.json_parts.get(data["index"])
            if parts is not None:
                content[data["index"]]["input"] = _parse_input("".join(parts))
        elif kind == "message_delta":
            self.message["stop_reason"] = data["delta"]["stop_reason"]
            self.message["stop_sequence"] = data["delta"]["stop_sequence"]
            self.message["usage"] = data["usage"]
        elif kind == "message_start":
            self.message["usage"] = data["message"]["usage"]

    def response(self) -> dict[str, Any]:
        return self.message

    def to_json(self) -> str:
        return dumps(self.message)


def _parse_input(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return {}
