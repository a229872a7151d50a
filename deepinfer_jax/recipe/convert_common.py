"""Rules shared by the three protocol converters (recipe.md §2.1).

Model names, thinking mode and effort, sampling settings (f32 like the official library, so 0.3 is
0.30000001192092896), token limits, tools and tool choice, response formats, assistant reasoning
fill/reject, and the derived output constraint and parsing options. Error messages are the official
ones; each function raises :class:`ConversionError` (HTTP 400) for a rule it checks.

Matched official behaviours worth knowing: effort ``none`` with an explicit ``thinking.type: enabled``
keeps thinking on (effort ``high``); an effort value alone turns thinking on even when the default is
off; ``required`` or a named choice without tools silently becomes ``auto`` (no error); with
reasoning REJECT, an assistant turn after the last user message that lacks reasoning is a 400 if it calls
tools *or* the request declares any tool.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from deepinfer_jax.recipe.conversation import AssistantMessage, Conversation, ImageSource, Message, ToolDefinition
from deepinfer_jax.recipe.errors import ConversionError
from deepinfer_jax.recipe.options import (
    ConversationRequest,
    ConversionOptions,
    InferenceOptions,
    ModelVersion,
    OutputConstraint,
    ParsingOptions,
    ReasoningContentBehavior,
    ThinkingInitialStage,
)
from deepinfer_jax.recipe.pyjson import dumps_compact
from deepinfer_jax.recipe.schema_check import check_tool_parameters
from deepinfer_jax.recipe.strict_schema import normalize_json_schema, normalize_tool_parameters

__all__ = [
    "EFFORT_VALUES",
    "ContentBuilder",
    "ResponseFormatSpec",
    "ToolChoiceSpec",
    "build_request",
    "check_json_word",
    "check_tool_names",
    "f32",
    "fill_reasoning",
    "image_source_from_url",
    "resolve_model",
    "resolve_sampling",
    "resolve_thinking",
    "resolve_tools",
]

#: Request effort values (Chat ``reasoning_effort``, Responses ``reasoning.effort``, Messages
#: ``output_config.effort``) and the conversation effort each maps to (None: thinking off).
EFFORT_VALUES = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
_EFFORT_MAP = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "xhigh",
               "max": "max", "ultra": "max"}
UNSUPPORTED_IMAGE = "[Unsupported Image]"
_F32_095 = struct.unpack("f", struct.pack("f", 0.95))[0]


def f32(x: float) -> float:
    """``x`` rounded to the nearest float32 (then widened back), as the official library stores it."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return float("inf") if x > 0 else float("-inf")


_B64 = re.compile(r"[A-Za-z0-9+/]*(={0,2})")
_IMAGE_MIMES = ("image/png", "image/jpeg", "image/jpg", "image/gif", "image/webp")


def image_source_from_url(url: str, detail: str, path: str) -> ImageSource:
    """An image source for a request URL (``path``: its location for error messages).

    ``data:<image mime>[;params];base64,<payload>`` (png, jpeg, gif, webp; payload checked as base64,
    whitespace ignored) or any ``http:``/``https:`` URL; anything else is a 400, with the official
    messages.
    """
    low = url[:8].lower()
    if low.startswith("data:"):
        header, comma, payload = url.partition(",")
        if not comma or not header.endswith(";base64"):
            raise ConversionError(f"{path}: Unsupported image_url format")
        mime = header[5:].split(";", 1)[0].lower()
        if mime not in _IMAGE_MIMES:
            raise ConversionError(f"{path}: You have uploaded an unsupported image. Please make sure your image is "
                                  "valid and has one of the following formats: webp, png, jpeg, and gif.")
        b64 = "".join(payload.split())
        m = _B64.fullmatch(b64)
        body = len(b64) - len(m.group(1)) if m else 0
        if m is None or body % 4 == 1 or (m.group(1) and len(b64) % 4):
            raise ConversionError(f"{path}: Invalid base64 data")
        return ImageSource.from_data_url(url, detail, path=path)  # type: ignore[arg-type]
    if low.startswith(("http:", "https:")):
        return ImageSource.from_url(url, detail, path=path)  # type: ignore[arg-type]
    raise ConversionError(f"{path}: Unsupported image_url format")


