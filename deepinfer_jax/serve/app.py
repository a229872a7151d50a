"""The FastAPI application: routes, authentication, body checks, error answers.

``build_app(llm)`` wraps an ``LLM`` in an ``AsyncEngine`` (started and stopped with the app's
lifespan) and serves:

- ``POST /v1/chat/completions``, ``/v1/responses``, ``/v1/messages``: through the recipe
  (``serve.handlers``), JSON or SSE (``"stream": true``) in the protocol's own shape;
- ``POST /v1/completions``: OpenAI's text completions (``deepinfer_jax.completions``);
- ``GET /v1/models``: the accepted model names (Anthropic's list shape when the request carries
  an ``anthropic-version`` header), ``GET /v1/models/{id}``;
- ``GET /health`` (200 once the engine thread runs, 503 when it failed), ``GET /metrics``.

With ``api_key`` set, ``/v1/*`` needs it as ``Authorization: Bearer KEY`` or ``x-api-key: KEY``
(401 otherwise); ``/health`` and ``/metrics`` stay open. Errors: ``serve.errors``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from deepinfer_jax.chat import prepare
from deepinfer_jax.completions import prepare_completion
from deepinfer_jax.engine.async_engine import AsyncEngine
from deepinfer_jax.recipe import ModelVersion
from deepinfer_jax.recipe.stream import token_table
from deepinfer_jax.serve import handlers
from deepinfer_jax.serve.errors import ApiError, error_body, from_exception
from deepinfer_jax.serve.metrics import Metrics, engine_snapshot

__all__ = ["ServerState", "build_app"]

_log = logging.getLogger("deepinfer_jax.serve")


@dataclass
class ServerState:
    """What the routes share: the model, its engine thread, the counters and the settings."""

    llm: object
    engine: AsyncEngine
    metrics: Metrics
    models: list[str]
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    created: int = field(default_factory=lambda: int(time.time()))
    engine_metrics: dict | None = None  # the latest engine snapshot (kept when a read times out)


class _SSE(StreamingResponse):
    """An SSE response whose ``on_close`` runs however the response ends (client gone included)."""

    def __init__(self, content, on_close) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def build_app(llm, *, api_key: str | None = None, max_queued: int = 256, served_model_name: str | None = None,
              max_body_bytes: int = 8 << 20) -> FastAPI:
    """The server app over ``llm`` (see the module docstring). ``served_model_name`` is accepted as
    another name of DeepSeek-V4.1-Flash; ``max_queued`` bounds the requests admitted at once
    (``AsyncEngine``); bodies over ``max_body_bytes`` get 413."""
    if served_model_name:
        llm.conversion_options = llm.conversion_options.with_model_alias(served_model_name,
                                                                       ModelVersion.DEEPSEEK_V41_FLASH)
    token_table(llm.parser_tokenizer)  # tokenizers and tables built now, not by the first requests
    llm.prompt_tokenizer  # noqa: B018
    state = ServerState(llm=llm, engine=AsyncEngine(llm.engine, max_queued=max_queued), metrics=Metrics(),
                        models=list(llm.conversion_options.model_versions_by_name), api_key=api_key,
                        max_body_bytes=max_body_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        try:
            yield
        finally:
            state.engine.stop()
            llm.save_profiles()  # what a lazily started engine fitted online, for the next start

    app = FastAPI(title="deepinfer-jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    def error(protocol: str, e: BaseException, endpoint: str) -> JSONResponse:
        err = from_exception(e)
        if err.status >= 500 and err.code not in ("overloaded", "engine_dead"):
            _log.error("%s failed", endpoint, exc_info=e)
        state.metrics.answered(endpoint, err.status)
        headers = {"Retry-After": "1"} if err.code == "overloaded" else None
        return JSONResponse(error_body(protocol, err), status_code=err.status, headers=headers)

    def authorize(request: Request) -> None:
        if state.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), state.api_key.encode()):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY or x-api-key: KEY)",
                           code="invalid_api_key")

    async def json_body(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > state.max_body_bytes:
            raise ApiError(413, f"the request body is larger than {state.max_body_bytes} bytes")
        raw = await request.body()
        if len(raw) > state.max_body_bytes:
            raise ApiError(413, f"the request body is larger than {state.max_body_bytes} bytes")
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise ApiError(400, f"invalid request body: not valid JSON ({e})", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"invalid request body: expected a JSON object, got {type(body).__name__}")
        model = body.get("model")
        if isinstance(model, str) and model not in state.models:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves {', '.join(state.models)}",
                           param="model", code="model_not_found")
        return body

    async def recipe_route(request: Request, protocol: str):
        arrival, endpoint = time.perf_counter(), request.url.path
        try:
            authorize(request)
            body = await json_body(request)
            prepared = prepare(llm, body, protocol)
            stream = await state.engine.add_request(prepared.ids, prepared.params)
        except Exception as e:  # noqa: BLE001 - every failure is an answer in the protocol's shape
            return error(protocol, e, endpoint)
        run = handlers.Run(state, stream, len(prepared.ids), arrival)
        if body.get("stream") is True:
            state.metrics.answered(endpoint, 200)
            return _SSE(handlers.recipe_events(state, prepared, run, protocol), run.close)
        return await _complete(request, run, handlers.recipe_response(state, prepared, run), protocol, endpoint)

    async def _complete(request: Request, run, job, protocol: str, endpoint: str):
        watcher = asyncio.create_task(handlers.watch_disconnect(request, run))
        try:
            result = await job
        except Exception as e:  # noqa: BLE001
            return error(protocol, e, endpoint)
        finally:
            watcher.cancel()
            run.close()
        state.metrics.answered(endpoint, 200)
        return JSONResponse(result)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await recipe_route(request, "chat")

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await recipe_route(request, "responses")

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await recipe_route(request, "messages")

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival, endpoint = time.perf_counter(), request.url.path
        try:
            authorize(request)
            prepared = prepare_completion(llm, await json_body(request))
            stream = await state.engine.add_request(prepared.ids, prepared.params, prompt=prepared.prompt)
        except Exception as e:  # noqa: BLE001
            return error("completions", e, endpoint)
        run = handlers.Run(state, stream, len(prepared.ids), arrival)
        if prepared.stream:
            state.metrics.answered(endpoint, 200)
            return _SSE(handlers.completion_events(state, prepared, run), run.close)
        return await _complete(request, run, handlers.completion_json(state, prepared, run), "completions", endpoint)

    def model_card(name: str, anthropic: bool) -> dict:
        if anthropic:
            created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(state.created))
            return {"type": "model", "id": name, "display_name": name, "created_at": created}
        return {"id": name, "object": "model", "created": state.created, "owned_by": "deepinfer-jax"}

    @app.get("/v1/models")
    async def models(request: Request):
        anthropic = "anthropic-version" in request.headers
        try:
            authorize(request)
        except ApiError as e:
            return error("messages" if anthropic else "models", e, "/v1/models")
        cards = [model_card(m, anthropic) for m in state.models]
        if anthropic:
            return {"data": cards, "has_more": False, "first_id": state.models[0], "last_id": state.models[-1]}
        return {"object": "list", "data": cards}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str):
        protocol = "messages" if "anthropic-version" in request.headers else "models"
        try:
            authorize(request)
            if model not in state.models:
                raise ApiError(404, f"The model `{model}` does not exist", param="model", code="model_not_found")
        except ApiError as e:
            return error(protocol, e, "/v1/models")
        return model_card(model, protocol == "messages")

    @app.get("/health")
    async def health():
        if state.engine.alive:
            return {"status": "ok"}
        reason = "the engine failed" if state.engine.error is not None else "the engine is not running"
        return JSONResponse({"status": "error", "message": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        if state.engine.alive:
            try:
                fut = state.engine.call(lambda: engine_snapshot(llm))
                state.engine_metrics = await asyncio.wait_for(asyncio.wrap_future(fut), timeout=2.0)
            except (TimeoutError, asyncio.TimeoutError, RuntimeError):
                pass  # the engine is busy (compiling): the previous snapshot
        return PlainTextResponse(state.metrics.render(state.engine_metrics),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
