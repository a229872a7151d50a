"""Streaming outputs: ``RequestOutput`` deltas of a running request, and a synchronous stream.

A delta is a ``RequestOutput`` whose one ``CompletionOutput`` holds only what is new since the
previous delta: ``token_ids`` (the tokens the last step added, several under speculation),
``text`` (the text they completed) and ``logprobs``. The last delta of a request has
``finished=True`` and the ``finish_reason`` ("stop", "length", "abort" or "error").
Concatenating a request's deltas gives exactly what ``LLM.generate`` returns for it.

Stop strings may span tokens and the text is cut before one once it is complete, so while a
request runs the last ``len(longest stop string) - 1`` characters of its text are held back;
a delta's text never has to be taken back.

``stream_requests`` drives an ``EngineCore`` from the calling thread (``LLM.generate_stream``,
notebooks); ``engine.async_engine.AsyncEngine`` runs the same trackers on an engine thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from deepinfer_jax.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer_jax.engine.request import Request

__all__ = ["DeltaTracker", "stream_requests"]


class DeltaTracker:
    """What of one request has been handed out; ``delta()`` gives the next ``RequestOutput`` delta."""

    __slots__ = ("hold", "request", "tokens", "chars", "logprobs", "done")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.hold = max((len(s) for s in request.params.stop_strings), default=1) - 1
        self.tokens = self.chars = self.logprobs = 0
        self.done = False

    def delta(self) -> RequestOutput | None:
        """The output since the previous call, or None when nothing new (and not just finished)."""
        r = self.request
        if self.done:
            return None
        finished = r.finished
        new_ids = r.output_ids[self.tokens:]
        if not new_ids and not finished:
            return None
        text = r.detok.text
        end = len(text) if finished else max(self.chars, len(text) - self.hold)
        piece = text[self.chars:end]
        logprobs = None
        if r.logprobs is not None:
            logprobs = r.logprobs[self.logprobs:]
            self.logprobs = len(r.logprobs)
        self.tokens += len(new_ids)
        self.chars = end
        self.done = finished
        completion = CompletionOutput(index=0, text=piece, token_ids=new_ids,
                                      finish_reason=r.finish_reason if finished else None,
                                      stop_reason=r.stop_reason if finished else None, logprobs=logprobs)
        metrics = RequestMetrics(r.arrival, r.first_token_time, r.finished_time, len(r.output_ids),
                                 r.num_preemptions)
        first = self.tokens == len(new_ids)  # the first delta also carries the prompt's logprobs
        return RequestOutput(r.request_id, r.prompt, r.prompt_ids, [completion], finished, r.num_cached_tokens,
                             metrics, r.prompt_logprobs if first else None)


def stream_requests(engine, requests: Iterable[tuple]) -> Iterator[RequestOutput]:
    """Add ``(prompt_ids, params, prompt)`` requests to ``engine`` (validated first: nothing runs
    when one is bad) and yield their deltas as the engine steps, in the calling thread. Closing the
    iterator early aborts the requests still running."""
    requests = [(engine.validate(ids, params), params, prompt) for ids, params, prompt in requests]
    trackers = [DeltaTracker(engine.requests[engine.add_request(ids, params, prompt)])
                for ids, params, prompt in requests]
    try:
        while not all(t.done for t in trackers):
            if not engine.has_unfinished:
                raise RuntimeError("engine stopped with unfinished requests")
            engine.step()
            for t in trackers:
                out = t.delta()
                if out is not None:
                    yield out
    finally:
        for t in trackers:
            if not t.request.finished:
                engine.abort(t.request.request_id)
            engine.requests.pop(t.request.request_id, None)
