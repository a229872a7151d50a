"""When EPLB rebalances and from what (engine.md §3): a sliding window of load and a period.

Host code, pure numpy. ``LoadStats`` keeps each layer's per-expert token counts of the last
``window`` steps in a ring buffer; ``RebalancePolicy`` says every how many steps a new placement is
computed from that window (DeepInfer: prefill 4 redundant slots per rank, window 100, every 1,000
steps; decode 1 per rank, window 1,000, every 10,000 steps); ``Rebalancer`` ties them to
``compute_placement`` for an engine loop: ``record`` the step's counts, get a new ``Placement`` when
one is due.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from deepinfer_jax.parallel.eplb import (
    Placement,
    _max_over_mean,
    compute_placement,
    identity_placement,
    moe_lb,
    rank_loads,
    slot_rank_loads,
)

__all__ = ["LoadStats", "RebalancePolicy", "Rebalancer", "expert_counts"]


def _positive(name: str, value) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class RebalancePolicy:
    """EPLB knobs: ``redundant_per_rank`` spare slots, ``window`` steps of statistics, a new placement every
    ``period`` steps; ``n_nodes``/``n_groups`` select the hierarchical placement."""

    redundant_per_rank: int = 4
    window: int = 100
    period: int = 1000
    n_nodes: int = 1
    n_groups: int | None = None

    def __post_init__(self):
        if not isinstance(self.redundant_per_rank, numbers.Integral) or self.redundant_per_rank < 0:
            raise ValueError(f"redundant_per_rank must be an integer >= 0, got {self.redundant_per_rank!r}")
        for name in ("window", "period", "n_nodes"):
            _positive(name, getattr(self, name))
        if self.n_groups is not None:
            _positive("n_groups", self.n_groups)

    @classmethod
    def prefill(cls, **overrides) -> RebalancePolicy:
        """DeepInfer's prefill setting: 4 redundant per rank, window 100, every 1,000 steps."""
        return cls(**{"redundant_per_rank": 4, "window": 100, "period": 1000, **overrides})

    @classmethod
    def decode(cls, **overrides) -> RebalancePolicy:
        """DeepInfer's decode setting: 1 redundant per rank, window 1,000, every 10,000 steps."""
        return cls(**{"redundant_per_rank": 1, "window": 1000, "period": 10000, **overrides})

    def due(self, step: int) -> bool:
        """Whether a rebalance follows step number ``step`` (1-based count of recorded steps)."""
        return step > 0 and step % self.period == 0


class LoadStats:
    """Per-layer expert token counts over the last ``window`` steps: a ring buffer [window, L, E] of int64."""

    def __init__(self, n_layers: int, n_experts: int, window: int):
        for name, value in (("n_layers", n_layers), ("n_experts", n_experts), ("window", window)):
            _positive(name, value)
        self._ring = np.zeros((window, n_layers, n_experts), np.int64)
        self.steps = 0  # steps recorded since the start

    @property
    def window(self) -> int:
        return self._ring.shape[0]

    def record(self, counts_LE) -> None:
        """Add one step's token counts [L, E] (non-negative integers), replacing the oldest step of the window."""
        counts = np.asarray(counts_LE)
        if counts.shape != self._ring.shape[1:]:
            raise ValueError(f"counts_LE has shape {counts.shape}, expected {self._ring.shape[1:]}")
        if not np.issubdtype(counts.dtype, np.integer) or (counts < 0).any():
            raise ValueError("counts_LE must hold non-negative integer token counts")
        self._ring[self.steps % self.window] = counts
        self.steps += 1

    def load(self) -> np.ndarray:
        """[L, E] total tokens per expert over the steps in the window (at most ``window`` of them)."""
        return self._ring.sum(0)

    def reset(self) -> None:
        self._ring[:] = 0
        self.steps = 0


def expert_counts(slot_counts_LP, placement: Placement) -> np.ndarray:
    """[L, E] tokens per logical expert from per-slot counts [L, P] (summing each expert's replicas)."""
    counts = np.asarray(slot_counts_LP)
    if counts.ndim == 1:
        counts = counts[None]
    if counts.shape != placement.phys_to_log.shape:
        raise ValueError(f"slot_counts_LP has shape {counts.shape}, the placement has {placement.phys_to_log.shape}")
    out = np.zeros((placement.n_layers, placement.n_experts), np.int64)
    np.add.at(out, (np.arange(placement.n_layers)[:, None], placement.phys_to_log), counts.astype(np.int64))
    return out


