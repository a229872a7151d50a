"""The router policies of deepinfer_jax.cluster on hand-made cases, and their errors on bad input."""

from __future__ import annotations

import random

import pytest

from deepinfer_jax.cache.block_hash import block_digests, extra_keys
from deepinfer_jax.cluster.policies import (
    Autoscaler,
    AutoscalerSettings,
    ClusterSignals,
    DecodeInstanceView,
    PolicyInputError,
    PrefillBalancer,
    PrefillEngineView,
    PrefixIndex,
    RankLoad,
    RoleSettings,
    RoleState,
    ScaleDecision,
    SlotRule,
    count_oscillations,
    decide,
    length_bucket,
    match_digests,
    match_tokens,
    matched_step_budget,
    num_patches,
    pick_decode_rank,
    pick_prefill_group,
    pick_prefill_rank,
    pick_prefill_slot,
    pick_vision_card,
    reassign_engines,
    request_quota,
    resize_buckets,
    route_prefill,
)
from deepinfer_jax.engine.cost_model import CostModel
from deepinfer_jax.engine.dp_router import pick_rank

EXTRA = extra_keys(bytes(32))


# ---- prefix match at the entry ----
def test_prefix_match_counts_leading_blocks_and_applies_the_hit_rule():
    tokens = list(range(1000))  # 7 full blocks of 128
    digests = block_digests(tokens, 128, EXTRA)
    index = PrefixIndex(digests[:5])
    m, d = match_tokens(tokens, EXTRA, index)
    assert d == digests and m.cached_blocks == 5
    # L1 <= 1000 - 134 = 866 -> 768 (6 blocks) but only 5 cached -> 640, bounded replay of 128
    assert (m.hit_tokens, m.replay_tokens, m.uncached_tokens) == (640, 128, 360)
    index.add(digests[5:])
    assert match_digests(digests, 1000, index).hit_tokens == 768  # capped by the window + slack
    # a hole in the chain stops the match: block 0 missing -> nothing reused
    assert match_digests(digests, 1000, PrefixIndex(digests[1:])).hit_tokens == 0
    # with exact windows known only at 512, the hit falls back there (no replay)
    exact = match_digests(digests, 1000, PrefixIndex(digests), has_swa=lambda p: p == 512)
    assert (exact.hit_tokens, exact.replay_tokens) == (512, 0)


def test_prefix_match_other_salt_misses():
    tokens = list(range(600))
    index = PrefixIndex(block_digests(tokens, 128, EXTRA))
    m, _ = match_tokens(tokens, extra_keys(bytes(32), "other-salt"), index)
    assert m.hit_tokens == 0


def test_prefix_match_bad_input():
    with pytest.raises(PolicyInputError) as e:
        match_digests([], -1, PrefixIndex())
    assert e.value.field == "num_tokens"
    with pytest.raises(PolicyInputError, match="digests"):
        match_digests([b"x" * 32] * 3, 300, PrefixIndex())
    with pytest.raises(PolicyInputError, match="token_ids"):
        match_tokens([1, -2], EXTRA, PrefixIndex())


# ---- prefill balancer ----
def test_length_buckets_edges():
    assert [length_bucket(n) for n in (0, 16383, 16384, 65535, 65536, 262143, 262144)] == [0, 0, 1, 1, 2, 2, 3]
    with pytest.raises(PolicyInputError, match="num_tokens"):
        length_bucket(-5)


def test_request_quota_is_the_cost_models_chunk_cost():
    cm = CostModel((1e6, 10.0, 0.5, 0.25))
    assert request_quota(cm, 100, 1000) == pytest.approx(10 * 100 + 0.5 * 100 * 1000 + 0.25 * 100 ** 2)
    # replayed tokens are computed again, after fewer cached ones
    assert request_quota(cm, 100, 1000, 128) == pytest.approx(cm.chunk_cost(228, 872))
    with pytest.raises(PolicyInputError, match="replay_tokens"):
        request_quota(cm, 10, 5, 6)


