"""The autoscaler over a 24 h diurnal day: a tick-level (fluid) replay, not per request.

A day at production rate is ~10^8 requests, far beyond a per-request Python simulation, and the
autoscaler only sees aggregate signals, so the day is replayed per tick (``tick_s``): arrivals are
Poisson draws of ``traces.diurnal_rate`` (a sine plus bursts); each request brings uncached tokens
(lognormal, mean ``uncached_mean``: the agent trace's ~2.7K of a 96%-hit prompt) and stays in decode
for a lognormal time (mean ``decode_s``). Prefill keeps a token backlog drained at
``capacity * active instances``; running decode requests follow arrivals and departures
(``running / decode_s`` per second). Each tick the live hook (``Autoscaler.tick``) gets the signals
and its decisions take effect: a scale-up takes a ready-pool machine at once (the pool refills after
``cold_start_s``) or cold-starts; a decode scale-down drains for ``grace_s`` (the design's 1 minute)
before the machine is released. Instance-hours count active, booting and draining instances;
ready-pool hours are reported apart. An oscillation is two consecutive changes of one role in
opposite directions less than ``oscillation_window_s`` apart (``autoscaler.count_oscillations``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from deepinfer_jax.cluster.autoscaler import (
    Autoscaler,
    AutoscalerSettings,
    ClusterSignals,
    RoleSettings,
    count_oscillations,
)
from deepinfer_jax.cluster.errors import check_number
from deepinfer_jax.cluster.traces import diurnal_rate

__all__ = ["DayResult", "default_settings", "naive_settings", "replay_day"]


def default_settings(prefill_capacity: float, decode_capacity: float) -> AutoscalerSettings:
    """The policy's settings (autoscaler defaults) for instances of the given capacities."""
    return AutoscalerSettings(RoleSettings(prefill_capacity, min_instances=2, max_instances=64),
                              RoleSettings(decode_capacity, min_instances=2, max_instances=64))


def naive_settings(prefill_capacity: float, decode_capacity: float) -> AutoscalerSettings:
    """A baseline: the same sizing rule with no margin, no cooldowns, no peak window (scale to the
    last tick's load) and no 80% guard: what the policy's rate limits and spare capacity prevent."""
    def role(cap):
        return RoleSettings(cap, min_instances=1, max_instances=64, margin_instances=0, margin_fraction=0.0,
                            max_step_up=64, max_step_down=64, down_hysteresis=0, up_cooldown_s=0.0, down_after_up_s=0.0,
                            down_after_down_s=0.0, up_window_s=0.0, down_window_s=0.0, no_scale_down_above=1.0,
                            sustain_window_s=0.0)
    return AutoscalerSettings(role(prefill_capacity), role(decode_capacity), ready_pool=0)


@dataclass
class DayResult:
    name: str
    instance_hours: float
    ready_pool_hours: float
    oscillations: int
    scale_events: int
    prefill_overload_s: float   # time the prefill backlog exceeded 10 s of capacity
    decode_overload_s: float    # time running requests exceeded the active decode capacity
    prefill_range: tuple
    decode_range: tuple
    timeline: list = field(default_factory=list, repr=False, compare=False)  # (t, prefill, decode) per change


