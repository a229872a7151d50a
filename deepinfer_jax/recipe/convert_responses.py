"""Responses request -> :class:`ConversationRequest` (recipe.md §2.1, §2.3).

Input items become messages:

- ``instructions`` (non-empty) is a leading system message; a string ``input`` is one user message;
- message items (roles user, assistant, system, developer -> system) with ``input_text`` /
  ``output_text`` / ``input_image`` / ``input_file`` parts (files become ``[Unsupported Document]``);
- an assistant *turn* collects, in order, ``reasoning`` items (their ``reasoning_text`` parts joined
  with ``\\n``), assistant message texts (joined with ``\\n\\n``) and ``function_call`` /
  ``custom_tool_call`` items; its ``*_call_output`` items become tool messages in call order. A user or
  system message, a reasoning item after content, or a call after outputs starts a new turn;
- unknown item types are ignored.

Tools: ``function``; ``namespace`` (flattened to ``ns::name``, description ``"<ns>\\n<fn>"``);
``custom`` ``apply_patch`` (a built-in function tool); ``web_search`` variants dropped or rejected per
options; other hosted tools dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any

from deepinfer_jax.recipe import convert_common as cc
from deepinfer_jax.recipe.body import MISSING, expect, field, parse_body, typed, variant
from deepinfer_jax.recipe.builtin_tools import APPLY_PATCH_NAME, apply_patch_description, apply_patch_parameters
from deepinfer_jax.recipe.conversation import (
    AssistantMessage,
    Conversation,
    Message,
    SystemMessage,
    ToolCall,
    ToolMessage,
    UserMessage,
)
from deepinfer_jax.recipe.errors import ConversionError, RequestBodyError
from deepinfer_jax.recipe.options import ConversationRequest, ConversionOptions, WebSearchBehavior
from deepinfer_jax.recipe.pyjson import dumps_compact
from deepinfer_jax.recipe.special_tokens import SpecialToken

__all__ = ["convert_responses", "namespace_tool_map"]

_ROLES = ("user", "assistant", "system", "developer")
_PARTS = ("input_text", "output_text", "input_image", "input_file")
_WEB_SEARCH = ("web_search", "web_search_2025_08_26")
_HOSTED_DROPPED = ("web_search_preview", "web_search_preview_2025_03_11", "file_search", "code_interpreter", "mcp",
                   "image_generation", "computer_use_preview", "local_shell", "shell")
UNSUPPORTED_DOCUMENT = "[Unsupported Document]"


# --------------------------------------------------------------------------------------- parse


def _parse_parts(value: Any, what: str) -> Any:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise RequestBodyError(what)
    parts = []
    for p in value:
        typed(p, "internally tagged enum InputContent")
        kind = variant(p["type"], _PARTS)
        if kind in ("input_text", "output_text"):
            parts.append(("text", field(p, "text", "str", required=True)))
        elif kind == "input_image":
            url = field(p, "image_url", "str")
            file_id = field(p, "file_id", "str")
            detail = p.get("detail")
            detail = "high" if detail is None else variant(detail, ("low", "high", "original", "auto"))
            parts.append(("image", None if url is MISSING else url, file_id is not MISSING, detail))
        else:
            parts.append(("file",))
    return parts


def _parse_item(item: Any, sep: str) -> dict[str, Any] | None:
    expect(item, "map", "an input item")
    kind = item.get("type")
    if kind is None or kind == "message":
        if kind is None and "role" not in item:
            raise RequestBodyError("invalid input item")
        if "role" not in item:
            raise RequestBodyError("missing field `role`")
        role = variant(item["role"], _ROLES)
        if "content" not in item:
            raise RequestBodyError("missing field `content`")
        return {"kind": "message", "role": role,
                "content": _parse_parts(item["content"], "content should be a string or a list of content blocks")}
    if kind == "reasoning":
        texts = []
        for c in field(item, "content", "list") if item.get("content") is not None else []:
            expect(c, "map")
            texts.append(field(c, "text", "str", required=True))
        return {"kind": "reasoning", "texts": texts}
    if kind in ("function_call", "custom_tool_call"):
        cid = field(item, "call_id", "str", required=True)
        name = field(item, "name", "str", required=True)
        if kind == "function_call":
            args = field(item, "arguments", "str", required=True)
            ns = field(item, "namespace", "str")
            if ns is not MISSING:
                name = f"{ns}{sep}{name}"
        else:
            args = dumps_compact({"input": field(item, "input", "str", required=True)})
        return {"kind": "call", "call_id": cid, "name": name, "arguments": args}
    if kind in ("function_call_output", "custom_tool_call_output"):
        cid = field(item, "call_id", "str", required=True)
        if "output" not in item:
            raise RequestBodyError("missing field `output`")
        return {"kind": "output", "call_id": cid,
                "output": _parse_parts(item["output"], "output should be a string or a list of output content parts")}
    return None  # other item types are ignored


def _parse_tool(tool: Any) -> dict[str, Any]:
    typed(tool, "internally tagged enum Tool")
    kind = tool["type"]
    if kind == "function":
        desc = field(tool, "description", "str")
        strict = field(tool, "strict", "bool")
        defer = field(tool, "defer_loading", "bool")
        return {"kind": "function", "name": field(tool, "name", "str", required=True),
                "description": None if desc is MISSING else desc, "parameters": tool.get("parameters"),
                "strict": None if strict is MISSING else strict, "defer_loading": defer is True}
    if kind == "namespace":
        desc = field(tool, "description", "str")
        return {"kind": "namespace", "name": field(tool, "name", "str", required=True),
                "description": None if desc is MISSING else desc,
                "tools": [_parse_tool(t) for t in field(tool, "tools", "list", required=True)]}
    if kind == "custom":
        return {"kind": "custom", "name": field(tool, "name", "str", required=True)}
    if kind in _WEB_SEARCH:
        return {"kind": "web_search"}
    return {"kind": "dropped"}


def _parse_tool_choice(value: Any) -> Any:
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise RequestBodyError("expected one of `none`, `auto`, `required` or a tool choice object")
        return value
    typed(value, "a tool choice")
    kind = variant(value["type"], ("function", "web_search", "web_search_2025_08_26", "custom"))
    if kind in ("function", "custom"):
        return ("named", field(value, "name", "str", required=True))
    return ("web_search",)


def _parse_format(text: Any) -> cc.ResponseFormatSpec:
    expect(text, "map", "struct TextConfig")
    fmt = text.get("format")
    if fmt is None:
        return cc.ResponseFormatSpec()
    typed(fmt, "internally tagged enum TextFormat")
    kind = variant(fmt["type"], ("text", "json_schema", "json_object"))
    if kind == "json_schema":
        field(fmt, "name", "str", required=True)
        if "schema" not in fmt:
            raise RequestBodyError("missing field `schema`")
        strict = field(fmt, "strict", "bool")
        return cc.ResponseFormatSpec("json_schema", schema=fmt["schema"], strict=strict is True)
    return cc.ResponseFormatSpec(kind)


def _parse(body: Any, options: ConversionOptions) -> dict[str, Any]:
    body = parse_body(body)
    expect(body, "map", "struct ResponsesRequest")
    req: dict[str, Any] = {"model": field(body, "model", "str", required=True)}
    version = options.model_versions_by_name.get(req["model"])
    sep = "__" if version is not None and not version.is_v41 else "::"
    req["sep"] = sep
    inp = body.get("input")
    if inp is None:
        req["input"] = None
    elif isinstance(inp, str):
        req["input"] = inp
    else:
        if not isinstance(inp, list):
            raise RequestBodyError("input should be a string or a list of input items")
        items = []
        for index, raw in enumerate(inp):
            item = _parse_item(raw, sep)
            if item is not None:
                items.append(dict(item, index=index))
        req["input"] = items
        req["input_len"] = len(inp)
    for key, kind in (("instructions", "str"), ("temperature", "f32"), ("top_p", "f32"),
                      ("max_output_tokens", "u32"), ("stream", "bool"), ("top_logprobs", "u8"), ("user", "str")):
        req[key] = field(body, key, kind)
    reasoning = field(body, "reasoning", "map", expected="struct Reasoning")
    req["effort"] = None
    if reasoning is not MISSING and reasoning.get("effort") is not None:
        req["effort"] = variant(reasoning["effort"], cc.EFFORT_VALUES)
    tools = field(body, "tools", "list")
    req["tools"] = [] if tools is MISSING else [_parse_tool(t) for t in tools]
    choice = body.get("tool_choice")
    req["tool_choice"] = "auto" if choice is None else _parse_tool_choice(choice)
    text = body.get("text")
    req["format"] = cc.ResponseFormatSpec() if text is None else _parse_format(text)
    req["format_given"] = req["format"].kind != "text"
    return req


# ------------------------------------------------------------------------------------- convert


def _content(parts: Any, path: str, token: str, v41: bool, *, assistant: bool) -> tuple[str, tuple[int, ...], list]:
    if isinstance(parts, str):
        return parts, (), []
    b = cc.ContentBuilder(token)
    for part in parts:
        if part[0] == "text":
            b.text(part[1])
        elif part[0] == "file":
            b.text(UNSUPPORTED_DOCUMENT)
        elif not v41:
            b.image(None)
        else:
            if assistant:
                raise ConversionError(f"{path}: Image in assistant message is unsupported")
            if part[2]:
                raise ConversionError(f"{path}.content[{parts.index(part)}]: file_id is not supported. Pass the image "
                                      "as a base64 data url instead.")
            b.image(cc.image_source_from_url(part[1] or "", part[3], path))
    return b.content, tuple(b.offsets), b.images


@dataclass
class _Turn:
    """An assistant turn being assembled: reasoning, content texts, calls and their outputs."""

    reasoning: list[str] = dc_field(default_factory=list)
    texts: list[str] = dc_field(default_factory=list)
    calls: list[tuple[str, str, str]] = dc_field(default_factory=list)
    outputs: dict[str, Message] = dc_field(default_factory=dict)
    has_reasoning: bool = False

    def empty(self) -> bool:
        return not (self.has_reasoning or self.texts or self.calls)


def _flush(turn: _Turn, out: list[Message]) -> _Turn:
    if turn.empty():
        return turn
    for cid, _, _ in turn.calls:
        if cid not in turn.outputs:
            raise ConversionError(f"No tool output found for tool call {cid}.")
    reasoning = "\n".join(turn.reasoning) if turn.has_reasoning else None
    calls = tuple(ToolCall(*c) for c in turn.calls) or None
    out.append(AssistantMessage("\n\n".join(turn.texts), reasoning, calls))
    out += [turn.outputs[cid] for cid, _, _ in turn.calls]
    return _Turn()


def _messages(items: list[dict[str, Any]], token: str, v41: bool) -> list[Message]:
    out: list[Message] = []
    turn = _Turn()
    seen_calls: set[str] = set()
    for item in items:
        path = f"input[{item['index']}]"
        kind = item["kind"]
        if kind == "message" and item["role"] != "assistant":
            turn = _flush(turn, out)
            text, offs, imgs = _content(item["content"], path, token, v41, assistant=False)
            role = item["role"]
            if role == "developer":  # V4.1 treats developer as system; V4-Pro as user (official)
                role = "system" if v41 else "user"
            cls = UserMessage if role == "user" else SystemMessage
            out.append(cls(text, tuple(imgs), image_offsets=offs, image_token=token))
        elif kind == "message":
            if turn.calls:
                turn = _flush(turn, out)
            turn.texts.append(_content(item["content"], path, token, v41, assistant=True)[0])
        elif kind == "reasoning":
            if turn.texts or turn.calls:
                turn = _flush(turn, out)
            if item["texts"]:
                turn.reasoning.append("\n".join(item["texts"]))
                turn.has_reasoning = True
        elif kind == "call":
            if turn.outputs:
                turn = _flush(turn, out)
            if item["call_id"] in seen_calls:
                raise ConversionError(f"Duplicate 'call_id': {item['call_id']}.")
            seen_calls.add(item["call_id"])
            turn.calls.append((item["call_id"], item["name"], item["arguments"]))
        else:
            cid = item["call_id"]
            if cid not in {c[0] for c in turn.calls}:
                raise ConversionError(f"No tool call found for tool output with call_id {cid}.")
            if cid in turn.outputs:
                raise ConversionError(f"Duplicate tool output for call_id: {cid}.")
            text, offs, imgs = _content(item["output"], path, token, v41, assistant=False)
            turn.outputs[cid] = ToolMessage(text, cid, tuple(imgs), image_offsets=offs, image_token=token)
    _flush(turn, out)
    return out


def _tools(raw: list[dict[str, Any]], options: ConversionOptions,
           v41: bool) -> tuple[list[tuple], dict[str, tuple[str, str]]]:
    """Flattened ``(name, description, parameters, strict, defer_loading)`` specs and the namespace map.

    V4.1 flattens ``ns``/``fn`` to ``ns::fn`` with description ``"<ns description>\\n<fn description>"``;
    V4-Pro to ``ns__fn`` with the function's own description.
    """
    specs: list[tuple] = []
    ns_map: dict[str, tuple[str, str]] = {}
    for t in raw:
        kind = t["kind"]
        if kind == "function":
            specs.append((t["name"], t["description"], t["parameters"], t["strict"], t["defer_loading"]))
        elif kind == "namespace":
            for f in t["tools"]:
                if f["kind"] != "function":
                    continue
                name = f"{t['name']}{'::' if v41 else '__'}{f['name']}"
                if v41 and t["description"] is not None:
                    desc = f"{t['description']}\n{f['description'] or ''}"
                else:
                    desc = f["description"]
                specs.append((name, desc, f["parameters"], f["strict"], f["defer_loading"]))
                ns_map[name] = (t["name"], f["name"])
        elif kind == "custom":
            if t["name"] != APPLY_PATCH_NAME:
                raise ConversionError(f"Unsupported custom tool: '{t['name']}'. Only 'apply_patch' is supported.")
            specs.append((APPLY_PATCH_NAME, apply_patch_description(v41), apply_patch_parameters(), None, False))
        elif kind == "web_search" and options.responses_web_search is WebSearchBehavior.REJECT:
            raise ConversionError("Server tools are not supported")
    return specs, ns_map


def namespace_tool_map(body: Any, options: ConversionOptions | None = None) -> dict[str, tuple[str, str]]:
    """Flattened function name -> (namespace, local name) of the request's namespace tools."""
    options = options or ConversionOptions()
    req = _parse(body, options)
    return _tools(req["tools"], options, cc.resolve_model(req["model"], options).is_v41)[1]