def test_resize_buckets_follows_quota_share():
    assert resize_buckets([10, 30, 60, 0], 10) == (1, 3, 6, 0)
    assert resize_buckets([1, 1, 98, 0], 10) == (1, 1, 8, 0)  # demanding buckets keep one engine
    assert sum(resize_buckets([3, 5, 7, 11], 13)) == 13
    assert resize_buckets([0, 0, 0, 0], 6, previous=(3, 1, 1, 1)) == (3, 1, 1, 1)
    with pytest.raises(PolicyInputError, match="num_engines"):
        resize_buckets([1, 1], 0)
    with pytest.raises(PolicyInputError, match=r"demand\[1\]"):
        resize_buckets([1, -1], 2)
    with pytest.raises(PolicyInputError, match="demand"):
        resize_buckets([], 2)


def test_reassign_moves_few_engines_least_loaded_first():
    new = reassign_engines((0, 0, 0, 1), (1, 3, 0, 0), loads=[5.0, 1.0, 3.0, 0.0])
    assert new == (0, 1, 1, 1)  # engines 1 (load 1) and 2 (load 3) moved; engine 0 stays
    with pytest.raises(PolicyInputError, match="counts"):
        reassign_engines((0, 1), (1, 2))


def test_group_by_remaining_quota_then_rank_by_least_quota():
    engines = [PrefillEngineView(1, (5.0, 5.0)), PrefillEngineView(1, (1.0, 8.0)), PrefillEngineView(1, (2.0, 2.0, 2.0))]
    # remaining with a round quota of 10 per rank: 10, 11, 24 -> engine 2 (more ranks, more left)
    assert pick_prefill_group(engines, 10.0) == 2
    assert pick_prefill_group(engines[:2], 10.0) == 1
    assert pick_prefill_rank((3.0, 1.0, 1.0)) == 1
    # route: the 64-256K bucket has no engine here -> the nearest (1)
    assert route_prefill(100_000, engines, 10.0) == (2, 0)
    with pytest.raises(PolicyInputError, match="engines"):
        route_prefill(10, [PrefillEngineView(0, (1.0,), accepting=False)], 10.0)
    with pytest.raises(PolicyInputError, match="round_quota_ns"):
        pick_prefill_group(engines, 0.0)
    with pytest.raises(PolicyInputError, match=r"backlogs\[0\]"):
        pick_prefill_rank((-1.0,))


def test_prefill_balancer_rounds_resize_by_demand():
    b = PrefillBalancer(num_engines=4, round_quota_ns=1e9)
    assert b.assignment == (0, 1, 2, 3)
    for _ in range(9):
        b.route(100_000, 10.0, [[0.0]] * 4)  # bucket 2 only
    b.route(1000, 1.0, [[0.0]] * 4)
    assert b.end_round() == (0, 2, 2, 2)
    e, r = b.route(100_000, 1.0, [[0.0], [3.0], [1.0], [2.0]])
    assert (e, r) == (2, 0)
    with pytest.raises(PolicyInputError, match="backlogs"):
        b.route(10, 1.0, [[0.0]])
    with pytest.raises(PolicyInputError, match="edges"):
        PrefillBalancer(2, 1e9, edges=(10, 5))


MS = 1e6  # ns


def test_slot_pairs_a_request_with_waiting_work_when_that_is_about_as_fast():
    idle = PrefillEngineView(0, (0.0, 0.0), waiting=(0.0, 0.0))
    # stepping, 10 ms left; rank 0 holds a 40 ms request that waits for the next step, rank 1 nothing
    half = PrefillEngineView(0, (40 * MS, 0.0), waiting=(40 * MS, 0.0), busy_ns=10 * MS)
    # idle engine: 24 + 40 = 64 ms, plus 20 ms of padding; beside the waiting request: 10 + 24 + 40, no padding
    assert pick_prefill_slot([idle, half], 40 * MS, 24 * MS, 250 * MS, pairing=1.0) == (1, 1)
    # the earliest finish alone wakes the idle engine
    assert pick_prefill_slot([idle, half], 40 * MS, 24 * MS, 250 * MS, pairing=0.0) == (0, 0)
    # a step that runs 200 ms more is not worth waiting for, padding or not
    late = PrefillEngineView(0, (40 * MS, 0.0), waiting=(40 * MS, 0.0), busy_ns=200 * MS)
    assert pick_prefill_slot([idle, late], 40 * MS, 24 * MS, 250 * MS, pairing=1.0) == (0, 0)
    # a rank with no waiting work: it goes there, alone, neither behind the waiting request
    assert pick_prefill_slot([late], 40 * MS, 24 * MS, 250 * MS) == (0, 1)


