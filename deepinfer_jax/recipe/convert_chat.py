"""Chat Completions request -> :class:`ConversationRequest` (recipe.md §2.1, §2.2).

Two steps, as in the official library: :func:`_parse` reads the body against the schema (a
:class:`RequestBodyError` for a missing field, a wrong type or an unknown enum value), then
:func:`convert_chat` applies the rules in the official order: model, messages (mapping, prefix and
tool-call pairing; the tool names are checked right after the model), ``json_object`` word check, tools and tool choice, stop, ``stream_options``,
``n``, temperature, ``top_p``, ``top_logprobs``, ``max_tokens``, ``seed``.

Official behaviours matched on purpose (some look like bugs, recipe.md §0):

- ``max_completion_tokens`` is read but ignored (pitfall 9); an assistant message with null content and
  no tool calls is a 400 (pitfall 10); empty system messages are dropped, so a request whose only
  message is an empty system message converts to an empty conversation;
- a tool message whose id is not pending is reported as "The following tool_call_ids did not have
  response messages: <that tool message's id>" (it names the tool message, not the missing call);
- a prefix turn is rejected ("Function call should not be used with prefix") when the request
  declares tools or the history holds any tool call, even with ``tool_choice`` none;
- ``response_format`` (even ``text``) with active strict tools is a 400; V4-Pro turns every image or
  file part into the text ``[Unsupported Image]`` without checking it.
"""

from __future__ import annotations

from typing import Any

from deepinfer_jax.recipe import convert_common as cc
from deepinfer_jax.recipe.body import MISSING, expect, field, parse_body, typed, variant
from deepinfer_jax.recipe.conversation import (
    AssistantMessage,
    Conversation,
    LatestReminderMessage,
    Message,
    SystemMessage,
    ToolCall,
    ToolMessage,
    UserMessage,
)
from deepinfer_jax.recipe.errors import ConversionError, RequestBodyError
from deepinfer_jax.recipe.options import ConversationRequest, ConversionOptions
from deepinfer_jax.recipe.special_tokens import SpecialToken

__all__ = ["convert_chat"]

_ROLES = ("system", "user", "assistant", "tool", "latest_reminder")
_PART_TYPES = ("text", "image_url", "file")
_DETAILS = ("low", "high", "original", "auto")


# --------------------------------------------------------------------------------------- parse


def _parse_content(msg: dict[str, Any], *, required: bool, parts_allowed: bool = True) -> Any:
    if "content" not in msg:
        if required:
            raise RequestBodyError("missing field `content`")
        return None
    content = msg["content"]
    if content is None and not required:
        return None
    if not parts_allowed:
        return expect(content, "str")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestBodyError("content should be a string or a list")
    parts = []
    for part in content:
        typed(part, "internally tagged enum ChatCompletionRequestMessageContentPart")
        kind = variant(part["type"], _PART_TYPES)
        if kind == "text":
            parts.append(("text", field(part, "text", "str", required=True)))
        elif kind == "image_url":
            img = field(part, "image_url", "map", required=True, expected="struct ChatCompletionImageUrl")
            url = field(img, "url", "str", required=True)
            detail = img.get("detail")
            parts.append(("image", url, "high" if detail is None else variant(detail, _DETAILS)))
        else:
            field(part, "file", "map", required=True)
            parts.append(("file",))
    return parts


def _parse_message(msg: Any) -> dict[str, Any]:
    expect(msg, "map", "internally tagged enum ChatCompletionRequestMessage")
    if "role" not in msg:
        raise RequestBodyError("missing field `role`")
    role = variant(msg["role"], _ROLES)
    out: dict[str, Any] = {"role": role}
    if role == "assistant":
        out["content"] = _parse_content(msg, required=False)
        r = field(msg, "reasoning_content", "str")
        out["reasoning_content"] = None if r is MISSING else r
        calls = field(msg, "tool_calls", "list")
        if calls is not MISSING:
            parsed = []
            for call in calls:
                expect(call, "map", "struct ChatCompletionMessageToolCall")
                cid = field(call, "id", "str", required=True)
                typed(call, check=False)
                variant(call["type"], ("function",))
                fn = field(call, "function", "map", required=True, expected="struct FunctionCall")
                name = field(fn, "name", "str", required=True)
                parsed.append((cid, name, field(fn, "arguments", "str", required=True)))
            calls = parsed
        out["tool_calls"] = None if calls is MISSING else calls
        prefix = field(msg, "prefix", "bool")
        out["prefix"] = False if prefix is MISSING else prefix
    elif role == "latest_reminder":
        out["content"] = _parse_content(msg, required=True, parts_allowed=False)
    else:
        out["content"] = _parse_content(msg, required=True)
        if role == "tool":
            out["tool_call_id"] = field(msg, "tool_call_id", "str", required=True)
    return out