class Rebalancer:
    """The EPLB loop of one engine: ``record`` each step's expert counts; a new placement every ``period`` steps.

    Starts from ``placement`` (default ``identity_placement`` with the policy's redundant slots); ``placement``
    is the current one. Besides the expert-load window it keeps each step's rank loads [L, R] over the same
    window (measured from per-slot counts with ``record_slots``, else each expert's load split evenly over its
    copies), and at every due step, just before the rebalance: ``last_moe_lb`` [L] (the window's expert load
    under the old placement, split evenly), ``last_measured_moe_lb`` [L] (``window_moe_lb()`` then) and
    ``last_expected_moe_lb`` [L] (the same window's load under the new placement, split evenly: a
    prediction). All three are None before the first due step. ``rebalances`` counts placements that changed;
    ``total_load`` [L, E] sums every recorded step.
    """

    def __init__(self, n_layers: int, n_experts: int, n_ranks: int, policy: RebalancePolicy,
                 placement: Placement | None = None):
        self.policy = policy
        if placement is None:
            placement = identity_placement(n_layers, n_experts, n_ranks, policy.redundant_per_rank)
        elif (placement.n_layers, placement.n_experts, placement.n_ranks) != (n_layers, n_experts, n_ranks) or \
                placement.slots_per_rank != n_experts // n_ranks + policy.redundant_per_rank:
            raise ValueError(f"placement: {placement.n_layers} layers x {placement.n_experts} experts over "
                             f"{placement.n_ranks} ranks ({placement.slots_per_rank} slots each) does not match "
                             f"{n_layers} x {n_experts} over {n_ranks} with {policy.redundant_per_rank} redundant")
        self.placement = placement
        self.stats = LoadStats(n_layers, n_experts, policy.window)
        self._rank_ring = np.zeros((policy.window, n_layers, n_ranks))
        self.total_load = np.zeros((n_layers, n_experts), np.int64)
        self.rebalances = 0
        self.last_moe_lb: np.ndarray | None = None
        self.last_measured_moe_lb: np.ndarray | None = None
        self.last_expected_moe_lb: np.ndarray | None = None

    def record(self, counts_LE, rank_load_LR=None) -> Placement | None:
        """Record one step (``rank_load_LR``: its measured rank loads, default: modelled under the current
        placement); returns the new placement when one is due and differs from the current one."""
        self.stats.record(counts_LE)
        counts = np.asarray(counts_LE, np.int64)
        self.total_load += counts
        ranks = rank_loads(counts, self.placement) if rank_load_LR is None else np.asarray(rank_load_LR, np.float64)
        if ranks.shape != self._rank_ring.shape[1:]:
            raise ValueError(f"rank_load_LR has shape {ranks.shape}, expected {self._rank_ring.shape[1:]}")
        self._rank_ring[(self.stats.steps - 1) % self.stats.window] = ranks
        if not self.policy.due(self.stats.steps):
            return None
        load = self.stats.load()
        self.last_moe_lb = moe_lb(load, self.placement)
        self.last_measured_moe_lb = self.window_moe_lb()
        new = compute_placement(load, self.placement.n_ranks, self.policy.redundant_per_rank,
                                self.policy.n_nodes, self.policy.n_groups)
        self.last_expected_moe_lb = moe_lb(load, new)
        if new == self.placement:
            return None
        self.placement = new
        self.rebalances += 1
        return new

    def record_slots(self, slot_counts_LP, placement: Placement | None = None) -> Placement | None:
        """``record`` from one step's per-slot counts [L, P] (as the EP MoE returns them) taken under
        ``placement`` (default: the current one; a step dispatched before a rebalance ran with the old one)."""
        placement = self.placement if placement is None else placement
        return self.record(expert_counts(slot_counts_LP, placement), slot_rank_loads(slot_counts_LP, placement.n_ranks))

    def window_moe_lb(self) -> np.ndarray:
        """[L] max rank load / mean rank load over the steps in the window (1.0 for a layer without load)."""
        return _max_over_mean(self._rank_ring.sum(0))