def replay_day(settings: AutoscalerSettings | None, seed: int = 0, mean_rate: float = 600.0, hours: float = 24.0,
               tick_s: float = 10.0, uncached_mean: float = 2700.0, decode_s: float = 8.0,
               prefill_capacity: float = 4 * 80_000.0, decode_capacity: float = 16 * 64.0,
               cold_start_s: float = 600.0, grace_s: float = 60.0, oscillation_window_s: float = 1800.0,
               bursts: int = 4, static: tuple[int, int] | None = None, name: str = "policy") -> DayResult:
    """Replay ``hours`` of diurnal traffic (mean ``mean_rate`` requests/s) under ``settings``
    (``None`` with ``static=(prefill, decode)``: fixed provisioning)."""
    check_number("mean_rate", mean_rate, 0.0, strict=True)
    check_number("tick_s", tick_s, 0.0, strict=True)
    rng = np.random.default_rng([seed, 4])
    span = hours * 3600.0
    burst_list = tuple((float(rng.uniform(0, span - 1800)), float(rng.uniform(300, 1200)), float(rng.uniform(1.3, 1.6)))
                       for _ in range(bursts))
    sigma = 0.8
    mu = math.log(uncached_mean) - sigma * sigma / 2
    r0 = diurnal_rate(0.0, mean_rate, bursts=burst_list)
    run0 = r0 * decode_s
    n_p = static[0] if static else max(2, math.ceil(r0 * uncached_mean / (0.7 * prefill_capacity)) + 1)
    n_d = static[1] if static else max(2, math.ceil(run0 / (0.7 * decode_capacity)) + 1)
    hook = None if settings is None else Autoscaler.start(replace(settings, tick_s=tick_s), n_p, n_d)
    active = {"prefill": n_p, "decode": n_d}
    booting: list = []   # (ready_at, role)
    draining: list = []  # (release_at, role)
    pool_ready, pool_refill = (settings.ready_pool if settings else 0), []
    backlog, running = 0.0, run0
    hours_used = pool_hours = p_over = d_over = 0.0
    lo_hi = {"prefill": [n_p, n_p], "decode": [n_d, n_d]}
    timeline = [(0.0, n_p, n_d)]
    t = 0.0
    while t < span:
        arrivals = int(rng.poisson(diurnal_rate(t, mean_rate, bursts=burst_list) * tick_s))
        tokens = float(rng.lognormal(mu, sigma, arrivals).sum()) if arrivals else 0.0
        backlog = max(0.0, backlog + tokens - active["prefill"] * prefill_capacity * tick_s)
        running = max(0.0, running + arrivals - running * tick_s / decode_s)
        p_over += tick_s if backlog > 10 * active["prefill"] * prefill_capacity else 0.0
        d_over += tick_s if running > active["decode"] * decode_capacity else 0.0
        for item in [b for b in booting if b[0] <= t]:
            booting.remove(item)
            active[item[1]] += 1
        draining = [d for d in draining if d[0] > t]
        for ready_at in [x for x in pool_refill if x <= t]:
            pool_refill.remove(ready_at)
            pool_ready += 1
        if hook is not None:
            d = hook.tick(t, ClusterSignals(tokens / tick_s, running))
            for role in ("prefill", "decode"):
                delta = getattr(d, role)
                for _ in range(max(delta, 0)):
                    if pool_ready > 0:
                        pool_ready -= 1
                        pool_refill.append(t + cold_start_s)
                        active[role] += 1
                    else:
                        booting.append((t + cold_start_s, role))
                for _ in range(max(-delta, 0)):
                    mine = [b for b in booting if b[1] == role]
                    if mine:  # cancel a machine still booting first
                        booting.remove(mine[-1])
                        continue
                    active[role] -= 1
                    if role == "decode":
                        draining.append((t + grace_s, role))
                lo_hi[role] = [min(lo_hi[role][0], active[role]), max(lo_hi[role][1], active[role])]
        if (active["prefill"], active["decode"]) != timeline[-1][1:]:
            timeline.append((t, active["prefill"], active["decode"]))
        hours_used += (active["prefill"] + active["decode"] + len(booting) + len(draining)) * tick_s / 3600.0
        pool_hours += (pool_ready + len(pool_refill)) * tick_s / 3600.0
        t += tick_s
    hist = hook.history if hook else []
    osc = sum(count_oscillations(hist, oscillation_window_s, r) for r in ("prefill", "decode"))
    events = sum(1 for d in hist for r in ("prefill", "decode") if getattr(d, r))
    return DayResult(name, hours_used, pool_hours, osc, events, p_over, d_over, tuple(lo_hi["prefill"]),
                     tuple(lo_hi["decode"]), timeline + [(span, active["prefill"], active["decode"])])