def _parse_tool(tool: Any) -> tuple[str, Any, Any, Any]:
    typed(tool, "struct ChatCompletionTool")
    variant(tool["type"], ("function",))
    fn = field(tool, "function", "map", required=True, expected="struct FunctionObject")
    name = field(fn, "name", "str", required=True)
    desc = field(fn, "description", "str")
    params = fn.get("parameters")
    strict = field(fn, "strict", "bool")
    return name, None if desc is MISSING else desc, params, None if strict is MISSING else strict


def _parse_tool_choice(value: Any) -> cc.ToolChoiceSpec:
    if isinstance(value, str):
        if value in ("none", "auto", "required"):
            return cc.ToolChoiceSpec(value)
        raise RequestBodyError("expected one of `none`, `auto`, `required` or a tool")
    if isinstance(value, dict):
        typed(value, check=False)
        variant(value["type"], ("function",))
        fn = value.get("function")
        if not isinstance(fn, dict):
            from deepinfer_jax.recipe.body import unexpected

            raise RequestBodyError(f"field `function`: invalid type: {unexpected(fn)}, expected struct "
                                   "ChatCompletionToolChoiceFunction")
        return cc.ToolChoiceSpec("named", field(fn, "name", "str", required=True))
    raise RequestBodyError("expected one of `none`, `auto`, `required` or a tool")


def _parse_response_format(value: Any) -> cc.ResponseFormatSpec:
    typed(value, "internally tagged enum ResponseFormat")
    kind = variant(value["type"], ("json_object", "json_schema", "regex", "text"))
    if kind == "json_schema":
        js = field(value, "json_schema", "map", required=True, expected="struct ResponseFormatJsonSchema")
        if "schema" not in js:
            raise RequestBodyError("missing field `schema`")
        strict = field(js, "strict", "bool")
        return cc.ResponseFormatSpec("json_schema", schema=js["schema"], strict=strict is True)
    if kind == "regex":
        return cc.ResponseFormatSpec("regex", regex=field(value, "regex", "str", required=True))
    return cc.ResponseFormatSpec(kind)


def _parse(body: Any) -> dict[str, Any]:
    body = parse_body(body)
    expect(body, "map", "struct ChatCompletionRequest")
    req: dict[str, Any] = {"model": field(body, "model", "str", required=True)}
    req["messages"] = [_parse_message(m) for m in field(body, "messages", "list", required=True)]
    for key, kind in (("temperature", "f32"), ("top_p", "f32"), ("max_tokens", "u32"), ("max_completion_tokens", "u32"),
                      ("n", "u32"), ("stream", "bool"), ("logprobs", "bool"), ("top_logprobs", "u8"),
                      ("seed", "u64"), ("reasoning_effort", "any")):
        req[key] = field(body, key, kind)
    if req["reasoning_effort"] is not MISSING:
        variant(req["reasoning_effort"], cc.EFFORT_VALUES)
    stop = body.get("stop")
    req["stop_is_str"] = isinstance(stop, str)
    if stop is None:
        req["stop"] = []
    elif isinstance(stop, str):
        req["stop"] = [stop]
    elif isinstance(stop, list):
        req["stop"] = [expect(s, "str") for s in stop]
    else:
        raise RequestBodyError("expected a string or a list")
    req["stream_options"] = body.get("stream_options")
    thinking = field(body, "thinking", "map", expected="struct Thinking")
    req["thinking"] = MISSING
    if thinking is not MISSING:
        typed(thinking, check=False)
        req["thinking"] = variant(thinking["type"], ("adaptive", "enabled", "disabled"))
    tools = field(body, "tools", "list")
    req["tools"] = [] if tools is MISSING else [_parse_tool(t) for t in tools]
    choice = body.get("tool_choice")
    req["tool_choice"] = cc.ToolChoiceSpec() if choice is None else _parse_tool_choice(choice)
    fmt = body.get("response_format")
    req["response_format_given"] = fmt is not None
    req["response_format"] = cc.ResponseFormatSpec() if fmt is None else _parse_response_format(fmt)
    return req


