"""Conversion options and the converted request: inference and parsing settings (recipe.md §1, §2).

- :class:`ConversionOptions`: how requests are converted (model names, defaults, behaviours).
- :class:`ConversationRequest`: the result, a :class:`Conversation` plus :class:`InferenceOptions`
  (sampling settings for the engine), :class:`ParsingOptions` (settings for the streaming parser in
  ``recipe.stream``), the target :class:`ModelVersion` and the ``stream`` flag.

Field names follow the official wheel so code written against it reads the same.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from deepinfer_jax.recipe.conversation import Conversation
from deepinfer_jax.recipe.errors import ConversionError
from deepinfer_jax.recipe.render import ModelVersion
from deepinfer_jax.recipe.special_tokens import DEFAULT_SPECIAL_TOKENS, SpecialTokens

__all__ = [
    "DEFAULT_MODEL_VERSIONS",
    "ConversationRequest",
    "ConversionOptions",
    "InferenceOptions",
    "ModelVersion",
    "OutputConstraint",
    "ParsingOptions",
    "ReasoningContentBehavior",
    "ThinkingInitialStage",
    "WebSearchBehavior",
]

MAX_TOKENS_UPPER_BOUND = 393216


class WebSearchBehavior(enum.Enum):
    """What conversion does with web-search tool declarations and blocks."""

    DROP = "Drop"
    REJECT = "Reject"


class ReasoningContentBehavior(enum.Enum):
    """What conversion does with assistant history lacking reasoning in thinking mode."""

    FILL_EMPTY = "FillEmpty"
    REJECT = "Reject"


class ThinkingInitialStage(enum.Enum):
    """Where the streaming parser starts in thinking mode."""

    REASONING_START = "ReasoningStart"
    REASONING_CONTINUATION = "ReasoningContinuation"
    CONTENT_CONTINUATION = "ContentContinuation"

    def starts_in_reasoning(self) -> bool:
        return self is not ThinkingInitialStage.CONTENT_CONTINUATION


DEFAULT_MODEL_VERSIONS: Mapping[str, ModelVersion] = MappingProxyType({
    "DeepSeek-V4-Pro": ModelVersion.DEEPSEEK_V4_PRO,
    "DeepSeek-V4.1-Flash": ModelVersion.DEEPSEEK_V41_FLASH,
})


@dataclass(frozen=True)
class ConversionOptions:
    """Options for request conversion (defaults = the official library's).

    Attributes:
        default_thinking_mode: thinking mode for requests that say nothing about it.
        reasoning_content_behavior: FILL_EMPTY or REJECT missing assistant reasoning (thinking mode).
        responses_web_search / messages_web_search: DROP or REJECT web-search declarations.
        thinking_max_tokens_upper_bound / non_thinking_max_tokens_upper_bound: largest ``max_tokens``.
        model_versions_by_name: accepted request model names and their versions (order kept: it is
            the order of the "supported names" error message).
        special_tokens: spellings used for image placeholders and parsing.
    """

    default_thinking_mode: bool = True
    reasoning_content_behavior: ReasoningContentBehavior = ReasoningContentBehavior.FILL_EMPTY
    responses_web_search: WebSearchBehavior = WebSearchBehavior.DROP
    messages_web_search: WebSearchBehavior = WebSearchBehavior.REJECT
    thinking_max_tokens_upper_bound: int = MAX_TOKENS_UPPER_BOUND
    non_thinking_max_tokens_upper_bound: int = MAX_TOKENS_UPPER_BOUND
    model_versions_by_name: Mapping[str, ModelVersion] = field(default_factory=lambda: dict(DEFAULT_MODEL_VERSIONS))
    special_tokens: SpecialTokens = DEFAULT_SPECIAL_TOKENS

    def __post_init__(self) -> None:
        for name in ("thinking_max_tokens_upper_bound", "non_thinking_max_tokens_upper_bound"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1")
        object.__setattr__(self, "model_versions_by_name",
                           {str(k): ModelVersion.parse(v) for k, v in dict(self.model_versions_by_name).items()})

    def with_model_alias(self, model: str, version: ModelVersion | str) -> ConversionOptions:
        """Accept ``model`` as a name of ``version`` (adds it, or replaces its version)."""
        return replace(self, model_versions_by_name={**self.model_versions_by_name, model: ModelVersion.parse(version)})

    def with_(self, **changes: Any) -> ConversionOptions:
        """A copy with some fields changed."""
        return replace(self, **changes)


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """An advisory constraint for constrained decoding.

    ``kind``: ``json`` (schema = compact JSON Schema, or "" for any JSON value), ``regex``,
    ``tool_call`` / ``tool_call_required`` (schema = compact JSON array of Chat-style function tools).
    """

    kind: str
    schema: str


@dataclass(frozen=True, slots=True)
class InferenceOptions:
    """Sampling settings for the engine. ``temperature``/``top_p`` are already resolved (f32 values)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    seed: int | None = None
    output_constraint: OutputConstraint | None = None


@dataclass(frozen=True, slots=True)
class ParsingOptions:
    """Settings for the streaming output parser.

    Attributes:
        parse_tool_calls: parse DSML tool calls (tools active).
        starts_in_tool_calls: the prompt opened a tool-call block (required tool choice).
        parse_json_output: recognise fenced/bare JSON (json_object format).
        thinking_initial_stage: where parsing starts in thinking mode; None when thinking is off.
        stop_sequences: strings that end the output.
        special_tokens: spellings of the markers.
    """

    parse_tool_calls: bool = True
    starts_in_tool_calls: bool = False
    parse_json_output: bool = False
    thinking_initial_stage: ThinkingInitialStage | None = None
    stop_sequences: tuple[str, ...] = ()
    special_tokens: SpecialTokens = DEFAULT_SPECIAL_TOKENS


@dataclass(frozen=True)
class ConversationRequest:
    """A converted request.

    ``namespace_tool_map`` (Responses only): flattened tool name -> (namespace, local name).
    ``echo`` (Responses only): the request settings a Responses response reports.
    """

    conversation: Conversation
    model_version: ModelVersion
    inference_options: InferenceOptions = field(default_factory=InferenceOptions)
    parsing_options: ParsingOptions = field(default_factory=ParsingOptions)
    stream: bool = False
    model: str = ""
    namespace_tool_map: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    echo: Mapping[str, Any] = field(default_factory=dict)

    def resolve_max_tokens(self, prompt_tokens: int, context_limit: int) -> int:
        """The ``max_tokens`` to send to the backend for a prompt of ``prompt_tokens`` tokens.

        A requested value is kept; otherwise 8192 outside thinking, 131072 for thinking with ``max``
        effort, 65536 for other thinking. The result is lowered to the context left and raised to at
        least 1. Raises :class:`ConversionError` when prompt + requested > context (without a request:
        when the prompt alone exceeds it).
        """
        requested = self.inference_options.max_tokens
        conv = self.conversation
        if requested is not None:
            if prompt_tokens + requested > context_limit:
                raise ConversionError(
                    f"This model's maximum context length is {context_limit} tokens. However, you requested "
                    f"{prompt_tokens + requested} tokens ({prompt_tokens} in the messages, {requested} in the "
                    f"completion). Please reduce the length of the messages or completion.")
            wanted = requested
        else:
            if prompt_tokens > context_limit:
                raise ConversionError(
                    f"This model's maximum context length is {context_limit} tokens. However, you requested "
                    f"{prompt_tokens} tokens ({prompt_tokens} in the messages, 0 in the completion). "
                    f"Please reduce the length of the messages or completion.")
            if not conv.thinking_mode:
                wanted = 8192
            else:
                wanted = 131072 if conv.reasoning_effort == "max" else 65536
        return max(1, min(wanted, context_limit - prompt_tokens))
