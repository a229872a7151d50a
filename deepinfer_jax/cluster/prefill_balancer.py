"""The prefill balancer, four layers (engine.md §3; seed §1.1).

A request's **compute quota** is the predicted time of its uncached part,
``cost(q, c) = a1 q + a2 q c + a3 q**2`` ns (``CostModel.chunk_cost``: q uncached tokens after c
reused ones, bounded-replay tokens counted in q). A rank's load is the quota of the work it still
holds (its backlog).

1. **Length buckets** ``< 16K / 16-64K / 64-256K / >= 256K`` prompt tokens. Every prefill engine
   (a DP group) serves one bucket; each round the engine counts are re-sized to each bucket's share
   of the previous round's quota demand (largest remainders, every bucket that had demand keeps one
   engine while there are enough; ``resize_buckets``), moving as few engines as possible and the
   least loaded first (``reassign_engines``). A request whose bucket has no engine goes to the
   nearest bucket that has one (the longer on a tie). With ``SlotRule.bucket_penalty_ns`` set (the
   default) the bucket is a preference: every engine is a candidate, at that cost per bucket of
   distance, so a request does not wait for its bucket's busy engines while another is idle.
2. + 3. **Engine and rank**, together (``pick_prefill_slot``, with a ``SlotRule``):
   the ``(engine, rank)`` with the least predicted finish of the request plus ``pairing`` times the
   padding of that engine's next lockstep step, both from each rank's work still *waiting* for a
   step (not its total backlog: the chunk now running leaves with the step). A request goes to an
   idle rank beside waiting work when that is about as fast as waking an idle engine, and never
   queues behind a finishing chunk while another rank of the engine has nothing; near ties go to
   the rank that got the least quota this round. Without a ``SlotRule`` (the rule before): the
   engine with the most remaining quota ``ranks * round_quota - sum(backlog)``
   (``pick_prefill_group``), then its rank with the least backlog (``pick_prefill_rank``). No
   prefix affinity (every engine reads every prefix from the store).
4. **Inside the rank**: the engine's own cost-model chunking (``engine.cost_model.CostModel.largest_q``
   under ``EngineConfig.step_budget_ns``, engine.md §2.1), with one rule for a lockstep DP step
   (``matched_step_budget``, ``SlotRule.match_floor_ns``): when two or more ranks have work, they all
   chunk to the smallest working rank's natural chunk cost, so their chunks cost about the same. The simulator
   applies it, and a DP engine does with the engine setting ``dp_match_floor_ns`` (off by default;
   ``engine.ranks.matched_budget_ns``); the live cluster's instances are one rank each.

Ties everywhere go to the lowest index: the rules are deterministic.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from deepinfer_jax.cluster.errors import PolicyInputError, check_int, check_nonempty, check_number
from deepinfer_jax.engine import ranks

__all__ = ["BUCKET_EDGES", "PrefillBalancer", "PrefillEngineView", "SlotRule", "length_bucket", "matched_step_budget",
           "pick_prefill_group", "pick_prefill_rank", "pick_prefill_slot", "reassign_engines", "request_quota",
           "resize_buckets", "route_prefill"]

BUCKET_EDGES = (16 * 1024, 64 * 1024, 256 * 1024)  # four buckets: < 16K, 16-64K, 64-256K, >= 256K


def length_bucket(num_tokens: int, edges: Sequence[int] = BUCKET_EDGES) -> int:
    """The bucket (0 .. len(edges)) of a prompt of ``num_tokens`` tokens."""
    check_int("num_tokens", num_tokens)
    return bisect.bisect_right(edges, num_tokens)


def request_quota(cost_model, uncached_tokens: int, hit_tokens: int, replay_tokens: int = 0) -> float:
    """Compute quota (ns) of a request: ``cost(q, c)`` with ``q = uncached + replay`` and
    ``c = hit - replay`` (bounded replay recomputes the last block of the hit)."""
    check_int("uncached_tokens", uncached_tokens)
    check_int("hit_tokens", hit_tokens)
    check_int("replay_tokens", replay_tokens, 0, hit_tokens)
    return cost_model.chunk_cost(uncached_tokens + replay_tokens, hit_tokens - replay_tokens)


def resize_buckets(demand: Sequence[float], num_engines: int, min_per_bucket: int = 1,
                   previous: Sequence[int] | None = None) -> tuple[int, ...]:
    """Engines per bucket from last round's quota ``demand`` per bucket (largest remainders).

    Buckets with demand get at least ``min_per_bucket`` engines while the engines suffice (the
    neediest first); with no demand at all, ``previous`` is kept (or an even split)."""
    check_nonempty("demand", demand)
    check_int("num_engines", num_engines, 1)
    check_int("min_per_bucket", min_per_bucket, 0)
    for i, d in enumerate(demand):
        check_number(f"demand[{i}]", d)
    k = len(demand)
    total = float(sum(demand))
    if total <= 0:
        if previous is not None and len(previous) == k and sum(previous) == num_engines:
            return tuple(previous)
        return tuple(num_engines // k + (1 if i < num_engines % k else 0) for i in range(k))
    counts = [0] * k
    order = sorted(range(k), key=lambda i: (-demand[i], i))
    left = num_engines
    for i in order:  # the floor: demanding buckets, neediest first
        if demand[i] > 0 and left > 0:
            take = min(min_per_bucket, left)
            counts[i] += take
            left -= take
    ideal = [num_engines * d / total for d in demand]
    while left > 0:  # then the bucket furthest below its share
        i = max(range(k), key=lambda j: (ideal[j] - counts[j], demand[j], -j))
        counts[i] += 1
        left -= 1
    return tuple(counts)


def reassign_engines(assignment: Sequence[int], counts: Sequence[int], loads: Sequence[float] | None = None
                     ) -> tuple[int, ...]:
    """Bucket per engine for the new ``counts``: engines stay where they are unless their bucket
    has too many; the least loaded of a surplus bucket move first, to the buckets short of engines."""
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts) or sum(counts) != len(assignment):
        raise PolicyInputError("counts", f"must be integers >= 0 summing to the {len(assignment)} engines, got {counts!r}")
    if loads is not None and len(loads) != len(assignment):
        raise PolicyInputError("loads", f"needs one entry per engine ({len(assignment)}), got {len(loads)}")
    for i, b in enumerate(assignment):
        check_int(f"assignment[{i}]", b, 0, len(counts) - 1)
    load = list(loads) if loads is not None else [0.0] * len(assignment)
    new = list(assignment)
    have = [0] * len(counts)
    for b in new:
        have[b] += 1
    free: list[int] = []
    for b in range(len(counts)):
        surplus = have[b] - counts[b]
        if surplus > 0:
            members = sorted((e for e in range(len(new)) if new[e] == b), key=lambda e: (load[e], e))
            free.extend(members[:surplus])
    free.sort(key=lambda e: (load[e], e))
    for b in range(len(counts)):
        for _ in range(max(0, counts[b] - have[b])):
            new[free.pop(0)] = b
    return tuple(new)


@dataclass(frozen=True)
class PrefillEngineView:
    """What the router knows of one prefill engine (DP group): its bucket and each rank's backlog (ns).

    ``waiting`` (optional): each rank's work not in the step now running (ns; ``None``: all of the
    backlog waits); ``busy_ns``: what is left of the step now running (0: the engine is idle);
    ``routed``: the quota routed to each rank this round (ties of ``pick_prefill_slot`` go to the least)."""

    bucket: int
    backlogs: tuple[float, ...]
    accepting: bool = True
    waiting: tuple[float, ...] | None = None
    busy_ns: float = 0.0
    routed: tuple[float, ...] | None = None


def pick_prefill_group(engines: Sequence[PrefillEngineView], round_quota_ns: float,
                       candidates: Sequence[int] | None = None) -> int:
    """Layer 2: the engine (index) with the most remaining quota ``ranks * round_quota - sum(backlog)``."""
    check_nonempty("engines", engines)
    check_number("round_quota_ns", round_quota_ns, 0.0, strict=True)
    pool = list(range(len(engines))) if candidates is None else list(candidates)
    pool = [e for e in pool if engines[e].accepting and engines[e].backlogs]
    if not pool:
        raise PolicyInputError("engines", "no accepting engine with ranks to route to")
    return max(pool, key=lambda e: (len(engines[e].backlogs) * round_quota_ns - sum(engines[e].backlogs), -e))


def pick_prefill_rank(backlogs: Sequence[float]) -> int:
    """Layer 3: the rank with the least backlog (lowest index on ties)."""
    check_nonempty("backlogs", backlogs)
    for i, b in enumerate(backlogs):
        check_number(f"backlogs[{i}]", b)
    return min(range(len(backlogs)), key=lambda r: (backlogs[r], r))


def pick_prefill_slot(engines: Sequence[PrefillEngineView], quota_ns: float, step_overhead_ns: float,
                      step_budget_ns: float, pairing: float = 1.0,
                      candidates: Sequence[int] | None = None, tie_ns: float = 0.0,
                      extra_ns: Sequence[float] | None = None) -> tuple[int, int]:
    """Layers 2-3 together: the ``(engine, rank)`` minimising the request's predicted finish plus
    ``pairing`` times the padding its engine's next step gets, per rank.

    With ``w`` each rank's waiting work and ``w[r] += quota`` on the chosen rank, ``n`` steps of
    ``step_budget_ns`` hold the rank's work: finish ``= busy_ns + n * step_overhead_ns +
    max(w[r], max over other ranks of min(w[s], n * budget))``; the next step runs ``x[s] =
    min(w[s], budget)`` per rank and pads ``max(x) - mean(x)``. An idle engine pads the whole
    request on its other ranks, so ``pairing > 0`` sends the request to an idle rank next to work that
    waits for the next step when that costs less time than the padding (pairing is nearly free in
    step time: a step lasts ``a0 + max over ranks``). ``pairing = 0``: the earliest finish. Scores
    within ``tie_ns`` of the best tie; ties go to the rank with the least ``routed`` quota this round
    (spreading a round's work over all ranks), then the lowest index. ``extra_ns[e]``: a cost added
    to every slot of engine e (e.g. a bucket mismatch)."""
    check_nonempty("engines", engines)
    check_number("quota_ns", quota_ns)
    check_number("step_overhead_ns", step_overhead_ns)
    check_number("step_budget_ns", step_budget_ns, 0.0, strict=True)
    check_number("pairing", pairing)
    check_number("tie_ns", tie_ns)
    if extra_ns is not None and len(extra_ns) != len(engines):
        raise PolicyInputError("extra_ns", f"needs one entry per engine ({len(engines)}), got {len(extra_ns)}")
    pool = list(range(len(engines))) if candidates is None else list(candidates)
    pool = [e for e in pool if engines[e].accepting and engines[e].backlogs]
    if not pool:
        raise PolicyInputError("engines", "no accepting engine with ranks to route to")
    scored = []
    for e in pool:
        v = engines[e]
        wait = v.backlogs if v.waiting is None else v.waiting
        if len(wait) != len(v.backlogs):
            raise PolicyInputError(f"engines[{e}].waiting", f"needs one entry per rank ({len(v.backlogs)})")
        for i, b in enumerate(wait):
            check_number(f"engines[{e}].waiting[{i}]" if v.waiting is not None else f"engines[{e}].backlogs[{i}]", b)
        busy = check_number(f"engines[{e}].busy_ns", v.busy_ns)
        if extra_ns is not None:
            busy += check_number(f"extra_ns[{e}]", extra_ns[e])
        routed = v.routed if v.routed is not None else (0.0,) * len(wait)
        if len(routed) != len(wait):
            raise PolicyInputError(f"engines[{e}].routed", f"needs one entry per rank ({len(wait)})")
        for r in range(len(wait)):
            w = list(wait)
            w[r] += quota_ns
            steps = max(1, math.ceil(w[r] / step_budget_ns))
            others = max((min(x, steps * step_budget_ns) for s, x in enumerate(w) if s != r), default=0.0)
            finish = busy + steps * step_overhead_ns + max(w[r], others)
            x = [min(y, step_budget_ns) for y in w]
            scored.append((finish + pairing * (max(x) - sum(x) / len(x)), routed[r], e, r))
    best = min(s[0] for s in scored)
    _, _, e, r = min((s for s in scored if s[0] <= best + tie_ns + 1e-6), key=lambda s: (s[1], s[2], s[3]))
    return e, r


def matched_step_budget(natural_ns: Sequence[float], step_budget_ns: float, floor_ns: float) -> float:
    """Layer 4 in a lockstep step: the chunk budget of every rank (``engine.ranks.matched_step_budget``, the
    rule a DP engine runs with ``dp_match_floor_ns``), the arguments checked. ``natural_ns[r]``: the cost of
    what rank r would run within ``step_budget_ns``. When two or more ranks have work, the budget is
    the smallest of their chunks (not below ``floor_ns``): the longer chunks are cut to it and their
    rest waits for the next step. A rank with nothing pads whatever the chunks and is left out of the
    smallest (with four ranks, two working and two idle, the two working ones are still matched); with
    fewer than two working, the whole budget."""
    check_nonempty("natural_ns", natural_ns)
    for i, x in enumerate(natural_ns):
        check_number(f"natural_ns[{i}]", x)
    check_number("step_budget_ns", step_budget_ns, 0.0, strict=True)
    check_number("floor_ns", floor_ns)
    return ranks.matched_step_budget(natural_ns, step_budget_ns, floor_ns)


@dataclass(frozen=True)
class SlotRule:
    """Settings of ``pick_prefill_slot``: the engines' per-step overhead ``a0`` and step budget (ns),
    the weight of the next step's padding against the request's predicted finish, the score
    difference that counts as a tie, layer 4's ``matched_step_budget`` floor (``None``: each rank
    fills the whole budget), and the cost per bucket of distance between a request's length bucket
    and an engine's (``None``: hard buckets, only the nearest bucket's engines are candidates)."""

    step_overhead_ns: float = 0.0
    step_budget_ns: float = 250e6
    pairing: float = 4.0
    tie_ns: float = 20e6
    match_floor_ns: float | None = 10e6
    bucket_penalty_ns: float | None = 20e6

    def __post_init__(self) -> None:
        check_number("step_overhead_ns", self.step_overhead_ns)
        check_number("step_budget_ns", self.step_budget_ns, 0.0, strict=True)
        check_number("pairing", self.pairing)
        check_number("tie_ns", self.tie_ns)
        if self.match_floor_ns is not None:
            check_number("match_floor_ns", self.match_floor_ns)
        if self.bucket_penalty_ns is not None:
            check_number("bucket_penalty_ns", self.bucket_penalty_ns)


def route_prefill(num_tokens: int, engines: Sequence[PrefillEngineView], round_quota_ns: float,
                  edges: Sequence[int] = BUCKET_EDGES, quota_ns: float = 0.0,
                  slot: SlotRule | None = None) -> tuple[int, int]:
    """Layers 1-3 for one request of ``num_tokens`` prompt tokens: ``(engine, rank)``. With ``slot``,
    layers 2-3 are ``pick_prefill_slot`` for a request of ``quota_ns``; without, the remaining quota
    then the least backlog."""
    check_nonempty("engines", engines)
    want = length_bucket(num_tokens, edges)
    live = {v.bucket for v in engines if v.accepting and v.backlogs}
    if not live:
        raise PolicyInputError("engines", "no accepting engine with ranks to route to")
    bucket = min(live, key=lambda b: (abs(b - want), -b))
    members = [i for i, v in enumerate(engines) if v.bucket == bucket]
    if slot is not None and slot.bucket_penalty_ns is not None:  # buckets as a preference only
        extra = [slot.bucket_penalty_ns * abs(v.bucket - want) for v in engines]
        return pick_prefill_slot(engines, quota_ns, slot.step_overhead_ns, slot.step_budget_ns, slot.pairing, None,
                                 slot.tie_ns, extra)
    if slot is not None:
        return pick_prefill_slot(engines, quota_ns, slot.step_overhead_ns, slot.step_budget_ns, slot.pairing, members,
                                 slot.tie_ns)
    e = pick_prefill_group(engines, round_quota_ns, members)
    return e, pick_prefill_rank(engines[e].backlogs)


@dataclass
class PrefillBalancer:
    """The round bookkeeping around ``route_prefill``: demand per bucket this round and the bucket
    of every engine. A live router calls ``route`` per request with its view of the backlogs and
    ``end_round`` once per round (``round_s``) with the engines' total backlogs."""

    num_engines: int
    round_quota_ns: float
    edges: tuple[int, ...] = BUCKET_EDGES
    min_per_bucket: int = 1
    slot: SlotRule | None = None
    assignment: tuple[int, ...] = field(default=())
    demand: list[float] = field(default_factory=list)
    routed: dict = field(default_factory=dict)  # (engine, rank) -> quota routed this round
    rounds: int = 0

    def __post_init__(self) -> None:
        check_int("num_engines", self.num_engines, 1)
        check_number("round_quota_ns", self.round_quota_ns, 0.0, strict=True)
        if list(self.edges) != sorted(set(self.edges)) or any(e <= 0 for e in self.edges):
            raise PolicyInputError("edges", f"must be increasing positive lengths, got {self.edges!r}")
        k = len(self.edges) + 1
        if not self.assignment:
            counts = resize_buckets([1.0] * k, self.num_engines, self.min_per_bucket)
            self.assignment = tuple(b for b in range(k) for _ in range(counts[b]))
        elif len(self.assignment) != self.num_engines:
            raise PolicyInputError("assignment", f"needs {self.num_engines} entries")
        self.demand = [0.0] * k

    def route(self, num_tokens: int, quota_ns: float, backlogs: Sequence[Sequence[float]],
              accepting: Sequence[bool] | None = None, waiting: Sequence[Sequence[float]] | None = None,
              busy_ns: Sequence[float] | None = None) -> tuple[int, int]:
        """``(engine, rank)`` for a request; ``backlogs[e][r]``: rank r of engine e (ns); optional
        ``waiting[e][r]`` and ``busy_ns[e]`` as in ``PrefillEngineView``."""
        check_number("quota_ns", quota_ns)
        for name, per in (("backlogs", backlogs), ("accepting", accepting), ("waiting", waiting), ("busy_ns", busy_ns)):
            if per is not None and len(per) != self.num_engines:
                raise PolicyInputError(name, f"needs one entry per engine ({self.num_engines}), got {len(per)}")
        views = [PrefillEngineView(self.assignment[e], tuple(backlogs[e]), True if accepting is None else accepting[e],
                                   None if waiting is None else tuple(waiting[e]),
                                   0.0 if busy_ns is None else busy_ns[e],
                                   tuple(self.routed.get((e, r), 0.0) for r in range(len(backlogs[e]))))
                 for e in range(self.num_engines)]
        self.demand[length_bucket(num_tokens, self.edges)] += quota_ns
        e, r = route_prefill(num_tokens, views, self.round_quota_ns, self.edges, quota_ns, self.slot)
        self.routed[(e, r)] = self.routed.get((e, r), 0.0) + quota_ns
        return e, r

    def end_round(self, engine_loads: Sequence[float] | None = None) -> tuple[int, ...]:
        """Re-size the buckets by this round's demand shares; returns the new bucket of every engine."""
        counts = resize_buckets(self.demand, self.num_engines, self.min_per_bucket,
                                previous=[self.assignment.count(b) for b in range(len(self.demand))])
        self.assignment = reassign_engines(self.assignment, counts, engine_loads)
        self.demand = [0.0] * len(self.demand)
        self.routed = {}
        self.rounds += 1
        return self.assignment
