"""EPLB placement (issue 7, engine.md §3): valid placements, hierarchical ones, moe_lb improvement on Zipf loads,
property tests on random loads, the statistics window and the rebalance policy. Numpy only."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from deepinfer_jax.parallel.eplb import (
    Placement,
    compute_placement,
    identity_placement,
    moe_lb,
    move_sources,
    pack_balanced,
    rank_loads,
    replicate_experts,
    slot_rank_loads,
)
from deepinfer_jax.parallel.eplb_policy import LoadStats, RebalancePolicy, Rebalancer, expert_counts


def zipf_load(n_layers, n_experts, exponent, seed, tokens=100_000):
    """Per-layer Zipf popularity over a random expert order, sampled as token counts [L, E]."""
    rng = np.random.default_rng(seed)
    rank = np.argsort(rng.random((n_layers, n_experts)), 1) + 1
    p = rank ** -exponent
    return rng.multinomial(tokens, p / p.sum(1, keepdims=True))


def assert_valid(pl: Placement, n_layers, n_experts, n_ranks, redundant, n_nodes=1):
    spr = n_experts // n_ranks + redundant
    assert pl.phys_to_log.shape == (n_layers, n_ranks * spr) and pl.slots_per_rank == spr
    assert (pl.replica_count >= 1).all() and (pl.replica_count.sum(1) == n_ranks * spr).all()
    for layer in range(n_layers):
        for e in range(n_experts):
            slots = pl.replicas(layer, e)
            assert len(slots) == pl.replica_count[layer, e] and (pl.phys_to_log[layer, slots] == e).all()
    per_rank = pl.phys_to_log.reshape(n_layers, n_ranks, spr)
    # no rank holds two copies of one expert unless the expert has more copies than the ranks of its node
    for layer in range(n_layers):
        for r in range(n_ranks):
            experts, k = np.unique(per_rank[layer, r], return_counts=True)
            assert ((k == 1) | (pl.replica_count[layer, experts] > n_ranks // n_nodes)).all()


def test_flat_placement_is_valid_and_conserves_load():
    load = zipf_load(3, 64, 1.0, seed=0)
    pl = compute_placement(load, n_ranks=8, redundant_per_rank=2)
    assert_valid(pl, 3, 64, 8, 2)
    np.testing.assert_allclose(rank_loads(load, pl).sum(1), load.sum(1))
    # the hottest expert gets the most copies
    assert (pl.replica_count[np.arange(3), load.argmax(1)] == pl.replica_count.max(1)).all()


def test_hierarchical_placement_keeps_each_expert_and_group_on_one_node():
    load = zipf_load(2, 32, 0.7, seed=1)
    for n_groups in (None, 8):
        pl = compute_placement(load, n_ranks=8, redundant_per_rank=1, n_nodes=2, n_groups=n_groups)
        assert_valid(pl, 2, 32, 8, 1, n_nodes=2)
        node_of_slot = pl.rank_of_slot // 4
        for layer in range(2):
            nodes = [set(node_of_slot[pl.replicas(layer, e)]) for e in range(32)]
            assert all(len(n) == 1 for n in nodes)  # copies stay inside the expert's node
            assert sorted(sum(1 for n in nodes if n == {k}) for k in range(2)) == [16, 16]
            if n_groups:
                for g in range(8):
                    assert len(set().union(*nodes[g * 4:(g + 1) * 4])) == 1
        # each node carries about half of the load
        node_load = rank_loads(load, pl).reshape(2, 2, 4).sum(-1)
        assert (node_load.max(1) / node_load.mean(1) < 1.2).all()


@pytest.mark.parametrize("n_ranks, redundant", [(8, 4), (64, 1)])
def test_moe_lb_improves_on_zipf_loads(n_ranks, redundant):
    load = zipf_load(4, 384, 0.8, seed=2, tokens=1_000_000)
    before = moe_lb(load, identity_placement(4, 384, n_ranks, redundant))
    after = moe_lb(load, compute_placement(load, n_ranks, redundant))
    assert (before > 1.3).all() and (after < 1.02).all() and (after >= 1.0).all()
    # a hierarchical placement balances too (4 nodes)
    hier = moe_lb(load, compute_placement(load, n_ranks, redundant, n_nodes=4))
    assert (hier < before).all()


def test_replicate_experts_is_the_greedy_apportionment():
    rng = np.random.default_rng(3)
    load = rng.integers(0, 1000, (5, 12)).astype(float)
    count = replicate_experts(load, 20)
    for layer in range(5):
        ref = np.ones(12)
        for _ in range(8):
            ref[np.argmax((load[layer] + (load[layer].sum() + 1) * 1e-9 / 12) / ref)] += 1
        np.testing.assert_array_equal(count[layer], ref)
    # idle experts share spare copies instead of one taking them all
    assert replicate_experts(np.zeros((1, 4)), 8).tolist() == [[2, 2, 2, 2]]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.sampled_from([(8, 2), (16, 4), (12, 3), (24, 8)]), st.integers(0, 3), st.integers(0, 10**6),
       st.floats(0.0, 1.5), st.sampled_from([1, 2]))
def test_random_loads_give_valid_balanced_placements(n_layers, shape, redundant, seed, exponent, n_nodes):
    n_experts, n_ranks = shape
    assume(n_ranks % n_nodes == 0)
    redundant = min(redundant, n_experts // n_nodes - n_experts // n_ranks)
    load = zipf_load(n_layers, n_experts, exponent, seed, tokens=10_000)
    load[:, np.random.default_rng(seed).random(n_experts) < 0.2] = 0  # some idle experts
    pl = compute_placement(load, n_ranks, redundant, n_nodes=n_nodes)
    assert_valid(pl, n_layers, n_experts, n_ranks, redundant, n_nodes)
    node_of_slot = pl.rank_of_slot // (n_ranks // n_nodes)
    assert all(len(set(node_of_slot[pl.replicas(layer, e)])) == 1 for layer in range(n_layers) for e in range(n_experts))
    rl = rank_loads(load, pl)
    np.testing.assert_allclose(rl.sum(1), load.sum(1))
    lb = moe_lb(load, pl)
    assert (lb >= 1 - 1e-12).all()
    # never worse than the load-blind start by more than one copy's weight
    per_copy = (load / pl.replica_count).max(1)
    assert (rl.max(1) <= rank_loads(load, identity_placement(n_layers, n_experts, n_ranks, redundant)).max(1)
            + per_copy + 1e-9).all()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 5), st.integers(0, 10**6))
def test_pack_balanced_spread_is_at_most_the_heaviest_item(n_rows, n_packs, per, seed):
    weight = np.random.default_rng(seed).exponential(size=(n_rows, n_packs * per))
    pack = pack_balanced(weight, n_packs)
    assert all((np.bincount(pack[b], minlength=n_packs) == per).all() for b in range(n_rows))
    load = np.zeros((n_rows, n_packs))
    np.add.at(load, (np.arange(n_rows)[:, None], pack), weight)
    assert (load.max(1) - load.min(1) <= weight.max(1) + 1e-9).all()


def test_move_sources_keep_what_stays_and_fetch_the_right_expert():
    old = identity_placement(2, 16, 4, 1)
    new = compute_placement(zipf_load(2, 16, 1.2, seed=4), 4, 1)
    for layer in range(2):
        src = move_sources(old, new, layer)
        assert (old.phys_to_log[layer, src] == new.phys_to_log[layer]).all()
        same = old.phys_to_log[layer] == new.phys_to_log[layer]
        assert (src[same] == np.arange(old.n_slots)[same]).all()
    assert (move_sources(old, old, 0) == np.arange(old.n_slots)).all()
    with pytest.raises(ValueError, match="geometry"):
        move_sources(old, identity_placement(2, 16, 4, 2), 0)
    with pytest.raises(ValueError, match="layer"):
        move_sources(old, new, 5)


def test_slot_counts_round_trip():
    pl = compute_placement(zipf_load(2, 16, 1.0, seed=5), 4, 2)
    slot_counts = np.random.default_rng(5).integers(0, 50, pl.phys_to_log.shape)
    per_expert = expert_counts(slot_counts, pl)
    assert per_expert.sum() == slot_counts.sum()
    for layer in range(2):
        for e in range(16):
            assert per_expert[layer, e] == slot_counts[layer, pl.replicas(layer, e)].sum()
    assert slot_rank_loads(slot_counts, 4).sum() == slot_counts.sum()


@pytest.mark.parametrize("kwargs, field", [
    ({"load_LE": np.ones((2, 10)), "n_ranks": 4, "redundant_per_rank": 1}, "n_experts"),
    ({"load_LE": np.ones((2, 16)), "n_ranks": 4, "redundant_per_rank": 13}, "redundant_per_rank"),
    ({"load_LE": np.ones((2, 16)), "n_ranks": 4, "redundant_per_rank": -1}, "redundant_per_rank"),
    ({"load_LE": -np.ones((2, 16)), "n_ranks": 4, "redundant_per_rank": 1}, "load_LE"),
    ({"load_LE": np.full((2, 16), np.nan), "n_ranks": 4, "redundant_per_rank": 1}, "load_LE"),
    ({"load_LE": np.ones((2, 4, 4)), "n_ranks": 4, "redundant_per_rank": 1}, "load_LE"),
    ({"load_LE": np.ones((2, 16)), "n_ranks": 0, "redundant_per_rank": 1}, "n_ranks"),
    ({"load_LE": np.ones((2, 16)), "n_ranks": 4, "redundant_per_rank": 1, "n_nodes": 3}, "n_nodes"),
    ({"load_LE": np.ones((2, 16)), "n_ranks": 4, "redundant_per_rank": 1, "n_nodes": 2, "n_groups": 3}, "n_groups"),
    ({"load_LE": np.ones((2, 16)), "n_ranks": 4, "redundant_per_rank": 1, "n_nodes": 2, "n_groups": 1}, "n_groups"),
])
def test_bad_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        compute_placement(**kwargs)


def test_placement_rejects_inconsistent_tables():
    with pytest.raises(ValueError, match="expert 3 of layer 0 has no slot"):
        Placement(np.array([[0, 1, 2, 2]]), 2, 4)
    with pytest.raises(ValueError, match="n_ranks"):
        Placement(np.array([[0, 1, 2]]), 2, 3)
    with pytest.raises(ValueError, match="outside"):
        Placement(np.array([[0, 1, 2, 4]]), 2, 4)
    with pytest.raises(ValueError, match="rank_loads|placement needs"):
        moe_lb(np.ones((1, 5)), identity_placement(1, 4, 2))


def test_load_stats_is_a_sliding_window():
    stats = LoadStats(n_layers=2, n_experts=3, window=4)
    steps = [np.full((2, 3), i) for i in range(1, 8)]
    for i, c in enumerate(steps, 1):
        stats.record(c)
        np.testing.assert_array_equal(stats.load(), sum(steps[max(0, i - 4):i]))
    assert stats.steps == 7
    with pytest.raises(ValueError, match="counts_LE"):
        stats.record(np.ones((2, 4), int))
    with pytest.raises(ValueError, match="counts_LE"):
        stats.record(-np.ones((2, 3), int))
    with pytest.raises(ValueError, match="window"):
        LoadStats(2, 3, 0)


def test_policy_defaults_follow_the_design():
    pre, dec = RebalancePolicy.prefill(), RebalancePolicy.decode()
    assert (pre.redundant_per_rank, pre.window, pre.period) == (4, 100, 1000)
    assert (dec.redundant_per_rank, dec.window, dec.period) == (1, 1000, 10000)
    assert [pre.due(s) for s in (0, 999, 1000, 2000)] == [False, False, True, True]
    for bad in ({"window": 0}, {"period": -1}, {"redundant_per_rank": -1}, {"n_groups": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RebalancePolicy(**bad)


def test_rebalancer_replaces_the_placement_every_period():
    reb = Rebalancer(2, 16, 4, RebalancePolicy(redundant_per_rank=1, window=3, period=5))
    start = reb.placement
    load = zipf_load(2, 16, 1.2, seed=6, tokens=1000)
    new = [reb.record(load) for _ in range(5)]
    assert new[:4] == [None] * 4 and new[4] is not None and reb.placement is new[4] and reb.placement != start
    assert (moe_lb(load, reb.placement) < reb.last_moe_lb).all()
    assert all(reb.record(load) is None for _ in range(5))  # same load: the same placement, nothing to move


def test_rebalancer_from_slot_counts_measures_the_window_and_the_last_rebalance():
    policy = RebalancePolicy(redundant_per_rank=1, window=2, period=3)
    start = identity_placement(2, 8, 4, 1)
    reb = Rebalancer(2, 8, 4, policy, start)
    hot = np.zeros((2, 8), np.int64)
    hot[:, 0] = 30  # expert 0 is hot: it has two copies at the start (slots 0 and 8, ranks 0 and 2)
    hot[:, 1:] = 2
    rng = np.random.default_rng(0)
    slot_steps = []
    for _ in range(3):  # per-slot counts of an uneven split between expert 0's copies
        slots = np.zeros((2, start.n_slots), np.int64)
        for layer in range(2):
            for e in range(8):
                copies = start.replicas(layer, e)
                share = rng.multinomial(hot[layer, e], np.full(len(copies), 1 / len(copies)))
                slots[layer, copies] += share
        slot_steps.append(slots)
    assert reb.record_slots(slot_steps[0]) is None and reb.record_slots(slot_steps[1]) is None
    assert reb.last_moe_lb is None and reb.rebalances == 0
    measured = slot_rank_loads(slot_steps[1] + slot_steps[2], 4)  # the window: the last 2 steps, as measured
    new = reb.record_slots(slot_steps[2])
    np.testing.assert_allclose(reb.last_measured_moe_lb, measured.max(1) / measured.mean(1))
    load = expert_counts(slot_steps[1] + slot_steps[2], start)
    np.testing.assert_allclose(reb.last_moe_lb, moe_lb(load, start))
    assert new is not None and reb.placement is new and reb.rebalances == 1
    np.testing.assert_allclose(reb.last_expected_moe_lb, moe_lb(load, new))
    assert (reb.last_expected_moe_lb < reb.last_moe_lb).all()
    np.testing.assert_array_equal(reb.total_load, sum(expert_counts(s, start) for s in slot_steps))
    np.testing.assert_allclose(reb.window_moe_lb(), reb.last_measured_moe_lb)
    # a step dispatched before the rebalance is read with the placement it ran under
    reb.record_slots(slot_steps[0], start)
    np.testing.assert_array_equal(reb.stats.load(), expert_counts(slot_steps[2] + slot_steps[0], start))
    with pytest.raises(ValueError, match="placement"):
        Rebalancer(2, 8, 4, RebalancePolicy(redundant_per_rank=2), start)
    with pytest.raises(ValueError, match="rank_load_LR"):
        reb.record(load, np.ones((2, 3)))