# ------------------------------------------------------------------------------------- convert


def _content(parts: Any, path: str, image_token: str, *, images_ok: bool,
             v41: bool) -> tuple[str, tuple[int, ...], list]:
    """(text, placeholder offsets, image sources) of a string or a list of parts.

    V4-Pro has no image input: every image or file part becomes the text ``[Unsupported Image]``
    (no error), as in the official library.
    """
    if parts is None:
        return "", (), []
    if isinstance(parts, str):
        return parts, (), []
    b = cc.ContentBuilder(image_token)
    for part in parts:
        if part[0] == "text":
            b.text(part[1])
        elif not v41:
            b.image(None)
        elif part[0] == "image":
            if not images_ok:
                raise ConversionError("Image in assistant message is not supported")
            b.image(cc.image_source_from_url(part[1], part[2], path))
        else:
            raise ConversionError(f"{path}: file must have a file_id or file_data")
    return b.content, tuple(b.offsets), b.images


def _messages(raw: list[dict[str, Any]], image_token: str, v41: bool) -> list[Message]:
    """Map the messages and check the tool-call pairing (prefix placement is checked afterwards)."""
    out: list[Message] = []
    pending: list[str] = []
    for i, m in enumerate(raw):
        role = m["role"]
        path = f".messages[{i}]"
        if pending and role != "tool":
            raise ConversionError("An assistant message with 'tool_calls' must be followed by tool messages "
                                  "responding to each 'tool_call_id'. (insufficient tool messages following "
                                  "tool_calls message)")
        if role == "assistant":
            calls = m["tool_calls"]
            if calls is not None and not calls:
                raise ConversionError(f"Invalid 'messages[{i}].tool_calls': empty array. Expected an array with "
                                      "minimum length 1, but got an empty array instead.")
            if m["content"] is None and not calls:
                raise ConversionError("Invalid assistant message: content or tool_calls must be set")
            text, _, _ = _content(m["content"], path, image_token, images_ok=False, v41=v41)
            if calls:
                ids = [c[0] for c in calls]
                for cid in ids:
                    if ids.count(cid) > 1:
                        raise ConversionError(f"Duplicate value for 'tool_call_id' of {cid} in message[{i}]")
                pending = list(ids)
            out.append(AssistantMessage(text, m["reasoning_content"],
                                        tuple(ToolCall(*c) for c in calls) if calls else None, m["prefix"]))
        elif role == "tool":
            if not pending:
                raise ConversionError("Messages with role 'tool' must be a response to a preceding message with "
                                      "'tool_calls'")
            if m["tool_call_id"] not in pending:
                raise ConversionError("An assistant message with 'tool_calls' must be followed by tool messages "
                                      "responding to each 'tool_call_id', The following tool_call_ids did not have "
                                      f"response messages: {m['tool_call_id']}")
            pending.remove(m["tool_call_id"])
            text, offs, imgs = _content(m["content"], path, image_token, images_ok=True, v41=v41)
            out.append(ToolMessage(text, m["tool_call_id"], tuple(imgs), image_offsets=offs, image_token=image_token))
        elif role == "latest_reminder":
            out.append(LatestReminderMessage(m["content"]))
        else:
            text, offs, imgs = _content(m["content"], path, image_token, images_ok=True, v41=v41)
            if role == "system" and not text:  # empty system messages are dropped
                continue
            cls = SystemMessage if role == "system" else UserMessage
            out.append(cls(text, tuple(imgs), image_offsets=offs, image_token=image_token))
    if pending:
        raise ConversionError("An assistant message with 'tool_calls' must be followed by tool messages responding "
                              "to each 'tool_call_id'. (insufficient tool messages following tool_calls message)")
    return out


