"""deepseek-recipe in pure Python (recipe.md): request conversion, prompt rendering and encoding.

Host code (no JAX). Conformant with the official ``deepseek-recipe==0.2.0`` wheel, which the tests in
``tests/recipe`` use as the oracle. The streaming output parser lives in :mod:`deepinfer_jax.recipe.stream`.

Typical use::

    from deepinfer_jax import recipe

    req = recipe.convert_request(body, "chat")          # or "responses" / "messages"
    prompt = recipe.render(req.conversation, req.model_version)
    ids = recipe.encode_rendered(prompt, recipe.load_prompt_tokenizer())
    max_tokens = req.resolve_max_tokens(len(ids), context_limit)
    # sampling: req.inference_options; output parsing: req.parsing_options
"""

from deepinfer_jax.recipe.conversation import (
    AssistantMessage,
    Conversation,
    ImageSource,
    LatestReminderMessage,
    Message,
    SystemMessage,
    ToolCall,
    ToolDefinition,
    ToolMessage,
    UserMessage,
)
from deepinfer_jax.recipe.convert import PROTOCOLS, convert_request
from deepinfer_jax.recipe.encode import EncodingError, encode, encode_many, encode_rendered
from deepinfer_jax.recipe.errors import ConversionError, RequestBodyError
from deepinfer_jax.recipe.options import (
    ConversationRequest,
    ConversionOptions,
    InferenceOptions,
    OutputConstraint,
    ParsingOptions,
    ReasoningContentBehavior,
    ThinkingInitialStage,
    WebSearchBehavior,
)
from deepinfer_jax.recipe.render import ModelVersion, RenderedPrompt, render
from deepinfer_jax.recipe.special_tokens import (
    V4_TOKEN_IDS,
    V41_SYSTEM_TOKEN_ID,
    SpecialToken,
    SpecialTokens,
)
from deepinfer_jax.recipe.tokenizer import PromptTokenizer, load_prompt_tokenizer, v41_tokenizer_json

__all__ = [
    "PROTOCOLS",
    "V4_TOKEN_IDS",
    "V41_SYSTEM_TOKEN_ID",
    "AssistantMessage",
    "Conversation",
    "ConversationRequest",
    "ConversionError",
    "ConversionOptions",
    "EncodingError",
    "ImageSource",
    "InferenceOptions",
    "LatestReminderMessage",
    "Message",
    "ModelVersion",
    "OutputConstraint",
    "ParsingOptions",
    "PromptTokenizer",
    "ReasoningContentBehavior",
    "RenderedPrompt",
    "RequestBodyError",
    "SpecialToken",
    "SpecialTokens",
    "SystemMessage",
    "ThinkingInitialStage",
    "ToolCall",
    "ToolDefinition",
    "ToolMessage",
    "UserMessage",
    "WebSearchBehavior",
    "convert_request",
    "encode",
    "encode_many",
    "encode_rendered",
    "load_prompt_tokenizer",
    "render",
    "v41_tokenizer_json",
]
