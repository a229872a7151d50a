"""Helpers for the differential tests against the official ``deepseek-recipe==0.2.0`` wheel.

Translate the wheel's objects into plain dicts (and our objects into the same dicts) so that every
field can be compared with one ``==``; build wheel conversations from ours. Random ids and timestamps
do not occur in part A (conversion, rendering, encoding), so nothing needs masking here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

dr = pytest.importorskip("deepseek_recipe", reason="official deepseek-recipe wheel not importable (x86_64 Linux only)")

from deepinfer_jax import recipe as ours
from deepinfer_jax.recipe import conversation as oc

PROTOCOL_CLASSES = {"chat": dr.ChatCompletionRequest, "responses": dr.ResponsesRequest, "messages": dr.MessagesRequest}


def image_dict(s: Any) -> dict:
    return {"kind": s.kind, "detail": s.detail, "data_url": s.data_url, "url": s.url, "data": s.data, "path": s.path}


def message_dict(m: Any) -> dict:
    """Every observable field of a message (wheel or ours)."""
    calls = m.tool_calls
    d = {
        "role": m.role,
        "content": m.content,
        "reasoning_content": m.reasoning_content,
        "tool_calls": None if calls is None else [(c.id, c.name, c.arguments) for c in calls],
        "tool_call_id": m.tool_call_id,
        "prefix": m.prefix,
        "image_sources": [image_dict(s) for s in m.image_sources],
    }
    if m.role == "system":
        tools = getattr(m, "tools", None)
        d["tools"] = None if not tools else [tool_dict(t) for t in tools]
    return d


def tool_dict(t: Any) -> dict:
    return {"name": t.name, "description": t.description, "parameters": json.dumps(t.parameters),
            "strict": t.strict, "defer_loading": t.defer_loading}


def conversation_dict(c: Any) -> dict:
    return {
        "messages": [message_dict(m) for m in c.messages],
        "thinking_mode": c.thinking_mode,
        "tools": [tool_dict(t) for t in c.tools],
        "tool_choice": c.tool_choice,
        "reasoning_effort": c.reasoning_effort,
        "response_format": c.response_format,
        "response_schema": json.dumps(c.response_schema),
        "response_regex": c.response_regex,
    }


def _enum_name(v: Any) -> Any:
    """Wheel enums print as ``Class.Name``; ours are Python enums with the wheel's member name as value."""
    if v is None:
        return None
    if hasattr(v, "value") and isinstance(v.value, str):
        return v.value
    return str(v).split(".")[-1]


def request_dict(r: Any) -> dict:
    """Conversation, inference options, parsing options, model version and stream flag."""
    io, po = r.inference_options, r.parsing_options
    oc_ = io.output_constraint
    return {
        "conversation": conversation_dict(r.conversation),
        "inference": {
            "max_tokens": io.max_tokens, "temperature": io.temperature, "top_p": io.top_p,
            "logprobs": io.logprobs, "top_logprobs": io.top_logprobs, "seed": io.seed,
            "output_constraint": None if oc_ is None else (oc_.kind, oc_.schema),
        },
        "parsing": {
            "parse_tool_calls": po.parse_tool_calls, "starts_in_tool_calls": po.starts_in_tool_calls,
            "parse_json_output": po.parse_json_output,
            "thinking_initial_stage": _enum_name(po.thinking_initial_stage),
            "stop_sequences": list(po.stop_sequences),
        },
        "model_version": _enum_name(r.model_version),
        "stream": r.stream,
    }


def official_convert(body: Any, protocol: str, options: Any = None) -> dict:
    """The wheel's conversion of ``body`` as a comparable dict, or the error it raises."""
    try:
        req = PROTOCOL_CLASSES[protocol](body)
    except ValueError as e:
        return {"error": "ValueError", "message": str(e)}
    try:
        return request_dict(req.convert(options or dr.ConversionOptions()))
    except dr.ConversionError as e:
        return {"error": "ConversionError", "status": e.status_code, "body": json.loads(e.body)}


def our_convert(body: Any, protocol: str, options: Any = None) -> dict:
    try:
        r = ours.convert_request(body, protocol, options)
    except ours.RequestBodyError as e:
        return {"error": "ValueError", "message": str(e)}
    except ours.ConversionError as e:
        return {"error": "ConversionError", "status": e.status_code, "body": json.loads(e.body)}
    return request_dict(r)


# ------------------------------------------------------------------ ours -> wheel conversations

def _wheel_image(s: oc.ImageSource) -> Any:
    if s.kind == "url":
        return dr.UrlImageSource(s.url, s.detail, path=s.path)
    if s.kind == "data_url":
        return dr.DataUrlImageSource(s.data_url, s.detail, path=s.path)
    return dr.BytesImageSource(s.data, s.detail, path=s.path)


