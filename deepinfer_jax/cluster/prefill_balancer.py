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
   nearest bucket that has one (the longer on a tie).
2. **DP group** within the bucket: the engine with the most remaining quota,
   ``ranks * round_quota - sum(backlog)``; no prefix affinity (every engine reads every prefix
   from the store).
3. **Rank** within the group: the least backlog.
4. **Inside the rank**: the engine's own cost-model chunking (``engine.cost_model.CostModel.largest_q``
   under ``EngineConfig.step_budget_ns``, engine.md §2.1); nothing here.

Ties everywhere go to the lowest index: the rules are deterministic.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from deepinfer_jax.cluster.errors import PolicyInputError, check_int, check_nonempty, check_number

__all__ = ["BUCKET_EDGES", "PrefillBalancer", "PrefillEngineView", "length_bucket", "pick_prefill_group",
           "pick_prefill_rank", "reassign_engines", "request_quota", "resize_buckets", "route_prefill"]

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
    """What the router knows of one prefill engine (DP group): its bucket and each rank's backlog (ns)."""

    bucket: int
    backlogs: tuple[float, ...]
    accepting: bool = True


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


def route_prefill(num_tokens: int, engines: Sequence[PrefillEngineView], round_quota_ns: float,
                  edges: Sequence[int] = BUCKET_EDGES) -> tuple[int, int]:
    """Layers 1-3 for one request of ``num_tokens`` prompt tokens: ``(engine, rank)``."""
    check_nonempty("engines", engines)
    want = length_bucket(num_tokens, edges)
    live = {v.bucket for v in engines if v.accepting and v.backlogs}
    if not live:
        raise PolicyInputError("engines", "no accepting engine with ranks to route to")
    bucket = min(live, key=lambda b: (abs(b - want), -b))
    e = pick_prefill_group(engines, round_quota_ns, [i for i, v in enumerate(engines) if v.bucket == bucket])
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
    assignment: tuple[int, ...] = field(default=())
    demand: list[float] = field(default_factory=list)
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
              accepting: Sequence[bool] | None = None) -> tuple[int, int]:
        """``(engine, rank)`` for a request; ``backlogs[e][r]``: rank r of engine e (ns)."""
        check_number("quota_ns", quota_ns)
        if len(backlogs) != self.num_engines:
            raise PolicyInputError("backlogs", f"needs one entry per engine ({self.num_engines}), got {len(backlogs)}")
        views = [PrefillEngineView(self.assignment[e], tuple(backlogs[e]), True if accepting is None else accepting[e])
                 for e in range(self.num_engines)]
        self.demand[length_bucket(num_tokens, self.edges)] += quota_ns
        return route_prefill(num_tokens, views, self.round_quota_ns, self.edges)

    def end_round(self, engine_loads: Sequence[float] | None = None) -> tuple[int, ...]:
        """Re-size the buckets by this round's demand shares; returns the new bucket of every engine."""
        counts = resize_buckets(self.demand, self.num_engines, self.min_per_bucket,
                                previous=[self.assignment.count(b) for b in range(len(self.demand))])
        self.assignment = reassign_engines(self.assignment, counts, engine_loads)
        self.demand = [0.0] * len(self.demand)
        self.rounds += 1
        return self.assignment
