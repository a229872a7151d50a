"""Errors of the HTTP server, in each protocol's own shape and status.

OpenAI's endpoints (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
``/v1/models``) answer ``{"error": {"message", "type", "param", "code"}}``; Anthropic's
``/v1/messages`` answers ``{"type": "error", "error": {"type", "message"}}`` (no ``param`` field:
the field's name leads the message instead).

=======  =================================================  ===========================
status   cause                                              Anthropic ``error.type``
=======  =================================================  ===========================
400      the recipe's ``ConversionError`` (its message and   invalid_request_error
         ``param``), an engine ``RequestError`` (its field),
         malformed JSON, a body that is not an object
401      ``--api-key`` set and the request lacks it         authentication_error
404      a ``model`` the server does not serve              not_found_error
413      a body over the size limit                         request_too_large
503      the engine is at capacity (``EngineOverloaded``,   overloaded_error
         with ``Retry-After``) or has failed
500      anything unexpected (the server keeps serving)     api_error
=======  =================================================  ===========================
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_jax.engine.async_engine import EngineDead, EngineOverloaded
from deepinfer_jax.engine.sampling_params import RequestError
from deepinfer_jax.recipe import ConversionError

__all__ = ["ApiError", "error_body", "from_exception"]

_OPENAI_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                413: "invalid_request_error", 503: "server_error", 500: "server_error"}
_ANTHROPIC_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   413: "request_too_large", 503: "overloaded_error", 500: "api_error"}


@dataclass
class ApiError(Exception):
    """An error answer: HTTP ``status``, ``message``, the field ``param`` and OpenAI's ``code``."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    error_type: str | None = None  # OpenAI's type when it is not the status's default

    def __str__(self) -> str:
        return self.message


def from_exception(e: BaseException) -> ApiError:
    """The answer to an exception raised while preparing or running a request."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, ConversionError):
        return ApiError(e.status_code, e.message, e.param, e.code, e.error_type)
    if isinstance(e, RequestError):
        return ApiError(400, str(e), e.field, "invalid_request_error")
    if isinstance(e, EngineOverloaded):
        return ApiError(503, str(e), None, "overloaded")
    if isinstance(e, EngineDead):
        return ApiError(503, str(e), None, "engine_dead")
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error")


def error_body(protocol: str, err: ApiError) -> dict:
    """The JSON body of ``err`` for ``protocol`` ("messages" is Anthropic's, the rest OpenAI's)."""
    if protocol == "messages":
        message = err.message
        if err.param and err.param not in message:
            message = f"{err.param}: {message}"
        return {"type": "error", "error": {"type": _ANTHROPIC_TYPE.get(err.status, "api_error"), "message": message}}
    return {"error": {"message": err.message, "type": err.error_type or _OPENAI_TYPE.get(err.status, "server_error"),
                      "param": err.param, "code": err.code}}