def _wheel_tool(t: oc.ToolDefinition) -> Any:
    return dr.ToolDefinition(t.name, t.description, t.parameters, t.strict, t.defer_loading)


def wheel_message(m: oc.Message) -> Any:
    imgs = [_wheel_image(s) for s in m.image_sources]
    if m.role == "system":
        return dr.SystemMessage(m.content, imgs, [_wheel_tool(t) for t in m.tools] if m.tools else None)
    if m.role == "user":
        return dr.UserMessage(m.content, imgs)
    if m.role == "tool":
        return dr.ToolMessage(m.content, m.tool_call_id, imgs)
    if m.role == "latest_reminder":
        return dr.LatestReminderMessage(m.content)
    calls = None if m.tool_calls is None else [dr.ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls]
    return dr.AssistantMessage(m.content, m.reasoning_content, calls, m.prefix)


def wheel_conversation(c: oc.Conversation) -> Any:
    kw: dict[str, Any] = {}
    if c.response_format == "json_schema":
        kw["response_schema"] = c.response_schema
    elif c.response_format == "regex":
        kw["response_regex"] = c.response_regex
    else:
        kw["response_format"] = c.response_format
    return dr.Conversation([wheel_message(m) for m in c.messages], thinking_mode=c.thinking_mode,
                           tools=[_wheel_tool(t) for t in c.tools], tool_choice=c.tool_choice,
                           reasoning_effort=c.reasoning_effort, **kw)


def wheel_encoding(version: str) -> Any:
    return dr.DeepseekV41Encoding() if version in ("v4.1", "DeepseekV41Flash") else dr.DeepseekV4Encoding()


def rendered_dict(r: Any) -> dict:
    return {"prompt": r.prompt, "special_ranges": [tuple(x) for x in r.special_ranges],
            "image_sources": [image_dict(s) for s in r.image_sources]}


def official_render(conv: oc.Conversation, version: str) -> dict:
    return rendered_dict(wheel_encoding(version).render_conversation(wheel_conversation(conv)))


def our_render(conv: oc.Conversation, version: str) -> dict:
    return rendered_dict(ours.render(conv, version))


# ------------------------------------------------------------------ options on both sides

def options_pair(**kw: Any) -> tuple[Any, Any]:
    """(wheel ConversionOptions, our ConversionOptions) with the same settings.

    Keywords: default_thinking_mode, reasoning_reject, responses_web_search_reject,
    messages_web_search_drop, thinking_bound, non_thinking_bound, alias=(name, "v4"|"v4.1").
    """
    w = dr.ConversionOptions(default_thinking_mode=kw.get("default_thinking_mode", True))
    o: dict[str, Any] = {"default_thinking_mode": kw.get("default_thinking_mode", True)}
    if kw.get("reasoning_reject"):
        w = w.with_reasoning_content_behavior(dr.ReasoningContentBehavior.Reject)
        o["reasoning_content_behavior"] = ours.ReasoningContentBehavior.REJECT
    if kw.get("responses_web_search_reject"):
        w = w.with_responses_web_search(dr.WebSearchBehavior.Reject)
        o["responses_web_search"] = ours.WebSearchBehavior.REJECT
    if kw.get("messages_web_search_drop"):
        w = w.with_messages_web_search(dr.WebSearchBehavior.Drop)
        o["messages_web_search"] = ours.WebSearchBehavior.DROP
    if "thinking_bound" in kw:
        w = w.with_thinking_max_tokens_upper_bound(kw["thinking_bound"])
        o["thinking_max_tokens_upper_bound"] = kw["thinking_bound"]
    if "non_thinking_bound" in kw:
        w = w.with_non_thinking_max_tokens_upper_bound(kw["non_thinking_bound"])
        o["non_thinking_max_tokens_upper_bound"] = kw["non_thinking_bound"]
    ours_opts = ours.ConversionOptions(**o)
    if "alias" in kw:
        name, version = kw["alias"]
        mv = dr.ModelVersion.DeepseekV41Flash if version == "v4.1" else dr.ModelVersion.DeepseekV4Pro
        w = w.with_model_alias(name, mv)
        ours_opts = ours_opts.with_model_alias(name, version)
    return w, ours_opts


def compare_convert(body: Any, protocol: str, **opts: Any) -> tuple[dict, dict]:
    """(official, ours) conversion results for ``body``."""
    w, o = options_pair(**opts)
    import copy

    return official_convert(copy.deepcopy(body), protocol, w), our_convert(copy.deepcopy(body), protocol, o)


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Human-readable differences between two nested values."""
    if type(a) is not type(b) and not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))):
        return [f"{path}: {a!r} != {b!r}"]
    if isinstance(a, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}.{k}: {a.get(k, '<absent>')!r} != {b.get(k, '<absent>')!r}")
            else:
                out += diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}: {a!r} != {b!r}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]
