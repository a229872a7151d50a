"""The internal event model: what the parser found, before any protocol shapes it (recipe.md §8.9).

Every protocol projection (:mod:`.chat_events`, :mod:`.responses_events`, :mod:`.messages_events`)
consumes these, in order: one :class:`Start`, then deltas and tool-call events, then one
:class:`Finish` carrying the usage.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Start:
    """The backend is ready: prompt usage is known."""

    prompt_tokens: int = 0
    cache_hit_tokens: int = 0
    system_fingerprint: str | None = None


@dataclass(slots=True)
class ReasoningDelta:
    text: str


@dataclass(slots=True)
class ContentDelta:
    text: str


@dataclass(slots=True)
class ToolCallStart:
    """A tool call whose name is complete; its arguments follow as :class:`ToolArgsDelta`."""

    index: int
    id: str
    name: str


@dataclass(slots=True)
class ToolArgsDelta:
    """A fragment of the arguments JSON of tool call ``index``."""

    index: int
    text: str


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    cache_hit_tokens: int
    completion_tokens: int
    reasoning_tokens: int | None  # None outside thinking mode or without a tokenizer

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def cache_miss_tokens(self) -> int:
        return self.prompt_tokens - self.cache_hit_tokens


@dataclass(slots=True)
class Finish:
    """The end: ``reason`` is ``stop``, ``length``, ``content_filter`` or ``tool_calls``."""

    reason: str
    usage: Usage
    stop_sequence: str | None = None


Event = Start | ReasoningDelta | ContentDelta | ToolCallStart | ToolArgsDelta | Finish