def test_slot_ranks_by_waiting_work_not_backlog():
    # rank 0's last chunk is running (leaves with this step); rank 1 holds a request not started yet
    v = PrefillEngineView(0, (50 * MS, 40 * MS), waiting=(0.0, 40 * MS), busy_ns=30 * MS)
    assert pick_prefill_rank(v.backlogs) == 1  # the old layer 3: behind the waiting request, rank 0 idle next step
    assert pick_prefill_slot([v], 40 * MS, 24 * MS, 250 * MS) == (0, 0)  # beside it: both ranks work
    # without waiting/busy (a one-rank live instance): the least backlog, as before
    ones = [PrefillEngineView(0, (5.0,)), PrefillEngineView(0, (3.0,)), PrefillEngineView(0, (4.0,))]
    assert pick_prefill_slot(ones, 1.0, 0.0, 250 * MS) == (1, 0)


def test_slot_ties_go_to_the_rank_with_least_quota_this_round():
    a = PrefillEngineView(0, (0.0, 0.0), routed=(9.0, 0.0))
    b = PrefillEngineView(0, (0.0, 0.0), routed=(1.0, 3.0))
    assert pick_prefill_slot([a, b], 10 * MS, 24 * MS, 250 * MS) == (0, 1)
    assert pick_prefill_slot([b, a], 10 * MS, 24 * MS, 250 * MS) == (1, 1)
    # within tie_ns of the best: still a tie; outside it the faster slot wins
    c = PrefillEngineView(0, (0.0, 0.0), busy_ns=3 * MS, routed=(0.0, 0.0))
    d = PrefillEngineView(0, (0.0, 0.0), routed=(5.0, 5.0))
    assert pick_prefill_slot([d, c], 10 * MS, 24 * MS, 250 * MS, tie_ns=5 * MS) == (1, 0)
    assert pick_prefill_slot([d, c], 10 * MS, 24 * MS, 250 * MS, tie_ns=1 * MS) == (0, 0)


def test_balancer_with_a_slot_rule_spreads_a_round_and_routes_by_waiting_work():
    b = PrefillBalancer(num_engines=2, round_quota_ns=1e9, assignment=(0, 0), slot=SlotRule(24 * MS))
    picks = [b.route(1000, 10 * MS, [[0.0, 0.0], [0.0, 0.0]]) for _ in range(4)]
    assert sorted(picks) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # idle everywhere: each rank once
    b.end_round()
    assert b.routed == {}
    # engine 1 is busy for 5 ms more with 30 ms waiting on rank 0: pairing beats waking engine 0
    assert b.route(1000, 30 * MS, [[0.0, 0.0], [60 * MS, 0.0]], waiting=[[0.0, 0.0], [30 * MS, 0.0]],
                   busy_ns=[0.0, 5 * MS]) == (1, 1)


def test_soft_buckets_leave_a_busy_bucket_for_an_idle_engine_only_when_cheaper():
    # bucket 0 (the request's) busy for 100 ms more; engine 1 of bucket 1 idle
    engines = [PrefillEngineView(0, (0.0, 0.0), waiting=(0.0, 0.0), busy_ns=100 * MS),
               PrefillEngineView(1, (0.0, 0.0))]
    soft = SlotRule(24 * MS, pairing=1.0, bucket_penalty_ns=20 * MS)
    assert route_prefill(1000, engines, 1e9, quota_ns=10 * MS, slot=soft) == (1, 0)
    # a penalty above the wait keeps it in its bucket; hard buckets (None) always do
    far = SlotRule(24 * MS, pairing=1.0, bucket_penalty_ns=200 * MS)
    assert route_prefill(1000, engines, 1e9, quota_ns=10 * MS, slot=far) == (0, 0)
    hard = SlotRule(24 * MS, pairing=1.0, bucket_penalty_ns=None)
    assert route_prefill(1000, engines, 1e9, quota_ns=10 * MS, slot=hard) == (0, 0)
    with pytest.raises(PolicyInputError) as e:
        pick_prefill_slot(engines, 1.0, 0.0, 1.0, extra_ns=[0.0])
    assert e.value.field == "extra_ns"
    with pytest.raises(PolicyInputError) as e:
        pick_prefill_slot(engines, 1.0, 0.0, 1.0, extra_ns=[0.0, -1.0])
    assert e.value.field == "extra_ns[1]"
    with pytest.raises(PolicyInputError) as e:
        SlotRule(bucket_penalty_ns=-1.0)
    assert e.value.field == "bucket_penalty_ns"


