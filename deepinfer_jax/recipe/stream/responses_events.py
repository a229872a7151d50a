"""Responses projection: internal events to ``response.*`` stream events (recipe.md §8.9).

Output items open and close as the output moves between kinds: a ``reasoning`` item
(``rs_<id>_<n>``, ``encrypted_content`` ``<id>-<n>``), a ``message`` item (``msg_<id>_<n>``, phase
``final_answer``, ``commentary`` at done when a tool call follows) and one ``function_call`` item per
tool call (``fc_<id>_<n>``; a namespaced name is split through the namespace map). ``<n>`` is the
output index. The stream opens with ``response.created`` and ``response.in_progress`` and ends
with ``response.completed`` or ``response.incomplete`` (``max_output_tokens`` / ``content_filter``;
the item open at that moment is ``incomplete``). Every event carries a ``sequence_number``; the SSE
event name is the event type and there is no done message.

The response object repeats the request settings (the *echo*, :func:`responses_echo`); the other
fields are the official library's constants.
"""

from __future__ import annotations

import copy
import time
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
from deepinfer_jax.recipe.stream.protocol import StreamEvent, dumps, json_str

DEFAULT_ECHO: dict[str, Any] = {
    "instructions": None, "max_output_tokens": None, "reasoning": {"effort": None, "summary": None},
    "temperature": 1.0, "text": {"format": {"type": "text"}, "verbosity": None}, "tool_choice": "auto",
    "tools": [], "top_logprobs": 0, "top_p": 1.0, "user": None,
}


def response_object(id: str, model: str, created: int, echo: dict[str, Any] | None) -> dict[str, Any]:
    """A ``response`` object in progress, with no output yet."""
    e = {**DEFAULT_ECHO, **(echo or {})}
    return {
        "id": id, "object": "response", "created_at": created, "status": "in_progress", "background": False,
        "completed_at": None, "content_filters": None, "error": None, "frequency_penalty": 0.0,
        "incomplete_details": None, "instructions": e["instructions"], "max_output_tokens": e["max_output_tokens"],
        "max_tool_calls": None, "model": model, "moderation": None, "output": [], "parallel_tool_calls": True,
        "presence_penalty": 0.0, "previous_response_id": None, "prompt_cache_key": None,
        "prompt_cache_retention": None, "reasoning": e["reasoning"], "safety_identifier": None,
        "service_tier": "default", "store": False, "temperature": e["temperature"], "text": e["text"],
        "tool_choice": e["tool_choice"], "tools": e["tools"], "top_logprobs": e["top_logprobs"], "top_p": e["top_p"],
        "truncation": "disabled", "usage": None, "user": e["user"], "metadata": {},
    }


def responses_usage(u: Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cache_hit_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens or 0},
            "total_tokens": u.total_tokens}


_TEXT_PART = {"reasoning": "reasoning_text", "message": "output_text"}


