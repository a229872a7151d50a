"""The decode rebalancer (cluster/decode_rebalance.py): hand-made plans, properties of every plan
(hypothesis), the pause model, bad input, and the simulator's deepinfer_migrate policy (its tick and its
plans after each admission)."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from deepinfer_jax.cluster.decode_rebalance import (KV_BYTES_PER_TOKEN, Move, RebalanceSettings, _best_swap,
                                                    migration_pause_s, plan_moves)
from deepinfer_jax.cluster.errors import PolicyInputError
from deepinfer_jax.cluster.simulate import ClusterShape, simulate
from deepinfer_jax.cluster.traces import agent_trace, chat_trace


def _apply(ranks, plan):
    loads = [sum(kv for _, kv in r) for r in ranks]
    rows = [len(r) for r in ranks]
    for mv in plan:
        loads[mv.src] -= mv.kv
        loads[mv.dst] += mv.kv
        rows[mv.src] -= 1
        rows[mv.dst] += 1
    return loads, rows


def test_moves_the_request_nearest_half_the_gap():
    ranks = [[(1, 100.0), (2, 40.0), (3, 10.0)], [(4, 10.0)], [(5, 50.0)]]
    plan = plan_moves(ranks, max_moves=1, keep_rows=False)
    # 150 | 10 | 50 -> 110 | 50 | 50 either way (40 or 100 moved): the fewer tokens move
    assert plan == [Move(2, 0, 1, 40.0)]
    assert plan_moves(ranks, max_moves=0) == []


def test_balanced_or_indivisible_ranks_plan_nothing():
    assert plan_moves([[(1, 50.0)], [(2, 50.0)]]) == []
    assert plan_moves([[(1, 100.0)], []]) == []  # moving the one request would not lower the max
    assert plan_moves([[], []]) == []
    assert plan_moves([[(1, 104.0)], [(2, 100.0)]], threshold=1.05) == []  # under the threshold


def test_cooldown_and_swaps():
    ranks = [[(1, 60.0), (2, 60.0)], [(3, 10.0)]]
    assert plan_moves(ranks, keep_rows=False, max_moves=1) == [Move(1, 0, 1, 60.0)]
    # request 1 moved 0.5 s ago: within the cooldown, so request 2 (same size) goes instead
    assert plan_moves(ranks, keep_rows=False, max_moves=1, now=10.0, last_moved={1: 9.5}, cooldown_s=1.0)[0].rid == 2
    assert plan_moves(ranks, keep_rows=False, now=10.0, last_moved={1: 9.5, 2: 9.9}, cooldown_s=1.0) == []
    # keep_rows: rank 1 would exceed the busiest rank's rows, so a swap (rows unchanged) is planned
    swap = plan_moves([[(1, 50.0), (2, 30.0), (3, 20.0)], [(4, 5.0), (5, 5.0), (6, 5.0)]], max_moves=2,
                      keep_rows=True)
    assert swap == [Move(1, 0, 1, 50.0), Move(4, 1, 0, 5.0)]  # 100 | 15 -> 55 | 60
    assert plan_moves([[(1, 50.0), (2, 30.0), (3, 20.0)], [(4, 5.0), (5, 5.0), (6, 5.0)]], max_moves=1,
                      keep_rows=True) == []  # a swap needs two moves of the budget


ranks_st = st.lists(st.lists(st.floats(0.0, 1e6, allow_nan=False), max_size=8), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(ranks_st, st.integers(0, 12), st.floats(1.0, 1.5), st.booleans(), st.sets(st.integers(0, 63), max_size=20))
def test_plan_properties(kvs, max_moves, threshold, keep_rows, recent):
    rid = iter(range(1000))
    ranks = [[(next(rid), kv) for kv in r] for r in kvs]
    last = {r: 9.5 for r in recent}
    plan = plan_moves(ranks, max_moves, threshold, now=10.0, last_moved=last, cooldown_s=1.0, keep_rows=keep_rows)
    before = [sum(kv for _, kv in r) for r in ranks]
    after, rows = _apply(ranks, plan)
    assert len(plan) <= max_moves
    assert max(after) <= max(before) + 1e-6 * max(1.0, max(before))  # never raises the largest load
    ids = [m.rid for m in plan]
    assert len(ids) == len(set(ids))  # no request twice in a plan
    assert not set(ids) & recent  # nor one moved within the cooldown
    if keep_rows:
        assert max(rows) <= max(len(r) for r in ranks)
    if plan:
        assert max(before) * len(before) > threshold * sum(before)


def test_an_admissions_plan_skips_a_threshold_no_placement_reaches():
    """One request holds more than ``threshold`` times the mean rank's KV: the tick still moves the others off its
    rank (nearer the bound), a plan after an admission (``only_if_reachable``) moves nothing."""
    ranks = [[(1, 300.0), (2, 60.0), (3, 50.0)], [(4, 40.0)], [(5, 30.0)], [(6, 20.0)]]  # mean 125
    assert plan_moves(ranks, max_moves=4, threshold=1.05)
    assert plan_moves(ranks, max_moves=4, threshold=1.05, only_if_reachable=True) == []
    reachable = [[(1, 70.0), (2, 60.0), (3, 50.0)], [(4, 40.0)], [(5, 30.0)], [(6, 20.0)]]  # 70 < 1.05 x mean 67.5
    plan = plan_moves(reachable, max_moves=4, threshold=1.05, only_if_reachable=True)
    assert plan and plan == plan_moves(reachable, max_moves=4, threshold=1.05)


def _every_pair_swap(held, loads, src, low, moved):
    """The swap search over every pair of requests (what ``_best_swap`` replaced), as the reference."""
    best = None
    for a, ka in held[src]:
        for b, kb in held[low]:
            d = ka - kb
            if a in moved or b in moved or d <= 0 or loads[low] + d >= loads[src]:
                continue
            key = (max(loads[src] - d, loads[low] + d), 2, ka + kb, a, b)
            if best is None or key < best[0]:
                best = (key, [(a, ka, src, low), (b, kb, low, src)])
    return best


@settings(max_examples=300, deadline=None)
@example([1, 10], [0, 9.5, 1.401298464324817e-45, 2.2250738585072014e-308, 3.7310422189012674e-308], 0.0, set())
@given(st.lists(st.one_of(st.integers(0, 40), st.floats(0.0, 3e5)), min_size=1, max_size=14),
       st.lists(st.one_of(st.integers(0, 40), st.floats(0.0, 3e5)), min_size=0, max_size=14),
       st.floats(0.0, 2e5), st.sets(st.integers(0, 40), max_size=6))
def test_swap_search_equals_the_search_over_every_pair(src_kv, low_kv, extra, moved):
    """Repeated lengths (small integers), ties and requests moved before included; the example: lengths whose
    sums round alike (a denormal beside 0), where the tie falls to the ids."""
    held = [[(i, float(k)) for i, k in enumerate(src_kv)], [(100 + i, float(k)) for i, k in enumerate(low_kv)]]
    loads = [sum(k for _, k in held[0]) + extra, sum(k for _, k in held[1])]
    moved = moved | {100 + m for m in moved}
    assert _best_swap(held, loads, 0, 1, moved) == _every_pair_swap(held, loads, 0, 1, moved)


def test_pause_model():
    assert migration_pause_s(0) == pytest.approx(0.02)
    # 100K tokens of 890 B at 5 GB/s: 17.8 ms of reads after the fixed 20 ms
    assert migration_pause_s(100_000) == pytest.approx(0.02 + 100_000 * KV_BYTES_PER_TOKEN / 5e9)
    assert migration_pause_s(100_000, bandwidth_gb_s=1.0, fixed_s=0.0) == pytest.approx(0.089)


@pytest.mark.parametrize("call, field", [
    (lambda: plan_moves([]), "ranks"),
    (lambda: plan_moves([[(1, -1.0)]]), "ranks[0]"),
    (lambda: plan_moves([[(1, 1.0)], [(1, 2.0)]]), "ranks[1]"),
    (lambda: plan_moves([[("a", 1.0)]]), "ranks[0]"),
    (lambda: plan_moves([[(1, 1.0)]], max_moves=-1), "max_moves"),
    (lambda: plan_moves([[(1, 1.0)]], threshold=0.5), "threshold"),
    (lambda: plan_moves([[(1, 1.0)]], cooldown_s=-1.0), "cooldown_s"),
    (lambda: migration_pause_s(-5), "kv_tokens"),
    (lambda: migration_pause_s(5, bandwidth_gb_s=0.0), "bandwidth_gb_s"),
    (lambda: RebalanceSettings(tick_s=0.0), "tick_s"),
    (lambda: RebalanceSettings(on_admit="yes"), "on_admit"),
])
def test_bad_input_names_the_argument(call, field):
    with pytest.raises(ValueError) as e:
        call()
    assert isinstance(e.value, PolicyInputError) and e.value.field == field


def test_simulated_migration_improves_decode_balance():
    chat = chat_trace(120.0, 15.0, seed=3)
    shape = ClusterShape(8, 2, 1, 8)
    base = simulate(chat, "deepinfer", shape)
    moved = simulate(chat, "deepinfer_migrate", shape)
    assert base.migrations == 0 < moved.migrations
    assert moved.decode_balance < base.decode_balance
    assert moved.measured == base.measured  # every request still finishes once
    assert moved.tpot_ms[1] < 1.1 * base.tpot_ms[1]  # the pauses are paid, and small
    settled = simulate(chat, "deepinfer_migrate", shape, rebalance=RebalanceSettings(settle=True))
    assert 0 < settled.migrations < moved.migrations  # fresh requests are left where routing put them


def test_simulated_rebalance_after_each_admission_lowers_decode_imbalance_further():
    """Agent traffic on 2 x 8 decode ranks: most peaks are a large arrival on a rank only a little below the
    mean, so a plan right after each admission (``on_admit``, the default) beats the 0.1 s tick alone; with
    the tick never due, the admissions' plans still migrate, and with neither nothing moves."""
    agent = agent_trace(4.0, 15.0, seed=3, gap_s=3.0)
    shape = ClusterShape(8, 2, 2, 8)
    base = simulate(agent, "deepinfer", shape)
    ticks = simulate(agent, "deepinfer_migrate", shape, rebalance=RebalanceSettings(on_admit=False))
    both = simulate(agent, "deepinfer_migrate", shape)
    never = simulate(agent, "deepinfer_migrate", shape, rebalance=RebalanceSettings(tick_s=1e4, on_admit=False))
    assert both.decode_balance < ticks.decode_balance < base.decode_balance
    assert both.migrations > ticks.migrations > 0 and never.migrations == 0
    assert never.decode_balance == base.decode_balance
    assert both.measured == ticks.measured == base.measured  # every request still finishes once