def resolve_model(model: str, options: ConversionOptions) -> ModelVersion:
    """The version of ``model``; 400 if it is not an accepted name."""
    table = options.model_versions_by_name
    if model not in table:
        raise ConversionError(f"The supported API model names are {', '.join(table)}, but you passed {model}.")
    return table[model]


_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]+")
TOOL_NAME_MAX = 128


def check_tool_names(names: Sequence[tuple[str, str]]) -> None:
    """Each ``(path, name)`` of a declared function tool: 1 to 128 characters of ``[a-zA-Z0-9_-]``,
    else a 400 naming the path (e.g. ``tools[2].function.name``) in the official wording."""
    for path, name in names:
        if not name:
            raise ConversionError(f"Invalid '{path}': empty string. Expected a string with minimum length 1, but "
                                  "got an empty string instead.")
        if len(name) > TOOL_NAME_MAX:
            raise ConversionError(f"Invalid '{path}': string too long. Expected a string with maximum length "
                                  f"{TOOL_NAME_MAX}, but got a string with length {len(name)} instead.")
        if _TOOL_NAME.fullmatch(name) is None:
            raise ConversionError(f"Invalid '{path}': string does not match pattern. Expected a string that matches "
                                  "the pattern '^[a-zA-Z0-9_-]+$'.")


def resolve_thinking(thinking_type: str | None, effort: str | None,
                     options: ConversionOptions) -> tuple[bool, str | None]:
    """(thinking mode, conversation effort).

    ``thinking_type`` (enabled / adaptive / disabled) wins; else an effort value decides (``none`` is
    off, any other is on); else the options' default. Effort: minimal/low -> low, medium/high -> high,
    xhigh -> xhigh, max/ultra -> max, none or absent -> high; None when thinking is off.
    """
    if thinking_type is not None:
        thinking = thinking_type != "disabled"
    elif effort is not None:
        thinking = effort != "none"
    else:
        thinking = options.default_thinking_mode
    if not thinking:
        return False, None
    return True, _EFFORT_MAP.get(effort or "high", "high")


def resolve_sampling(version: ModelVersion, thinking: bool, tools_active: bool,
                     temperature: float | None, top_p: float | None) -> tuple[float, float]:
    """(temperature, top_p) sent to the backend, after the range checks (400)."""
    t = None if temperature is None else f32(temperature)
    p = None if top_p is None else f32(top_p)
    if t is not None and not 0.0 <= t <= 2.0:
        raise ConversionError("Invalid temperature value, the valid range of temperature is [0, 2]")
    if p is not None and not 0.0 < p <= 1.0:
        raise ConversionError("Invalid top_p value, the valid range of top_p is (0, 1.0]")
    temp = 1.0 if thinking or t is None else t
    if version is ModelVersion.DEEPSEEK_V4_PRO:
        top = (_F32_095 if tools_active else 1.0) if thinking else (1.0 if p is None else p)
    else:
        top = (1.0 if p is None else max(p, _F32_095)) if thinking else 1.0
    return temp, top


def check_max_tokens(value: int | None, thinking: bool, options: ConversionOptions, *, clamp: bool) -> int | None:
    """``max_tokens`` within [1, bound]; above the bound Chat/Responses reject and Messages clamp."""
    if value is None:
        return None
    bound = options.thinking_max_tokens_upper_bound if thinking else options.non_thinking_max_tokens_upper_bound
    if clamp and value > bound:
        value = bound
    if not 1 <= value <= bound:
        raise ConversionError(f"Invalid max_tokens value, the valid range of max_tokens is [1, {bound}]")
    return value


def check_seed(seed: int | None) -> int | None:
    if seed is not None and seed >= 2**63:
        raise ConversionError("Invalid seed value, the valid range of seed is [0, 2^63)")
    return seed


def check_top_logprobs(top_logprobs: int | None, logprobs: bool) -> int | None:
    if top_logprobs is not None:
        if not logprobs:
            raise ConversionError("Invalid top_logprobs and logprobs value, logprobs must be set to true if "
                                  "top_logprobs is used.")
        if top_logprobs > 20:
            raise ConversionError("Invalid top_logprobs value, the valid range of top_logprobs is [0, 20].")
    return top_logprobs


