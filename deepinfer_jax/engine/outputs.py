"""What ``LLM.generate`` returns: vLLM-shaped ``RequestOutput`` / ``CompletionOutput`` plus metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CompletionOutput", "RequestMetrics", "RequestOutput", "TokenLogprobs"]


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs at one generated position: the chosen token's and the top ones (id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass(frozen=True)
class CompletionOutput:
    """One completion. ``finish_reason``: "stop" (EOS, a stop token or string), "length"
    (max_tokens or the context limit), or None while unfinished. ``stop_reason`` is the stop
    string or stop token id that ended it (None for EOS / length). ``logprobs``: one
    ``TokenLogprobs`` per generated token when ``SamplingParams.logprobs`` was set; then also
    ``cumulative_logprob`` (vLLM's field): the sum of the sampled tokens' logprobs (None otherwise)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass(frozen=True)
class RequestMetrics:
    """Timings in seconds from ``arrival``: ``ttft`` (first token), ``e2e`` (finish); decode rate."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_generated: int
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first, per second after the first token."""
        if self.finished_time is None or self.first_token_time is None or self.num_generated < 2:
            return None
        span = self.finished_time - self.first_token_time
        return (self.num_generated - 1) / span if span > 0 else float("inf")


@dataclass(frozen=True)
class RequestOutput:
    """One request's result. ``prompt_logprobs`` (vLLM's field): when ``SamplingParams.prompt_logprobs``
    was set, one entry per prompt token, None for the first, then that token's ``TokenLogprobs``
    given the tokens before it (``runner.prompt_scores``); None otherwise."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, compare=False)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
