"""What the engine core needs to step several attention data-parallel ranks at once (docs/engine.md §3-4).

One device is the case of one rank. Over a mesh each DP rank is its own scheduling domain: its own
``Scheduler`` over its own shard of the KV cache, and ``EngineCore`` schedules every rank, hands the per-rank
chunk lists to the one runner and reconciles. This module holds the pieces only that case adds:

- ``check_schedulers``: every rank's scheduler must agree on what the step shares (one cost model, the same
  decoder replay, prefix caching on all ranks or none, with one host store, one block store and one SWA
  window store, so a prefix computed on one rank is a hit on another through the lower tiers);
- ``merge_plans``: every rank's ``SchedulerOutput`` as one plan whose cost-model view is the slowest rank's
  (a DP step lasts as long as its slowest rank);
- ``matched_budget_ns`` (``dp_match_floor_ns``, off by default): the step budget every rank schedules with when
  two or more ranks have prompt work, cut to the smallest such rank's plan (``matched_step_budget``, layer 4 of
  the prefill balancer, docs/cluster.md), so short work is not padded to a long chunk's end;
- ``make_rebalancer`` / ``eplb_stats``: the EPLB loop when the runner runs the expert-parallel MoE.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer_jax.engine.scheduler import Scheduler, SchedulerOutput
from deepinfer_jax.parallel.eplb_policy import RebalancePolicy, Rebalancer

__all__ = ["RanksPlan", "check_schedulers", "eplb_stats", "make_rebalancer", "matched_budget_ns", "matched_step_budget",
           "merge_plans"]


@dataclass
class RanksPlan(SchedulerOutput):
    """Every rank's chunks as one plan; ``cost_shape`` is the slowest rank's (q, c) list, the cost model's view of
    the step (``predicted_ns`` is that rank's prediction)."""

    cost_shape: list | None = None

    def shape(self) -> list[tuple[int, int]]:
        return super().shape() if self.cost_shape is None else self.cost_shape


def check_schedulers(schedulers: Sequence[Scheduler], dp_size: int) -> list[Scheduler]:
    """The schedulers as a list, one per DP rank; ``ValueError`` naming the setting the ranks disagree on. Every
    rank's prefix cache is given rank 0's window store (a window saved on one rank serves all)."""
    schedulers = list(schedulers)
    if len(schedulers) != dp_size:
        raise ValueError(f"schedulers: one per DP rank ({dp_size}), got {len(schedulers)}")
    first = schedulers[0]
    for s in schedulers:
        if s.chunking == "cost" and s.cost_model is not first.cost_model:
            raise ValueError("chunking: with chunking='cost' every DP rank's scheduler must share one cost model")
        if s.decoder_keep != first.decoder_keep:
            raise ValueError("decoder_replay: every DP rank's scheduler must keep the same decoder tokens")
        if (s.prefix is None) != (first.prefix is None):
            raise ValueError("enable_prefix_caching: every DP rank's scheduler must have prefix caching, or none")
        if s.prefix is not None:
            if s.prefix.extra != first.prefix.extra or s.prefix.block_size != first.prefix.block_size:
                raise ValueError("enable_prefix_caching: every DP rank's prefix cache must use the same digests "
                                 "(model, cache_salt, block_size)")
            if s.prefix.host is not first.prefix.host or s.prefix.files is not first.prefix.files:
                raise ValueError("host_store_bytes: every DP rank's prefix cache must share one host store and "
                                 "one block store")
            s.prefix.snapshots = first.prefix.snapshots
    return schedulers


def merge_plans(plans: Sequence[SchedulerOutput]) -> SchedulerOutput:
    """One rank: its plan as it is. Several: their chunks rank by rank, and with ``chunking="cost"`` the slowest
    rank's prediction and shape (the step the cost model predicts and is refitted on)."""
    if len(plans) == 1:
        return plans[0]
    plan = RanksPlan(chunks=[c for p in plans for c in p.chunks], preempted=[r for p in plans for r in p.preempted],
                     copies=[c for p in plans for c in p.copies])
    costed = [p for p in plans if p.predicted_ns is not None]
    if costed:
        slowest = max(costed, key=lambda p: p.predicted_ns)
        plan.predicted_ns, plan.cost_shape = slowest.predicted_ns, slowest.shape()
    return plan


def matched_step_budget(natural_ns: Sequence[float], step_budget_ns: float, floor_ns: float) -> float:
    """The chunk budget of every rank in a lockstep step. ``natural_ns[r]``: the cost of what rank r would run
    within ``step_budget_ns`` (0: nothing to match). When two or more ranks have work, the smallest of their costs,
    not below ``floor_ns``: longer chunks are cut to it and their rest waits for the next step, so the short work
    is not padded to the long chunk's end (its request finishes a step earlier) and the rest can pair with new
    work. A rank without work pads whatever the chunks and is left out; with fewer than two working, the whole
    budget. Unchecked; ``cluster.prefill_balancer.matched_step_budget`` checks its arguments."""
    working = [x for x in natural_ns if x > 0]
    if len(working) < 2:
        return step_budget_ns
    return min(step_budget_ns, max(min(working), floor_ns))


def matched_budget_ns(schedulers: Sequence[Scheduler], floor_ns: float | None) -> float | None:
    """The ``budget_ns`` every rank's ``Scheduler.schedule`` takes this step (``chunking="cost"``), or None for the
    whole ``step_budget_ns``: None unless ``floor_ns`` is set and two or more ranks have prompt work, else the step
    overhead plus ``matched_step_budget`` over each rank's ``planned_cost_ns`` (a rank without prompt work counts
    as idle, so decoding ranks leave prompt chunks whole)."""
    if floor_ns is None or len(schedulers) < 2:
        return None
    overhead = schedulers[0].cost_model.coef[0]
    full = schedulers[0].step_budget_ns - overhead
    natural = []
    for s in schedulers:
        cost, prompt = s.planned_cost_ns()
        natural.append(cost if prompt else 0.0)
    budget = matched_step_budget(natural, full, floor_ns)
    return None if budget >= full else overhead + budget


def make_rebalancer(runner) -> Rebalancer | None:
    """The EPLB loop of a runner that runs the EP MoE (``runner.placement`` set; window and period from the preset's
    ``eplb`` settings); None otherwise."""
    placement = getattr(runner, "placement", None)
    if placement is None:
        return None
    knobs = runner.preset.eplb
    policy = RebalancePolicy(redundant_per_rank=knobs.redundant_slots_per_rank, window=knobs.window_steps,
                             period=knobs.rebalance_period)
    return Rebalancer(placement.n_layers, placement.n_experts, placement.n_ranks, policy, placement)


def eplb_stats(reb: Rebalancer | None) -> dict:
    """EPLB counters (empty without the EP MoE), lists per MoE layer: ``eplb_steps`` recorded, ``eplb_rebalances``
    (placements that changed), ``eplb_moe_lb`` (max rank load / mean rank load over the current window, measured
    from the slot counts), ``eplb_moe_lb_before`` (the same, measured at the latest due rebalance, just before it)
    and ``eplb_moe_lb_after`` (that window's load under the new placement, split evenly over the copies:
    expected, not measured), ``eplb_max_replicas`` (most copies of one expert in the current placement)."""
    if reb is None:
        return {}
    as_list = lambda a: None if a is None else [float(x) for x in a]
    return {"eplb_steps": reb.stats.steps, "eplb_rebalances": reb.rebalances,
            "eplb_moe_lb": as_list(reb.window_moe_lb()), "eplb_moe_lb_before": as_list(reb.last_measured_moe_lb),
            "eplb_moe_lb_after": as_list(reb.last_expected_moe_lb),
            "eplb_max_replicas": int(reb.placement.replica_count.max())}