@dataclass(frozen=True, slots=True)
class ToolChoiceSpec:
    """A requested tool choice: ``auto``, ``none``, ``required`` or ``named`` (with ``name``)."""

    mode: str = "auto"
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ResponseFormatSpec:
    """A requested response format: ``text``, ``json_object``, ``json_schema`` (schema, strict), ``regex``.

    ``constraint_schema`` is the schema for the output constraint: :meth:`checked` fills it (strict
    schemas normalised, which may raise the 400s of :mod:`~deepinfer_jax.recipe.strict_schema`).
    """

    kind: str = "text"
    schema: Any = None
    strict: bool = False
    regex: str | None = None
    constraint_schema: Any = None

    def checked(self) -> ResponseFormatSpec:
        if self.kind != "json_schema":
            return self
        return replace(self, constraint_schema=normalize_json_schema(self.schema) if self.strict else self.schema)

    def conversation_kwargs(self) -> dict[str, Any]:
        """``response_format`` / ``response_schema`` / ``response_regex`` for :class:`Conversation`."""
        if self.kind == "json_schema":
            return {"response_format": "json_schema", "response_schema": self.schema}
        if self.kind == "regex":
            return {"response_format": "regex", "response_regex": self.regex}
        return {"response_format": self.kind}


class ContentBuilder:
    """Joins text parts and image placeholders with ``\\n\\n``, recording the placeholder offsets."""

    __slots__ = ("image_token", "images", "offsets", "parts", "pos")

    def __init__(self, image_token: str) -> None:
        self.parts: list[str] = []
        self.offsets: list[int] = []
        self.images: list[Any] = []
        self.pos = 0
        self.image_token = image_token

    def _sep(self) -> None:
        if self.parts:
            self.parts.append("\n\n")
            self.pos += 2

    def text(self, s: str) -> None:
        self._sep()
        self.parts.append(s)
        self.pos += len(s)

    def image(self, source: Any) -> None:
        """A real placeholder for ``source``; None (a model without images) writes the text
        ``[Unsupported Image]`` instead, as the official library does for V4-Pro."""
        if source is None:
            self.text(UNSUPPORTED_IMAGE)
            return
        self._sep()
        self.offsets.append(self.pos)
        self.images.append(source)
        self.parts.append(self.image_token)
        self.pos += len(self.image_token)

    @property
    def content(self) -> str:
        return "".join(self.parts)


def make_tool(name: str, description: str | None, parameters: Any, strict: bool | None,
              defer_loading: bool = False, *, normalize_strict: bool = True,
              check_none: bool = False) -> ToolDefinition:
    """A tool definition: ``strict: true`` parameters are normalised; others are checked as a JSON
    Schema of an object (missing parameters become ``{}`` unless ``check_none``)."""
    if strict and normalize_strict:
        parameters = normalize_tool_parameters(parameters)
    elif parameters is None and not check_none:
        parameters = {}
    else:
        check_tool_parameters(name, parameters)
    return ToolDefinition(name, description, parameters, strict, defer_loading)


def build_tools(raw: Sequence[tuple[Any, ...]], **make_kw: Any) -> list[ToolDefinition]:
    """Tool definitions from ``(name, description, parameters, strict[, defer_loading])`` tuples, in order:
    each name must be new (400 "Tool names must be unique.") and its schema valid."""
    seen: set[str] = set()
    out = []
    for spec in raw:
        if spec[0] in seen:
            raise ConversionError("Tool names must be unique.")
        seen.add(spec[0])
        out.append(make_tool(*spec, **make_kw))
    return out


def resolve_tools(tools: Sequence[ToolDefinition], choice: ToolChoiceSpec, thinking: bool,
                  any_declared: bool = False) -> tuple[tuple[ToolDefinition, ...], str]:
    """(tools kept, conversation tool_choice).

    ``none`` drops the tools; no tools means ``auto`` (Messages: only when the request lists no tool at
    all, dropped web-search tools included); a named choice keeps that tool only and acts as
    ``required``; ``required``/named with thinking on is rejected.
    """
    if choice.mode == "none":
        return (), "none"
    if not tools and not (any_declared and choice.mode == "named"):
        return (), "auto"
    kept = tuple(tools)
    if choice.mode == "named":
        match = [t for t in tools if t.name == choice.name]
        if not match:
            raise ConversionError(f"Invalid value for 'tool_call': no function named '{choice.name}' was "
                                  "specified in the 'tools' parameter.")
        kept = (match[0],)
    if choice.mode in ("named", "required"):
        if thinking:
            raise ConversionError("Thinking mode does not support this tool_choice")
        return kept, "required"
    return kept, "auto"


