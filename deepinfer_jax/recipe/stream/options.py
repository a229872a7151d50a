"""Options of one streamed response: how to parse the model output and how to present it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

Protocol = Literal["chat", "responses", "messages"]
ThinkingStage = Literal["reasoning_start", "reasoning_continuation", "content_continuation"]
FinishReason = Literal["stop", "length", "content_filter"]

PROTOCOLS = ("chat", "responses", "messages")
THINKING_STAGES = ("reasoning_start", "reasoning_continuation", "content_continuation")


@dataclass(frozen=True)
class ParseOptions:
    """How model output is split into reasoning, content and tool calls (the wheel's ``ParsingOptions``).

    ``thinking_stage`` is ``None`` outside thinking mode; otherwise the stage parsing begins in
    (``reasoning_start`` for a fresh turn, the two continuations for prefix continuation). A stage
    also turns on ``reasoning_tokens`` in usage. ``starts_in_tool_calls`` (required tool choice: the
    prompt already opened the DSML block) wins over the thinking stage. ``parse_json_output`` is set
    for ``json_object`` responses. Empty stop sequences are dropped.
    """

    parse_tool_calls: bool = True
    starts_in_tool_calls: bool = False
    parse_json_output: bool = False
    thinking_stage: ThinkingStage | None = None
    stop_sequences: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.thinking_stage is not None and self.thinking_stage not in THINKING_STAGES:
            raise ValueError(f"thinking_stage must be one of {THINKING_STAGES} or None, got {self.thinking_stage!r}")
        if isinstance(self.stop_sequences, str):
            raise TypeError("stop_sequences must be a sequence of strings, not a string")
        object.__setattr__(self, "stop_sequences", tuple(s for s in self.stop_sequences if s))

    @property
    def thinking(self) -> bool:
        """Whether the response is in thinking mode (reasoning tokens are reported)."""
        return self.thinking_stage is not None


@dataclass(frozen=True)
class StreamOptions:
    """Everything a :class:`~deepinfer_jax.recipe.stream.StreamParser` needs for one response.

    ``response_id``, ``created`` and ``model`` are what the protocol objects report; ``created`` is
    the wall clock at construction unless given (tests fix it). ``thinking`` is the conversation's
    thinking mode (Chat shows ``reasoning_content``, Messages opens thinking blocks); it defaults to
    ``parse.thinking``. ``responses_echo`` is the request echo a Responses object reports (see
    :func:`~deepinfer_jax.recipe.stream.responses_echo`); ``namespace_tool_map`` maps flattened
    Responses tool names (``fs::read``) to ``(namespace, name)``. ``messages_signature`` is the
    signature closing Messages thinking blocks (default: the response id). ``chat_include_usage``
    (Chat ``stream_options.include_usage``, or a non-streamed request) puts ``"usage": null`` in every
    chunk before the last, as the official library does. ``tool_call_id`` makes
    tool-call ids deterministic: called with the call index, it returns the id (default: ``call_``
    + 2-digit index + ``_`` + 24 random alphanumerics, as the official library).
    """

    protocol: Protocol = "chat"
    parse: ParseOptions = field(default_factory=ParseOptions)
    response_id: str = "resp"
    model: str = "DeepSeek-V4.1-Flash"
    created: int | None = None
    thinking: bool | None = None
    responses_echo: dict[str, Any] | None = None
    namespace_tool_map: dict[str, tuple[str, str]] | None = None
    messages_signature: str | None = None
    chat_include_usage: bool = False
    tool_call_id: Any = None

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if self.created is None:
            object.__setattr__(self, "created", int(time.time()))
        if self.thinking is None:
            object.__setattr__(self, "thinking", self.parse.thinking)

    @property
    def starts_in_reasoning(self) -> bool:
        """Whether output starts as reasoning (shown in the first Chat delta)."""
        return not self.parse.starts_in_tool_calls and self.parse.thinking_stage in (
            "reasoning_start", "reasoning_continuation")
