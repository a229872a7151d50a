"""The conversation model shared by the three protocols (recipe.md §3).

Plain frozen dataclasses, the same fields as the official wheel's classes:

- messages: :class:`SystemMessage`, :class:`UserMessage`, :class:`AssistantMessage`,
  :class:`ToolMessage`, :class:`LatestReminderMessage` (all with ``role`` and ``content``);
- :class:`ToolCall` (arguments kept as text), :class:`ToolDefinition`, :class:`ImageSource`;
- :class:`Conversation`: messages plus thinking mode, tools, tool choice, effort, response format.

Image placeholders: user, system and tool content may hold the image token spelling. Only the
occurrences listed in ``image_offsets`` (code-point offsets into ``content``) are real placeholders,
rendered as the special image token; any other occurrence is text the user typed. Conversion records
the offsets it creates; a message built directly takes the first ``len(image_sources)`` occurrences,
as the wheel does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from deepinfer_jax.recipe.special_tokens import IMAGE

__all__ = [
    "AssistantMessage",
    "Conversation",
    "ImageSource",
    "LatestReminderMessage",
    "Message",
    "ReasoningEffort",
    "ResponseFormat",
    "SystemMessage",
    "ToolCall",
    "ToolChoice",
    "ToolDefinition",
    "ToolMessage",
    "UserMessage",
]

ToolChoice = Literal["auto", "none", "required"]
ReasoningEffort = Literal["low", "high", "xhigh", "max"]
ResponseFormat = Literal["text", "json_object", "json_schema", "regex"]
ImageDetail = Literal["low", "high", "original", "auto"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A historical tool call. ``arguments`` is the caller's text (expected: a JSON object), not validated."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolDefinition:
    """A client function tool. ``parameters`` is its JSON Schema (strict tools normalised by conversion)."""

    name: str
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None
    defer_loading: bool = False


@dataclass(frozen=True, slots=True)
class ImageSource:
    """An image attached to a message: a data URL, an external URL or encoded bytes.

    ``path`` is the request location reported in errors (e.g. ``.messages[0]``), empty if built directly.
    """

    kind: Literal["data_url", "url", "bytes"]
    detail: ImageDetail = "high"
    data_url: str | None = None
    url: str | None = None
    data: bytes | None = None
    path: str = ""

    @classmethod
    def from_data_url(cls, data_url: str, detail: ImageDetail = "high", *, path: str = "") -> ImageSource:
        return cls("data_url", detail, data_url=data_url, path=path)

    @classmethod
    def from_url(cls, url: str, detail: ImageDetail = "high", *, path: str = "") -> ImageSource:
        return cls("url", detail, url=url, path=path)

    @classmethod
    def from_bytes(cls, data: bytes, detail: ImageDetail = "high", *, path: str = "") -> ImageSource:
        return cls("bytes", detail, data=data, path=path)


def _first_occurrences(content: str, token: str, n: int) -> tuple[int, ...]:
    """Offsets of the first ``n`` non-overlapping occurrences of ``token`` in ``content``."""
    out: list[int] = []
    start = 0
    while len(out) < n:
        i = content.find(token, start)
        if i < 0:
            break
        out.append(i)
        start = i + len(token)
    return tuple(out)


class Message:
    """Base of the message classes; role-specific fields have fixed values on other roles."""

    __slots__ = ()
    role: str
    content: str
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    tool_call_id: str | None = None
    prefix: bool = False
    image_sources: tuple[ImageSource, ...] = ()
    image_offsets: tuple[int, ...] = ()
    image_token: str = IMAGE


class _WithImages:
    """``__post_init__`` shared by messages that carry images: fills ``image_offsets`` when omitted."""

    __slots__ = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_sources", tuple(self.image_sources))  # type: ignore[attr-defined]
        if not self.image_token:  # type: ignore[attr-defined]
            raise ValueError("image_token must not be empty")
        if self.image_offsets is None:  # type: ignore[attr-defined]
            offsets = _first_occurrences(self.content, self.image_token, len(self.image_sources))  # type: ignore
            object.__setattr__(self, "image_offsets", offsets)
        else:
            object.__setattr__(self, "image_offsets", tuple(self.image_offsets))  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class SystemMessage(_WithImages, Message):
    """A system message; ``tools`` (rare) are listed as updated tool schemas after its content."""

    content: str
    image_sources: tuple[ImageSource, ...] = ()
    tools: tuple[ToolDefinition, ...] | None = None
    image_offsets: tuple[int, ...] | None = None
    image_token: str = IMAGE
    role: Literal["system"] = field(default="system", init=False)


@dataclass(frozen=True, slots=True)
class UserMessage(_WithImages, Message):
    """A user message."""

    content: str
    image_sources: tuple[ImageSource, ...] = ()
    image_offsets: tuple[int, ...] | None = None
    image_token: str = IMAGE
    role: Literal["user"] = field(default="user", init=False)


@dataclass(frozen=True, slots=True)
class AssistantMessage(Message):
    """An assistant turn; ``prefix`` marks the final message that the model continues."""

    content: str
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    prefix: bool = False
    role: Literal["assistant"] = field(default="assistant", init=False)

    def __post_init__(self) -> None:
        if self.tool_calls is not None:
            object.__setattr__(self, "tool_calls", tuple(self.tool_calls))


@dataclass(frozen=True, slots=True)
class ToolMessage(_WithImages, Message):
    """A tool result; rendered as user content wrapped in ``<tool_result>``."""

    content: str
    tool_call_id: str | None = None
    image_sources: tuple[ImageSource, ...] = ()
    image_offsets: tuple[int, ...] | None = None
    image_token: str = IMAGE
    role: Literal["tool"] = field(default="tool", init=False)


@dataclass(frozen=True, slots=True)
class LatestReminderMessage(Message):
    """A reminder carrying extra instructions; never merged with neighbours."""

    content: str
    role: Literal["latest_reminder"] = field(default="latest_reminder", init=False)


_EFFORTS = ("low", "high", "xhigh", "max")


@dataclass(frozen=True, slots=True)
class Conversation:
    """Messages and prompt configuration.

    ``response_format`` is ``text``, ``json_object``, ``json_schema`` (with ``response_schema``) or
    ``regex`` (with ``response_regex``). ``reasoning_effort`` None renders as ``high`` in thinking mode.
    """

    messages: tuple[Message, ...] = ()
    thinking_mode: bool = True
    tools: tuple[ToolDefinition, ...] = ()
    tool_choice: ToolChoice = "auto"
    reasoning_effort: ReasoningEffort | None = None
    response_format: ResponseFormat = "text"
    response_schema: Any = None
    response_regex: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(self.messages))
        object.__setattr__(self, "tools", tuple(self.tools or ()))
        if self.tool_choice not in ("auto", "none", "required"):
            raise ValueError(f"tool_choice must be auto, none or required, got {self.tool_choice!r}")
        if self.reasoning_effort is not None and self.reasoning_effort not in _EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {_EFFORTS} or None, got {self.reasoning_effort!r}")
        fmt = self.response_format
        if self.response_schema is not None and self.response_regex is not None:
            raise ValueError("response_schema and response_regex are exclusive")
        if fmt == "text" and self.response_schema is not None:
            object.__setattr__(self, "response_format", "json_schema")
        elif fmt == "text" and self.response_regex is not None:
            object.__setattr__(self, "response_format", "regex")
        elif fmt == "json_object" and (self.response_schema is not None or self.response_regex is not None):
            raise ValueError("json_object takes no response_schema or response_regex")
        elif fmt == "json_schema" and self.response_schema is None:
            raise ValueError("json_schema needs response_schema")
        elif fmt == "regex" and self.response_regex is None:
            raise ValueError("regex needs response_regex")
        elif fmt not in ("text", "json_object", "json_schema", "regex"):
            raise ValueError(f"unknown response_format {fmt!r}")

    @property
    def tools_active(self) -> bool:
        """Whether tools are effective: declared and ``tool_choice != "none"`` (recipe.md pitfall 4)."""
        return bool(self.tools) and self.tool_choice != "none"