def test_matched_step_budget_cuts_long_chunks_to_the_shortest_working_rank():
    assert matched_step_budget([10 * MS, 100 * MS], 250 * MS, 5 * MS) == 10 * MS  # both ranks work: match the short
    assert matched_step_budget([2 * MS, 100 * MS], 250 * MS, 10 * MS) == 10 * MS   # not below the floor
    assert matched_step_budget([0.0, 100 * MS], 250 * MS, 5 * MS) == 250 * MS     # one rank works: nothing to match
    # four ranks, two idle: the idle ones pad anyway and are left out; the working two are matched
    assert matched_step_budget([0.0, 100 * MS, 0.0, 30 * MS], 250 * MS, 5 * MS) == 30 * MS
    assert matched_step_budget([0.0, 0.0, 0.0, 30 * MS], 250 * MS, 5 * MS) == 250 * MS
    assert matched_step_budget([300 * MS, 400 * MS], 250 * MS, 5 * MS) == 250 * MS  # never above the budget
    for call, field in ((lambda: matched_step_budget([1.0, -1.0], 1.0, 0.0), "natural_ns[1]"),
                        (lambda: matched_step_budget([], 1.0, 0.0), "natural_ns"),
                        (lambda: matched_step_budget([1.0], 1.0, -2.0), "floor_ns"),
                        (lambda: SlotRule(match_floor_ns=-1.0), "match_floor_ns")):
        with pytest.raises(PolicyInputError) as e:
            call()
        assert e.value.field == field


def test_slot_rule_bad_input_names_the_field():
    v = PrefillEngineView(0, (0.0, 0.0))
    cases = [
        (lambda: pick_prefill_slot([PrefillEngineView(0, (0.0, 0.0), waiting=(0.0,))], 1.0, 0.0, 1.0),
         "engines[0].waiting"),
        (lambda: pick_prefill_slot([PrefillEngineView(0, (0.0, 0.0), waiting=(0.0, -1.0))], 1.0, 0.0, 1.0),
         "engines[0].waiting[1]"),
        (lambda: pick_prefill_slot([v, PrefillEngineView(0, (0.0, float("nan")))], 1.0, 0.0, 1.0),
         "engines[1].backlogs[1]"),
        (lambda: pick_prefill_slot([PrefillEngineView(0, (0.0,), busy_ns=-1.0)], 1.0, 0.0, 1.0), "engines[0].busy_ns"),
        (lambda: pick_prefill_slot([PrefillEngineView(0, (0.0,), routed=(1.0, 2.0))], 1.0, 0.0, 1.0),
         "engines[0].routed"),
        (lambda: pick_prefill_slot([v], -1.0, 0.0, 1.0), "quota_ns"),
        (lambda: pick_prefill_slot([v], 1.0, 0.0, 0.0), "step_budget_ns"),
        (lambda: pick_prefill_slot([v], 1.0, 0.0, 1.0, pairing=-1.0), "pairing"),
        (lambda: pick_prefill_slot([], 1.0, 0.0, 1.0), "engines"),
        (lambda: pick_prefill_slot([PrefillEngineView(0, (0.0,), accepting=False)], 1.0, 0.0, 1.0), "engines"),
        (lambda: SlotRule(pairing=-0.5), "pairing"),
        (lambda: SlotRule(tie_ns=float("inf")), "tie_ns"),
        (lambda: PrefillBalancer(2, 1e9, slot=SlotRule()).route(10, 1.0, [[0.0]] * 2, waiting=[[0.0]]), "waiting"),
        (lambda: PrefillBalancer(2, 1e9, slot=SlotRule()).route(10, 1.0, [[0.0]] * 2, busy_ns=[0.0]), "busy_ns"),
    ]
    for call, field in cases:
        with pytest.raises(PolicyInputError) as e:
            call()
        assert e.value.field == field, (field, e.value)


