"""Accumulators: stream events in, the final non-streaming response JSON out (the official
``ChatCompletionResponse`` / ``ResponsesResponse`` / ``MessagesResponse`` ``to_json()`` shapes)."""

from __future__ import annotations

from typing import Any

from deepinfer_jax.recipe.stream.options import StreamOptions
from deepinfer_jax.recipe.stream.protocol import StreamEvent, dumps


class ChatAccumulator:
    """Builds a ``chat.completion`` object from ``chat.completion.chunk`` events."""

    def __init__(self, id: str, model: str, created: int, prompt_tokens: int = 0, cache_hit_tokens: int = 0) -> None:
        self.id, self.model, self.created = id, model, created
        self.prompt_tokens, self.cache_hit_tokens = prompt_tokens, cache_hit_tokens
        self.content: list[str] | None = None
        self.reasoning: list[str] | None = None
        self.tool_calls: list[dict[str, Any]] = []
        self.args: list[list[str]] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.fingerprint: str | None = None
        self.seen = False

    def accumulate(self, event: StreamEvent) -> None:
        data = event.data
        self.seen = True
        self.fingerprint = data.get("system_fingerprint")
        if "usage" in data and data["usage"] is not None:
            self.usage = data["usage"]
        for choice in data["choices"]:
            delta = choice["delta"]
            if delta.get("content") is not None:
                if self.content is None:
                    self.content = []
                self.content.append(delta["content"])
            if delta.get("reasoning_content") is not None:
                if self.reasoning is None:
                    self.reasoning = []
                self.reasoning.append(delta["reasoning_content"])
            for tc in delta.get("tool_calls") or ():
                fn = tc.get("function", {})
                if "id" in tc:
                    self.tool_calls.append({"index": tc["index"], "id": tc["id"], "type": "function",
                                            "function": {"name": fn.get("name", ""), "arguments": ""}})
                    self.args.append([])
                if fn.get("arguments"):
                    self.args[tc["index"]].append(fn["arguments"])
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]

    def response(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant",
                                   "content": "".join(self.content) if self.content is not None else None}
        if self.reasoning is not None:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            calls = []
            for tc, args in zip(self.tool_calls, self.args, strict=True):
                calls.append({**tc, "function": {**tc["function"], "arguments": "".join(args)}})
            message["tool_calls"] = calls
        choices = [{"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish_reason}] \
            if self.seen else []
        out = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
               "choices": choices}
        if self.usage is not None:
            out["usage"] = self.usage
        out["system_fingerprint"] = self.fingerprint
        return out

    def to_json(self) -> str:
        return dumps(self.response())


def accumulator(options: StreamOptions, prompt_tokens: int = 0, cache_hit_tokens: int = 0):
    """The accumulator of ``options.protocol`` for one response."""
    if options.protocol == "chat":
        return ChatAccumulator(options.response_id, options.model, options.created, prompt_tokens, cache_hit_tokens)
    if options.protocol == "responses":
        from deepinfer_jax.recipe.stream.responses_events import ResponsesAccumulator

        return ResponsesAccumulator(options.response_id, options.model, options.created, prompt_tokens,
                                    cache_hit_tokens)
    from deepinfer_jax.recipe.stream.messages_events import MessagesAccumulator

    return MessagesAccumulator(options.response_id, options.model, options.created, prompt_tokens, cache_hit_tokens)
