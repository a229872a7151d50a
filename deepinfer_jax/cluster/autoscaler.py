"""The autoscaler policy (engine.md §3; seed §2): the prefill/decode ratio follows traffic.

Signals, per role: prefill instances from the **rate of uncached (missed) prompt tokens**
(tokens/s the prefill side must compute), decode instances from the **running requests**. With an
instance's capacity ``cap`` (tokens/s, or running requests it sustains):

    needed(load)  = ceil(load / (cap * target_utilization))        the computed minimum
    desired(load) = clamp(needed + margin, min, max),  margin = max(margin_instances,
                                                                    ceil(margin_fraction * needed))

* **Scale up** when ``current < desired(load_up)`` (``load_up``: the mean over the last
  ``up_window_s``), by at most ``max_step_up``, no sooner than ``up_cooldown_s`` after the last
  scale-up. Instances come from the ready pool at once, else cold-start (the caller's business).
  **Bursts ride on the spare quota**: a scale-up is held while ``load_up`` is a jump (more than
  ``burst_jump`` times the median over ``sustain_window_s``, 45 min: a level short bursts do not
  move) that the current instances still carry at or below ``burst_utilization`` (80%, the
  quota line); a ramp (the median follows) or a burst beyond 80% scales up at once.
* **Scale down** when ``current > desired(load_down)`` (``load_down``: the *peak* over the last
  ``down_window_s``) plus ``down_hysteresis`` instances, to that count, by at most ``max_step_down``, no sooner than ``down_after_up_s`` after the last
  scale-up and ``down_after_down_s`` after the last scale-down; never while quota use
  ``load_now / (current * cap)`` exceeds ``no_scale_down_above`` (80%), and only by as many
  instances as keep the projected use ``load_down / ((current - k) * cap)`` at or below it. An
  instance that has work (``busy``: requests routed to it and not yet done) uses its whole quota:
  both checks take at least ``busy * cap`` as the load, so a backlog that stalls new arrivals (a slow
  step, a compilation) never reads as an idle role. Nor while an instance of the role is still
  starting (``RoleState.starting``, counted by the live hook): a scale-up is not undone before the
  capacity it added could serve, so a closed-loop client that waits on decode (no new prompts, a
  zero rate) cannot make the role start and stop instances over and over.
* Bounds ``min_*`` / ``max_*`` always hold; spare capacity is the margin (online, above the
  minimum) plus ``ready_pool`` idle machines kept booted for instant scale-up.

``decide`` is the pure rule; ``Autoscaler`` is the live hook: the router calls
``tick(now, signals)`` every tick with what it measures and gets a ``ScaleDecision`` back. A decode
instance scaled down is drained by the caller (grace period, then forwarding; not this module).
"""

from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass, field, fields, replace

from deepinfer_jax.cluster.errors import PolicyInputError, check_int, check_number

__all__ = ["Autoscaler", "AutoscalerSettings", "ClusterSignals", "RoleSettings", "RoleState", "ScaleDecision",
           "count_oscillations", "decide", "desired_instances"]


@dataclass(frozen=True)
class RoleSettings:
    """One role's scaling settings. ``capacity``: load one instance sustains (prefill: uncached
    tokens/s; decode: running requests)."""

    capacity: float
    min_instances: int = 1
    max_instances: int = 64
    target_utilization: float = 0.7
    margin_instances: int = 1
    margin_fraction: float = 0.1
    max_step_up: int = 4
    max_step_down: int = 1
    up_cooldown_s: float = 60.0
    down_after_up_s: float = 1800.0
    down_after_down_s: float = 600.0
    up_window_s: float = 60.0
    down_window_s: float = 1800.0
    no_scale_down_above: float = 0.8
    down_hysteresis: int = 1
    sustain_window_s: float = 2700.0
    burst_utilization: float = 0.8
    burst_jump: float = 1.15

    def __post_init__(self) -> None:
        check_number("capacity", self.capacity, 0.0, strict=True)
        check_int("min_instances", self.min_instances, 0)
        check_int("max_instances", self.max_instances, max(1, self.min_instances))
        check_number("target_utilization", self.target_utilization, 0.0, 1.0, strict=True)
        check_int("margin_instances", self.margin_instances, 0)
        check_number("margin_fraction", self.margin_fraction, 0.0)
        check_int("max_step_up", self.max_step_up, 1)
        check_int("max_step_down", self.max_step_down, 1)
        for name in ("up_cooldown_s", "down_after_up_s", "down_after_down_s", "up_window_s", "down_window_s",
                     "sustain_window_s"):
            check_number(name, getattr(self, name), 0.0)
        check_number("no_scale_down_above", self.no_scale_down_above, 0.0, 1.0, strict=True)
        check_int("down_hysteresis", self.down_hysteresis, 0)
        check_number("burst_utilization", self.burst_utilization, 0.0, strict=True)
        check_number("burst_jump", self.burst_jump, 1.0)