def check_strict_mix(tools: Sequence[ToolDefinition], response_format_given: bool) -> None:
    """Strict tools cannot be mixed with non-strict ones, nor combined with a ``response_format``."""
    strict = [bool(t.strict) for t in tools]
    if any(strict):
        if not all(strict):
            raise ConversionError("Cannot use strict tool with non-strict tool in the same request")
        if response_format_given:
            raise ConversionError("response_format should not be used with tools")


def check_json_word(messages: Sequence[Message], error: str) -> None:
    """A ``json_object`` format needs the word "json" (any case) in some message content."""
    if not any("json" in m.content.lower() for m in messages):
        raise ConversionError(error)


def fill_reasoning(messages: list[Message], thinking: bool, behavior: ReasoningContentBehavior,
                   tools_declared: bool, field_name: str = "reasoning_content") -> list[Message]:
    """Thinking on: missing assistant reasoning becomes ``""``. Thinking off: all reasoning is dropped.

    REJECT gives 400 for an assistant message after the last user message that lacks reasoning and
    either calls tools or belongs to a request that declares tools (official behaviour).
    """
    if not thinking:
        return [replace(m, reasoning_content=None) if isinstance(m, AssistantMessage) and
                m.reasoning_content is not None else m for m in messages]
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
    out: list[Message] = []
    for i, m in enumerate(messages):
        if isinstance(m, AssistantMessage) and m.reasoning_content is None:
            if behavior is ReasoningContentBehavior.REJECT and (m.tool_calls or tools_declared) and i > last_user:
                raise ConversionError(f"The `{field_name}` in the thinking mode must be passed back to the API.")
            m = replace(m, reasoning_content="")
        out.append(m)
    return out


def _tools_schema(tools: Sequence[ToolDefinition]) -> str:
    items = []
    for t in tools:
        item: dict[str, Any] = {"type": "function", "function": {"name": t.name, "description": t.description,
                                                                 "parameters": t.parameters, "strict": t.strict}}
        if t.defer_loading:
            item["defer_loading"] = True
        items.append(item)
    return dumps_compact(items)


def _initial_stage(conv: Conversation) -> ThinkingInitialStage | None:
    if not conv.thinking_mode:
        return None
    last = conv.messages[-1] if conv.messages else None
    if isinstance(last, AssistantMessage) and last.prefix:
        if last.content or last.tool_calls:
            return ThinkingInitialStage.CONTENT_CONTINUATION
        if last.reasoning_content:
            return ThinkingInitialStage.REASONING_CONTINUATION
    return ThinkingInitialStage.REASONING_START


def build_request(*, conversation: Conversation, version: ModelVersion, response_format: ResponseFormatSpec,
                  options: ConversionOptions, temperature: float, top_p: float, max_tokens: int | None,
                  logprobs: bool, top_logprobs: int | None, seed: int | None, stop: Sequence[str],
                  stream: bool, model: str, **extra: Any) -> ConversationRequest:
    """Assemble the converted request: output constraint and parsing options from the conversation."""
    conv = conversation
    active = conv.tools_active
    if active:
        kind = "tool_call_required" if conv.tool_choice == "required" else "tool_call"
        constraint: OutputConstraint | None = OutputConstraint(kind, _tools_schema(conv.tools))
    elif response_format.kind == "json_object":
        constraint = OutputConstraint("json", "")
    elif response_format.kind == "json_schema":
        constraint = OutputConstraint("json", dumps_compact(response_format.checked().constraint_schema))
    elif response_format.kind == "regex":
        constraint = OutputConstraint("regex", response_format.regex or "")
    else:
        constraint = None
    inference = InferenceOptions(max_tokens=max_tokens, temperature=temperature, top_p=top_p, logprobs=logprobs,
                                 top_logprobs=top_logprobs, seed=seed, output_constraint=constraint)
    parsing = ParsingOptions(parse_tool_calls=active, starts_in_tool_calls=active and conv.tool_choice == "required",
                             parse_json_output=response_format.kind == "json_object",
                             thinking_initial_stage=_initial_stage(conv), stop_sequences=tuple(stop),
                             special_tokens=options.special_tokens)
    return ConversationRequest(conversation=conv, model_version=version, inference_options=inference,
                               parsing_options=parsing, stream=stream, model=model, **extra)