def _tool_names(tools: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """``(path, name)`` of the function tools and namespaces (a namespace, then its functions)."""
    out = []
    for i, t in enumerate(tools):
        if t["kind"] in ("function", "namespace"):
            out.append((f"tools[{i}].name", t["name"]))
        if t["kind"] == "namespace":
            out += [(f"tools[{i}].tools[{j}].name", f["name"]) for j, f in enumerate(t["tools"])
                    if f["kind"] == "function"]
    return out


def convert_responses(body: Any, options: ConversionOptions | None = None) -> ConversationRequest:
    """Convert a Responses request body (dict, JSON text or bytes).

    Rule order (official): model, function and namespace tool names, tool list (custom / web search), input items, reasoning fill,
    tool schemas, tool choice, ``json_object`` word, strict formats, sampling, ``top_logprobs``, limit.
    """
    options = options or ConversionOptions()
    req = _parse(body, options)
    version = cc.resolve_model(req["model"], options)
    cc.check_tool_names(_tool_names(req["tools"]))
    thinking, effort = cc.resolve_thinking(None, req["effort"], options)
    specs, ns_map = _tools(req["tools"], options, version.is_v41)
    choice_raw = req["tool_choice"]
    token = options.special_tokens[SpecialToken.IMAGE]
    instructions = None if req["instructions"] is MISSING else req["instructions"]
    inp = req["input"]
    if inp is None and instructions is None:
        raise ConversionError("Either input or instructions must be provided")
    messages: list[Message] = []
    if instructions:
        messages.append(SystemMessage(instructions))
    if isinstance(inp, str):
        messages.append(UserMessage(inp))
    elif inp is not None:
        if not req.get("input_len"):
            raise ConversionError("Input items array must not be empty")
        messages += _messages(inp, token, version.is_v41)
    messages = cc.fill_reasoning(messages, thinking, options.reasoning_content_behavior, bool(specs),
                                 "reasoning_text")
    if choice_raw == ("web_search",):
        if options.responses_web_search is WebSearchBehavior.REJECT:
            raise ConversionError("Server tools are not supported")
        choice = cc.ToolChoiceSpec("auto")
    elif isinstance(choice_raw, tuple):
        choice = cc.ToolChoiceSpec("named", choice_raw[1])
    else:
        choice = cc.ToolChoiceSpec(choice_raw)
    declared = cc.build_tools(specs) if choice.mode != "none" else []
    tools, tool_choice = cc.resolve_tools(declared, choice, thinking)
    fmt: cc.ResponseFormatSpec = req["format"]
    if fmt.kind == "json_object":
        cc.check_json_word(messages, "Response input messages must contain the word 'json' in some form to use "
                                     "'text.format' of type 'json_object'.")
    fmt = fmt.checked()
    cc.check_strict_mix(tools, req["format_given"])
    conv = Conversation(messages, thinking_mode=thinking, tools=tools, tool_choice=tool_choice,  # type: ignore[arg-type]
                        reasoning_effort=effort, **fmt.conversation_kwargs())  # type: ignore[arg-type]
    get = lambda k: None if req[k] is MISSING else req[k]
    temperature, top_p = cc.resolve_sampling(version, thinking, conv.tools_active, get("temperature"), get("top_p"))
    top_logprobs = get("top_logprobs")
    if top_logprobs is not None and top_logprobs > 20:
        raise ConversionError("Invalid top_logprobs value, the valid range of top_logprobs is [0, 20].")
    max_tokens = cc.check_max_tokens(get("max_output_tokens"), thinking, options, clamp=False)
    echo = {"instructions": instructions, "max_output_tokens": get("max_output_tokens"),
            "temperature": 1.0 if get("temperature") is None else cc.f32(get("temperature")),
            "top_p": 1.0 if get("top_p") is None else cc.f32(get("top_p")),
            "top_logprobs": top_logprobs or 0, "user": get("user")}
    return cc.build_request(conversation=conv, version=version, response_format=fmt, options=options,
                            temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                            logprobs=top_logprobs is not None, top_logprobs=top_logprobs, seed=None, stop=(),
                            stream=req["stream"] is True, model=req["model"], namespace_tool_map=ns_map, echo=echo)
