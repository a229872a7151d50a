"""Messages (Anthropic-style) request -> :class:`ConversationRequest` (recipe.md §2.1, §2.4).

Mapping, as the official library does it:

- ``system`` (string or text blocks, joined with ``\\n\\n``) is a leading system message;
- a user message becomes one message per block: its leading ``tool_result`` blocks become tool
  messages, every other block its own user message (images are placeholders, documents the text
  ``[Unsupported document type: <media type>]``); the renderer merges them again;
- an assistant message becomes one assistant turn: text blocks joined with ``\\n\\n`` as content,
  ``thinking`` blocks joined with ``\\n\\n`` as reasoning (signatures ignored), ``tool_use`` blocks as
  calls with ``input`` written as py-JSON;
- a ``system`` message inside ``messages`` joins its text/image blocks; its ``tool_addition`` blocks
  attach declared tools (usually deferred ones) to it;
- every ``tool_use`` id must be answered by ``tool_result`` blocks at the start of the next message;
- ``max_tokens`` above the bound is lowered to it (Chat and Responses reject instead);
- web-search server tools and blocks are rejected (default) or dropped; other server tools are 400.

Official behaviours matched on purpose: ``tool_choice`` ``any`` means ``auto``; V4-Pro turns system
messages inside ``messages`` into ``<system-reminder>`` user messages and ignores ``defer_loading``;
the two "``tool_use`` ids were found without ``tool_result``" messages differ (``messages.N:`` without a
space names the assistant turn when the results simply run out, ``messages.N: `` names the message
where something else came first); ``tool_use`` input is written with Rust-style floats (``1e-7``).
"""

from __future__ import annotations

from typing import Any

from deepinfer_jax.recipe import convert_common as cc
from deepinfer_jax.recipe.body import MISSING, expect, field, parse_body, typed, variant
from deepinfer_jax.recipe.conversation import (
    AssistantMessage,
    Conversation,
    Message,
    SystemMessage,
    ToolCall,
    ToolDefinition,
    ToolMessage,
    UserMessage,
)
from deepinfer_jax.recipe.errors import ConversionError, RequestBodyError
from deepinfer_jax.recipe.options import ConversationRequest, ConversionOptions, WebSearchBehavior
from deepinfer_jax.recipe.pyjson import dumps_v4
from deepinfer_jax.recipe.special_tokens import SpecialToken

__all__ = ["convert_messages"]

_BLOCKS = ("text", "image", "document", "thinking", "server_tool_use", "tool_use", "tool_result",
           "web_search_tool_result", "tool_addition")
_MEDIA = ("image/jpeg", "image/jpg", "image/png", "image/gif", "image/webp")


def _missing_results(where: str, ids: list[str]) -> ConversionError:
    return ConversionError(f"{where}`tool_use` ids were found without `tool_result` blocks immediately after: "
                           f"{', '.join(ids)}. Each `tool_use` block must have a corresponding `tool_result` block "
                           "in the next message.")


def _unexpected_result(k: int, b: int, tid: str) -> ConversionError:
    return ConversionError(f"unexpected `messages.{k}.content.{b}: tool_use_id` found in `tool_result` blocks: {tid}. "
                           "Each `tool_result` block must have a corresponding `tool_use` block in the previous "
                           "message.")


# --------------------------------------------------------------------------------------- parse


def _parse_source(src: Any, document: bool) -> dict[str, Any]:
    typed(src, "internally tagged enum Source")
    kind = src["type"]
    if document:
        media = src.get("media_type")
        return {"type": kind, "media_type": media if isinstance(media, str) else None}
    kind = variant(kind, ("base64", "url", "file"))
    if kind == "base64":
        if "media_type" not in src:
            raise RequestBodyError("missing field `media_type`")
        media = variant(src["media_type"], _MEDIA)
        return {"type": kind, "media_type": media, "data": field(src, "data", "str", required=True)}
    if kind == "url":
        return {"type": kind, "url": field(src, "url", "str", required=True)}
    return {"type": kind}


