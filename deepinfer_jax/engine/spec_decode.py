"""The engine's speculative-decoding bookkeeping (host only): each step's verification plan, the verify
rows as ``ChunkSpec``s, and what the results teach (acceptance per depth, step times).

``SpecDecoding.plan`` asks the verification policy (``engine.spec_policy``) for the caps, forced flags
and budget of the step's verify rows; a row verifies no drafts when its request is constrained by a
grammar (its token mask covers one position) or its slot holds no fresh drafts. It also decides
whether the step drafts again: when the policy would verify nothing in a step like this one even with
fresh drafts (e.g. at high load, where verifying costs more than it gains), the drafter is skipped
and the next step decodes plainly, paying nothing for speculation. ``observe`` takes a reconciled
step back: per row the drafts verified and accepted (against the survival the plan assumed), the
confidences of its next drafts (the next plan's estimate, one step stale under asynchronous
scheduling), and the step's wall time (host work included) for its token bucket. Steps whose
sampling runs the top-p / top-k threshold search (every logit row then searches, so each verified
token costs more) keep their own step-time tables (``search_times``).

Over attention data-parallel ranks (``engine.core``, ``engine.ranks``) ``plan_ranks`` plans each rank's rows on their own (each
rank gets its own budget and its own drafting switch) and counts the step once; ``observe`` is the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from deepinfer_jax.engine.spec_policy import AcceptanceStats, StepTimes, VerifyPlan, VerifyPolicy, VerifyRow
from deepinfer_jax.runner.step_output import StepOutput

__all__ = ["SpecDecoding", "SpecStats"]


@dataclass
class SpecStats:
    """Counters of speculative decoding (in ``llm.stats``)."""

    verify_rows: int = 0  # verify rows reconciled
    drafts_verified: int = 0
    drafts_accepted: int = 0
    tokens: int = 0  # tokens the verify rows produced (accepted + 1 each, before stop truncation)
    steps: int = 0  # steps planned
    steps_drafting: int = 0  # of which drafted the next blocks
    budgets: list = field(default_factory=list, repr=False)  # the budget of each planned step


@dataclass
class _Planned:
    """What a step's plan assumed, kept until the step is reconciled."""

    survival: dict  # chunk index -> the survival estimate used (or None)
    tokens: int  # the step's planned flat tokens (host chunks + verify rows + forced + budget)
    draft: bool  # the step drafts the next blocks
    search: bool = False  # its sampling searches top-p / top-k thresholds (``search_times`` apply)