@dataclass(frozen=True)
class AutoscalerSettings:
    """Both roles' settings and the ready pool (idle booted machines kept for instant scale-up)."""

    prefill: RoleSettings
    decode: RoleSettings
    ready_pool: int = 2
    tick_s: float = 10.0

    def __post_init__(self) -> None:
        check_int("ready_pool", self.ready_pool, 0)
        check_number("tick_s", self.tick_s, 0.0, strict=True)


@dataclass(frozen=True)
class ClusterSignals:
    """What the router measures each tick: uncached prompt tokens/s, running decode requests, and how many
    prefill instances have work now (requests routed to them and not yet handed over)."""

    uncached_tokens_per_s: float
    running_requests: float
    prefill_busy: float = 0.0

    def __post_init__(self) -> None:
        check_number("uncached_tokens_per_s", self.uncached_tokens_per_s)
        check_number("running_requests", self.running_requests)
        check_number("prefill_busy", self.prefill_busy)


@dataclass(frozen=True)
class RoleState:
    """A role's instance count, when it last changed (``-inf``: never), and how many of its instances are
    still starting (the live hook's count; none in a replay that starts instances at once)."""

    current: int
    last_up: float = -math.inf
    last_down: float = -math.inf
    starting: int = 0


@dataclass(frozen=True)
class ScaleDecision:
    """``prefill`` / ``decode``: instances to add (> 0) or remove (< 0); ``reasons`` per role."""

    time: float
    prefill: int = 0
    decode: int = 0
    reasons: tuple[str, ...] = ()


def desired_instances(load: float, s: RoleSettings) -> tuple[int, int]:
    """``(needed, desired)``: the computed minimum for ``load`` and the count with the margin, bounded."""
    check_number("load", load)
    needed = math.ceil(load / (s.capacity * s.target_utilization) - 1e-9)
    margin = max(s.margin_instances, math.ceil(s.margin_fraction * needed - 1e-9))
    return needed, min(s.max_instances, max(s.min_instances, needed + margin))


def decide(now: float, state: RoleState, s: RoleSettings, load_up: float, load_down: float, load_now: float,
           load_sustained: float | None = None, busy: float = 0.0) -> tuple[int, str]:
    """The change (instances, signed) for one role and why; the rule of the module docstring.
    ``load_sustained``: the median over ``sustain_window_s`` (``None``: no burst hold). ``busy``: instances
    with work now (each counts as fully used in the scale-down checks)."""
    check_int("current", state.current, 0)
    check_int("starting", state.starting, 0)
    check_number("busy", busy)
    for name, v in (("load_up", load_up), ("load_down", load_down), ("load_now", load_now)):
        check_number(name, v)
    if load_sustained is not None:
        check_number("load_sustained", load_sustained)
    n = state.current
    if n < s.min_instances:
        return s.min_instances - n, "below min_instances"
    if n > s.max_instances:
        return s.max_instances - n, "above max_instances"
    _, want_up = desired_instances(load_up, s)
    if want_up > n:
        if (load_sustained is not None and load_up > s.burst_jump * load_sustained
                and load_up <= s.burst_utilization * n * s.capacity):
            return 0, "scale-up held: a burst the spare quota carries"
        if now - state.last_up < s.up_cooldown_s:
            return 0, "scale-up held: up_cooldown_s"
        return min(want_up - n, s.max_step_up), f"load {load_up:.4g} needs {want_up}"
    _, want_down = desired_instances(load_down, s)
    want_down = min(s.max_instances, want_down + s.down_hysteresis)
    if want_down >= n:
        return 0, "steady"
    if now - state.last_up < s.down_after_up_s or now - state.last_down < s.down_after_down_s:
        return 0, "scale-down held: cooldown"
    if state.starting:
        return 0, "scale-down held: an instance is still starting"
    in_use = busy * s.capacity  # the quota the busy instances use, whatever arrived lately
    if max(load_now, in_use) > s.no_scale_down_above * n * s.capacity:
        return 0, "scale-down held: quota use above no_scale_down_above"
    k = min(n - want_down, s.max_step_down)
    while k > 0 and max(load_down, in_use) > s.no_scale_down_above * (n - k) * s.capacity:
        k -= 1
    if k == 0:
        return 0, "scale-down held: projected quota use above no_scale_down_above"
    return -k, f"peak load {load_down:.4g} needs {want_down}"