def _parse_block(block: Any) -> dict[str, Any]:
    typed(block, "internally tagged enum ContentBlock")
    kind = variant(block["type"], _BLOCKS)
    out: dict[str, Any] = {"type": kind}
    if kind == "text":
        out["text"] = field(block, "text", "str", required=True)
    elif kind in ("image", "document"):
        if "source" not in block:
            raise RequestBodyError("missing field `source`")
        out["source"] = _parse_source(block["source"], kind == "document")
    elif kind == "thinking":
        out["thinking"] = field(block, "thinking", "str", required=True)
        field(block, "signature", "str")
    elif kind == "tool_use":
        out["id"] = field(block, "id", "str", required=True)
        out["name"] = field(block, "name", "str", required=True)
        if "input" not in block:
            raise RequestBodyError("missing field `input`")
        out["input"] = block["input"]
    elif kind == "tool_result":
        out["tool_use_id"] = field(block, "tool_use_id", "str", required=True)
        content = block.get("content")
        if content is None or isinstance(content, str):
            out["content"] = content or ""
        else:
            expect(content, "list", "a string or a list of content blocks")
            out["content"] = [_parse_block(c) for c in content]
    elif kind == "tool_addition":
        tool = field(block, "tool", "map", required=True)
        typed(tool, check=False)
        variant(tool["type"], ("tool_reference",))
        out["name"] = field(tool, "name", "str", required=True)
    return out


def _parse_message(msg: Any) -> dict[str, Any]:
    expect(msg, "map", "struct Message")
    if "role" not in msg:
        raise RequestBodyError("missing field `role`")
    role = variant(msg["role"], ("user", "assistant", "system"))
    if "content" not in msg:
        raise RequestBodyError("missing field `content`")
    content = msg["content"]
    if isinstance(content, str):
        return {"role": role, "content": content}
    expect(content, "list", "a string or a list of content blocks")
    return {"role": role, "content": [_parse_block(b) for b in content]}


def _parse_tool(tool: Any) -> dict[str, Any]:
    expect(tool, "map", "a tool")
    kind = tool.get("type")
    if kind is not None:
        expect(kind, "str")
        return {"kind": "web_search" if kind.startswith("web_search_") else "server", "name": tool.get("name")}
    desc = field(tool, "description", "str")
    defer = field(tool, "defer_loading", "bool")
    return {"kind": "client", "name": field(tool, "name", "str", required=True),
            "description": None if desc is MISSING else desc, "parameters": tool.get("input_schema"),
            "defer_loading": defer is True}


def _parse(body: Any) -> dict[str, Any]:
    body = parse_body(body)
    expect(body, "map", "struct MessagesRequest")
    req: dict[str, Any] = {"model": field(body, "model", "str", required=True)}
    req["messages"] = [_parse_message(m) for m in field(body, "messages", "list", required=True)]
    system = body.get("system")
    if system is None or isinstance(system, str):
        req["system"] = system
    else:
        expect(system, "list", "a string or a list of text blocks")
        texts = []
        for b in system:
            typed(b)
            variant(b["type"], ("text",))
            texts.append(field(b, "text", "str", required=True))
        req["system"] = texts
    for key, kind in (("max_tokens", "u32"), ("temperature", "f32"), ("top_p", "f32"), ("top_k", "u32"),
                      ("stream", "bool")):
        req[key] = field(body, key, kind)
    stops = field(body, "stop_sequences", "list")
    req["stop"] = [] if stops is MISSING else [expect(s, "str") for s in stops]
    thinking = field(body, "thinking", "map", expected="struct Thinking")
    req["thinking"] = None
    if thinking is not MISSING:
        typed(thinking, check=False)
        req["thinking"] = variant(thinking["type"], ("adaptive", "enabled", "disabled"))
    config = field(body, "output_config", "map")
    req["effort"] = None
    if config is not MISSING and config.get("effort") is not None:
        req["effort"] = variant(config["effort"], cc.EFFORT_VALUES)
    tools = field(body, "tools", "list")
    req["tools"] = [] if tools is MISSING else [_parse_tool(t) for t in tools]
    choice = body.get("tool_choice")
    req["tool_choice"] = cc.ToolChoiceSpec()
    if choice is not None:
        typed(choice, "internally tagged enum ToolChoice")
        kind = variant(choice["type"], ("auto", "any", "tool", "none"))
        if kind == "tool":
            req["tool_choice"] = cc.ToolChoiceSpec("named", field(choice, "name", "str", required=True))
        elif kind == "none":
            req["tool_choice"] = cc.ToolChoiceSpec("none")
    return req


# ------------------------------------------------------------------------------------- convert


