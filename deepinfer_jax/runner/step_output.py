"""What a launched step gives back to the engine core: ``StepOutput``, typed.

``PendingStep.output()`` (plain steps) and ``SpecPending.output()`` (speculative steps) wait for the
device and return one ``StepOutput``; the engine core takes it into its requests (``EngineCore._reconcile``)
and the speculation policy learns from it (``SpecDecoding.observe``). The plan side of the contract is the
scheduler's ``SchedulerOutput`` (chunks and the cache copies to make before the step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["SampledToken", "StepOutput"]


class SampledToken(NamedTuple):
    """One sampled token, its log-probability and the step's top log-probabilities at its position."""

    token: int
    logprob: float
    top_ids: np.ndarray
    top_logprobs: np.ndarray


@dataclass(frozen=True)
class StepOutput:
    """Per chunk, in launch order: ``tokens[i]`` is None for a chunk that samples nothing (a prompt piece
    before its end), else the tokens it adds (a plain step: one; a verify row: the drafts it accepted and
    one more). Speculative steps also give, per chunk, the drafts its row ``verified``, the ``anchors``
    position the row ran at, and the ``confidence`` of its next drafts (None on plain steps)."""

    tokens: list[list[SampledToken] | None]
    verified: list[int] | None = None
    anchors: list[int] | None = None
    confidence: list[np.ndarray] | None = None

    @classmethod
    def plain(cls, sampled: list[SampledToken | None]) -> StepOutput:
        """A plain step's output from its one sampled token per chunk (None: the chunk sampled nothing)."""
        return cls([None if t is None else [t] for t in sampled])
