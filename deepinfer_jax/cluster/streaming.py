"""Per-token streaming through ``Cluster`` (issue 23 item 2): the deltas ``LLM.generate_stream`` yields.

A streamed request's deltas come from three places, in order: the prefill instance's first token,
the decode instance's **partial reports** (``PartialTracker`` on the actor: what a running request
added since the actor's previous answer), and the finished output. Each report carries the offsets
it starts at (tokens, characters, logprobs into the request's whole output), and ``StreamCursor``
(one per request on the driver) hands out only what lies beyond what the client already has. That
is what keeps the stream right across faults: an instance that continues a request after a decode
actor died regenerates tokens from its handoff (identical under greedy decoding), and the cursor
skips those the client already got; a forwarded request continues from the forwarding instance's
tokens, some of which the client may not have yet, and the cursor hands them out.

Text follows ``engine.streaming``: while a request runs, the last ``len(longest stop string) - 1``
characters are held back (a stop string may still complete and cut them), so a delta's text is never
taken back, and the deltas of a request concatenate to exactly its ``Cluster.generate`` output.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_jax.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["Partial", "PartialTracker", "StreamCursor"]


@dataclass(frozen=True)
class Partial:
    """New output of a running request at offsets ``tokens`` / ``chars`` / ``logprobs`` of its whole
    output (what the actor had already reported, or what the router asked it to start after)."""

    tokens: int
    token_ids: list[int]
    chars: int
    text: str
    logprobs: int = 0
    logprob_items: list | None = None


class PartialTracker:
    """Actor side: one running ``engine.request.Request``; ``partial()`` is what it added since the
    last call (``None`` when nothing), starting after ``start`` (tokens, characters, logprobs)."""

    __slots__ = ("request", "hold", "tokens", "chars", "logprobs")

    def __init__(self, request, start: tuple[int, int, int] = (0, 0, 0)) -> None:
        self.request = request
        self.hold = max((len(s) for s in request.params.stop_strings), default=1) - 1
        self.tokens, self.chars, self.logprobs = start

    def partial(self) -> Partial | None:
        r = self.request
        ids = r.output_ids[self.tokens:]
        if not ids:
            return None
        text = r.detok.text
        end = max(self.chars, len(text) - self.hold)
        lps = None if r.logprobs is None else r.logprobs[self.logprobs:]
        out = Partial(self.tokens, list(ids), self.chars, text[self.chars:end], self.logprobs, lps)
        self.tokens += len(ids)
        self.chars = end
        if r.logprobs is not None:
            self.logprobs = len(r.logprobs)
        return out


class StreamCursor:
    """Driver side: what of one request the client has; each method returns the next delta (or
    ``None`` when nothing is new). ``hold``: characters held back while it runs (stop strings)."""

    __slots__ = ("hold", "tokens", "chars", "logprobs", "deltas")

    def __init__(self, stop_strings) -> None:
        self.hold = max((len(s) for s in stop_strings), default=1) - 1
        self.tokens = self.chars = self.logprobs = self.deltas = 0

    @property
    def start(self) -> tuple[int, int, int]:
        """Where an instance taking the request over starts its reports."""
        return self.tokens, self.chars, self.logprobs

    def first(self, out: RequestOutput, arrival: float, first_time: float) -> RequestOutput | None:
        """The prefill instance's unfinished output (the first token): its text less the hold."""
        c = out.outputs[0]
        text = c.text[:max(0, len(c.text) - self.hold)]
        return self._delta(out, Partial(0, list(c.token_ids), 0, text, 0, c.logprobs),
                           RequestMetrics(arrival, first_time, None, len(c.token_ids)))

    def partial(self, base: RequestOutput, p: Partial, arrival: float,
                first_time: float | None) -> RequestOutput | None:
        """A decode instance's report; ``base``: the request's first output (prompt, ids, cache)."""
        return self._delta(base, p, RequestMetrics(arrival, first_time, None, p.tokens + len(p.token_ids)))

    def final(self, done: RequestOutput) -> RequestOutput:
        """The last delta: everything of ``done`` (the whole output) the client does not have yet."""
        c = done.outputs[0]
        lps = None if c.logprobs is None else c.logprobs[self.logprobs:]
        last = CompletionOutput(0, c.text[self.chars:], list(c.token_ids[self.tokens:]), c.finish_reason,
                                c.stop_reason, lps)
        self.tokens, self.chars = len(c.token_ids), len(c.text)
        self.logprobs = 0 if c.logprobs is None else len(c.logprobs)
        self.deltas += 1
        return RequestOutput(done.request_id, done.prompt, done.prompt_token_ids, [last], True,
                             done.num_cached_tokens, done.metrics, done.prompt_logprobs if self.deltas == 1 else None)

    def _delta(self, base: RequestOutput, p: Partial, metrics: RequestMetrics) -> RequestOutput | None:
        if p.tokens > self.tokens or p.chars > self.chars:  # a gap: cannot happen, reports start at ``start``
            raise RuntimeError(f"stream of {base.request_id}: a report starts after what the client has")
        ids = p.token_ids[self.tokens - p.tokens:]
        text = p.text[self.chars - p.chars:]
        lps = None
        if p.logprob_items is not None:
            lps = list(p.logprob_items[max(0, self.logprobs - p.logprobs):])
        if not ids:
            return None
        self.tokens += len(ids)
        self.chars += len(text)
        if lps is not None:
            self.logprobs += len(lps)
        self.deltas += 1
        return RequestOutput(base.request_id, base.prompt, base.prompt_token_ids,
                             [CompletionOutput(0, text, ids, None, None, lps)], False, base.num_cached_tokens,
                             metrics, base.prompt_logprobs if self.deltas == 1 else None)