def _image(block: dict[str, Any], path: str, v41: bool) -> Any:
    """An image source (None for V4-Pro: the text ``[Unsupported Image]``)."""
    if not v41:
        return None
    src = block["source"]
    if src["type"] == "file":
        raise ConversionError(f"{path}: file_id is not supported. Pass the image as a base64 data url instead.")
    if src["type"] == "url":
        url = src["url"]
        if not url[:8].lower().startswith(("http:", "https:")):
            raise ConversionError(f'{path}: invalid url: "{url}"')
        return cc.ImageSource.from_url(url, path=path)
    url = f"data:{src['media_type']};base64,{src['data']}"
    try:
        return cc.image_source_from_url(url, "high", path)
    except ConversionError:
        raise ConversionError(f"{path}: base64 decode error") from None


def _document_text(block: dict[str, Any]) -> str:
    return f"[Unsupported document type: {block['source']['media_type'] or 'unknown'}]"


def _user_message(blocks: list[dict[str, Any]], k: int, pending: list[str], token: str, v41: bool,
                  web: WebSearchBehavior) -> list[Message]:
    """Tool messages for the leading results, then one user message per other block."""
    out: list[Message] = []
    answered: set[str] = set()
    leading = True
    for b, block in enumerate(blocks):
        kind = block["type"]
        if kind == "tool_result" and leading:
            tid = block["tool_use_id"]
            if tid in answered:
                raise ConversionError(f"messages.{k}.content.{b}: each tool_use must have a single result. Found "
                                      f"multiple `tool_result` blocks with id: {tid}")
            if tid not in pending:
                raise _unexpected_result(k, b, tid)
            answered.add(tid)
            out.append(_tool_message(block, f"messages.{k}.content.{b}.tool_result", token, v41))
            continue
        if leading and pending and len(answered) < len(pending):
            raise _missing_results(f"messages.{k}: ", [i for i in pending if i not in answered])
        leading = False
        if kind == "tool_result":
            raise _unexpected_result(k, b, block["tool_use_id"])
        if kind == "text":
            out.append(UserMessage(block["text"]))
        elif kind == "image":
            b_ = cc.ContentBuilder(token)
            b_.image(_image(block, f"messages.{k}.content[{b}]", v41))
            out.append(UserMessage(b_.content, tuple(b_.images), image_offsets=tuple(b_.offsets), image_token=token))
        elif kind == "document":
            out.append(UserMessage(_document_text(block)))
        elif kind == "thinking":
            raise ConversionError(f"messages.{k}.content: thinking blocks may only be in `assistant` messages")
        elif kind in ("tool_use", "server_tool_use"):
            raise ConversionError(f"messages.{k}: `{kind}` blocks can only be in `assistant` messages")
        elif kind == "web_search_tool_result":
            raise ConversionError(f"messages.{k}: `web_search_tool_result` blocks can only be in `assistant` messages")
        elif kind == "tool_addition":
            raise ConversionError(f"messages.{k}: `tool_addition` blocks can only be in `system` messages")
    if pending and len(answered) < len(pending):
        raise _missing_results(f"messages.{k - 1}:", [i for i in pending if i not in answered])
    return out


def _tool_message(block: dict[str, Any], path: str, token: str, v41: bool) -> ToolMessage:
    content = block["content"]
    tid = block["tool_use_id"]
    if isinstance(content, str):
        return ToolMessage(content, tid)
    b = cc.ContentBuilder(token)
    for c in content:
        if c["type"] == "text":
            b.text(c["text"])
        elif c["type"] == "image":
            b.image(_image(c, path, v41))
        elif c["type"] == "document":
            b.text(_document_text(c))
    return ToolMessage(b.content, tid, tuple(b.images), image_offsets=tuple(b.offsets), image_token=token)


def _join(parts: list[str]) -> str:
    """Join with ``\\n\\n``, adding a separator only after non-empty text (official behaviour)."""
    out = ""
    for p in parts:
        out = f"{out}\n\n{p}" if out else p
    return out


