"""The step-time model behind cost-aware chunked prefill (engine.md §2.1).

A step that runs chunks ``(q_r, c_r)`` (q new tokens after c cached ones, per request) is
predicted to take

    cost = a0 + sum_r (a1 * q_r + a2 * q_r * c_r + a3 * q_r ** 2)   nanoseconds,

linear in the four coefficients, so a least-squares fit over profiled steps gives them (kept
non-negative so that cost grows with q). ``largest_q`` solves one chunk's quadratic for the most
tokens that fit a remaining budget: with a long cached prefix the same budget buys fewer tokens,
which a plain token budget ignores. Observations of real steps refit the model online; the mean
relative prediction error is kept in ``stats``.

Fitted coefficients are cached on disk as JSON, keyed by the caller (model, cache layout,
buckets, machine), so the start-up profiling pass runs once per configuration and machine.
"""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["CostModel"]


def _features(chunks: Sequence[tuple[int, int]]) -> np.ndarray:
    q = np.array([c[0] for c in chunks], np.float64)
    c = np.array([c[1] for c in chunks], np.float64)
    return np.array([1.0, q.sum(), (q * c).sum(), (q * q).sum()])


class CostModel:
    """Quadratic step-time model; ``coef = (a0, a1, a2, a3)`` in ns."""

    def __init__(self, coef: Sequence[float] = (0.0, 0.0, 0.0, 0.0), window: int = 256, refit_every: int = 16) -> None:
        self.coef = np.asarray(coef, np.float64)
        if self.coef.shape != (4,) or not np.all(np.isfinite(self.coef)):
            raise ValueError(f"coef must be 4 finite numbers, got {coef!r}")
        self._X: collections.deque = collections.deque(maxlen=window)
        self._y: collections.deque = collections.deque(maxlen=window)
        self._errors: collections.deque = collections.deque(maxlen=window)
        self._refit_every, self._since = refit_every, 0
        self._base: tuple[list, list] = ([], [])
        self.num_observed = 0
        self.num_refits = 0

    # ---- prediction ----
    def predict(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Predicted ns of a step running ``chunks`` [(q, c), ...]."""
        return float(_features(chunks) @ self.coef)

    def chunk_cost(self, q: int, c: int) -> float:
        """The part of a step's cost one chunk adds (ns)."""
        return float(self.coef[1] * q + self.coef[2] * q * c + self.coef[3] * q * q)

    def largest_q(self, budget_ns: float, c: int, q_max: int) -> int:
        """The most tokens (<= q_max) one chunk after ``c`` cached tokens may run within ``budget_ns``."""
        if budget_ns <= 0:
            return 0
        a = self.coef[3]
        b = self.coef[1] + self.coef[2] * c
        if a > 0:
            q = (-b + math.sqrt(b * b + 4 * a * budget_ns)) / (2 * a)
        elif b > 0:
            q = budget_ns / b
        else:
            return q_max
        return int(min(q_max, math.floor(q)))

    # ---- fitting ----
    def fit(self, steps: Sequence[Sequence[tuple[int, int]]], times_ns: Sequence[float], base: bool = False,
            prior: np.ndarray | None = None) -> None:
        """Least-squares fit with non-negative coefficients (an active-set loop over ``lstsq``).

        ``base``: these are the profiled steps; they stay in every later online refit, so a window
        of look-alike steps (decode only: sum q == sum q**2) cannot make the fit degenerate.
        ``prior``: a weak ridge pull toward these coefficients for directions the data leaves open.
        """
        if base:
            self._base = ([list(s) for s in steps], [float(t) for t in times_ns])
        X = np.stack([_features(s) for s in steps])
        y = np.asarray(times_ns, np.float64)
        w = 1.0 / np.maximum(y, 1.0)  # relative least squares: every step counts alike whatever its length
        A, b = X * w[:, None], y * w
        if prior is not None:
            lam = 1e-2 * np.sqrt(np.mean(A * A, axis=0)) + 1e-12
            A, b = np.vstack([A, np.diag(lam)]), np.concatenate([b, lam * prior])
        active = np.ones(4, bool)
        coef = np.zeros(4)
        for _ in range(4):
            coef = np.zeros(4)
            coef[active] = np.linalg.lstsq(A[:, active], b, rcond=None)[0]
            if np.all(coef >= 0):
                break
            active &= coef > 0
        self.coef = np.maximum(coef, 0.0)

    def observe(self, chunks: Sequence[tuple[int, int]], time_ns: float) -> None:
        """Record one measured step; refit every ``refit_every`` observations."""
        pred = self.predict(chunks)
        if time_ns > 0:
            self._errors.append(abs(pred - time_ns) / time_ns)
        self._X.append(list(chunks))
        self._y.append(float(time_ns))
        self.num_observed += 1
        self._since += 1
        if self._since >= self._refit_every and len(self._y) >= 8:
            self.fit(self._base[0] + list(self._X), self._base[1] + list(self._y), prior=self.coef)
            self._since = 0
            self.num_refits += 1

    @property
    def mean_relative_error(self) -> float | None:
        """Mean |predicted - measured| / measured over the recent observed steps (None before any)."""
        return float(np.mean(self._errors)) if self._errors else None

    # ---- persistence ----
    def save(self, path: str | Path, meta: dict | None = None) -> None:
        """JSON with the coefficients and the profiled steps (the base of later refits)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"coef": self.coef.tolist(), "steps": self._base[0], "times_ns": self._base[1], "meta": meta or {}}
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # atomic: concurrent engines never read half a file
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path, **kwargs) -> CostModel:
        data = json.loads(Path(path).read_text())
        model = cls(data["coef"], **kwargs)
        model._base = ([[tuple(c) for c in s] for s in data.get("steps", [])], list(data.get("times_ns", [])))
        return model