def convert_chat(body: Any, options: ConversionOptions | None = None) -> ConversationRequest:
    """Convert a Chat Completions request body (dict, JSON text or bytes)."""
    options = options or ConversionOptions()
    req = _parse(body)
    version = cc.resolve_model(req["model"], options)
    cc.check_tool_names([(f"tools[{i}].function.name", t[0]) for i, t in enumerate(req["tools"])])
    effort = None if req["reasoning_effort"] is MISSING else req["reasoning_effort"]
    thinking_type = None if req["thinking"] is MISSING else req["thinking"]
    thinking, conv_effort = cc.resolve_thinking(thinking_type, effort, options)
    if not req["messages"]:
        raise ConversionError("Empty input messages")
    image_token = options.special_tokens[SpecialToken.IMAGE]
    messages = _messages(req["messages"], image_token, version.is_v41)
    if any(isinstance(m, AssistantMessage) and m.prefix for m in messages[:-1]):
        raise ConversionError("Invalid completion message: prefix set true with message which is not final message "
                              "or message role is not assistant")
    prefix = bool(messages) and isinstance(messages[-1], AssistantMessage) and messages[-1].prefix
    messages = cc.fill_reasoning(messages, thinking, options.reasoning_content_behavior, bool(req["tools"]))
    fmt: cc.ResponseFormatSpec = req["response_format"]
    if fmt.kind == "json_object":
        cc.check_json_word(messages, "Prompt must contain the word 'json' in some form to use 'response_format' of "
                                     "type 'json_object'.")
    choice: cc.ToolChoiceSpec = req["tool_choice"]
    declared = cc.build_tools(req["tools"]) if choice.mode != "none" else []  # "none": tools are not checked
    tools, tool_choice = cc.resolve_tools(declared, choice, thinking)
    if fmt.kind == "json_object" and prefix:
        raise ConversionError("response_format json_object should not be used with prefix")
    if prefix and (req["tools"] or any(m.tool_calls for m in messages)):
        raise ConversionError("Function call should not be used with prefix")
    stop = req["stop"]
    if len(stop) > 16:
        raise ConversionError(f"Stop string array too long: {len(stop)}")
    for k, s in enumerate(stop):
        if not s:
            where = "stop" if req["stop_is_str"] else f"stop[{k}]"
            raise ConversionError(f"Invalid '{where}': empty string. Expected a string with minimum length 1, but got "
                                  "an empty string instead.")
    stream = req["stream"] is True
    if req["stream_options"] is not None and not stream:
        raise ConversionError("stream_options should be set along with stream = true")
    fmt = fmt.checked()
    cc.check_strict_mix(tools, req["response_format_given"])
    if req["n"] is not MISSING and req["n"] != 1:
        raise ConversionError("Invalid n value (currently only n = 1 is supported)")
    conv = Conversation(messages, thinking_mode=thinking, tools=tools, tool_choice=tool_choice,  # type: ignore[arg-type]
                        reasoning_effort=conv_effort, **fmt.conversation_kwargs())  # type: ignore[arg-type]
    temperature, top_p = cc.resolve_sampling(version, thinking, conv.tools_active,
                                             None if req["temperature"] is MISSING else req["temperature"],
                                             None if req["top_p"] is MISSING else req["top_p"])
    logprobs = req["logprobs"] is True
    top_logprobs = cc.check_top_logprobs(None if req["top_logprobs"] is MISSING else req["top_logprobs"], logprobs)
    max_tokens = cc.check_max_tokens(None if req["max_tokens"] is MISSING else req["max_tokens"], thinking, options,
                                     clamp=False)
    seed = cc.check_seed(None if req["seed"] is MISSING else req["seed"])
    return cc.build_request(conversation=conv, version=version, response_format=fmt, options=options,
                            temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=logprobs,
                            top_logprobs=top_logprobs, seed=seed, stop=stop, stream=stream, model=req["model"])
