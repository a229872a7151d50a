"""``GET /metrics``: Prometheus text exposition format (version 0.0.4), written by hand.

The format is a few lines per metric (``# HELP``, ``# TYPE``, ``name{labels} value``), so no
client library is needed. Server-side series (``deepinfer_`` prefix):

- ``requests_total{endpoint,status}`` (counter): answered requests by HTTP status;
- ``prompt_tokens_total``, ``generation_tokens_total``, ``cached_prompt_tokens_total`` (counters);
- ``time_to_first_token_seconds``, ``time_per_output_token_seconds``, ``e2e_request_latency_seconds``
  (histograms, measured from the request's arrival at the server);
- ``requests_running`` (gauge): admitted to the engine and not finished.

Engine-side series, read on the engine thread (``AsyncEngine.call``) from ``LLM.stats``:
``engine_steps_total``, ``engine_generated_tokens_total``, ``kv_blocks_used`` / ``kv_blocks_total``,
``prefix_cache_queried_tokens_total`` / ``prefix_cache_hit_tokens_total`` / ``prefix_cache_hit_rate``,
``spec_drafts_verified_total`` / ``spec_drafts_accepted_total`` / ``spec_acceptance_rate``.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict

__all__ = ["Histogram", "Metrics", "engine_snapshot"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _num(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    return repr(float(v)) if isinstance(v, float) else str(v)


class Histogram:
    """Cumulative buckets, sum and count of observed values."""

    def __init__(self, buckets=_LATENCY_BUCKETS) -> None:
        self.buckets = tuple(buckets) + (math.inf,)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{_num(b)}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f"{name}_sum {_num(self.sum)}", f"{name}_count {self.count}"]


class Metrics:
    """The server's counters (thread-safe); ``render`` writes the exposition text."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.prompt_tokens = self.generation_tokens = self.cached_tokens = 0
        self.ttft, self.tpot, self.e2e = Histogram(), Histogram(), Histogram()
        self.running = 0

    def answered(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def finished(self, prompt_tokens: int, generated: int, cached: int, ttft: float | None, tpot: float | None,
                 e2e: float) -> None:
        """One request's generation ended (completed, stopped or aborted)."""
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generated
            self.cached_tokens += cached
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)
            self.e2e.observe(e2e)

    def render(self, engine: dict | None) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[str]) -> None:
            lines.extend([f"# HELP deepinfer_{name} {help_}", f"# TYPE deepinfer_{name} {kind}"])
            lines.extend(f"deepinfer_{s}" for s in samples)

        with self._lock:
            metric("requests_total", "counter", "HTTP requests answered, by endpoint and status.",
                   [f'requests_total{{endpoint="{e}",status="{s}"}} {n}' for (e, s), n in sorted(self.requests.items())])
            metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                   [f"prompt_tokens_total {self.prompt_tokens}"])
            metric("generation_tokens_total", "counter", "Tokens generated for finished requests.",
                   [f"generation_tokens_total {self.generation_tokens}"])
            metric("cached_prompt_tokens_total", "counter", "Prompt tokens served from the prefix cache.",
                   [f"cached_prompt_tokens_total {self.cached_tokens}"])
            for name, hist, help_ in (("time_to_first_token_seconds", self.ttft, "Arrival to first token."),
                                      ("time_per_output_token_seconds", self.tpot, "Mean time per token after "
                                       "the first."),
                                      ("e2e_request_latency_seconds", self.e2e, "Arrival to the last token.")):
                metric(name, "histogram", help_, hist.lines(name))
            metric("requests_running", "gauge", "Requests admitted to the engine, not finished.",
                   [f"requests_running {self.running}"])
        for name, kind, help_ in _ENGINE_SERIES:
            value = None if engine is None else engine.get(name)
            if value is not None:
                metric(name, kind, help_, [f"{name} {_num(value)}"])
        return "\n".join(lines) + "\n"


_ENGINE_SERIES = (
    ("engine_steps_total", "counter", "Engine steps run."),
    ("engine_generated_tokens_total", "counter", "Tokens the engine generated."),
    ("kv_blocks_used", "gauge", "KV cache blocks in use."),
    ("kv_blocks_total", "gauge", "KV cache blocks."),
    ("prefix_cache_queried_tokens_total", "counter", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache."),
    ("prefix_cache_hit_rate", "gauge", "hit_tokens / queried_tokens of the prefix cache."),
    ("spec_drafts_verified_total", "counter", "Speculative draft tokens verified."),
    ("spec_drafts_accepted_total", "counter", "Speculative draft tokens accepted."),
    ("spec_acceptance_rate", "gauge", "accepted / verified draft tokens."),
)


def engine_snapshot(llm) -> dict:
    """The engine-side values (call on the engine thread)."""
    s = llm.stats
    pool = getattr(getattr(llm.engine, "scheduler", None), "pool", None)
    prefix = s.get("prefix") or {}
    queried, hits = prefix.get("queried_tokens"), prefix.get("hit_tokens")
    verified, accepted = s.get("spec_drafts_verified"), s.get("spec_drafts_accepted")
    return {"engine_steps_total": s["steps"], "engine_generated_tokens_total": s["generated_tokens"],
            "kv_blocks_used": None if pool is None else pool.used_count,
            "kv_blocks_total": None if pool is None else pool.used_count + pool.free_count,
            "prefix_cache_queried_tokens_total": queried, "prefix_cache_hit_tokens_total": hits,
            "prefix_cache_hit_rate": (hits / queried if queried else 0.0) if queried is not None else None,
            "spec_drafts_verified_total": verified, "spec_drafts_accepted_total": accepted,
            "spec_acceptance_rate": s.get("spec_acceptance") if verified is not None else None}
