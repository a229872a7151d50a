"""Decode rebalancing by migration (issue 23, the decode balance target; docs/cluster.md).

Routing places a decode request once, at admission; afterwards requests grow and finish at
different times, so the per-rank KV sums drift apart, and a large arrival can land on a rank that was
only a little below the mean. ``plan_moves`` is the correction, run every tick and (by default) right
after each admission where one request alone does not keep the threshold out of reach: a pure
function over the decode ranks' running requests that plans a bounded number of migrations from
the most loaded rank to the least loaded one, each chosen to lower the larger of the two ranks'
loads the most (the request nearest half their gap). It plans nothing while
``max / mean <= threshold``, never plans a move that would raise the largest load, and skips
requests moved within ``cooldown_s`` (no ping-pong). A moved request leaves its rank and resumes on
the other one after ``migration_pause_s``: its KV blocks read back from the shared block store (the
forwarding path of the live cluster, ``DecodeInstance.forward_unfinished``).

Pure Python; bad input raises ``PolicyInputError`` (a ``ValueError``) naming the argument.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deepinfer_jax.cluster.errors import PolicyInputError, check_int, check_nonempty, check_number

__all__ = ["KV_BYTES_PER_TOKEN", "Move", "RebalanceSettings", "migration_pause_s", "plan_moves"]

# The model's compressed global KV per token (docs/model.md §4.8: 890 B); the SWA window and the
# other slot state travel in a fixed-size part covered by ``fixed_s``.
KV_BYTES_PER_TOKEN = 890


@dataclass(frozen=True)
class RebalanceSettings:
    """How often and how much the decode rebalancing runs (the simulator's ``deepinfer_migrate`` policy
    and the live ``Cluster(rebalance=...)``): a plan every ``tick_s`` over all decode ranks, and with
    ``on_admit`` also right after each admission of a new request (a large arrival is what most often
    makes the most loaded rank; waiting for the tick leaves it there), unless one request alone keeps the
    threshold out of reach (``plan_moves(only_if_reachable=True)``), ``plan_moves`` arguments, and the
    store read bandwidth of ``migration_pause_s``. ``settle``: a request is not moved within
    ``cooldown_s`` of its admission either (spares short-lived requests the pause; less balance gained)."""

    tick_s: float = 0.1
    max_moves: int = 16
    threshold: float = 1.05
    cooldown_s: float = 1.0
    bandwidth_gb_s: float = 5.0
    keep_rows: bool = True
    settle: bool = False
    on_admit: bool = True

    def __post_init__(self) -> None:
        check_number("tick_s", self.tick_s, 0.0, strict=True)
        check_int("max_moves", self.max_moves)
        check_number("threshold", self.threshold, 1.0)
        check_number("cooldown_s", self.cooldown_s)
        check_number("bandwidth_gb_s", self.bandwidth_gb_s, 0.0, strict=True)
        for name in ("keep_rows", "settle", "on_admit"):
            if not isinstance(getattr(self, name), bool):
                raise PolicyInputError(name, f"must be True or False, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Move:
    """Migrate request ``rid`` (``kv`` tokens) from rank ``src`` to rank ``dst`` (flat rank indices)."""

    rid: int
    src: int
    dst: int
    kv: float


def migration_pause_s(kv_tokens: float, bandwidth_gb_s: float = 5.0, bytes_per_token: float = KV_BYTES_PER_TOKEN,
                      fixed_s: float = 0.02) -> float:
    """Seconds a migrated request does not decode: ``fixed_s`` (the hand-over round trip and the
    slot state) plus its KV blocks read from the store at ``bandwidth_gb_s`` GB/s (default 5 GB/s,
    an assumption: one rank's share of an RDMA store read)."""
    check_number("kv_tokens", kv_tokens)
    check_number("bandwidth_gb_s", bandwidth_gb_s, 0.0, strict=True)
    check_number("bytes_per_token", bytes_per_token)
    check_number("fixed_s", fixed_s)
    return fixed_s + kv_tokens * bytes_per_token / (bandwidth_gb_s * 1e9)


def plan_moves(ranks: Sequence[Sequence[tuple[int, float]]], max_moves: int = 4, threshold: float = 1.05,
               now: float = 0.0, last_moved: Mapping[int, float] | None = None, cooldown_s: float = 5.0,
               keep_rows: bool = False, only_if_reachable: bool = False) -> list[Move]:
    """Moves for the decode ranks ``ranks[k] = [(request id, kv tokens), ...]`` (flat over instances).

    Greedy, at most ``max_moves``: while the ranks' KV ``max / mean > threshold``, take the most
    loaded rank and the least loaded one and move the request (not moved since ``now - cooldown_s``
    per ``last_moved``, nor earlier in this plan) that minimises the larger of their two new loads,
    provided it is below the old maximum; stop when there is none. With ``keep_rows`` a single move
    only goes to a rank with fewer requests than the busiest one (the rows term of the step time is
    not made worse). Also considered, when two moves are left: a swap of a request of the most loaded
    rank with a smaller one of the least loaded (rows unchanged), which packs large requests that no
    single move fits. Ties prefer one migration, then fewer tokens moved (a shorter pause), then the
    lower rank and request id, so a plan is deterministic. ``only_if_reachable`` (the plans after admissions):
    plan nothing when one request alone holds ``threshold`` times the mean rank's KV, as no placement of whole
    requests then reaches the threshold and moves would only approach that bound, each at a pause."""
    check_nonempty("ranks", ranks)
    check_int("max_moves", max_moves)
    check_number("threshold", threshold, 1.0)
    check_number("now", now, None)
    check_number("cooldown_s", cooldown_s)
    last_moved = {} if last_moved is None else last_moved
    held: list[list[tuple[int, float]]] = []
    seen: set[int] = set()
    for k, reqs in enumerate(ranks):
        rank = []
        for rid, kv in reqs:
            if isinstance(rid, bool) or not isinstance(rid, int) or rid in seen:
                raise PolicyInputError(f"ranks[{k}]", f"request ids must be distinct integers, got {rid!r}")
            check_number(f"ranks[{k}]", kv)
            seen.add(rid)
            rank.append((rid, float(kv)))
        held.append(rank)
    loads = [sum(kv for _, kv in r) for r in held]
    n = len(loads)
    if only_if_reachable and max((kv for r in held for _, kv in r), default=0.0) * n >= threshold * sum(loads):
        return []
    moved: set[int] = {rid for rid, t in last_moved.items() if now - t < cooldown_s}
    plan: list[Move] = []
    while len(plan) < max_moves:
        total = sum(loads)
        if total <= 0 or max(loads) * n <= threshold * total:
            break
        src = max(range(n), key=lambda k: (loads[k], -k))
        low = min((k for k in range(n) if k != src), key=lambda k: (loads[k], k), default=None)
        if low is None:
            break
        top_rows = max(map(len, held))
        open_ranks = [k for k in range(n) if k != src and (not keep_rows or len(held[k]) < top_rows)]
        best = None  # ((new larger load, migrations, tokens moved, ids), [(rid, kv, from, to), ...])
        if open_ranks:
            dst = min(open_ranks, key=lambda k: (loads[k], k))
            for rid, kv in held[src]:
                if rid in moved or kv <= 0 or loads[dst] + kv >= loads[src]:
                    continue
                key = (max(loads[src] - kv, loads[dst] + kv), 1, kv, rid)
                if best is None or key < best[0]:
                    best = (key, [(rid, kv, src, dst)])
        if max_moves - len(plan) >= 2:  # a swap keeps both ranks' row counts
            swap = _best_swap(held, loads, src, low, moved)
            if swap is not None and (best is None or swap[0] < best[0]):
                best = swap
        if best is None:
            break
        for rid, kv, frm, to in best[1]:
            held[frm].remove((rid, kv))
            held[to].append((rid, kv))
            loads[frm] -= kv
            loads[to] += kv
            moved.add(rid)
            plan.append(Move(rid, frm, to, kv))
    return plan


def _best_swap(held, loads, src: int, low: int, moved: set[int]):
    """The swap ``plan_moves`` considers between the most loaded rank ``src`` and the least loaded ``low``:
    request ``a`` of ``src`` for a smaller ``b`` of ``low`` (``d = ka - kb > 0``, ``loads[low] + d <
    loads[src]``) minimising the key ``(max(loads[src] - d, loads[low] + d), 2, ka + kb, a, b)``;
    ``(key, [(a, ka, src, low), (b, kb, low, src)])`` or None.

    Both parts of the larger load are monotone in ``kb`` (float rounding keeps them so) and the allowed ``kb``
    are an interval around ``ka - gap / 2``, so for each ``a`` the least key lies at one of the ``kb`` values
    next to ``ka - gap / 2`` (among equal ``kb``, at the smallest id). Checking the three on either side with
    the key itself, and walking on outwards while rounding keeps the larger load at its least (a run of
    ``kb`` values whose loads round alike; the rest of the key breaks that tie), gives the swap a search over
    every pair gives (``tests/test_cluster_decode_rebalance.py`` compares them), in ``O(n log n)`` instead of
    ``O(n^2)``: a 16-move plan over 32 ranks of 100 requests took 24.5 ms before, about 3 ms with it, on this
    machine."""
    src_load, low_load = loads[src], loads[low]
    firsts: dict[float, int] = {}
    for b, kb in held[low]:
        if b not in moved and (kb not in firsts or b < firsts[kb]):
            firsts[kb] = b
    values = sorted(firsts)
    best = None
    for a, ka in held[src]:
        if a in moved:
            continue
        i = bisect.bisect_left(values, ka - (src_load - low_load) / 2)
        lo, hi = max(0, i - 3), min(len(values), i + 3)
        found = [x for x in (_swap_key(values, firsts, j, a, ka, src_load, low_load) for j in range(lo, hi)) if x]
        if not found:
            continue
        top = min(key[0] for key, _ in found)
        # rounding can make the larger load equal over a run of kb values (a denormal beside 0, or lengths
        # past 2**53): walk outwards while it stays at the least, so a tie is broken as over every pair
        for j, step in ((lo - 1, -1), (hi, 1)):
            while 0 <= j < len(values) and (x := _swap_key(values, firsts, j, a, ka, src_load, low_load)) \
                    and x[0][0] <= top:
                found.append(x)
                j += step
        key, kb = min(found)
        if best is None or key < best[0]:
            best = (key, [(a, ka, src, low), (key[4], kb, low, src)])
    return best


def _swap_key(values, firsts, j, a, ka, src_load, low_load):
    """``_best_swap``'s ``(key, kb)`` for swapping request ``a`` (``ka``) for the first request of length
    ``values[j]`` on the least loaded rank, or None when that swap is not allowed."""
    kb = values[j]
    d = ka - kb
    if d <= 0 or low_load + d >= src_load:
        return None
    return (max(src_load - d, low_load + d), 2, ka + kb, a, firsts[kb]), kb