def _assistant(blocks: list[dict[str, Any]], k: int, web: WebSearchBehavior,
               v41: bool) -> tuple[AssistantMessage, list[str]]:
    """One assistant turn. Texts (and thoughts) are joined with ``\\n\\n`` after a non-empty start, so
    leading empty blocks vanish; ``tool_use`` input is spaced JSON with Rust-style floats (official)."""
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    ids: list[str] = []
    for b, block in enumerate(blocks):
        kind = block["type"]
        if kind == "tool_use":
            if block["id"] in ids:
                raise ConversionError(f"messages.{k}.content.{b}: `tool_use` ids must be unique")
            ids.append(block["id"])
            calls.append(ToolCall(block["id"], block["name"], dumps_v4(block["input"])))
        elif kind == "thinking":
            thoughts.append(block["thinking"])
        elif kind in ("server_tool_use", "web_search_tool_result"):
            if web is WebSearchBehavior.REJECT:
                raise ConversionError("Unsupported content block: server tools are not supported")
        elif kind == "tool_result":
            raise ConversionError(f"messages.{k}: `tool_result` blocks can only be in `user` messages")
        elif kind == "tool_addition":
            raise ConversionError(f"messages.{k}: `tool_addition` blocks can only be in `system` messages")
        elif kind in ("image", "document"):
            raise ConversionError("Image in assistant message is unsupported")
        else:
            if ids:
                raise _missing_results(f"messages.{k}.{b}: ", ids)
            texts.append(block["text"])
    msg = AssistantMessage(_join(texts), _join(thoughts) if thoughts else None, tuple(calls) or None)
    return msg, ids


def _system_message(blocks: Any, k: int, token: str, v41: bool, declared: dict[str, ToolDefinition],
                    choice_none: bool) -> SystemMessage | None:
    """A system message inside ``messages`` (None: dropped).

    ``tool_addition`` blocks must name a declared tool; the tools are attached here and filtered to the
    finally kept tools by :func:`_attach_kept_tools`. With tool_choice none they are ignored, and a
    message made only of them is dropped.
    """
    if isinstance(blocks, str):
        return SystemMessage(blocks)
    b_ = cc.ContentBuilder(token)
    tools: list[ToolDefinition] = []
    has_content = False
    for b, block in enumerate(blocks):
        if block["type"] == "text":
            b_.text(block["text"])
            has_content = True
        elif block["type"] == "image":
            b_.image(_image(block, f"messages.{k}", v41))
            has_content = True
        elif block["type"] == "tool_addition":
            if block["name"] not in declared:
                raise ConversionError(f"messages.{k}.content.{b}: `tool_addition` references unknown tool "
                                      f"'{block['name']}'")
            if not choice_none:
                tools.append(declared[block["name"]])
    if choice_none and not has_content:
        return None
    return SystemMessage(b_.content, tuple(b_.images), tuple(tools) or None, image_offsets=tuple(b_.offsets),
                         image_token=token)


def _attach_kept_tools(messages: list[Message], kept: tuple[ToolDefinition, ...]) -> list[Message]:
    """Replace system-message tool lists by the kept (validated) definitions of the same names."""
    by_name = {t.name: t for t in kept}
    out: list[Message] = []
    for m in messages:
        if isinstance(m, SystemMessage) and m.tools:
            tools = tuple(by_name[t.name] for t in m.tools if t.name in by_name)
            m = SystemMessage(m.content, m.image_sources, tools or None, image_offsets=m.image_offsets,
                              image_token=m.image_token)
        out.append(m)
    return out


def _v4_system_reminders(messages: list[Message], first_inner: int) -> list[Message]:
    """V4-Pro has no mid-conversation system role: system messages from ``messages`` become user messages
    wrapped in ``<system-reminder>`` tags; empty ones are dropped."""
    out = messages[:first_inner]
    for m in messages[first_inner:]:
        if m.role == "system":
            if m.content:
                out.append(UserMessage(f"<system-reminder>\n{m.content}\n</system-reminder>"))
        else:
            out.append(m)
    return out