# ---- decode balancer ----
def test_decode_balancer_is_dp_router_rule_over_all_ranks():
    insts = [DecodeInstanceView((RankLoad(4, 4000), RankLoad(1, 40_000))),
             DecodeInstanceView((RankLoad(2, 30_000), RankLoad(3, 1000)))]
    flat = [ld for i in insts for ld in i.ranks]
    for n in (10, 5000, 100_000):
        i, r = pick_decode_rank(insts, n)
        assert 2 * i + r == pick_rank(flat, n)
    # short request -> few requests even with much KV; long request -> little KV
    assert pick_decode_rank(insts, 10) == (0, 1)
    assert pick_decode_rank(insts, 100_000) == (1, 1)
    # a draining instance is skipped
    assert pick_decode_rank([DecodeInstanceView(insts[0].ranks, accepting=False), insts[1]], 10)[0] == 1


def test_decode_balancer_bad_input():
    with pytest.raises(PolicyInputError, match="instances"):
        pick_decode_rank([], 10)
    with pytest.raises(PolicyInputError, match="instances"):
        pick_decode_rank([DecodeInstanceView(())], 10)
    with pytest.raises(PolicyInputError, match="num_tokens"):
        pick_decode_rank([DecodeInstanceView((RankLoad(),))], -1)
    with pytest.raises(PolicyInputError, match=r"instances\[0\].ranks\[0\]"):
        pick_decode_rank([DecodeInstanceView((RankLoad(-1, 0),))], 1)


# ---- vision encoder balancer ----
def test_vision_patches_and_card_choice():
    assert num_patches(448, 448, 14) == 32 * 32
    assert num_patches(450, 14, 14) == 33  # a partial patch is padded
    machines = [[10, 3, 3], [], [7, 0]]
    picks = {pick_vision_card(machines, random.Random(s)) for s in range(50)}
    assert picks == {(0, 1), (2, 1)}  # never the empty machine; the least-loaded card, lowest on ties
    assert pick_vision_card(machines, random.Random(1)) == pick_vision_card(machines, random.Random(1))
    with pytest.raises(PolicyInputError, match="patch_size"):
        num_patches(10, 10, 0)
    with pytest.raises(PolicyInputError, match="machines"):
        pick_vision_card([[], []], random.Random(0))
    with pytest.raises(PolicyInputError, match=r"machines\[0\]\[1\]"):
        pick_vision_card([[1, -1]], random.Random(0))


# ---- autoscaler ----
ROLE = RoleSettings(capacity=100.0, min_instances=1, max_instances=10, target_utilization=0.5, margin_instances=1,
                    margin_fraction=0.0, up_cooldown_s=60, down_after_up_s=600, down_after_down_s=300,
                    down_hysteresis=0)


def test_autoscaler_rule_up_down_bounds_and_guards():
    st = RoleState(current=2)
    assert decide(0.0, st, ROLE, 160.0, 160.0, 160.0)[0] == 3  # 160 / 50 -> needs 4, +1 margin -> 5: add 3
    assert decide(0.0, RoleState(2, last_up=-10.0), ROLE, 160.0, 160.0, 160.0)[0] == 0  # up cooldown
    assert decide(0.0, RoleState(8), ROLE, 100.0, 100.0, 100.0)[0] == -1  # needs 2 + 1 -> down by one step
    assert decide(0.0, RoleState(8, last_up=-100.0), ROLE, 100.0, 100.0, 100.0)[0] == 0  # soon after an up
    assert decide(0.0, RoleState(8), ROLE, 100.0, 100.0, 700.0)[0] == 0  # quota use 700/800 > 80% now
    big = RoleSettings(100.0, max_instances=10, target_utilization=0.95, margin_instances=0, margin_fraction=0.0,
                       max_step_down=5, down_hysteresis=0)
    # desired 4 for 350, but removing 4 of 8 leaves 350/400 = 87.5% > 80%: only 3 go
    assert decide(0.0, RoleState(8), big, 350.0, 350.0, 350.0)[0] == -3
    assert decide(0.0, RoleState(0), ROLE, 0.0, 0.0, 0.0)[0] == 1      # min bound
    assert decide(0.0, RoleState(20), ROLE, 0.0, 0.0, 0.0)[0] == -10   # max bound
    assert decide(0.0, RoleState(3), ROLE, 10_000.0, 10_000.0, 1.0)[0] == 4  # max_step_up


