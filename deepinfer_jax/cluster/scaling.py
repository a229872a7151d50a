"""The autoscaler live in ``Cluster`` (issue 23): measure, ``Autoscaler.tick``, apply (``LiveScaler``).

Every ``AutoscalerSettings.tick_s`` seconds the router's ``step`` measures the two signals of the
policy (``cluster.autoscaler``): the **rate of uncached prompt tokens** routed to prefill since the
previous tick (from the entry prefix match the router does for every request it routes) and the
**running requests** on the decode side (routed there and not finished), plus how many prefill instances
have prompts routed to them and not yet handed over (``prefill_busy``: each counts as fully used, so a
backlog that stalls new arrivals holds a scale-down). ``Autoscaler.tick`` turns them into a
``ScaleDecision``, applied at once:

* **scale-up**: an instance of the role from the **ready pool** when one is there (in service at
  once: its engine has already started), else ``Cluster.add_instance(role, wait=False)``, a new Ray
  actor, not routed to until it has answered ``info`` (its engine has started, a cold start); the
  router keeps stepping meanwhile;
* **scale-down**, an instance still starting first (killed at once), else the accepting one with
  the fewest requests (never the last one accepting): decode ``retire_decode`` (the grace period,
  then its unfinished requests forwarded, as for going offline by hand); prefill: no new requests,
  and its actor is stopped once it has answered every request it has.

The ready pool is ``AutoscalerSettings.ready_pool`` instances booted beside those in service (their
engines started, nothing routed to them), decode and prefill in turn (decode first: the role whose
requests wait on it mid-generation). A pooled instance taken into service is replaced by a new one
started in the background, so a burst finds capacity without waiting for an engine to start; the
pool is stopped with the scaler (``Cluster.enable_autoscaler(None)``, ``Cluster.shutdown``).

The policy's bounds, cooldowns, burst hold (the spare quota) and its "no scale-down above 80% quota
use" apply as ``decide`` rules them; after each tick the policy's instance counts are set to the
instances actually in service, so a change the cluster could not make is not believed made. Every
change is a ``ScaleEvent`` in ``ClusterStats.scale_events``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from deepinfer_jax.cluster.autoscaler import Autoscaler, AutoscalerSettings, ClusterSignals
from deepinfer_jax.cluster.errors import PolicyInputError

__all__ = ["LiveScaler", "ScaleEvent", "check_settings"]


@dataclass(frozen=True)
class ScaleEvent:
    """One change of a role's instances in service: at ``time`` (``time.perf_counter``), from
    ``before`` to ``after``, and the policy's reason."""

    time: float
    role: str
    before: int
    after: int
    reason: str
    from_pool: int = 0  # instances of the scale-up taken from the ready pool (in service at once)


def check_settings(settings) -> AutoscalerSettings | None:
    """``settings`` for a live cluster: an ``AutoscalerSettings`` (or None) whose roles keep at
    least one instance (a role with none could not take or hand on a request)."""
    if settings is None:
        return None
    if not isinstance(settings, AutoscalerSettings):
        raise PolicyInputError("autoscaler", f"must be an AutoscalerSettings or None, got {type(settings).__name__}")
    for role in ("prefill", "decode"):
        if getattr(settings, role).min_instances < 1:
            raise PolicyInputError(f"autoscaler.{role}.min_instances",
                                   "a live cluster needs at least one instance of each role")
    return settings


class LiveScaler:
    """The router's side of the autoscaler for one ``Cluster`` (``cluster``): ``count_uncached`` at
    each routed prompt, ``tick(now)`` from every ``step``."""

    def __init__(self, cluster, settings: AutoscalerSettings, now: float) -> None:
        self.cluster = cluster
        self.settings = settings
        self.policy = Autoscaler.start(settings, self.in_service("prefill"), self.in_service("decode"))
        self.last = now
        self.uncached = 0
        self.pool: list = []  # live._Instance: booted, not in service
        self._fill_pool()

    def in_service(self, role: str) -> int:
        """Instances of ``role`` alive and not going offline (starting ones included)."""
        return len(self._serving(role))

    def _serving(self, role: str) -> list:
        return [i for i in self.cluster.instances[role]
                if i.alive and i.retire_at is None and not i.draining and not i.pooled]

    def _fill_pool(self) -> None:
        """Start what the ready pool lacks: ``ready_pool`` instances, decode and prefill in turn."""
        self.pool = [i for i in self.pool if i.alive]
        want = [("decode", "prefill")[k % 2] for k in range(self.settings.ready_pool)]
        for role in ("decode", "prefill"):
            for _ in range(want.count(role) - sum(1 for i in self.pool if i.role == role)):
                inst = self.cluster.instances[role][self.cluster.add_instance(role, wait=False)]
                inst.pooled = True
                self.pool.append(inst)

    def _from_pool(self, role: str) -> bool:
        """Put a pooled instance of ``role`` in service (a started one first); False if the pool has none."""
        pooled = sorted((i for i in self.pool if i.alive and i.role == role), key=lambda i: not i.ready)
        if not pooled:
            return False
        inst = pooled[0]
        self.pool.remove(inst)
        inst.pooled, inst.accepting = False, inst.ready  # a starting one is routed to once it answers
        return True

    def close(self) -> None:
        """Stop the ready pool's instances (the scaler is being replaced or switched off)."""
        for inst in self.pool:
            if inst.alive:
                self.cluster.stop_instance(inst)
        self.pool = []

    def count_uncached(self, tokens: int) -> None:
        self.uncached += tokens

    def tick(self, now: float) -> bool:
        """Measure and apply a decision if ``tick_s`` has passed since the previous tick; True if it ticked."""
        if now - self.last < self.settings.tick_s:
            return False
        c = self.cluster
        rate = self.uncached / (now - self.last)
        running = sum(len(i.rids) for i in c.instances["decode"] if i.alive)
        busy = sum(1 for i in self._serving("prefill") if i.rids)  # prompts routed there, not yet handed over
        self.last, self.uncached = now, 0
        for role in ("prefill", "decode"):  # no scale-down of a role while an instance it started is starting
            starting = sum(1 for i in self._serving(role) if not i.ready)
            setattr(self.policy, role, dataclasses.replace(getattr(self.policy, role), starting=starting))
        decision = self.policy.tick(now, ClusterSignals(rate, running, busy))
        reasons = dict(r.split(": ", 1) for r in decision.reasons)
        for role in ("prefill", "decode"):
            delta = getattr(decision, role)
            before = self.in_service(role)
            pooled = sum(self._from_pool(role) for _ in range(max(delta, 0)))
            for _ in range(delta - pooled):
                c.add_instance(role, wait=False)
            for _ in range(-delta):
                if not self._scale_down(role):
                    break
            after = self.in_service(role)
            if after != before:
                c.stats.scale_events.append(ScaleEvent(now, role, before, after, reasons.get(role, ""), pooled))
            state = getattr(self.policy, role)
            if state.current != after:  # a change the cluster could not make (or one it did not ask for)
                setattr(self.policy, role, dataclasses.replace(state, current=after))
        self._fill_pool()
        return True

    def _scale_down(self, role: str) -> bool:
        """Take one instance of ``role`` out of service; False when none can go."""
        c = self.cluster
        serving = self._serving(role)
        starting = [i for i in serving if not i.ready]
        if starting:
            c.stop_instance(starting[-1])
            return True
        accepting = [i for i in serving if i.accepting]
        if len(accepting) < 2:
            return False
        victim = min(reversed(accepting), key=lambda i: len(i.rids))
        if role == "decode":
            c.retire_decode(victim.index)
        else:
            victim.accepting, victim.draining = False, True
        return True
