"""One request's run through the ``AsyncEngine``: recipe protocols and ``/v1/completions``.

Recipe protocols (Chat Completions, Responses, Messages): ``chat.prepare`` converts, renders and
encodes the body; the engine streams deltas; a ``StreamParser`` turns their ids into the protocol's
stream events (streamed as SSE) or, accumulated by ``chat.final_response``, into its response JSON.
The parser's ``ready`` runs with the first delta, when the prefix cache's hit (``cached_tokens``
in usage) is known. A stop sequence the parser sees ends the request in the engine at once.

Every run ends by aborting its request unless it finished, so a client that goes away (the SSE
response is cancelled, or ``watch_disconnect`` sees ``http.disconnect``) frees its blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from deepinfer_jax.chat import budget_warning, final_response
from deepinfer_jax.chat_logprobs import attach
from deepinfer_jax.completions import _logprobs, completion_chunk, completion_response
from deepinfer_jax.engine.outputs import CompletionOutput, RequestOutput
from deepinfer_jax.recipe.stream import StreamEvent
from deepinfer_jax.recipe.stream.protocol import dumps
from deepinfer_jax.serve.errors import error_body, from_exception

__all__ = ["Run", "watch_disconnect"]


class Run:
    """One admitted request: its stream, timing and metrics (``close`` records them once)."""

    def __init__(self, state, stream, prompt_tokens: int, arrival: float) -> None:
        self.state, self.stream, self.prompt_tokens, self.arrival = state, stream, prompt_tokens, arrival
        self.first = self.last = None
        self.tokens: list[int] = []
        self.cached = 0
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.logprobs: list | None = None
        self.text: list[str] = []
        self._closed = False
        state.metrics.running += 1

    async def deltas(self) -> AsyncIterator[RequestOutput]:
        """The engine's deltas (timing recorded); ends with the finished one."""
        async for d in self.stream:
            out = d.outputs[0]
            now = time.perf_counter()
            if out.token_ids:
                self.first = self.first or now
                self.last = now
            self.tokens += out.token_ids
            self.text.append(out.text)
            self.cached = d.num_cached_tokens
            if out.logprobs is not None:
                self.logprobs = (self.logprobs or []) + out.logprobs
            if d.finished:
                self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
            yield d

    async def drain(self) -> None:
        """Run the request to its end (non-streaming answers), then ``close``."""
        try:
            async for _ in self.deltas():
                pass
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it finished; record its metrics (once)."""
        if self._closed:
            return
        self._closed = True
        self.stream.abort()
        m = self.state.metrics
        m.running -= 1
        n = len(self.tokens)
        ttft = None if self.first is None else self.first - self.arrival
        tpot = (self.last - self.first) / (n - 1) if n > 1 else None
        m.finished(self.prompt_tokens, n, self.cached, ttft, tpot, time.perf_counter() - self.arrival)


async def watch_disconnect(request, run: Run) -> None:
    """Abort ``run`` when the client disconnects (non-streaming answers; cancel when done)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            run.stream.abort()
            return


def _finish(engine_reason: str | None) -> str:
    return "length" if engine_reason == "length" else "stop"


# ---- recipe protocols ----
async def recipe_response(state, prepared, run: Run) -> dict:
    """The protocol's final response JSON."""
    await run.drain()
    return final_response(state.llm, prepared, run.tokens, run.finish_reason, run.cached, run.logprobs)


async def recipe_events(state, prepared, run: Run, protocol: str) -> AsyncIterator[str]:
    """The protocol's SSE messages (Chat ends with ``data: [DONE]``)."""
    llm, eos = state.llm, state.llm.engine.eos_token_id
    parser = prepared.parser(llm)
    started = False
    top, pending = prepared.params.logprobs, []  # Chat logprobs of tokens no chunk has shown yet
    try:
        async for d in run.deltas():
            if not started:
                started = True
                for e in parser.ready(prompt_tokens=len(prepared.ids), cache_hit_tokens=d.num_cached_tokens):
                    yield e.sse()
            out = d.outputs[0]
            keep = [k for k, t in enumerate(out.token_ids) if t != eos]  # the end of sequence is not text
            if keep and not parser.finished:
                events = parser.push_ids([out.token_ids[k] for k in keep])
                if top is not None:
                    pending += [out.logprobs[k] for k in keep]
                    events = attach(events, pending, llm.tokenizer, top)
                for e in events:
                    yield e.sse()
            if parser.finished:  # the parser saw a stop sequence: the engine may stop now
                break
        if not started:  # ended before any delta (engine shutting down)
            for e in parser.ready(prompt_tokens=len(prepared.ids), cache_hit_tokens=run.cached):
                yield e.sse()
        if not parser.finished:
            finish = _finish(run.finish_reason)
            events = parser.finish(finish)
            if top is not None:
                events = attach(events, pending, llm.tokenizer, top)
            warning = budget_warning(llm, prepared.params, prepared.options, run.tokens, finish)
            if warning is not None and events:
                events[-1] = StreamEvent({**events[-1].data, "warning": warning}, events[-1].event)
            for e in events:
                yield e.sse()
        done = parser.sse_done()
        if done is not None:
            yield done
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - the headers are sent: report in the stream
        yield stream_error(protocol, e)
    finally:
        run.close()


def stream_error(protocol: str, e: BaseException) -> str:
    """An error inside an SSE stream, in the protocol's shape."""
    body = dumps(error_body(protocol, from_exception(e)))
    return f"event: error\ndata: {body}\n\n" if protocol == "messages" else f"data: {body}\n\n"


# ---- /v1/completions ----
async def completion_json(state, prepared, run: Run) -> dict:
    await run.drain()
    out = RequestOutput(run.stream.request_id, prepared.prompt, prepared.ids,
                        [CompletionOutput(0, "".join(run.text), run.tokens, run.finish_reason, run.stop_reason,
                                          run.logprobs)], True, run.cached)
    return completion_response(state.llm, prepared, out)


async def completion_events(state, prepared, run: Run) -> AsyncIterator[str]:
    logprobs = []  # of tokens not sent yet
    try:
        async for d in run.deltas():
            out = d.outputs[0]
            logprobs += out.logprobs or []
            if not out.text and not d.finished:
                continue  # tokens that completed no text yet (a split character, a held-back stop prefix)
            chunk = completion_chunk(prepared, out.text, _finish(out.finish_reason) if d.finished else None)
            if prepared.params.logprobs is not None and logprobs:
                chunk["choices"][0]["logprobs"] = _logprobs(state.llm, logprobs)
                logprobs = []
            yield f"data: {dumps(chunk)}\n\n"
        if prepared.include_usage:
            yield f"data: {dumps(completion_chunk(prepared, '', usage=(len(run.tokens), run.cached)))}\n\n"
        yield "data: [DONE]\n\n"
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001
        yield stream_error("completions", e)
    finally:
        run.close()
