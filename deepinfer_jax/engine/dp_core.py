"""The engine core over attention data-parallel ranks (engine.md §3 decode balancer, §4).

Each DP rank is an independent scheduling domain: its own ``Scheduler`` (waiting queue, running
list, block pool, slots) over its own shard of the KV cache. A new request joins the rank chosen by
``dp_router.pick_rank`` (balancing request count and total KV length) and stays there until it ends.
One ``step()`` schedules every rank, hands the per-rank chunk lists to the one ``ModelRunner`` over the mesh (all
ranks step together in one jitted program; idle ranks run padding) and reconciles the sampled
tokens exactly as ``EngineCore`` does: synchronous, or asynchronous with the host one step behind
(engine.md §2.2). Request validation, stop rules, outputs and statistics are ``EngineCore``'s.

EPLB (engine.md §3), when the runner runs the EP MoE (``ModelRunner.placement`` is set): each reconciled
step's per-slot pair counts go into a ``parallel.eplb_policy.Rebalancer`` (window and period from the
preset's ``eplb`` settings); when a rebalance is due it computes the new placement and the runner moves
the expert weights before the next step is dispatched (steps already in flight finish on the old ones;
no token is dropped or recomputed). ``eplb_stats()`` reports the balance (``LLM.stats``' ``eplb_*`` keys).

Cost-model chunking (``chunking="cost"``): every rank's scheduler plans its own chunks against the
step budget with one shared ``CostModel``; a DP step lasts as long as its slowest rank, so the step is
predicted by, and the model refitted on, the rank whose plan predicts the most time (``_DPPlan``).

Structured output: the token masks of every rank's constrained rows are computed as in ``EngineCore``
(on the worker thread while the device runs the model step, or first with ``overlap=False``) into one
``[dp * rows, words]`` mask, row ``d * rows + k`` for rank d's k-th request (``Forward.chunk_rows``),
which the DP sampling program applies.

Prefix caching (docs/prefix_cache.md) runs per rank: each rank's scheduler has its own ``PrefixCache`` over
its own block pool (device hits, hit accounting), and the runner's block and window copies target the
request's rank's slice of the stacked cache (``rank=``). The lower tiers (host memory, the file store) and
the SWA window store are shared by every rank (rank 0's window store serves all; payloads and windows are
rank-independent host arrays), so a prefix computed on one rank is a hit on another through them: its
blocks are uploaded into that rank's pool and its window restored into that rank's slot. The router does
not look at prefixes (``pick_rank`` balances load only). Decoder bounded replay (``decoder_replay``) runs
on every rank as on one device.

Engine roles (``cluster.roles``): ``add_continuation`` routes a continuation like a new request (``pick_rank``,
or the ``rank`` the cluster's decode balancer chose) and admits it on that rank's scheduler; its handed blocks go
into that rank's pool and its slot state into that rank's slot, and a role reads a request's slot and blocks
from its rank's slice (``snapshot_slot`` / ``read_blocks`` with ``rank=``).

Speculative decoding (``spec=SpecDecoding`` with a ``runner.SpecRunner`` over the mesh): each rank's decoding
requests verify their slots' drafts as on one device; ``SpecDecoding.plan_ranks`` plans every rank's verification
on its own (its rows' caps, its budget and whether it drafts again), and the runner runs every rank's draft and
verify rows in one program. ``rank_spec_verified[d]`` / ``rank_spec_accepted[d]`` count the drafts rank d verified
and accepted (``LLM.stats``' ``dp_rank_spec_drafts_verified`` / ``dp_rank_spec_accepted``; they sum to the engine's
``spec_drafts_verified`` / ``spec_drafts_accepted``). The step loop is still this class's own, beside
``EngineCore.step`` (the two are not merged yet).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

from deepinfer_jax.engine.core import EngineCore, _InFlight
from deepinfer_jax.engine.dp_router import RankLoad, pick_rank
from deepinfer_jax.engine.outputs import RequestOutput
from deepinfer_jax.engine.request import Request
from deepinfer_jax.engine.sampling_params import SamplingParams
from deepinfer_jax.engine.scheduler import Scheduler, SchedulerOutput
from deepinfer_jax.engine.spec_decode import SpecDecoding
from deepinfer_jax.engine.structured import StructuredOutputs
from deepinfer_jax.parallel.eplb_policy import RebalancePolicy, Rebalancer

if TYPE_CHECKING:
    from deepinfer_jax.runner import ModelRunner

__all__ = ["DPEngineCore"]


@dataclass
class _DPPlan(SchedulerOutput):
    """Every rank's chunks as one plan; ``cost_shape`` is the slowest rank's (q, c) list, the cost model's view of
    the step (``predicted_ns`` is that rank's prediction)."""

    cost_shape: list | None = None

    def shape(self) -> list[tuple[int, int]]:
        return super().shape() if self.cost_shape is None else self.cost_shape


@dataclass
class _DPInFlight(_InFlight):
    forward: Any = None  # the runner's Forward when EPLB reads its slot counts
    ranks: list = None  # speculative decoding: each chunk's DP rank


class DPEngineCore(EngineCore):
    """``EngineCore``'s public surface (add_request, step, abort, drain, has_unfinished, requests, stats,
    validate) over ``dp`` per-rank schedulers and one ``ModelRunner`` over the mesh.

    ``schedulers[d]`` schedules rank d (all with the same settings; ``EngineCore.scheduler`` is rank 0's
    and is read only for what every rank shares, e.g. ``max_model_len``). ``rank_requests[d]`` counts the
    requests routed to rank d, ``rank_tokens[d]`` the tokens it computed and ``rank_idle_steps[d]`` the
    steps it ran only padding; with ``spec``, ``rank_spec_verified[d]`` / ``rank_spec_accepted[d]`` the drafts
    its verify rows verified and accepted.
    """

    def __init__(self, runner: ModelRunner, schedulers: Sequence[Scheduler], *, tokenizer: Tokenizer | None,
                 eos_token_id: int, seed: int = 0, async_scheduling: bool = True, max_logprobs: int = 5,
                 structured: StructuredOutputs | None = None, spec: SpecDecoding | None = None) -> None:
        schedulers = list(schedulers)
        if len(schedulers) != runner.dp_size:
            raise ValueError(f"schedulers: one per DP rank ({runner.dp_size}), got {len(schedulers)}")
        first = schedulers[0].prefix if schedulers else None
        for s in schedulers:
            if s.chunking == "cost" and s.cost_model is not schedulers[0].cost_model:
                raise ValueError("chunking: with chunking='cost' every DP rank's scheduler must share one cost model")
            if s.decoder_keep != schedulers[0].decoder_keep:
                raise ValueError("decoder_replay: every DP rank's scheduler must keep the same decoder tokens")
            if (s.prefix is None) != (first is None):
                raise ValueError("enable_prefix_caching: every DP rank's scheduler must have prefix caching, or none")
            if s.prefix is not None:
                if s.prefix.extra != first.extra or s.prefix.block_size != first.block_size:
                    raise ValueError("enable_prefix_caching: every DP rank's prefix cache must use the same digests "
                                     "(model, cache_salt, block_size)")
                if s.prefix.host is not first.host or s.prefix.files is not first.files:
                    raise ValueError("host_store_bytes: every DP rank's prefix cache must share one host store and "
                                     "one block store")
                s.prefix.snapshots = first.snapshots  # one window store: a window saved on one rank serves all
        super().__init__(runner, schedulers[0], tokenizer=tokenizer, eos_token_id=eos_token_id, seed=seed,
                         async_scheduling=async_scheduling, max_logprobs=max_logprobs, structured=structured,
                         spec=spec)
        self.schedulers = schedulers
        self._rank: dict[str, int] = {}  # unfinished request id -> its DP rank
        self.rank_requests = [0] * len(schedulers)
        self.rank_tokens = [0] * len(schedulers)
        self.rank_idle_steps = [0] * len(schedulers)
        self.rank_spec_verified = [0] * len(schedulers)
        self.rank_spec_accepted = [0] * len(schedulers)
        #: The EPLB loop (None without the EP MoE); its ``placement`` is the one the next step runs with.
        self.eplb: Rebalancer | None = None
        placement = getattr(runner, "placement", None)
        if placement is not None:
            knobs = runner.preset.eplb
            policy = RebalancePolicy(redundant_per_rank=knobs.redundant_slots_per_rank, window=knobs.window_steps,
                                     period=knobs.rebalance_period)
            self.eplb = Rebalancer(placement.n_layers, placement.n_experts, placement.n_ranks, policy, placement)

    # ---- requests ----
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
        self._prefetch(req, self.schedulers[rank])
        return req.request_id

    def _enqueue(self, req: Request, rank: int | None) -> None:
        """A continuation (``EngineCore.add_continuation``, the engine roles) joins ``rank``, or the rank the DP
        router picks as for ``add_request``; with ``admit`` its blocks are uploaded into that rank's pool and
        its slot state restored into that rank's slot (``ModelRunner.restore_slot(rank=)``)."""
        if rank is None:
            rank = pick_rank(self.loads(), req.num_tokens)
        self._rank[req.request_id] = rank
        self.rank_requests[rank] += 1
        self.schedulers[rank].add(req)

    def rank_of(self, request_id: str) -> int | None:
        """The DP rank of an unfinished request (None once it ended)."""
        return self._rank.get(request_id)

    def _scheduler_of(self, r: Request) -> Scheduler:
        return self.schedulers[self._rank[r.request_id]]

    def rank_args(self, r: Request) -> dict:
        return {"rank": self._rank[r.request_id]}

    def _ranks(self) -> list[tuple[Scheduler, dict]]:
        return [(s, {"rank": d}) for d, s in enumerate(self.schedulers)]

    @property
    def has_unfinished(self) -> bool:
        return any(s.has_unfinished for s in self.schedulers) or self._inflight is not None

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """One iteration over every rank; returns the requests that finished in it."""
        t0 = time.perf_counter()
        host0 = self.stats.reconcile_s + self.stats.wait_s
        traces0 = getattr(self.runner, "traces", 0)
        plans = [s.schedule() for s in self.schedulers]
        prev = self._inflight if self.async_scheduling else None
        self._inflight = None
        finished: list[RequestOutput] = []
        launched = None
        plan = _DPPlan(chunks=[c for p in plans for c in p.chunks], preempted=[r for p in plans for r in p.preempted])
        costed = [p for p in plans if p.predicted_ns is not None]
        if costed:  # chunking="cost": the slowest rank sets the step time
            slowest = max(costed, key=lambda p: p.predicted_ns)
            plan.predicted_ns, plan.cost_shape = slowest.predicted_ns, slowest.shape()
        if plan.chunks:
            self._restore_states(plan.chunks)  # prefix-cache hits: uploads and windows into their rank's slots
            planned = None
            if self.spec is None:
                specs = [[self._spec(c) for c in p.chunks] for p in plans]
            else:  # every rank's verification planned on its own
                budgets, caps, planned, drafts = self.spec.plan_ranks([p.chunks for p in plans], fresh=prev is None)
                specs = [[self._spec(c, caps[d].get(i)) for i, c in enumerate(p.chunks)] for d, p in enumerate(plans)]
            rows = [(c.request.matcher, i) for i, c in enumerate(plan.chunks)
                    if c.sample and c.request.matcher is not None]  # (matcher, chunk index)
            masks = None
            if rows and not self.structured.overlap:  # the baseline: masks first, the device waits
                if prev is not None:  # the masks need the previous step's tokens
                    finished += self._reconcile(prev)
                    prev = None
                height, at = self.runner.sample_rows(specs)
                masks = self.structured.masks(height, [(m, at[i]) for m, i in rows])
            if planned is None:
                fwd = self.runner.forward(specs)
            else:
                logprobs = any(c.request.logprobs is not None for c in plan.chunks)
                fwd = self.runner.forward(specs, budgets, drafts, logprobs)
                planned.tokens = max(planned.tokens, getattr(fwd, "tokens", 0))  # the bucket every rank ran in
            launched = _DPInFlight(plan, None, time.perf_counter(), spec=planned, started=t0,
                                   forward=fwd if self.eplb is not None else None,
                                   ranks=[d for d, p in enumerate(plans) for _ in p.chunks])
            if getattr(self.runner, "traces", 0) != traces0 and prev is not None:  # a lazy bucket compiled beside it
                prev.compiled = True
            self._copies_behind(launched)  # window copies and block reads right behind the model step
            if rows and masks is None:
                masks, done = self._masks_beside_reconcile(
                    prev, lambda: self.structured.submit(fwd.rows, [(m, fwd.chunk_rows[i]) for m, i in rows]))
                finished += done
                prev = None
            mask = None
            if rows:
                mask, dead = masks
                chunk_of_row = {fwd.chunk_rows[i]: i for _, i in rows}
                for row, reason in dead.items():
                    r = plan.chunks[chunk_of_row[row]].request
                    if not r.finished:
                        r.finished_time = time.perf_counter()
                        self._finish(r, "error", reason)
                        finished.append(r.to_output())
            launched.pending = self.runner.sample(fwd, mask)
            if getattr(self.runner, "traces", 0) != traces0:
                launched.compiled = True
                if prev is not None:
                    prev.compiled = True
            self.stats.steps += 1
            self.stats.scheduled_tokens += plan.num_tokens
            for d, p in enumerate(plans):
                self.rank_tokens[d] += p.num_tokens
                self.rank_idle_steps[d] += not p.chunks
        return self._close_step(plan, t0, host0, prev, launched, finished)

    def _reconcile(self, step: _InFlight, on_tokens=None) -> list[RequestOutput]:
        finished = super()._reconcile(step, on_tokens)
        if step.spec is not None:  # per rank, the drafts its verify rows verified and accepted (as ``observe``)
            for i, (c, res) in enumerate(zip(step.plan.chunks, step.pending.result())):
                if c.verify and res:
                    self.rank_spec_verified[step.ranks[i]] += step.pending.verified[i]
                    self.rank_spec_accepted[step.ranks[i]] += len(res) - 1
        fwd = getattr(step, "forward", None)
        if self.eplb is not None and fwd is not None:  # the step's expert load; maybe a rebalance before the next
            new = self.eplb.record_slots(self.runner.slot_counts(fwd), fwd.placement)
            if new is not None:
                self.runner.set_placement(new)
        return finished

    def eplb_stats(self) -> dict:
        """EPLB counters (empty without the EP MoE), lists per MoE layer: ``eplb_steps`` recorded,
        ``eplb_rebalances`` (placements that changed), ``eplb_moe_lb`` (max rank load / mean rank load over the
        current window, measured from the slot counts), ``eplb_moe_lb_before`` (the same, measured at the latest
        due rebalance, just before it) and ``eplb_moe_lb_after`` (that window's load under the new placement,
        split evenly over the copies: expected, not measured), ``eplb_max_replicas`` (most copies of one expert
        in the current placement)."""
        reb = self.eplb
        if reb is None:
            return {}
        as_list = lambda a: None if a is None else [float(x) for x in a]
        return {"eplb_steps": reb.stats.steps, "eplb_rebalances": reb.rebalances,
                "eplb_moe_lb": as_list(reb.window_moe_lb()), "eplb_moe_lb_before": as_list(reb.last_measured_moe_lb),
                "eplb_moe_lb_after": as_list(reb.last_expected_moe_lb),
                "eplb_max_replicas": int(reb.placement.replica_count.max())}

    def _finish(self, r: Request, reason: str, stop_reason=None) -> None:
        super()._finish(r, reason, stop_reason)  # on its rank's scheduler, prefix cache and cache slice
        self._rank.pop(r.request_id)