class _Window:
    """(time, value) samples over the last ``span`` seconds."""

    def __init__(self) -> None:
        self.items: collections.deque = collections.deque()

    def push(self, t: float, v: float, keep: float) -> None:
        self.items.append((t, v))
        while self.items and self.items[0][0] < t - keep:
            self.items.popleft()

    def mean(self, t: float, span: float) -> float:
        vals = [v for (u, v) in self.items if u >= t - span]
        return sum(vals) / len(vals)

    def peak(self, t: float, span: float) -> float:
        return max(v for (u, v) in self.items if u >= t - span)

    def median(self, t: float, span: float) -> float:
        vals = sorted(v for (u, v) in self.items if u >= t - span)
        mid = len(vals) // 2
        return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


@dataclass
class Autoscaler:
    """The live hook: ``tick(now, signals) -> ScaleDecision``, keeping the signal windows and the
    role states; ``history`` holds every non-zero decision."""

    settings: AutoscalerSettings
    prefill: RoleState
    decode: RoleState
    history: list[ScaleDecision] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._windows = {"prefill": _Window(), "decode": _Window()}
        self._last_tick = -math.inf

    @classmethod
    def start(cls, settings: AutoscalerSettings, prefill: int, decode: int) -> Autoscaler:
        check_int("prefill", prefill, 0)
        check_int("decode", decode, 0)
        return cls(settings, RoleState(prefill), RoleState(decode))

    def tick(self, now: float, signals: ClusterSignals) -> ScaleDecision:
        check_number("now", now, None)
        if now < self._last_tick:
            raise PolicyInputError("now", f"time went backwards ({now} < {self._last_tick})")
        self._last_tick = now
        out, reasons = {}, []
        for role, load, busy in (("prefill", signals.uncached_tokens_per_s, signals.prefill_busy),
                                 ("decode", signals.running_requests, 0.0)):
            s: RoleSettings = getattr(self.settings, role)
            w = self._windows[role]
            w.push(now, load, max(s.up_window_s, s.down_window_s, s.sustain_window_s))
            state: RoleState = getattr(self, role)
            delta, why = decide(now, state, s, w.mean(now, s.up_window_s), w.peak(now, s.down_window_s), load,
                                w.median(now, s.sustain_window_s), busy)
            if delta > 0:
                state = replace(state, current=state.current + delta, last_up=now)
            elif delta < 0:
                state = replace(state, current=state.current + delta, last_down=now)
            setattr(self, role, state)
            out[role] = delta
            reasons.append(f"{role}: {why}")
        decision = ScaleDecision(now, out["prefill"], out["decode"], tuple(reasons))
        if decision.prefill or decision.decode:
            self.history.append(decision)
        return decision


def count_oscillations(decisions, window_s: float, role: str) -> int:
    """Oscillations of ``role`` ("prefill" / "decode") in a decision history: pairs of consecutive
    changes of opposite sign less than ``window_s`` apart (up then down, or down then up)."""
    check_number("window_s", window_s)
    if role not in {f.name for f in fields(ScaleDecision)} - {"time", "reasons"}:
        raise PolicyInputError("role", f"must be 'prefill' or 'decode', got {role!r}")
    changes = [(d.time, getattr(d, role)) for d in decisions if getattr(d, role)]
    return sum(1 for (t0, a), (t1, b) in itertools.pairwise(changes) if (a > 0) != (b > 0) and t1 - t0 < window_s)
