"""The attention data-parallel router: which DP rank a new request joins (engine.md §3, decode balancer).

Every step all DP ranks run together (the EP collectives need them all), so a step lasts as long as
its slowest rank, and a rank's attention cost grows with two things: how many requests it runs
(batch rows) and how much KV they read (total context length). ``pick_rank`` measures both as
fractions of the whole engine's (``n_j / N``, ``kv_j / K``, totals including the new request) and puts
a new request of ``L`` tokens where it least increases the sum over ranks of the squared fractions
(a smooth stand-in for the slowest rank: it evens out both). Placing it on rank i adds
``(2 n_i + 1) / N**2 + (2 kv_i L + L**2) / K**2``, so the choice minimises

    n_i / N**2 + L * kv_i / K**2

For a request of average length (``L = K / N``) the two terms weigh a rank's share of the requests and
its share of the KV equally; a shorter request leans on the count (it goes to a rank with few
requests even if its KV is long), a longer one on the KV (it goes to a rank with little KV even if it
runs more requests), as the decode balancer does (engine.md §3). Ties go to the lowest rank.
Scale-free: no capacities. Pure Python; no JAX.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RankLoad", "pick_rank"]


@dataclass(frozen=True)
class RankLoad:
    """What a DP rank holds: ``num_requests`` unfinished requests (running or waiting) with ``kv_tokens``
    tokens (prompt + output so far) in total."""

    num_requests: int = 0
    kv_tokens: int = 0


def pick_rank(loads: Sequence[RankLoad], num_tokens: int) -> int:
    """The rank (index into ``loads``) for a new request of ``num_tokens`` tokens; ``ValueError`` naming the
    argument for bad input."""
    if not loads:
        raise ValueError("loads: needs at least one rank")
    if not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens: must be an integer >= 0, got {num_tokens!r}")
    reqs = [ld.num_requests for ld in loads]
    kvs = [ld.kv_tokens for ld in loads]
    if min(reqs) < 0 or min(kvs) < 0:
        raise ValueError("loads: num_requests and kv_tokens must be >= 0")
    total_reqs, total_kv = sum(reqs) + 1, max(sum(kvs) + num_tokens, 1)

    def added_cost(i: int) -> tuple[float, int]:
        return reqs[i] / total_reqs**2 + num_tokens * kvs[i] / total_kv**2, i

    return min(range(len(loads)), key=added_cost)
