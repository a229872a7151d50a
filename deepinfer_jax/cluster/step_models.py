"""Step-time models for the simulator, at production shapes (docs/cluster.md, "Scaling assumptions").

**Prefill**: the engine's own ``engine.cost_model.CostModel``, ``cost = a0 + sum(a1 q + a2 q c + a3 q**2)``
ns per step. The fitted models this project has are CPU fits of the small checkpoint, whose
absolute times say nothing about a Blackwell rank, so ``production_prefill_model`` sets the
coefficients from the seed's per-rank prefill measurements (a 4,096-token step in ~68 ms, a
65,536-token step in ~732 ms: ``a0 = 23.7 ms``, ``a1 = 10.8 us/token``) plus one assumption for
the attention term the seed does not give: at 128K tokens of context the ``q c`` term costs as much
per token as the linear term (``a2 = a1 / 131072``), and ``a3 = a2 / 2`` (causal attention inside a
chunk), which makes a prompt's total quota independent of how it is chunked.
``scale_cost_model`` instead takes any fitted model (e.g. one of the engine's JSON caches,
``CostModel.load``) and rescales it to the seed's anchor, keeping its shape.

**Decode**: ``DecodeStepModel``, one DP rank's share of a decode step linear in its batch rows and
total KV, ``d1 * rows + d2 * kv`` plus a fixed ``d0`` per step; all ranks of an instance step
together (the EP collectives), so an instance's step lasts ``d0 + max over ranks``. From the seed's
decode sweep (8 sequences/rank: ~2,600 tok/s/GPU; 256: ~26,300, at 3.25 tokens per step with
speculation): ``d0 = 9.3 ms``, ``d1 = 87 us/row``; assumption: ``d2 = 1.3 ns`` per KV token (a rank
with 256 requests of 64K tokens spends as long on attention as on its rows). ``fit`` refits it from
measured (rows, kv, ns) steps by least squares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deepinfer_jax.cluster.errors import PolicyInputError, check_number
from deepinfer_jax.engine.cost_model import CostModel

__all__ = ["DecodeStepModel", "production_prefill_model", "scale_cost_model"]

SEED_PREFILL_ANCHOR = (4096, 68e6)  # tokens, ns per step (seed: 4,096-token batch ~68 ms)


def production_prefill_model() -> CostModel:
    """The prefill cost model at production shapes (see the module docstring)."""
    a0 = 23.7e6
    a1 = (732e6 - 68e6) / (65536 - 4096)  # ns per token
    a2 = a1 / 131072
    return CostModel((a0, a1, a2, a2 / 2))


def scale_cost_model(model: CostModel, anchor_q: int = SEED_PREFILL_ANCHOR[0],
                     anchor_ns: float = SEED_PREFILL_ANCHOR[1]) -> CostModel:
    """A copy of ``model`` with every coefficient scaled so that a step of ``anchor_q`` fresh tokens
    takes ``anchor_ns`` (the fit's shape kept, its machine's speed replaced)."""
    check_number("anchor_ns", anchor_ns, 0.0, strict=True)
    t = model.predict([(anchor_q, 0)])
    if t <= 0:
        raise PolicyInputError("model", "predicts no time for the anchor step; cannot scale")
    return CostModel(model.coef * (anchor_ns / t))


@dataclass(frozen=True)
class DecodeStepModel:
    """Decode step time: ``d0 + max over ranks (d1 * rows + d2 * kv)`` ns; ``tokens_per_step`` per
    request per step (1 without speculation)."""

    d0: float = 9.3e6
    d1: float = 87e3
    d2: float = 1.3
    tokens_per_step: float = 3.25

    def __post_init__(self) -> None:
        for name in ("d0", "d1", "d2"):
            check_number(name, getattr(self, name))
        check_number("tokens_per_step", self.tokens_per_step, 0.0, strict=True)

    def rank_ns(self, rows: int, kv: float) -> float:
        return self.d1 * rows + self.d2 * kv

    def attention_ns(self, kv: float) -> float:
        """The attention part of a rank's step (what the decode balance metric compares)."""
        return self.d2 * kv

    @classmethod
    def fit(cls, rows: Sequence[int], kv: Sequence[float], times_ns: Sequence[float],
            tokens_per_step: float = 1.0) -> DecodeStepModel:
        """Least squares (non-negative by clipping) over measured single-rank steps."""
        if not (len(rows) == len(kv) == len(times_ns)) or len(rows) < 3:
            raise PolicyInputError("times_ns", "needs >= 3 steps with rows, kv and times of equal length")
        X = np.column_stack([np.ones(len(rows)), np.asarray(rows, float), np.asarray(kv, float)])
        coef = np.maximum(np.linalg.lstsq(X, np.asarray(times_ns, float), rcond=None)[0], 0.0)
        return cls(float(coef[0]), float(coef[1]), float(coef[2]), tokens_per_step)
