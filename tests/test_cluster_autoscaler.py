"""The autoscaler's quota-use guard with busy instances (issue 23: no scale-down while quota use is above 80%,
the post-scale-down load checked too): an instance with work uses its whole quota, whatever arrived lately."""

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