def _messages(raw: list[dict[str, Any]], token: str, v41: bool, web: WebSearchBehavior,
              declared: dict[str, ToolDefinition], choice_none: bool) -> list[Message]:
    out: list[Message] = []
    pending: list[str] = []
    for k, m in enumerate(raw):
        role, content = m["role"], m["content"]
        if isinstance(content, list) and not content:
            raise ConversionError(f"messages.{k}: all messages must have non-empty content")
        if pending and role != "user":
            raise _missing_results(f"messages.{k}: ", pending)
        if role == "user":
            if isinstance(content, str):
                if pending:
                    raise _missing_results(f"messages.{k}: ", pending)
                out.append(UserMessage(content))
            else:
                out += _user_message(content, k, pending, token, v41, web)
            pending = []
        elif role == "assistant":
            if isinstance(content, str):
                out.append(AssistantMessage(content))
            else:
                msg, pending = _assistant(content, k, web, v41)
                out.append(msg)
        else:
            sys_msg = _system_message(content, k, token, v41, declared, choice_none)
            if sys_msg is not None:
                out.append(sys_msg)
    if pending:
        raise _missing_results(f"messages.{len(raw) - 1}:", pending)
    return out


def convert_messages(body: Any, options: ConversionOptions | None = None) -> ConversationRequest:
    """Convert a Messages request body (dict, JSON text or bytes).

    Rule order (official): model, client tool names, server tools, deferred tools, messages, reasoning fill, tool schemas,
    tool choice, stop sequences, sampling, ``max_tokens`` (clamped to the bound).
    """
    options = options or ConversionOptions()
    req = _parse(body)
    version = cc.resolve_model(req["model"], options)
    cc.check_tool_names([(f"tools[{i}].name", t["name"]) for i, t in enumerate(req["tools"]) if t["kind"] == "client"])
    v41 = version.is_v41
    thinking, effort = cc.resolve_thinking(req["thinking"], req["effort"], options)
    token = options.special_tokens[SpecialToken.IMAGE]
    web = options.messages_web_search
    specs = []
    for i, t in enumerate(req["tools"]):
        if t["kind"] == "client":  # V4-Pro has no deferred tools
            specs.append((t["name"], t["description"], t["parameters"], None, t["defer_loading"] and v41))
        elif t["kind"] == "server" or web is WebSearchBehavior.REJECT:
            raise ConversionError(f"tools[{i}]: server tools are not supported")
    if specs and all(spec[4] for spec in specs):
        raise ConversionError("tools: at least one tool must have defer_loading=false. All tools cannot be deferred.")
    if not req["messages"]:
        raise ConversionError("messages: at least one message is required")
    choice: cc.ToolChoiceSpec = req["tool_choice"]
    declared = {s_[0]: ToolDefinition(s_[0], s_[1], s_[2], None, s_[4]) for s_ in specs}
    messages: list[Message] = []
    if req["system"] is not None:
        messages.append(SystemMessage(req["system"] if isinstance(req["system"], str) else "\n\n".join(req["system"])))
    first_inner = len(messages)
    messages += _messages(req["messages"], token, v41, web, declared, choice.mode == "none")
    if not v41:
        messages = _v4_system_reminders(messages, first_inner)
    messages = cc.fill_reasoning(messages, thinking, options.reasoning_content_behavior, bool(specs),
                                 "content[].thinking")
    declared_tools = cc.build_tools(specs, check_none=True) if choice.mode != "none" else []
    dropped = {t.get("name") for t in req["tools"] if t["kind"] == "web_search"}
    if choice.mode == "named" and choice.name in dropped:
        choice = cc.ToolChoiceSpec("auto")  # a choice of a dropped web-search tool is dropped with it
    tools, tool_choice = cc.resolve_tools(declared_tools, choice, thinking, any_declared=bool(req["tools"]))
    messages = _attach_kept_tools(messages, tools)
    stop = req["stop"]
    if len(stop) > 16:
        raise ConversionError(f"Stop string array too long: {len(stop)}")
    for k, s in enumerate(stop):
        if not s:
            raise ConversionError(f"Invalid 'stop[{k}]': empty string. Expected a string with minimum length 1, "
                                  "but got an empty string instead.")
    conv = Conversation(messages, thinking_mode=thinking, tools=tools, tool_choice=tool_choice,  # type: ignore[arg-type]
                        reasoning_effort=effort)
    get = lambda k: None if req[k] is MISSING else req[k]
    temperature, top_p = cc.resolve_sampling(version, thinking, conv.tools_active, get("temperature"), get("top_p"))
    max_tokens = cc.check_max_tokens(get("max_tokens"), thinking, options, clamp=True)
    return cc.build_request(conversation=conv, version=version, response_format=cc.ResponseFormatSpec(),
                            options=options, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                            logprobs=False, top_logprobs=None, seed=None, stop=stop, stream=req["stream"] is True,
                            model=req["model"])
