"""Verification policies for speculative decoding (engine.md §2.3): how many drafts a step verifies.

Host only (numpy). A policy sees the step's verify rows (``VerifyRow``: how many drafts each may take,
whether its count must be batch-independent, the host's estimate of its drafts' survival) and returns
a ``VerifyPlan``: per row a cap and whether it is forced (always verifies its whole cap), plus the
budget of further drafts the device hands out by confidence (``model.speculative.select_counts``).

- ``none``: no speculation (the engine then runs without a drafter; listed for completeness).
- ``fixed``: every row verifies ``k`` drafts (forced), no budget.
- ``dspark``: the confidence-driven budget. Each row may take up to K drafts; the host picks the
  step's total B maximising ``(expected produced tokens) / (step time at B)``, where the produced
  tokens are one per row plus the expected accepted drafts (the top-B of the rows' estimated
  survival products, calibrated online against the acceptances seen), and the step time is the
  measured time of the token bucket the step falls into (``StepTimes``, profiled at start-up and
  updated from every step). Deterministic rows (a request with its own seed) get a fixed count
  instead (engine.md §2.5), so their tokens do not depend on what else runs. ``worth_drafting``
  compares the best such rate with plain decoding's (the step times of steps that do not draft):
  when plain decoding wins, the engine stops drafting until a step's prospects change.

``AcceptanceStats`` keeps, per draft depth and kind (greedy / sampled rows), the predicted survival
and the observed acceptance, which gives the calibration factors and the numbers in ``llm.stats``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

__all__ = ["POLICIES", "AcceptanceStats", "DSparkPolicy", "FixedPolicy", "StepTimes", "VerifyPlan", "VerifyPolicy",
           "VerifyRow", "make_policy", "solve_budget"]


@dataclass(frozen=True)
class VerifyRow:
    """One verify row as a policy sees it."""

    max_drafts: int  # drafts it may verify (0: none, e.g. a structured-output request)
    deterministic: bool  # a seeded request: its count must not depend on the batch
    greedy: bool
    survival: np.ndarray | None = None  # estimated P(draft 1..i all accepted), i = 1..K (None: unknown)


@dataclass(frozen=True)
class VerifyPlan:
    caps: tuple[int, ...]
    forced: tuple[bool, ...]
    budget: int
    expected_tokens: float = 0.0  # the plan's expected produced tokens (rows + accepted drafts)


class VerifyPolicy(Protocol):
    name: str

    def plan(self, rows: Sequence[VerifyRow], host_tokens: int) -> VerifyPlan: ...

    def worth_drafting(self, rows: Sequence[VerifyRow], host_tokens: int) -> bool: ...


class StepTimes:
    """Measured device time (ns) of a step per token bucket: profiled values, then an exponential
    moving average of the steps the engine runs (``observe``).

    ``times_ns=None`` starts unmeasured (a lazily started engine without a profile on disk): the
    first observation of a bucket becomes its time, and an unmeasured bucket is estimated from the
    measured ones (``a + c * tokens`` through them, or proportional to one), else from ``fallback``
    (the drafting table for the plain one: drafting looks free until measured, so the engine tries
    it), else the bucket size (relative units: only ratios between buckets then matter).
    """

    def __init__(self, buckets: Sequence[int], times_ns: Sequence[float] | None = None, alpha: float = 0.1,
                 measured: Sequence[bool] | None = None, fallback: StepTimes | None = None):
        self.buckets = tuple(int(b) for b in buckets)
        base = list(times_ns) if times_ns is not None else [float(b) for b in self.buckets]
        if len(base) != len(self.buckets) or any(not math.isfinite(t) or t <= 0 for t in base):
            raise ValueError(f"times_ns must be one positive time per bucket {self.buckets}, got {times_ns!r}")
        self.times = [float(t) for t in base]
        if measured is None:
            measured = [times_ns is not None] * len(self.buckets)
        if len(measured) != len(self.buckets):
            raise ValueError(f"measured must be one flag per bucket {self.buckets}, got {measured!r}")
        self.measured = [bool(m) for m in measured]
        self.alpha = alpha
        self.fallback = fallback

    def bucket_index(self, tokens: int) -> int | None:
        return next((i for i, b in enumerate(self.buckets) if b >= tokens), None)

    def time(self, tokens: int) -> float:
        i = self.bucket_index(tokens)
        if i is None:
            return math.inf
        if self.measured[i]:
            return self.times[i]
        return self._estimate(i)

    def _estimate(self, i: int) -> float:
        pts = [(b, t) for b, t, m in zip(self.buckets, self.times, self.measured) if m]
        if not pts:
            return self.fallback.time(self.buckets[i]) if self.fallback is not None else self.times[i]
        b = self.buckets[i]
        if len(pts) == 1:
            return pts[0][1] * b / pts[0][0]
        x, y = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
        slope = max(0.0, float(np.polyfit(x, y, 1)[0]))
        return max(1.0, float(np.mean(y) + slope * (b - np.mean(x))))

    def observe(self, tokens: int, time_ns: float) -> None:
        """Move the bucket's time toward ``time_ns``; one sample counts at most twice the current
        value (a step that waited on a compilation or another process must not hide the bucket).
        An unmeasured bucket takes its first sample as it is."""
        i = self.bucket_index(tokens)
        if i is None or time_ns <= 0:
            return
        if not self.measured[i]:
            self.times[i], self.measured[i] = float(time_ns), True
        else:
            self.times[i] += self.alpha * (min(time_ns, 2.0 * self.times[i]) - self.times[i])

    @property
    def fully_measured(self) -> bool:
        return all(self.measured)

    def to_json(self) -> dict:
        return {"buckets": list(self.buckets), "times_ns": self.times, "measured": self.measured}

    @classmethod
    def from_json(cls, data: dict, buckets: Sequence[int], fallback: StepTimes | None = None) -> StepTimes:
        """A table saved by ``to_json``; ``ValueError`` when it was saved for other buckets."""
        if tuple(data["buckets"]) != tuple(buckets):
            raise ValueError(f"step-time table for buckets {data['buckets']}, wanted {tuple(buckets)}")
        return cls(buckets, data["times_ns"], measured=data["measured"], fallback=fallback)


class AcceptanceStats:
    """Per draft depth (1..K) and row kind: verified drafts, accepted drafts, summed predicted survival."""

    def __init__(self, k: int, prior: float = 8.0):
        self.k = k
        self.verified = np.zeros((2, k))
        self.accepted = np.zeros((2, k))
        self.predicted = np.zeros((2, k))
        self.prior = prior  # pseudo-observations pulling the calibration factor toward 1
        self.rows = 0  # verify rows seen
        self.produced = 0  # tokens they produced (accepted + 1 each)

    def observe(self, greedy: bool, verified: int, accepted: int, survival: np.ndarray | None) -> None:
        g = 0 if greedy else 1
        self.rows += 1
        self.produced += accepted + 1
        if verified:
            self.verified[g, :verified] += 1
            self.accepted[g, :accepted] += 1
            if survival is not None:
                self.predicted[g, :verified] += survival[:verified]
            else:
                self.predicted[g, :verified] += self.default_survival(greedy)[:verified]

    def calibration(self, greedy: bool) -> np.ndarray:
        """Observed / predicted survival per depth (shrunk toward 1 by ``prior`` pseudo-drafts)."""
        g = 0 if greedy else 1
        return (self.accepted[g] + self.prior * 0.5) / (self.predicted[g] + self.prior * 0.5)

    def default_survival(self, greedy: bool) -> np.ndarray:
        """The survival a row without known confidences is assumed to have: the observed acceptance
        (0.5 per depth before any observation)."""
        g = 0 if greedy else 1
        return (self.accepted[g] + 0.5 * self.prior * 0.5 ** np.arange(1, self.k + 1)) / (self.verified[g] + 0.5 * self.prior)

    def acceptance_rate(self) -> list[float | None]:
        """P(draft at depth i accepted | verified), both kinds together."""
        v, a = self.verified.sum(0), self.accepted.sum(0)
        return [float(x / y) if y else None for x, y in zip(a, v)]


def _estimates(rows: Sequence[VerifyRow], stats: AcceptanceStats | None, k: int) -> list[np.ndarray]:
    out = []
    for row in rows:
        if stats is None:
            est = row.survival if row.survival is not None else 0.5 ** np.arange(1, k + 1)
        else:
            base = row.survival if row.survival is not None else stats.default_survival(row.greedy)
            est = np.clip(np.asarray(base, float)[:k] * (stats.calibration(row.greedy) if row.survival is not None
                                                          else 1.0), 0.0, 1.0)
            est = np.minimum.accumulate(est)  # survival never grows with depth
        out.append(np.asarray(est, float)[:k])
    return out


def solve_budget(gains: Sequence[float], fixed_tokens: int, fixed_expected: float, time_at: Callable[[int], float],
                 candidates: Sequence[int]) -> tuple[int, float]:
    """The budget B among ``candidates`` maximising (fixed_expected + sum of the B largest ``gains``) /
    ``time_at(fixed_tokens + B)``; returns (B, its expected tokens). Ties go to the smaller B."""
    order = np.sort(np.asarray(gains, float))[::-1]
    cum = np.concatenate([[0.0], np.cumsum(order)])
    best, best_rate, best_tokens = 0, -1.0, fixed_expected
    for b in sorted(set(int(c) for c in candidates)):
        b = max(0, min(b, len(order)))
        tokens = fixed_expected + cum[b]
        t = time_at(fixed_tokens + b)
        rate = tokens / t if t > 0 and math.isfinite(t) else -1.0
        if rate > best_rate * (1 + 1e-9):
            best, best_rate, best_tokens = b, rate, tokens
    return best, best_tokens


@dataclass
class FixedPolicy:
    """Every row verifies ``k`` drafts (fewer where it has fewer)."""

    k: int
    name: str = "fixed"

    def plan(self, rows: Sequence[VerifyRow], host_tokens: int) -> VerifyPlan:
        caps = tuple(min(self.k, r.max_drafts) for r in rows)
        return VerifyPlan(caps, (True,) * len(rows), 0, float(len(rows)))

    def worth_drafting(self, rows: Sequence[VerifyRow], host_tokens: int) -> bool:
        return self.k > 0


@dataclass
class DSparkPolicy:
    """The confidence-driven budget (see the module docstring). ``deterministic_k``: the fixed count of
    seeded rows. ``stats`` calibrates the survival estimates; ``times`` gives the step time per bucket."""

    k: int
    times: StepTimes
    deterministic_k: int = 3
    stats: AcceptanceStats | None = None
    plain_times: StepTimes | None = None  # steps that do not draft (None: never stop drafting)
    margin: float = 0.05  # drafting must promise this much more than plain decoding (model error, host work)
    name: str = "dspark"
    last_budget: int = field(default=0, init=False)

    def plan(self, rows: Sequence[VerifyRow], host_tokens: int) -> VerifyPlan:
        est = _estimates(rows, self.stats, self.k)
        caps, forced, gains = [], [], []
        fixed_tokens, fixed_expected = host_tokens + len(rows), float(len(rows))
        for row, e in zip(rows, est):
            if row.deterministic:
                cap = min(self.deterministic_k, row.max_drafts)
                caps.append(cap)
                forced.append(True)
                fixed_tokens += cap
                fixed_expected += float(np.sum(e[:cap]))
            else:
                caps.append(row.max_drafts)
                forced.append(False)
                gains.extend(e[: row.max_drafts])
        base = fixed_tokens
        candidates = [0] + [b - base for b in self.times.buckets if b > base]
        budget, expected = solve_budget(gains, fixed_tokens, fixed_expected, self.times.time,
                                        [min(c, len(gains)) for c in candidates])
        self.last_budget = budget
        return VerifyPlan(tuple(caps), tuple(forced), budget, expected)

    def worth_drafting(self, rows: Sequence[VerifyRow], host_tokens: int) -> bool:
        """Whether a step like this one, with fresh drafts for every row, beats plain decoding."""
        if not rows or self.plain_times is None:
            return True
        if self.deterministic_k and any(r.deterministic and r.max_drafts for r in rows):
            return True  # their fixed counts need drafts
        plan = self.plan(rows, host_tokens)
        n = host_tokens + len(rows) + plan.budget
        spec_rate = plan.expected_tokens / self.times.time(n)
        return bool(spec_rate > (1.0 + self.margin) * len(rows) / self.plain_times.time(host_tokens + len(rows)))


#: Policy names accepted by ``EngineConfig.speculation``.
POLICIES = ("none", "fixed", "dspark")


def make_policy(name: str, *, k: int, num_speculative_tokens: int, times: StepTimes | None = None,
                stats: AcceptanceStats | None = None, plain_times: StepTimes | None = None) -> VerifyPolicy | None:
    """The policy for a name of ``POLICIES`` (None for "none"). ``k``: the drafter's block size;
    ``num_speculative_tokens``: the fixed length ("fixed") or the deterministic rows' count ("dspark")."""
    if name == "none":
        return None
    if name == "fixed":
        return FixedPolicy(min(num_speculative_tokens, k))
    if name == "dspark":
        return DSparkPolicy(k, times or StepTimes((1 << 30,)), min(num_speculative_tokens, k), stats, plain_times)
    raise ValueError(f"speculation must be one of {POLICIES}, got {name!r}")
