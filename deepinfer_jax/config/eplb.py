"""Expert-parallel load-balancing settings (docs/engine.md §3): the ``[eplb]`` table of a sharding preset.

Plain Python (host side, no JAX). ``DISPATCHES`` names the MoE token dispatches; the EP MoE
(``parallel.ep_moe``) reads the same tuple from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_jax.config.fields import ShardingError, int_field, str_field

__all__ = ["DISPATCHES", "EplbSettings"]

#: MoE token dispatches: capacity-based ``all_to_all`` (runs on CPU) and ``ragged_all_to_all`` (GPU/TPU only).
DISPATCHES = ("all_to_all", "ragged_all_to_all")


@dataclass(frozen=True, kw_only=True)
class EplbSettings:
    """Expert-parallel load balancing knobs (docs/engine.md §3).

    redundant_slots_per_rank: extra physical expert slots per EP rank for replicas of hot experts.
    window_steps: steps of per-layer expert load kept for the statistics.
    rebalance_period: steps between two placements.
    dispatch: MoE token dispatch, ``"all_to_all"`` (capacity based; runs on CPU) or ``"ragged_all_to_all"``.
    enabled: in the engine (``LLM(sharding=...)`` with ``ep_size > 1``): True runs the MoE layers through the
        shard_map EP MoE over an EPLB placement (the redundant slots, per-slot load counts, a rebalance every
        ``rebalance_period`` steps); False leaves the routed experts to GSPMD (no slots, no statistics).
    """

    redundant_slots_per_rank: int = 0
    window_steps: int = 100
    rebalance_period: int = 1000
    dispatch: str = "all_to_all"
    enabled: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "redundant_slots_per_rank",
                           int_field("eplb.redundant_slots_per_rank", self.redundant_slots_per_rank, 0))
        object.__setattr__(self, "window_steps", int_field("eplb.window_steps", self.window_steps, 1))
        object.__setattr__(self, "rebalance_period", int_field("eplb.rebalance_period", self.rebalance_period, 1))
        if str_field("eplb.dispatch", self.dispatch) not in DISPATCHES:
            raise ShardingError("eplb.dispatch", f"must be one of {DISPATCHES}, got {self.dispatch!r}")
        if not isinstance(self.enabled, bool):
            raise ShardingError("eplb.enabled", f"must be a boolean, got {self.enabled!r}")
