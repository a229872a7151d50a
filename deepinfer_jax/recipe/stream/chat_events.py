"""Chat Completions projection: internal events to ``chat.completion.chunk`` objects (recipe.md §8.9).

The first chunk (at ready) carries the role; then one chunk per delta or tool-call event; the last
chunk has an empty content delta, the finish reason and the usage (always sent, even without
``stream_options``). In thinking mode every text delta names both ``content`` and
``reasoning_content``, one of them null. SSE: unnamed data events, then ``data: [DONE]``.
"""

from __future__ import annotations

from typing import Any

from deepinfer_jax.recipe.stream.events import (
    ContentDelta,
    Event,
    Finish,
    ReasoningDelta,
    Start,
    ToolArgsDelta,
    ToolCallStart,
    Usage,
)
from deepinfer_jax.recipe.stream.options import StreamOptions
from deepinfer_jax.recipe.stream.protocol import StreamEvent, json_str

DONE = "[DONE]"


def chat_usage(u: Usage) -> dict[str, Any]:
    """The Chat Completions usage object."""
    out: dict[str, Any] = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                           "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cache_hit_tokens}}
    if u.reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": u.reasoning_tokens}
    out["prompt_cache_hit_tokens"] = u.cache_hit_tokens
    out["prompt_cache_miss_tokens"] = u.cache_miss_tokens
    return out


class ChatProjection:
    """Turns internal events into Chat Completions chunks."""

    sse_done_data = DONE

    def __init__(self, options: StreamOptions) -> None:
        self.id = options.response_id
        self.model = options.model
        self.created = options.created
        self.thinking = options.thinking
        self.starts_in_reasoning = options.starts_in_reasoning
        self.include_usage = options.chat_include_usage
        self.fingerprint: str | None = None
        self._templates()

    def _templates(self) -> None:
        """The constant JSON around a delta, for the hot path (key order as ``_chunk`` builds it)."""
        fp = json_str(self.fingerprint) if self.fingerprint is not None else "null"
        self.head = (f'{{"id":{json_str(self.id)},"object":"chat.completion.chunk","created":{self.created},'
                     f'"model":{json_str(self.model)},"system_fingerprint":{fp},"choices":[{{"index":0,"delta":')
        self.tail = ',"logprobs":null,"finish_reason":null}]' + (',"usage":null}' if self.include_usage else "}")
        self.base = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                     "system_fingerprint": self.fingerprint}

    def _fast(self, delta: dict[str, Any], delta_json: str) -> StreamEvent:
        data = self.base.copy()
        data["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]
        if self.include_usage:
            data["usage"] = None
        return StreamEvent(data, None, self.head + delta_json + self.tail)

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> StreamEvent:
        data = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
        if self.include_usage:
            data["usage"] = None
        return StreamEvent(data)

    def project(self, ev: Event) -> list[StreamEvent]:
        thinking = self.thinking
        t = type(ev)
        if t is ContentDelta:
            text = ev.text
            if thinking:
                return [self._fast({"content": text, "reasoning_content": None},
                                   '{"content":' + json_str(text) + ',"reasoning_content":null}')]
            return [self._fast({"content": text}, '{"content":' + json_str(text) + "}")]
        if t is ReasoningDelta:
            text = ev.text
            if thinking:
                return [self._fast({"content": None, "reasoning_content": text},
                                   '{"content":null,"reasoning_content":' + json_str(text) + "}")]
            return [self._fast({"reasoning_content": text}, '{"reasoning_content":' + json_str(text) + "}")]
        if t is ToolArgsDelta:
            return [self._fast({"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]},
                               f'{{"tool_calls":[{{"index":{ev.index},"function":{{"arguments":'
                               f'{json_str(ev.text)}}}}}]}}')]
        if t is ToolCallStart:
            return [self._chunk({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                                 "function": {"name": ev.name, "arguments": ""}}]})]
        if t is Start:
            self.fingerprint = ev.system_fingerprint
            self._templates()
            if not thinking:
                delta = {"role": "assistant", "content": ""}
            elif self.starts_in_reasoning:
                delta = {"role": "assistant", "content": None, "reasoning_content": ""}
            else:
                delta = {"role": "assistant", "content": "", "reasoning_content": None}
            return [self._chunk(delta)]
        if t is Finish:
            delta = {"content": "", "reasoning_content": None} if thinking else {"content": ""}
            chunk = self._chunk(delta, ev.reason)
            chunk.data["usage"] = chat_usage(ev.usage)
            return [chunk]
        raise TypeError(f"not a stream event: {ev!r}")
