"""The autoscaler's quota-use guard with busy instances (issue 23: no scale-down while quota use is above 80%,
the post-scale-down load checked too): an instance with work uses its whole quota, whatever arrived lately."""

from types import SimpleNamespace

import pytest

from deepinfer_jax.cluster.autoscaler import Autoscaler, AutoscalerSettings, ClusterSignals, RoleSettings, RoleState, decide
from deepinfer_jax.cluster.errors import PolicyInputError


def _role(min_instances=1, max_instances=4):
    return RoleSettings(1.0, min_instances=min_instances, max_instances=max_instances, target_utilization=1.0,
                        margin_instances=0, margin_fraction=0.0, max_step_up=1, max_step_down=2, up_cooldown_s=0.0,
                        down_after_up_s=0.0, down_after_down_s=0.0, up_window_s=0.0, down_window_s=0.0,
                        sustain_window_s=0.0, down_hysteresis=0)


def test_busy_instances_hold_a_scale_down_that_idle_arrivals_would_make():
    s, state = _role(), RoleState(2)
    assert decide(10.0, state, s, 0.0, 0.0, 0.0) == (-1, "peak load 0 needs 1")  # nothing arrived, nothing queued
    # the same quiet arrivals while one instance still works a backlog: removing one would leave it at 100% use
    delta, why = decide(10.0, state, s, 0.0, 0.0, 0.0, busy=1)
    assert delta == 0 and why == "scale-down held: projected quota use above no_scale_down_above"
    delta, why = decide(10.0, state, s, 0.0, 0.0, 0.0, busy=2)  # both working: above the 80% line now
    assert delta == 0 and why == "scale-down held: quota use above no_scale_down_above"
    # four instances, one busy: two can go (1 busy of 2 left is 50% use), but the step is capped to keep it <= 80%
    assert decide(10.0, RoleState(4), s, 0.0, 0.0, 0.0, busy=1)[0] == -2
    assert decide(10.0, RoleState(4), s, 0.0, 0.0, 0.0, busy=2)[0] == -1  # 2 busy of 3 left: 67%


def test_the_live_signal_reaches_the_prefill_rule_only():
    settings = AutoscalerSettings(_role(), _role(), ready_pool=0, tick_s=0.1)
    busy = Autoscaler.start(settings, 2, 2)
    d = busy.tick(1.0, ClusterSignals(0.0, 0.0, prefill_busy=1))
    assert d.prefill == 0 and d.decode == -1  # prefill held by its backlog; idle decode scales down
    idle = Autoscaler.start(settings, 2, 2)
    assert idle.tick(1.0, ClusterSignals(0.0, 0.0)).prefill == -1  # the default: nobody busy


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "1"])
def test_bad_busy_is_a_typed_error_naming_the_field(bad):
    with pytest.raises(PolicyInputError) as e:
        ClusterSignals(1.0, 1.0, prefill_busy=bad)
    assert e.value.field == "prefill_busy"
    with pytest.raises(PolicyInputError) as e:
        decide(0.0, RoleState(2), _role(), 0.0, 0.0, 0.0, busy=bad)
    assert e.value.field == "busy"


def test_a_starting_instance_holds_the_scale_down():
    s = _role()
    assert decide(10.0, RoleState(2), s, 0.0, 0.0, 0.0) == (-1, "peak load 0 needs 1")
    held = (0, "scale-down held: an instance is still starting")
    assert decide(10.0, RoleState(2, starting=1), s, 0.0, 0.0, 0.0) == held
    assert decide(10.0, RoleState(1, starting=1), s, 5.0, 5.0, 5.0)[0] == 1  # a scale-up is not held by it
    assert decide(10.0, RoleState(5, starting=1), s, 0.0, 0.0, 0.0) == (-1, "above max_instances")  # bounds first
    with pytest.raises(PolicyInputError) as e:
        decide(10.0, RoleState(2, starting=-1), s, 0.0, 0.0, 0.0)
    assert e.value.field == "starting"


class _FakeCluster:
    """The parts of ``live.Cluster`` the live scaler touches: instances that start not ready."""

    def __init__(self):
        self.instances = {"prefill": [self._instance("prefill", ready=True)],
                          "decode": [self._instance("decode", ready=True)]}
        self.stats = SimpleNamespace(scale_events=[])
        self.stopped = []

    @staticmethod
    def _instance(role, ready):
        return SimpleNamespace(role=role, alive=True, ready=ready, accepting=ready, retire_at=None, draining=False,
                               pooled=False, rids=set())

    def add_instance(self, role, wait=True):
        self.instances[role].append(self._instance(role, ready=False))
        return len(self.instances[role]) - 1

    def stop_instance(self, inst):
        inst.alive = inst.accepting = False
        self.stopped.append(inst)


def test_the_live_scaler_never_stops_the_instance_it_is_starting():
    """The failure a slow CI run showed: a closed-loop client waits on decode, so no prompt arrives
    for a few seconds after a prefill scale-up; the scaler stopped the starting instance and started
    another, over and over (69 starts and 68 stops in 9 minutes), and none ever served."""
    from deepinfer_jax.cluster.scaling import LiveScaler

    c = _FakeCluster()
    settings = AutoscalerSettings(_role(1, 2), _role(1, 1), ready_pool=0, tick_s=0.1)
    scaler = LiveScaler(c, settings, 0.0)
    scaler.count_uncached(100)
    assert scaler.tick(1.0) and len(c.instances["prefill"]) == 2  # 100 tokens/s: one more prefill instance
    new = c.instances["prefill"][-1]
    for t in (2.0, 3.0, 4.0):  # nothing arrives while it starts
        scaler.tick(t)
    assert new.alive and not c.stopped and len(c.instances["prefill"]) == 2
    assert scaler.policy.prefill.starting == 1
    new.ready = new.accepting = True  # it answered: the role may scale down again
    scaler.tick(5.0)
    assert [(e.role, e.before, e.after) for e in c.stats.scale_events] == [("prefill", 1, 2), ("prefill", 2, 1)]