def test_autoscaler_burst_hold():
    # load 160 needs 5 of 2 instances; a jump over the sustained median (x1.15) that the current
    # capacity carries below burst_utilization (80% of 2 x 100 = 160) is held: the spare quota absorbs it
    assert decide(0.0, RoleState(2), ROLE, 160.0, 160.0, 160.0, load_sustained=100.0) == \
        (0, "scale-up held: a burst the spare quota carries")
    assert decide(0.0, RoleState(2), ROLE, 161.0, 161.0, 161.0, load_sustained=100.0)[0] == 3  # above 80%: up now
    assert decide(0.0, RoleState(2), ROLE, 160.0, 160.0, 160.0, load_sustained=150.0)[0] == 3  # a ramp, not a burst
    with pytest.raises(PolicyInputError, match="burst_jump"):
        RoleSettings(1.0, burst_jump=0.5)
    with pytest.raises(PolicyInputError, match="load_sustained"):
        decide(0.0, RoleState(2), ROLE, 1.0, 1.0, 1.0, load_sustained=-1.0)


def test_autoscaler_settings_errors_name_the_field():
    for kwargs, field in (({"capacity": 0.0}, "capacity"), ({"capacity": 1.0, "target_utilization": 1.5},
                          "target_utilization"), ({"capacity": 1.0, "min_instances": 5, "max_instances": 2},
                          "max_instances"), ({"capacity": 1.0, "no_scale_down_above": 0.0}, "no_scale_down_above")):
        with pytest.raises(PolicyInputError) as e:
            RoleSettings(**kwargs)
        assert e.value.field == field
    with pytest.raises(PolicyInputError, match="uncached_tokens_per_s"):
        ClusterSignals(-1.0, 0.0)
    hook = Autoscaler.start(AutoscalerSettings(ROLE, ROLE), 2, 2)
    hook.tick(10.0, ClusterSignals(0.0, 0.0))
    with pytest.raises(PolicyInputError, match="now"):
        hook.tick(5.0, ClusterSignals(0.0, 0.0))


def test_live_hook_follows_load_and_records_history():
    hook = Autoscaler.start(AutoscalerSettings(ROLE, ROLE), prefill=1, decode=1)
    d = hook.tick(0.0, ClusterSignals(uncached_tokens_per_s=300.0, running_requests=0.0))
    assert (d.prefill, d.decode) == (4, 0)  # 300 / 50 = 6 + 1 margin -> 7, step 4; idle decode: 0 + 1 margin
    assert hook.prefill.current == 5 and hook.decode.current == 1
    for t in range(10, 3000, 10):
        hook.tick(float(t), ClusterSignals(300.0, 0.0))
    assert hook.prefill.current == 7
    assert all(x.prefill >= 0 for x in hook.history)  # steady load: no scale-down


def test_oscillation_count():
    hist = [ScaleDecision(0.0, 1, 0), ScaleDecision(100.0, -1, 0), ScaleDecision(5000.0, 1, 1), ScaleDecision(5100.0, 1, -1)]
    assert count_oscillations(hist, 1800.0, "prefill") == 1
    assert count_oscillations(hist, 1800.0, "decode") == 1
    assert count_oscillations(hist, 50.0, "prefill") == 0
    with pytest.raises(PolicyInputError, match="role"):
        count_oscillations(hist, 10.0, "vision")
