"""The decode balancer (engine.md §3; seed §1.2): one router over every rank of every decode instance.

It balances request count (a rank's batch rows per step) against total KV length (its attention
cost) with the in-engine DP router's rule, ``engine.dp_router.pick_rank``, applied to the flattened
list of all ranks of all accepting instances: a short request goes to a rank with few requests even
if its KV is long, a long one to a rank with little KV. An instance that is draining (told to go
offline) is not offered new requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer_jax.cluster.errors import PolicyInputError, check_int, check_nonempty
from deepinfer_jax.engine.dp_router import RankLoad, pick_rank

__all__ = ["DecodeInstanceView", "RankLoad", "pick_decode_rank"]


@dataclass(frozen=True)
class DecodeInstanceView:
    """One decode instance as the router sees it: each DP rank's load, and whether it takes new work."""

    ranks: tuple[RankLoad, ...]
    accepting: bool = True


def pick_decode_rank(instances: Sequence[DecodeInstanceView], num_tokens: int) -> tuple[int, int]:
    """``(instance, rank)`` for a request entering decode with ``num_tokens`` tokens of KV."""
    check_nonempty("instances", instances)
    check_int("num_tokens", num_tokens)
    flat: list[tuple[int, int]] = []
    loads: list[RankLoad] = []
    for i, inst in enumerate(instances):
        if not inst.accepting:
            continue
        for r, ld in enumerate(inst.ranks):
            if ld.num_requests < 0 or ld.kv_tokens < 0:
                raise PolicyInputError(f"instances[{i}].ranks[{r}]", "num_requests and kv_tokens must be >= 0")
            flat.append((i, r))
            loads.append(ld)
    if not loads:
        raise PolicyInputError("instances", "no accepting instance with ranks to route to")
    return flat[pick_rank(loads, num_tokens)]