class ResponsesProjection:
    """Turns internal events into Responses stream events."""

    sse_done_data = None

    def __init__(self, options: StreamOptions) -> None:
        self.id = options.response_id
        self.model = options.model
        self.created = options.created
        self.echo = options.responses_echo
        self.namespaces = options.namespace_tool_map or {}
        self.seq = 0
        self.response: dict[str, Any] | None = None
        self.item: dict[str, Any] | None = None  # the open output item
        self.parts: list[str] = []  # text or arguments of the open item

    def _ev(self, data: dict[str, Any]) -> StreamEvent:
        data["sequence_number"] = self.seq
        self.seq += 1
        return StreamEvent(data, data["type"])

    def _open(self, out: list[StreamEvent], item: dict[str, Any]) -> None:
        index = len(self.response["output"])
        kind = item["type"]
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item_id = f"{prefix}_{self.id}_{index}"
        if kind == "reasoning":
            item = {"type": "reasoning", "id": item_id, "status": "in_progress", "content": [], "summary": [],
                    "encrypted_content": f"{self.id}-{index}"}
        elif kind == "message":
            item = {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant",
                    "phase": "final_answer", "content": []}
        else:
            item = {"type": "function_call", "id": item_id, "status": "in_progress", **item, "arguments": ""}
        self.item = item
        self.parts = []
        out.append(self._ev({"type": "response.output_item.added", "item": copy.deepcopy(item), "output_index": index}))
        if kind in _TEXT_PART:
            part = {"type": _TEXT_PART[kind], "text": ""} if kind == "reasoning" else \
                {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
            out.append(self._ev({"type": "response.content_part.added", "content_index": 0, "item_id": item_id,
                                 "output_index": index, "part": part}))

    def _close(self, out: list[StreamEvent], status: str = "completed", followed_by_call: bool = False) -> None:
        item = self.item
        if item is None:
            return
        index = len(self.response["output"])
        item_id = item["id"]
        text = "".join(self.parts)
        kind = item["type"]
        if kind == "reasoning":
            out.append(self._ev({"type": "response.reasoning_text.done", "content_index": 0, "item_id": item_id,
                                 "output_index": index, "text": text}))
            part = {"type": "reasoning_text", "text": text}
        elif kind == "message":
            out.append(self._ev({"type": "response.output_text.done", "content_index": 0, "item_id": item_id,
                                 "logprobs": [], "output_index": index, "text": text}))
            part = {"type": "output_text", "annotations": [], "logprobs": [], "text": text}
            if followed_by_call:
                item["phase"] = "commentary"
        else:
            out.append(self._ev({"type": "response.function_call_arguments.done", "arguments": text,
                                 "item_id": item_id, "output_index": index}))
            item["arguments"] = text
        if kind in _TEXT_PART:
            out.append(self._ev({"type": "response.content_part.done", "content_index": 0, "item_id": item_id,
                                 "output_index": index, "part": part}))
            item["content"] = [dict(part)]
        item["status"] = status
        out.append(self._ev({"type": "response.output_item.done", "item": copy.deepcopy(item), "output_index": index}))
        self.response["output"].append(item)
        self.item = None

    def _text(self, kind: str, text: str) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        item = self.item
        if item is None or item["type"] != kind:
            self._close(out)
            self._open(out, {"type": kind})
            item = self.item
        self.parts.append(text)
        index = len(self.response["output"])
        seq = self.seq
        self.seq += 1
        item_id = item["id"]
        if kind == "reasoning":
            name = "response.reasoning_text.delta"
            data = {"type": name, "content_index": 0, "delta": text, "item_id": item_id, "output_index": index,
                    "sequence_number": seq}
            js = (f'{{"type":"{name}","content_index":0,"delta":{json_str(text)},"item_id":{json_str(item_id)},'
                  f'"output_index":{index},"sequence_number":{seq}}}')
        else:
            name = "response.output_text.delta"
            data = {"type": name, "content_index": 0, "delta": text, "item_id": item_id, "logprobs": [],
                    "output_index": index, "sequence_number": seq}
            js = (f'{{"type":"{name}","content_index":0,"delta":{json_str(text)},"item_id":{json_str(item_id)},'
                  f'"logprobs":[],"output_index":{index},"sequence_number":{seq}}}')
        out.append(StreamEvent(data, name, js))
        return out

    def project(self, ev: Event) -> list[StreamEvent]:
        if type(ev) is ContentDelta:
            return self._text("message", ev.text)
        if type(ev) is ReasoningDelta:
            return self._text("reasoning", ev.text)
        if type(ev) is ToolArgsDelta:
            text = ev.text
            self.parts.append(text)
            seq, index, item_id = self.seq, len(self.response["output"]), self.item["id"]
            self.seq += 1
            name = "response.function_call_arguments.delta"
            return [StreamEvent({"type": name, "delta": text, "item_id": item_id, "output_index": index,
                                 "sequence_number": seq}, name,
                                f'{{"type":"{name}","delta":{json_str(text)},"item_id":{json_str(item_id)},'
                                f'"output_index":{index},"sequence_number":{seq}}}')]
        if type(ev) is ToolCallStart:
            out: list[StreamEvent] = []
            self._close(out, followed_by_call=True)
            split = self.namespaces.get(ev.name)
            named = {"call_id": ev.id, "name": split[1], "namespace": split[0]} if split else \
                {"call_id": ev.id, "name": ev.name}
            self._open(out, {"type": "function_call", **named})
            return out
        if type(ev) is Start:
            self.response = response_object(self.id, self.model, self.created, self.echo)
            return [self._ev({"type": "response.created", "response": copy.deepcopy(self.response)}),
                    self._ev({"type": "response.in_progress", "response": copy.deepcopy(self.response)})]
        if type(ev) is Finish:
            out = []
            incomplete = {"length": "max_output_tokens", "content_filter": "content_filter"}.get(ev.reason)
            self._close(out, "incomplete" if incomplete else "completed")
            r = self.response
            r["completed_at"] = max(self.created, int(time.time()))
            r["usage"] = responses_usage(ev.usage)
            if incomplete:
                r["status"] = "incomplete"
                r["incomplete_details"] = {"reason": incomplete}
                out.append(self._ev({"type": "response.incomplete", "response": copy.deepcopy(r)}))
            else:
                r["status"] = "completed"
                out.append(self._ev({"type": "response.completed", "response": copy.deepcopy(r)}))
            return out
        raise TypeError(f"not a stream event: {ev!r}")


class ResponsesAccumulator:
    """The final ``response`` object: the one the terminal event carries."""

    def __init__(self, id: str, model: str, created: int, prompt_tokens: int = 0, cache_hit_tokens: int = 0) -> None:
        self.result = response_object(id, model, created, None)
        self.result["usage"] = None

    def accumulate(self, event: StreamEvent) -> None:
        if event.data["type"] in ("response.completed", "response.incomplete", "response.failed",
                                  "response.created"):
            self.result = event.data["response"]

    def response(self) -> dict[str, Any]:
        return self.result

    def to_json(self) -> str:
        return dumps(self.result)