class SpecDecoding:
    """Plans verification with a policy, and learns from the results."""

    def __init__(self, policy: VerifyPolicy, k: int, times: StepTimes, stats: AcceptanceStats,
                 plain_times: StepTimes | None = None, sampled_drafts: bool = True,
                 search_times: tuple[StepTimes, StepTimes] | None = None,
                 can_draft: Callable[[], bool] | None = None) -> None:
        self.policy, self.k, self.times, self.acceptance = policy, k, times, stats
        # asked when the policy wants a step to draft: whether the runner may (``SpeculativeStep.can_draft``:
        # False while a lazy engine defers its drafting program); None = always
        self.can_draft = can_draft
        self.plain_times = plain_times  # steps that skip drafting
        # (drafting, plain) step times of steps whose sampling searches top-p / top-k thresholds (every
        # logit row then runs the search: verification costs more there); None = one table for all
        self.search_times = search_times
        # False: sampled requests (temperature > 0) verify no drafts and decode as without speculation
        self.sampled_drafts = sampled_drafts
        self.stats = SpecStats()

    def plan(self, chunks: Sequence,
             fresh: bool = True) -> tuple[VerifyPlan, dict[int, tuple[int, bool]], _Planned, bool]:
        """(the policy's plan, chunk index -> (cap, forced) for the verify rows, what to remember, whether
        the step drafts the next blocks). ``fresh``: the host holds the confidences of the drafts this
        step verifies (no step in flight); else (asynchronous scheduling) it holds the previous block's,
        and the plan assumes the acceptance observed per depth instead: measured at one sequence, the
        stale confidences picked worse budgets than that average (1.08x vs 1.14x plain decoding)."""
        plan, caps, planned, draft = self._plan_one(chunks, fresh)
        self._count([plan.budget], draft)
        return plan, caps, planned, draft

    def plan_ranks(self, chunks_by_rank: Sequence[Sequence],
                   fresh: bool = True) -> tuple[list[int], list[dict[int, tuple[int, bool]]], _Planned, list[bool]]:
        """``plan`` for a step over attention data-parallel ranks, one plan per rank: (per rank its budget, its
        verify rows' chunk index -> (cap, forced) within the rank's list, whether it drafts the next blocks;
        what to remember, keyed by the chunk's index in the ranks' lists concatenated). Each rank's budget is
        the policy's answer for that rank's rows alone (the step times are those of a whole DP step, which
        lasts as long as its slowest rank); the step's planned tokens are the largest rank's (all ranks run
        padded to one bucket). An idle rank verifies and drafts nothing. Counted as one step."""
        budgets, caps, drafts, survival, tokens, search, base = [], [], [], {}, 0, False, 0
        for chunks in chunks_by_rank:
            if not chunks:
                budgets.append(0)
                caps.append({})
                drafts.append(False)
                continue
            plan, rank_caps, planned, draft = self._plan_one(chunks, fresh)
            budgets.append(plan.budget)
            caps.append(rank_caps)
            drafts.append(draft)
            survival.update({base + i: v for i, v in planned.survival.items()})
            tokens, search = max(tokens, planned.tokens), search or planned.search
            base += len(chunks)
        self._count([sum(budgets)], any(drafts))
        return budgets, caps, _Planned(survival, tokens, any(drafts), search), drafts

    def _count(self, budgets: list[int], draft: bool) -> None:
        self.stats.budgets.extend(budgets)
        self.stats.steps_drafting += draft
        self.stats.steps += 1

    def _plan_one(self, chunks: Sequence,
                  fresh: bool) -> tuple[VerifyPlan, dict[int, tuple[int, bool]], _Planned, bool]:
        """``plan`` without the step counters."""
        idx = [i for i, c in enumerate(chunks) if c.verify]
        rows, could = [], []
        for i in idx:
            c = chunks[i]
            r = c.request
            ok = self._drafts_for(r)
            row = VerifyRow(max_drafts=min(self.k, c.num_tokens - 1) if ok else 0,
                            deterministic=r.params.seed is not None, greedy=r.params.temperature == 0,
                            survival=_survival(r.spec.next_conf) if r.spec.has_drafts and fresh else None)
            # with fresh drafts the row could take K (the scheduler reserves 1 token for a row without)
            could.append(VerifyRow(self.k if ok else 0, row.deterministic, row.greedy, row.survival))
            rows.append(row if r.spec.has_drafts else VerifyRow(0, row.deterministic, row.greedy))
        for c in chunks:  # a prefill chunk that samples: its request decodes from the next step on
            if c.sample and not c.verify:
                r = c.request
                could.append(VerifyRow(self.k if self._drafts_for(r) else 0, r.params.seed is not None,
                                       r.params.temperature == 0))
        host_tokens = sum(c.num_tokens for c in chunks if not c.verify)
        search = self.search_times is not None and _searches(chunks)
        if hasattr(self.policy, "plain_times"):  # the step-time tables of this kind of step
            self.policy.times, self.policy.plain_times = self._tables(search)
        plan = self.policy.plan(rows, host_tokens)
        caps = {i: (cap, forced) for i, cap, forced in zip(idx, plan.caps, plan.forced)}
        tokens = host_tokens + len(idx) + sum(c for c, f in zip(plan.caps, plan.forced) if f) + plan.budget
        draft = self.policy.worth_drafting(could, host_tokens) and (self.can_draft is None or self.can_draft())
        for c in chunks:  # the rows producing a token get fresh drafts iff this step drafts
            if c.sample:
                c.request.spec.has_drafts = draft and self._drafts_for(c.request)
        return plan, caps, _Planned({i: row.survival for i, row in zip(idx, rows)}, tokens, draft, search), draft

    def _tables(self, search: bool) -> tuple[StepTimes, StepTimes | None]:
        return self.search_times if search else (self.times, self.plain_times)

    def _drafts_for(self, r) -> bool:
        """Whether request ``r`` verifies drafts: not under structured output (its mask covers one
        position), and not when sampled unless ``sampled_drafts``."""
        return r.grammar.matcher is None and (self.sampled_drafts or r.params.temperature == 0)

    def observe(self, chunks: Sequence, out: StepOutput, planned: _Planned, step_ns: float) -> None:
        """Take a reconciled step's verify rows (``out``: the runner's output) and time back. ``step_ns``: the
        step's share of wall time
        (``EngineCore``: since the previous result, so host work the device did not hide counts: a
        step that verifies more tokens also reconciles and detokenizes more); None = a compilation ran
        beside the step (a lazily compiled bucket), so its time is not recorded."""
        times, plain = self._tables(planned.search)
        if step_ns is None:  # the step waited on a compilation: its time is not the step's
            pass
        elif planned.draft:
            times.observe(planned.tokens, step_ns)
        elif plain is not None:
            plain.observe(planned.tokens, step_ns)
        for i, (c, res) in enumerate(zip(chunks, out.tokens)):
            r = c.request
            if res is not None and out.confidence is not None and len(out.confidence) > i:
                r.spec.next_conf = out.confidence[i]
            if not c.verify or res is None or not res:
                continue
            verified = out.verified[i]
            accepted = len(res) - 1
            s = self.stats
            s.verify_rows += 1
            s.drafts_verified += verified
            s.drafts_accepted += accepted
            s.tokens += len(res)
            self.acceptance.observe(r.params.temperature == 0, verified, accepted, planned.survival.get(i))

    def summary(self) -> dict:
        s = self.stats
        return {"spec_policy": self.policy.name, "spec_verify_rows": s.verify_rows,
                "spec_drafts_verified": s.drafts_verified, "spec_drafts_accepted": s.drafts_accepted,
                "spec_acceptance": s.drafts_accepted / s.drafts_verified if s.drafts_verified else None,
                "spec_tokens_per_row": s.tokens / s.verify_rows if s.verify_rows else None,
                "spec_acceptance_by_depth": self.acceptance.acceptance_rate(),
                "spec_mean_budget": float(np.mean(s.budgets)) if s.budgets else None,
                "spec_drafting_steps": s.steps_drafting, "spec_steps": s.steps}


def _searches(chunks: Sequence) -> bool:
    """Whether the step's sampling runs the top-p / top-k threshold search: some sampling row has a
    temperature and some has such a filter (``model.sampler.search_flags``: one flag per step)."""
    params = [c.request.params for c in chunks if c.sample]
    return any(p.temperature > 0 for p in params) and any(p.top_p < 1.0 or p.top_k > 0 for p in params)


def _survival(conf) -> np.ndarray | None:
    return None if conf is None else np.cumprod(np.clip(np.asarray(conf, float), 0.0, 1.0))
