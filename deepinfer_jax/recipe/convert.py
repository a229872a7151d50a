"""One entry point for the three protocols: :func:`convert_request`."""

from __future__ import annotations

from typing import Any, Literal

from deepinfer_jax.recipe.convert_chat import convert_chat
from deepinfer_jax.recipe.options import ConversationRequest, ConversionOptions

__all__ = ["PROTOCOLS", "convert_request"]

PROTOCOLS = ("chat", "responses", "messages")


def convert_request(request: Any, protocol: Literal["chat", "responses", "messages"] = "chat",
                    options: ConversionOptions | None = None) -> ConversationRequest:
    """Convert a protocol request body (a dict of parsed JSON, JSON text or bytes).

    Raises :class:`~deepinfer_jax.recipe.errors.RequestBodyError` (a ``ValueError`` and a 400) when the
    body does not match the protocol schema, :class:`~deepinfer_jax.recipe.errors.ConversionError`
    (400, OpenAI-style ``body``) when it breaks a rule.
    """
    if protocol == "chat":
        return convert_chat(request, options)
    if protocol == "responses":
        from deepinfer_jax.recipe.convert_responses import convert_responses

        return convert_responses(request, options)
    if protocol == "messages":
        from deepinfer_jax.recipe.convert_messages import convert_messages

        return convert_messages(request, options)
    raise ValueError(f"unknown protocol {protocol!r}; expected one of {PROTOCOLS}")
