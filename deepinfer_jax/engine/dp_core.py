"""The engine core over attention data-parallel ranks (engine.md §3 decode balancer, §4).

Each DP rank is an independent scheduling domain: its own ``Scheduler`` (waiting queue, running
list, block pool, slots) over its own shard of the KV cache. A new request joins the rank chosen by
``dp_router.pick_rank`` (balancing request count and total KV length) and stays there until it ends.
One ``step()`` schedules every rank, hands the per-rank chunk lists to the one ``DPRunner`` (all
ranks step together in one jitted program; idle ranks run padding) and reconciles the sampled
tokens exactly as ``EngineCore`` does: synchronous, or asynchronous with the host one step behind
(engine.md §2.2). Request validation, stop rules, outputs and statistics are ``EngineCore``'s.

Not supported with DP yet (each refused with a clear error naming the setting): prefix caching
(``enable_prefix_caching``), structured output (``SamplingParams.structured_output``, a
``RequestError``), cost-model chunking (``chunking="cost"``) and decoder bounded replay
(``decoder_replay``); ``EngineConfig`` refuses the last three when ``sharding`` is set.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from deepinfer_jax.engine.core import EngineCore, _InFlight
from deepinfer_jax.engine.dp_router import RankLoad, pick_rank
from deepinfer_jax.engine.outputs import RequestOutput
from deepinfer_jax.engine.request import Request
from deepinfer_jax.engine.sampling_params import RequestError, SamplingParams
from deepinfer_jax.engine.scheduler import Scheduler, SchedulerOutput

if TYPE_CHECKING:
    from deepinfer_jax.runner.dp_runner import DPRunner

__all__ = ["DPEngineCore"]


class DPEngineCore(EngineCore):
    """``EngineCore``'s public surface (add_request, step, abort, drain, has_unfinished, requests, stats,
    validate) over ``dp`` per-rank schedulers and one ``DPRunner``.

    ``schedulers[d]`` schedules rank d (all with the same settings; ``EngineCore.scheduler`` is rank 0's
    and is read only for what every rank shares, e.g. ``max_model_len``). ``rank_requests[d]`` counts the
    requests routed to rank d, ``rank_tokens[d]`` the tokens it computed and ``rank_idle_steps[d]`` the
    steps it ran only padding.
    """

    def __init__(self, runner: DPRunner, schedulers: Sequence[Scheduler], *, tokenizer: Tokenizer | None,
                 eos_token_id: int, seed: int = 0, async_scheduling: bool = True, max_logprobs: int = 5) -> None:
        schedulers = list(schedulers)
        if len(schedulers) != runner.dp_size:
            raise ValueError(f"schedulers: one per DP rank ({runner.dp_size}), got {len(schedulers)}")
        for s in schedulers:
            if s.prefix is not None:
                raise ValueError("enable_prefix_caching: prefix caching is not supported with attention data "
                                 "parallel yet (set it to False)")
            if s.chunking != "tokens":
                raise ValueError("chunking: only 'tokens' is supported with attention data parallel yet")
            if s.decoder_keep is not None:
                raise ValueError("decoder_replay: not supported with attention data parallel yet")
        super().__init__(runner, schedulers[0], tokenizer=tokenizer, eos_token_id=eos_token_id, seed=seed,
                         async_scheduling=async_scheduling, max_logprobs=max_logprobs, structured=None)
        self.schedulers = schedulers
        self._rank: dict[str, int] = {}  # unfinished request id -> its DP rank
        self.rank_requests = [0] * len(schedulers)
        self.rank_tokens = [0] * len(schedulers)
        self.rank_idle_steps = [0] * len(schedulers)

    # ---- requests ----
    def validate(self, prompt_ids, params: SamplingParams, request_id: str | None = None) -> list[int]:
        if isinstance(params, SamplingParams) and params.constraint is not None:
            raise RequestError("structured_output", "not supported with attention data parallel (sharding) yet")
        return super().validate(prompt_ids, params, request_id)

    def loads(self) -> list[RankLoad]:
        """Every rank's unfinished requests and their total tokens (the router's view)."""
        return [RankLoad(len(s.waiting) + len(s.running), sum(r.num_tokens for r in (*s.waiting, *s.running)))
                for s in self.schedulers]

    def add_request(self, prompt_ids, params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None, arrival: float | None = None) -> str:
        ids = self.validate(prompt_ids, params, request_id)
        rank = pick_rank(self.loads(), len(ids))
        req = self._new_request(ids, params, prompt, request_id, arrival)
        self._rank[req.request_id] = rank
        self.rank_requests[rank] += 1
        self.schedulers[rank].add(req)
        return req.request_id

    def rank_of(self, request_id: str) -> int | None:
        """The DP rank of an unfinished request (None once it ended)."""
        return self._rank.get(request_id)

    @property
    def has_unfinished(self) -> bool:
        return any(s.has_unfinished for s in self.schedulers) or self._inflight is not None

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """One iteration over every rank; returns the requests that finished in it."""
        t0 = time.perf_counter()
        host0 = self.stats.reconcile_s + self.stats.wait_s
        plans = [s.schedule() for s in self.schedulers]
        prev = self._inflight if self.async_scheduling else None
        self._inflight = None
        finished: list[RequestOutput] = []
        launched = None
        plan = SchedulerOutput(chunks=[c for p in plans for c in p.chunks],
                               preempted=[r for p in plans for r in p.preempted])
        if plan.chunks:
            fwd = self.runner.forward([[self._spec(c) for c in p.chunks] for p in plans])
            launched = _InFlight(plan, None, time.perf_counter())
            launched.pending = self.runner.sample(fwd)
            self.stats.steps += 1
            self.stats.scheduled_tokens += plan.num_tokens
            for d, p in enumerate(plans):
                self.rank_tokens[d] += p.num_tokens
                self.rank_idle_steps[d] += not p.chunks
        return self._close_step(plan, t0, host0, prev, launched, finished)

    def _finish(self, r: Request, reason: str, stop_reason=None) -> None:
        self.schedulers[self._rank.pop(r.request_id)].finish(r, reason, stop_reason)
