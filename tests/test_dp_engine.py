"""Attention data parallel in the engine (issue 7 item 2): the router, the per-rank engine core against a
fake runner, the settings it refuses, and ``LLM(..., sharding=...)`` against the one-device engine on 8 fake
CPU devices for dp x ep = 2 x 4, 1 x 8 and 8 x 1; EPLB inside the running engine (item 4): a rebalance
mid-run changes no output, the step's counts conserve every pair, the weights really move; and the engine
over two jax.distributed processes of 4 CPU devices each (``tests/sharded/engine_multihost.py``) against one
device. Prefix caching, decoder bounded replay and speculative decoding in DP mode (issue 22): the per-rank copies
against a fake runner, and greedy outputs on 8 fake devices against the one-device engine with the same setting
(``tests/sharded/dp_prefix_check.py``).

The 8-device checks run in a subprocess (``tests/sharded/dp_engine_check.py``): the fake-device count must
be set before jax starts, and this process keeps its single CPU device.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from sharded import finish_processes, run_checks, start_processes

from deepinfer_jax.cache.block_store import HostBlockStore
from deepinfer_jax.config import EngineConfig
from deepinfer_jax.engine import RequestError, SamplingParams, Scheduler
from deepinfer_jax.engine.core import EngineCore
from deepinfer_jax.engine.dp_router import RankLoad, pick_rank
from deepinfer_jax.engine.request import GrammarState, SpecState
from deepinfer_jax.runner import StepOutput

PRESETS = ("cpu-dp2-ep4", "cpu-dp1-ep8", "cpu-dp8-ep1")


# ---- the router (no JAX) -------------------------------------------------------------------------


def _route_all(lengths, ranks):
    loads = [RankLoad() for _ in range(ranks)]
    picks = []
    for n in lengths:
        d = pick_rank(loads, n)
        loads[d] = RankLoad(loads[d].num_requests + 1, loads[d].kv_tokens + n)
        picks.append(d)
    return picks, loads


def test_router_spreads_equal_requests_over_every_rank():
    picks, loads = _route_all([100] * 8, 4)
    assert picks == [0, 1, 2, 3, 0, 1, 2, 3]
    assert {ld.num_requests for ld in loads} == {2}


def test_router_sends_short_requests_to_few_requests_and_long_ones_to_little_kv():
    # rank 0: more requests, little KV; rank 1: fewer requests, long KV (engine.md §3, the decode balancer)
    loads = [RankLoad(num_requests=3, kv_tokens=600), RankLoad(num_requests=2, kv_tokens=3000)]
    assert pick_rank(loads, 10) == 1
    assert pick_rank(loads, 2000) == 0


def test_router_balances_both_request_count_and_kv_better_than_round_robin():
    for seed in range(4):  # log-normal prompt lengths, as in the offline benchmark
        rng = np.random.default_rng(seed)
        lengths = [int(x) for x in np.exp(rng.normal(5, 1.2, 96)).clip(4, 4000)]
        _, loads = _route_all(lengths, 8)
        reqs = [ld.num_requests for ld in loads]
        kv = np.array([ld.kv_tokens for ld in loads], float)
        round_robin = np.array([sum(lengths[i::8]) for i in range(8)], float)  # 12 requests each
        assert max(reqs) - min(reqs) <= 2, reqs
        assert kv.max() / kv.mean() < 1.35 and kv.max() / kv.mean() < round_robin.max() / round_robin.mean() - 0.15


def test_router_rejects_bad_input_naming_the_argument():
    with pytest.raises(ValueError, match="loads"):
        pick_rank([], 3)
    with pytest.raises(ValueError, match="num_tokens"):
        pick_rank([RankLoad()], -1)
    with pytest.raises(ValueError, match="loads"):
        pick_rank([RankLoad(-1, 0)], 1)


# ---- the engine core over ranks, with a fake runner (no JAX) ---------------------------------------

VOCAB = 97


class FakeDPRunner:
    """Samples ``(previous token + 1) % VOCAB`` per request; keeps the last sampled id per (rank, slot) like the
    device buffer, so ``feed_last`` chunks work; records every step's per-rank chunk lists."""

    def __init__(self, dp_size: int, slots: int):
        self.dp_size, self.slots, self.cfg = dp_size, slots, SimpleNamespace(vocab_size=VOCAB)
        self.last: dict[tuple[int, int], int] = {}
        self.steps: list[list[list]] = []

    def forward(self, chunks_by_rank):
        assert len(chunks_by_rank) == self.dp_size and any(chunks_by_rank)
        self.steps.append(chunks_by_rank)
        out = []
        for d, chunks in enumerate(chunks_by_rank):
            assert len({c.slot for c in chunks}) == len(chunks) and all(0 <= c.slot < self.slots for c in chunks)
            for c in chunks:
                prev = self.last[d, c.slot] if c.feed_last else c.token_ids[-1]
                if c.sample is None:
                    out.append(None)
                    continue
                self.last[d, c.slot] = (prev + 1) % VOCAB
                out.append((self.last[d, c.slot], -1.0, np.zeros(0, np.int32), np.zeros(0, np.float32)))
        return out

    def sample(self, fwd, mask=None):
        return SimpleNamespace(result=lambda: fwd, output=lambda: StepOutput.plain(fwd))


def _engine(dp=3, slots=2, async_scheduling=True, dp_match_floor_ns=None, runner=FakeDPRunner, **sched):
    kw = {"num_blocks": 16, "block_size": 4, "max_blocks_per_request": 8, "max_num_seqs": slots, "max_model_len": 32,
          "max_num_batched_tokens": 8, **sched}
    return EngineCore(runner(dp, slots), [Scheduler(**kw) for _ in range(dp)], tokenizer=None,
                        eos_token_id=VOCAB - 1, async_scheduling=async_scheduling, dp_match_floor_ns=dp_match_floor_ns)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_dp_core_runs_every_rank_and_gives_each_request_its_own_tokens(async_scheduling):
    core = _engine(async_scheduling=async_scheduling)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 50, int(n)).tolist() for n in rng.integers(1, 12, 10)]
    rids = [core.add_request(p, SamplingParams(temperature=0, max_tokens=3 + i % 4)) for i, p in enumerate(prompts)]
    assert sorted(core.rank_requests) == [3, 3, 4] and {core.rank_of(r) for r in rids} == {0, 1, 2}
    done = {}
    while core.has_unfinished:
        done.update({o.request_id: o for o in core.step()})
    for i, (rid, p) in enumerate(zip(rids, prompts)):
        want = [(p[-1] + k) % VOCAB for k in range(1, 4 + i % 4)]
        assert done[rid].outputs[0].token_ids == want and done[rid].outputs[0].finish_reason == "length"
        assert core.rank_of(rid) is None
    steps = core.runner.steps
    assert any(not cs for step in steps for cs in step), "no rank ever idled"
    assert sum(core.rank_tokens) == core.stats.scheduled_tokens and sum(core.rank_idle_steps) > 0
    assert all(s.pool.free_count == 16 and len(s.free_slots) == 2 for s in core.schedulers)


def test_dp_core_preempts_within_a_rank_and_recomputes_the_same_tokens():
    core = _engine(dp=2, num_blocks=6)  # 24 tokens per rank: two requests of ~18 tokens do not fit together
    prompts = [list(range(10 + i, 20 + i)) for i in range(6)]
    rids = [core.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts]
    done = {}
    while core.has_unfinished:
        done.update({o.request_id: o for o in core.step()})
    assert core.stats.preemptions > 0
    for rid, p in zip(rids, prompts):
        assert done[rid].outputs[0].token_ids == [(p[-1] + k) % VOCAB for k in range(1, 9)]


def test_dp_core_abort_frees_the_rank_it_ran_on():
    core = _engine(dp=2)
    a = core.add_request([1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    b = core.add_request([4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
    assert {core.rank_of(a), core.rank_of(b)} == {0, 1}
    core.step()
    rank = core.rank_of(a)
    core.abort(a)
    assert core.requests[a].finish_reason == "abort" and not core.schedulers[rank].running
    while core.has_unfinished:
        core.step()
    assert core.requests[b].output_ids == [6, 7, 8, 9]


def test_dp_core_cost_chunking_plans_every_rank_and_fits_the_slowest():
    from deepinfer_jax.engine.cost_model import CostModel

    model = CostModel((0.0, 1000.0, 0.0, 0.0))  # 1 us per token; a step's budget buys 6 tokens per rank
    seen = []
    model.observe = lambda shape, ns: seen.append(list(shape))
    core = _engine(dp=2, slots=2, chunking="cost", cost_model=model, step_budget_ns=6000, async_scheduling=False)
    prompts = [list(range(1, 21)), [5, 6, 7]]  # rank 0 gets the long prompt, rank 1 the short one
    rids = [core.add_request(p, SamplingParams(max_tokens=3, ignore_eos=True)) for p in prompts]
    done = {}
    while core.has_unfinished:
        done.update({o.request_id: o for o in core.step()})
    for rid, p in zip(rids, prompts):
        assert done[rid].outputs[0].token_ids == [(p[-1] + k) % VOCAB for k in range(1, 4)]
    steps = core.runner.steps
    assert all(sum(len(c.token_ids) for c in cs) <= 6 for step in steps for cs in step)  # the budget, per rank
    assert max(len(c.token_ids) for step in steps for c in step[0]) == 6  # the long prompt came in chunks of 6
    # each step observed with the slowest rank's (q, c) list: the rank with more tokens
    want = [max(([(len(c.token_ids), c.ctx_len) for c in cs] for cs in step), key=lambda sh: sum(q for q, _ in sh))
            for step in steps]
    assert seen == want and len(seen) == len(steps)
    with pytest.raises(ValueError, match="chunking"):
        kw = {"num_blocks": 16, "block_size": 4, "max_blocks_per_request": 8, "max_num_seqs": 2, "max_model_len": 32,
              "max_num_batched_tokens": 8, "chunking": "cost", "step_budget_ns": 6000}
        EngineCore(FakeDPRunner(2, 2), [Scheduler(cost_model=CostModel((0, 1, 0, 0)), **kw) for _ in range(2)],
                     tokenizer=None, eos_token_id=0)


def _per_token_model():
    from deepinfer_jax.engine.cost_model import CostModel

    model = CostModel((0.0, 1000.0, 0.0, 0.0))  # 1 us per token, no step overhead
    model.observe = lambda shape, ns: None  # no online refit: the budget keeps buying the same tokens
    return model


def _run(core, prompts, sp):
    rids = [core.add_request(p, sp) for p in prompts]
    done = {}
    while core.has_unfinished:
        done.update({o.request_id: o for o in core.step()})
    return [done[r].outputs[0].token_ids for r in rids]


@pytest.mark.parametrize("floor_ns, first_tokens", [(None, [6, 3]), (0, [3, 3]), (5000, [5, 3])])
def test_dp_core_matches_the_ranks_prompt_chunks_to_the_smallest(floor_ns, first_tokens):
    """``dp_match_floor_ns``: in a step where both ranks have prompt work, the long prompt's chunk is cut to the
    short prompt's cost (not below the floor); its rest runs later, alone, whole-budget; the tokens are unchanged."""
    core = _engine(dp=2, chunking="cost", cost_model=_per_token_model(), step_budget_ns=6000, async_scheduling=False,
                   dp_match_floor_ns=floor_ns)
    prompts = [list(range(1, 21)), [5, 6, 7]]  # rank 0 gets the long prompt, rank 1 the short one
    ids = _run(core, prompts, SamplingParams(max_tokens=3, ignore_eos=True))
    assert ids == [[(p[-1] + k) % VOCAB for k in range(1, 4)] for p in prompts]
    per_rank = [[sum(len(c.token_ids) for c in cs) for cs in step] for step in core.runner.steps]
    assert per_rank[0] == first_tokens, per_rank
    assert core.stats.matched_steps == (0 if floor_ns is None else 1)  # one step with prompt work on both ranks
    # rank 1 decodes from the second step: a decode token is not prompt work, so rank 0's chunks are whole again
    assert per_rank[1] == [6, 1], per_rank


def test_dp_core_matching_costs_a_prefix_hit_by_its_uncached_tokens():
    """The matched budget comes from each rank's ``planned_cost_ns``, which looks a waiting request's prefix hit up
    as admission does: a repeat that reads 8 of its 14 tokens from the cache costs 6 tokens, and the other rank's
    fresh prompt is cut to that; the repeat's tokens are the first run's, and the estimate left no trace."""
    core = _engine(dp=2, chunking="cost", cost_model=_per_token_model(), step_budget_ns=8000, async_scheduling=False,
                   dp_match_floor_ns=0, runner=FakeCopyRunner, prefix_extra=b"model", ring_rows=4,
                   host_store=HostBlockStore())
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    prompt = list(range(10, 24))  # 14 tokens: windows saved at 8 and 12, a repeat hits 8
    (first,) = _run(core, [prompt], sp)
    long = list(range(30, 50))
    rids = [core.add_request(p, sp) for p in (long, prompt)]
    assert [core.rank_of(r) for r in rids] == [0, 1]

    def state():
        reqs = [core.requests[r] for r in rids]
        return ([(r.replay.approximate, list(r.cache.snapshot_points), r.num_computed) for r in reqs],
                [s.prefix.stats() for s in core.schedulers])

    before = state()
    assert [s.planned_cost_ns() for s in core.schedulers] == [(8000.0, True), (6000.0, True)]
    assert state() == before  # the lookups counted nothing and left the requests as they were
    start = len(core.runner.steps)
    done = {}
    while core.has_unfinished:
        done.update({o.request_id: o for o in core.step()})
    step = core.runner.steps[start]
    assert [[len(c.token_ids) for c in cs] for cs in step] == [[6], [6]]  # both ranks' chunks cost 6 us
    assert done[rids[1]].num_cached_tokens == 8 and done[rids[1]].outputs[0].token_ids == first
    assert done[rids[0]].outputs[0].token_ids == [(long[-1] + k) % VOCAB for k in range(1, 4)]


def test_dp_match_floor_refuses_bad_settings_naming_the_field():
    for bad in (-1, float("inf"), True, "10"):
        with pytest.raises(ValueError, match="dp_match_floor_ns"):
            _engine(dp=2, chunking="cost", cost_model=_per_token_model(), step_budget_ns=6000, dp_match_floor_ns=bad)
    with pytest.raises(ValueError, match="dp_match_floor_ns.*chunking='cost'"):
        _engine(dp=2, dp_match_floor_ns=0)  # token chunking: no cost to match
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="dp_match_floor_ns"):
            EngineConfig(dp_match_floor_ns=bad)
    with pytest.raises(ValueError, match="dp_match_floor_ns.*chunking='cost'"):
        EngineConfig(dp_match_floor_ns=10_000_000, chunking="tokens")
    assert EngineConfig(dp_match_floor_ns=10_000_000).parallel.dp_match_floor_ns == 10_000_000


def test_dp_core_refuses_what_it_does_not_support():
    core = _engine(dp=2)
    with pytest.raises(RequestError, match="structured_output"):
        core.add_request([1, 2], SamplingParams(structured_output={"regex": "a+"}))
    with pytest.raises(RequestError, match="prompt"):
        core.add_request([], SamplingParams())
    with pytest.raises(RequestError) as e:  # engine roles: a continuation's rank must be one of the engine's
        core.add_continuation([1, 2], [3], SamplingParams(), request_id="far", rank=2)
    assert e.value.field == "rank" and "far" not in core.requests
    rid = core.add_continuation([1, 2], [3], SamplingParams(), request_id="near", rank=1)
    assert core.rank_of(rid) == 1 and core.rank_requests[1] >= 1
    core.abort(rid)
    with pytest.raises(ValueError, match="schedulers"):
        EngineCore(FakeDPRunner(2, 2), [], tokenizer=None, eos_token_id=0)
    kw = {"num_blocks": 16, "block_size": 4, "max_blocks_per_request": 8, "max_num_seqs": 2, "max_model_len": 32,
          "max_num_batched_tokens": 8}
    mixed = {"enable_prefix_caching": [{"prefix_extra": b"model"}, {}],  # prefix caching on some ranks only
             "host_store_bytes": [{"prefix_extra": b"model", "host_store": HostBlockStore()},
                                  {"prefix_extra": b"model", "host_store": HostBlockStore()}],  # not one host tier
             "decoder_replay": [{"decoder_keep": 4}, {}]}
    for field, ranks in mixed.items():
        with pytest.raises(ValueError, match=field):
            EngineCore(FakeDPRunner(2, 2), [Scheduler(**kw, **r) for r in ranks], tokenizer=None, eos_token_id=0)


def test_one_device_is_one_rank_of_the_same_core():
    """One ``EngineCore`` for every layout: a one-device runner gets the flat chunk list, and the core keeps the
    same per-rank bookkeeping with one rank; a scheduler count that is not the runner's DP size is refused."""
    from tests.test_scheduler import FakeRunner

    kw = {"num_blocks": 16, "block_size": 4, "max_blocks_per_request": 8, "max_num_seqs": 2, "max_model_len": 32,
          "max_num_batched_tokens": 8}
    runner = FakeRunner(4)
    core = EngineCore(runner, Scheduler(**kw), tokenizer=None, eos_token_id=0)
    assert core.schedulers == [core.scheduler]
    rid = core.add_request([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    assert core.rank_of(rid) == 0 and core.rank_requests == [1] and core.rank_args(core.requests[rid]) == {}
    while core.has_unfinished:
        core.step()
    assert core.rank_of(rid) is None and core.requests[rid].finished
    assert core.rank_tokens == [core.stats.scheduled_tokens] and core.rank_idle_steps == [0]
    assert all(not isinstance(chunks[0], list) for chunks in runner.steps)  # flat lists, never one per rank
    for schedulers in ([Scheduler(**kw), Scheduler(**kw)], []):
        with pytest.raises(ValueError, match="schedulers"):
            EngineCore(FakeRunner(4), schedulers, tokenizer=None, eos_token_id=0)
    with pytest.raises(ValueError, match="schedulers"):  # a DP runner needs one scheduler per rank
        EngineCore(FakeDPRunner(3, 2), Scheduler(**kw), tokenizer=None, eos_token_id=0)


class FakeCopyRunner(FakeDPRunner):
    """``FakeDPRunner`` with the prefix cache's copies, each recorded as (what, rank, slot or block ids): a read
    block's payload and a window say which rank they were copied from."""

    def __init__(self, dp_size: int, slots: int):
        super().__init__(dp_size, slots)
        self.copies: list[tuple] = []

    def snapshot_swa(self, slot, rank):
        self.copies.append(("snapshot", rank, slot))
        return {"from_rank": np.array(rank)}

    def to_host(self, snapshot):
        return snapshot

    def restore_swa(self, slot, snapshot, engram_ids, position, rank):
        self.copies.append(("restore", rank, slot, int(snapshot["from_rank"])))

    def read_blocks(self, block_ids, rank):
        self.copies.append(("read", rank, tuple(block_ids)))
        return [(rank, b) for b in block_ids]

    def block_payloads(self, read):
        return [{"from": np.array(rb)} for rb in read]

    def write_blocks(self, block_ids, payloads, rank):
        self.copies.append(("write", rank, tuple(block_ids), tuple(int(p["from"][0]) for p in payloads)))


def test_dp_core_prefix_cache_copies_target_the_requests_rank_and_hit_across_ranks():
    kw = {"num_blocks": 16, "block_size": 4, "max_blocks_per_request": 8, "max_num_seqs": 2, "max_model_len": 32,
          "max_num_batched_tokens": 8, "prefix_extra": b"model", "ring_rows": 4, "host_store": HostBlockStore()}
    core = EngineCore(FakeCopyRunner(2, 2), [Scheduler(**kw) for _ in range(2)], tokenizer=None, eos_token_id=0)
    prompt = list(range(10, 24))  # 14 tokens: windows saved at 8 and 12, a repeat hits 8 (14 - ring 4, in blocks)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)

    def run(*prompts):
        rids = [core.add_request(p, sp) for p in prompts]
        ranks = [core.rank_of(r) for r in rids]
        done = {}
        while core.has_unfinished:
            done.update({o.request_id: o for o in core.step()})
        return [done[r] for r in rids], ranks

    (a,), (rank_a,) = run(prompt)
    first = list(core.runner.copies)
    assert rank_a == 0 and a.num_cached_tokens == 0
    assert {c[1] for c in first} == {0} and {c[0] for c in first} == {"snapshot", "read"}  # all on rank 0
    core.runner.copies.clear()
    (_, b), (_, rank_b) = run([50, 51, 52], prompt)  # the short request keeps rank 0 busy: the repeat goes to rank 1
    assert rank_b == 1 and b.num_cached_tokens == 8 and b.outputs[0].token_ids == a.outputs[0].token_ids
    writes = [c for c in core.runner.copies if c[0] == "write"]
    restores = [c for c in core.runner.copies if c[0] == "restore"]
    assert writes and all(c[1] == 1 and set(c[3]) == {0} for c in writes)  # rank 0's blocks uploaded into rank 1
    assert len(restores) == 1 and restores[0][1] == 1 and restores[0][3] == 0  # rank 0's window, into rank 1's slot
    hits = [s.prefix.stats() for s in core.schedulers]
    assert [h["hits"] for h in hits] == [0, 1] and hits[1]["tier_hits"] == {"device": 0, "host": 2, "file": 0}
    assert all(s.prefix.snapshots is core.schedulers[0].prefix.snapshots for s in core.schedulers)
    core.runner.copies.clear()
    (c,), (rank_c,) = run(prompt)  # both ranks idle: rank 0 again, where the blocks are still on the device
    assert rank_c == 0 and c.num_cached_tokens == 8 and c.outputs[0].token_ids == a.outputs[0].token_ids
    assert not [x for x in core.runner.copies if x[0] == "write"]
    assert core.schedulers[0].prefix.stats()["tier_hits"]["device"] == 2


def test_spec_plan_ranks_plans_each_rank_alone_and_counts_one_step():
    from deepinfer_jax.engine.spec_decode import SpecDecoding
    from deepinfer_jax.engine.spec_policy import AcceptanceStats, DSparkPolicy, StepTimes

    k = 4
    times = StepTimes((8, 16, 32), (1e6, 1.1e6, 2e6))

    def chunk(verify, seed=None, conf=0.9):
        req = SimpleNamespace(grammar=GrammarState(), params=SamplingParams(temperature=0, seed=seed),
                              spec=SpecState(has_drafts=True, next_conf=np.full(k, conf)))
        return SimpleNamespace(verify=verify, request=req, num_tokens=1 + k if verify else 6, sample=True)

    def planner():
        return SpecDecoding(DSparkPolicy(k, times, 2, AcceptanceStats(k)), k, times, AcceptanceStats(k))

    ranks = [[chunk(True), chunk(False), chunk(True, seed=3)], [], [chunk(True, conf=0.1)]]
    spec = planner()
    budgets, caps, planned, drafts = spec.plan_ranks(ranks)
    alone = [planner().plan(cs) if cs else None for cs in ranks]  # each rank's plan as if it ran by itself
    for d, cs in enumerate(ranks):
        if not cs:
            assert budgets[d] == 0 and caps[d] == {} and not drafts[d]
            continue
        assert budgets[d] == alone[d][0].budget and caps[d] == alone[d][1] and drafts[d] == alone[d][3]
    assert caps[0][2] == (2, True)  # the seeded row's forced count, keyed by its index within rank 0
    assert set(planned.survival) == {0, 2, 3}  # verify rows keyed by their index in the ranks' lists concatenated
    assert planned.tokens == max(p[2].tokens for p in alone if p is not None) and planned.draft == any(drafts)
    assert spec.stats.steps == 1 and spec.stats.budgets == [sum(budgets)]


# ---- settings (no devices needed) -------------------------------------------------------------------


def test_engine_config_refuses_unsupported_settings_with_sharding():
    ok = {"sharding": "cpu-dp2-ep4", "chunking": "tokens", "enable_prefix_caching": False}
    assert EngineConfig(**ok).sharding == "cpu-dp2-ep4"
    assert EngineConfig(**{**ok, "chunking": "cost"}).chunking == "cost"  # cost-model chunking per rank
    # prefix caching (per rank) and decoder bounded replay run with DP (issue 22)
    both = EngineConfig(**{**ok, "enable_prefix_caching": True, "decoder_replay": True})
    assert both.enable_prefix_caching and both.decoder_replay
    assert EngineConfig(sharding="cpu-dp2-ep4").enable_prefix_caching  # the default now holds with sharding
    for value in ("dspark", "fixed"):  # speculation runs per DP rank (issue 22)
        assert EngineConfig(**{**ok, "speculation": value}).speculation == value
    with pytest.raises(ValueError, match="num_speculative_tokens"):  # a bad budget still names its field
        EngineConfig(**{**ok, "speculation": "fixed", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="sharding"):
        EngineConfig(**{**ok, "sharding": 8})


def test_llm_refuses_a_mesh_larger_than_the_devices_before_loading():
    from deepinfer_jax import LLM
    from deepinfer_jax.sharding import ShardingError

    with pytest.raises(ShardingError, match="needs 8 devices") as e:  # this process has one CPU device
        LLM("tiny", sharding="cpu-dp2-ep4", chunking="tokens", enable_prefix_caching=False, use_tqdm=False)
    assert e.value.field == "mesh.shape"
    with pytest.raises(ShardingError, match="unknown preset") as e:
        LLM("tiny", sharding="no-such-preset", chunking="tokens", enable_prefix_caching=False, use_tqdm=False)
    assert e.value.field == "sharding"


# ---- the sharded engine on 8 fake devices (subprocess) ---------------------------------------------


MULTIHOST_PRESET = "prefill-ep8-dp8"  # every device a DP rank and an EP rank: ranks and the all_to_all span processes
MULTIHOST_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def checks(tmp_path_factory) -> dict[str, dict]:
    """The 8-device check script, with the two-process engine run started alongside (it overlaps on the two
    cores); the two-process results are under ``checks["multihost"]``."""
    tmp = tmp_path_factory.mktemp("dp_engine")
    multi = start_processes("engine_multihost.py", MULTIHOST_PRESET, str(tmp / "multihost")) if _has_gloo() else None
    try:
        out = run_checks("dp_engine_check.py", "--reference", str(tmp / "reference.json"), *PRESETS, timeout=600)
    except BaseException:
        for proc in multi or []:
            proc.kill()
        raise
    out["multihost"] = {"tmp": tmp, "results": None if multi is None else finish_processes(multi, MULTIHOST_TIMEOUT_S)}
    return out


def _has_gloo() -> bool:
    """Whether this jaxlib has CPU collectives across processes (gloo), which the two-process run needs."""
    import jax

    return hasattr(jax.config, "jax_cpu_collectives_implementation")


@pytest.mark.parametrize("preset", PRESETS)
def test_sharded_engine_equals_the_one_device_engine(checks, preset):
    ref, row = checks["reference"], checks[preset]
    assert ref["num_tokens"] > 0 and ref["second_batch_differs"]  # the engine-seeded requests really sample
    assert row["ids_equal"] and row["reasons_equal"] and row["num_tokens"] == ref["num_tokens"], row
    assert row["num_logprobs"] > 0 and row["max_logprob_diff"] < 1e-4, row
    assert row["sync_ids_equal"] and row["sync_max_logprob_diff"] < 1e-4, row  # the synchronous loop too
    assert not row["recompiled"] and not row["unfinished"], row


@pytest.mark.parametrize("preset", PRESETS)
def test_each_rank_holds_its_own_cache_and_the_experts_split_over_ep(checks, preset):
    row = checks[preset]
    dp = row["dp_size"]
    ep = 8 // dp
    assert row["cache_shape"][0] == dp and row["cache_shard"][0] == 1 and row["cache_spec"].startswith("P('dp'")
    # ep > 1 (eplb.enabled in these presets): the EP MoE, one program per device over the whole mesh, the experts
    # in EPLB's physical slots (8 experts + 1 redundant slot per EP rank); ep == 1: one program per rank along dp
    assert row["ep_moe"] == (ep > 1)
    assert row["manual_axes"] == (["dp", "ep"] if ep > 1 else ["dp"])
    assert row["experts_w1_shape"][0] == (8 + ep if ep > 1 else 8)
    assert row["experts_w1_shard"][0] == row["experts_w1_shape"][0] // ep
    assert sum(row["rank_requests"]) == 11 and len(row["rank_requests"]) == dp and min(row["rank_requests"]) >= 1


@pytest.mark.parametrize("preset", PRESETS)
def test_the_runner_names_what_is_wrong_with_a_step(checks, preset):
    row = checks[preset]
    errors, dp = row["runner_errors"], row["dp_size"]
    assert f"one chunk list per DP rank ({dp})" in errors["ranks"]
    assert "at least one chunk" in errors["empty"]
    assert errors["slot"].startswith(f"rank {dp - 1}: chunk 0 (slot 4): slot must lie in [0, 4)")


def test_uneven_ranks_idle_while_others_run(checks):
    row = checks["cpu-dp8-ep1"]
    assert sum(row["rank_idle_steps"]) > 0 and len(set(row["rank_tokens"])) > 1, row


# ---- EPLB inside the running engine (the same subprocess) --------------------------------------------


def test_a_rebalance_mid_run_changes_no_output(checks):
    forced, never, vs = checks["eplb_forced"], checks["eplb_never"], checks["eplb_vs_no_rebalance"]
    assert forced["rebalances"] >= 2 and never["rebalances"] == 0, (forced, never)
    assert forced["eplb_steps"] == forced["steps"] > 2 * 3  # every step recorded; several periods of 3 steps
    for row in (forced, never):  # both equal one device, asynchronous and synchronous loops
        assert row["ids_equal"] and row["reasons_equal"] and row["sync_ids_equal"], row
        assert row["max_logprob_diff"] < 1e-5 and row["sync_max_logprob_diff"] < 1e-5, row
        assert not row["recompiled"], row  # new tables are arguments; the weight move was compiled at start-up
    assert vs["ids_equal"] and vs["num_logprobs"] > 0 and vs["max_logprob_diff"] < 1e-5, vs
    assert vs["sync_max_logprob_diff"] < 1e-5, vs


def test_the_rebalance_really_moved_experts_and_made_replicas(checks):
    forced, never = checks["eplb_forced"], checks["eplb_never"]
    assert forced["placement_changed"] and not never["placement_changed"]
    assert forced["max_replicas"] > 1 and forced["moved_weights_exact"], forced
    assert forced["slots_per_rank"] == forced["n_experts"] // forced["ep_size"] + 1


def test_engine_counts_conserve_every_token_expert_pair(checks):
    for row in (checks["eplb_forced"], checks["eplb_never"]):
        assert row["pairs_per_layer"] == [row["expected_pairs"]] * 5, row  # 5 MoE layers, padding not counted
    assert checks["eplb_vs_no_rebalance"]["same_expert_load"]  # identical routing whatever the placement


def test_engine_reports_moe_lb_per_layer(checks):
    forced = checks["eplb_forced"]
    for key in ("moe_lb", "moe_lb_before", "moe_lb_after"):
        assert len(forced[key]) == 5 and all(v >= 1.0 for v in forced[key]), (key, forced[key])
    never = checks["eplb_never"]
    assert len(never["moe_lb"]) == 5 and never["moe_lb_before"] is None  # no rebalance was ever due


def test_cost_model_chunking_equals_one_device(checks):
    row = checks["cost_chunking"]
    assert row["ids_equal"] and row["reasons_equal"] and row["max_logprob_diff"] < 1e-4, row
    assert row["shared_model"] and sum(row["coef_ns"]) > 0, row  # profiled through the DP runner and fitted
    # the time budget, not the token budget, sized the chunks: one fresh 8-token chunk's cost buys each rank at most
    # 16 tokens in its first step (4 chunks whose q**2 sum to <= 64), where the token budget took 32
    first, token_first = row["first_step_tokens"], row["token_chunking_first_step_tokens"]
    assert max(first) <= 16 and sum(first) < sum(token_first) and len(first) == 2, row
    assert row["observed"] == row["predicted"] == row["steps"] and not row["recompiled"], row
    # the same batch with the ranks' prompt chunks matched (dp_match_floor_ns=0 given to LLM): still one device's
    matched = row["matched"]
    assert row["floor_from_llm"] == 0 and row["first_matched_steps"] == 0 and row["matched_steps"] > 0, row
    assert matched["ids_equal"] and matched["reasons_equal"] and matched["max_logprob_diff"] < 1e-4, row


def test_structured_output_equals_one_device(checks):
    for name in ("structured", "structured_masks_first"):  # masks on the worker / masks first, synchronous
        row = checks[name]
        assert row["ids_equal"] and row["reasons_equal"] and row["max_logprob_diff"] < 1e-4, row
        assert row["follows_grammar"] == [True] * 4 and row["reasons"][1] == "error", row  # the dead grammar
        assert row["mask_rows"] > 0 and not row["recompiled"], row


# ---- the engine across two processes (jax.distributed, 4 CPU devices each, gloo) -----------------------


def test_the_engine_over_two_processes_equals_one_device(checks):
    multi = checks["multihost"]
    if multi["results"] is None:
        pytest.skip("this jaxlib has no CPU collectives across processes (gloo)")
    for code, out in multi["results"]:
        assert code == 0, f"rc {code} (None = killed after {MULTIHOST_TIMEOUT_S} s):\n{out[-4000:]}"
    rows = [json.loads((multi["tmp"] / f"multihost{i}.json").read_text()) for i in range(2)]
    want = json.loads((multi["tmp"] / "reference.json").read_text())
    assert [r["process"] for r in rows] == [0, 1]
    assert all(r["processes"] == 2 and r["devices"] == 8 and r["local_devices"] == 4 for r in rows), rows
    assert rows[0]["outputs"] == rows[1]["outputs"] and rows[0]["total_load"] == rows[1]["total_load"]
    got = rows[0]["outputs"]
    assert len(got) == len(want) == 11 and sum(len(w["ids"]) for w in want) > 0
    assert [g["ids"] for g in got] == [w["ids"] for w in want]
    assert [g["reason"] for g in got] == [w["reason"] for w in want]
    diffs = [abs(a - b) for w, g in zip(want, got) for a, b in zip(w["lp"], g["lp"])]
    assert diffs and max(diffs) < 1e-5, max(diffs)
    assert all(r["rebalances"] >= 1 and not r["recompiled"] for r in rows), rows  # EPLB moved weights in both
    assert rows[0]["steps"] == rows[1]["steps"] > 3


def test_bad_presets_give_a_clear_error(checks):
    row = checks["too_many_devices"]
    assert row["error"] == "ShardingError" and row["field"] == "mesh.shape" and "16 devices" in row["message"]
    row = checks["experts_not_divisible"]
    assert row["error"] == "ShardingError" and row["field"] == "parallel.ep_size" and "n_routed_experts 8" in row["message"]
    row = checks["eplb_with_tp"]  # the EP MoE runs one program per device: no tensor parallel
    assert row["error"] == "ShardingError" and row["field"] == "eplb.enabled" and "['tp']" in row["message"], row
    row = checks["ragged_on_cpu"]
    assert row["error"] == "ShardingError" and row["field"] == "eplb.dispatch" and "all_to_all" in row["message"], row


# ---- prefix caching and decoder bounded replay on 8 fake devices (issue 22; a subprocess) -----------------

PREFIX_PRESETS = ("cpu-dp2-ep4", "cpu-dp8-ep1")


@pytest.fixture(scope="module")
def prefix_checks() -> dict[str, dict]:
    return run_checks("dp_prefix_check.py", *PREFIX_PRESETS, timeout=600)


@pytest.mark.parametrize("preset", PREFIX_PRESETS)
def test_prefix_caching_equals_one_device_and_hits(prefix_checks, preset):
    row = prefix_checks[f"prefix_{preset}"]
    assert row["ids_equal"] and row["reasons_equal"] and row["num_tokens"] == 17 * 6, row
    assert row["num_logprobs"] == 17 * 6 and row["max_logprob_diff"] < 1e-4, row
    cached = row["cached"]
    assert cached[5:] == row["ref_cached"][5:] and min(cached[5:10]) > 0, row  # every repeat and extension hit
    assert row["prefix"]["hits"] == sum(row["rank_hits"]) >= 10 and row["prefix"]["hit_tokens"] == sum(cached), row
    assert sum(1 for h in row["rank_hits"] if h) >= 2, row  # hits on more than one rank
    assert row["shared_windows"] and row["windows"] > 0 and not row["recompiled"] and not row["unfinished"], row


def test_prefix_hits_cross_ranks_through_the_host_tier(prefix_checks):
    row = prefix_checks["prefix_cpu-dp8-ep1"]  # the repeats land on other ranks than their prefixes' producers
    assert row["prefix"]["tier_hits"]["host"] > row["ref_prefix"]["tier_hits"]["host"], row
    assert row["prefix"]["tier_hits"]["device"] > 0, row


@pytest.mark.parametrize("preset", PREFIX_PRESETS)
def test_decoder_replay_equals_one_device(prefix_checks, preset):
    row = prefix_checks[f"decoder_{preset}"]
    assert row["decoder_replay"] and set(row["decoder_keep"]) == {4}, row
    assert row["ids_equal"] and row["reasons_equal"] and row["max_logprob_diff"] < 1e-4, row
    assert row["sync_ids_equal"] and row["sync_max_logprob_diff"] < 1e-4, row
    # the prompt within the kept tokens is exact; the longer ones are approximate, as on one device
    assert row["differs_from_exact"] == [False, True, True, True, True], row
    assert not row["recompiled"] and not row["unfinished"], row


@pytest.mark.parametrize("preset", PREFIX_PRESETS)
def test_speculation_equals_one_device_and_counts_per_rank(prefix_checks, preset):
    row = prefix_checks[f"spec_{preset}"]
    assert row["speculation"] == "dspark" and not row["recompiled"] and not row["unfinished"], row
    # lossless: the one-device speculative engine's tokens, plain greedy decoding's, through both loops
    assert row["ids_equal"] and row["reasons_equal"] and row["num_tokens"] == 7 * 12, row
    assert row["max_logprob_diff"] < 1e-4, row
    for other in ("vs_plain", "sync_vs_plain"):
        assert row[other]["ids_equal"] and row[other]["reasons_equal"], row
    verified, accepted = row["dp_rank_spec_drafts_verified"], row["dp_rank_spec_accepted"]
    assert len(verified) == len(accepted) == len(row["dp_rank_requests"]), row
    assert all(0 <= a <= v for a, v in zip(accepted, verified)), row
    assert sum(verified) == row["spec_drafts_verified"] and sum(accepted) == row["spec_drafts_accepted"], row
    assert sum(1 for v in verified if v) >= 2 and row["spec_drafts_accepted"] > 0, row  # drafts on several ranks
    assert row["one_device_verified"] > 0, row
    assert row["bad_budget"] is not None and "num_speculative_tokens" in row["bad_budget"], row


@pytest.mark.parametrize("preset", PREFIX_PRESETS)
def test_quantized_residency_equals_one_device(prefix_checks, preset):
    row = prefix_checks[f"quantized_{preset}"]  # a quantized checkpoint, FP8/FP4 weights resident on every rank
    assert row["resident"] == row["ref_resident"] == "quantized" and row["experts_quantized"], row
    assert row["ids_equal"] and row["reasons_equal"] and row["num_tokens"] == 7 * 6, row
    assert row["num_logprobs"] == 7 * 6 and row["max_logprob_diff"] < 1e-4, row
    # prompt logprobs of the 17- and 30-token prompts: a full-sequence pass over the model's own expert layout
    assert row["prompt_ids_equal"] and row["num_prompt_logprobs"] == 16 + 29, row
    assert row["max_prompt_logprob_diff"] < 1e-4, row
    if preset == "cpu-dp2-ep4":  # the FP4 expert stacks split over ep and moved by forced EPLB rebalances, which
        # happened before the scored requests came (the scorer read the experts of the moved slots: 2.98 off before)
        assert "ep" in row["experts_spec"] and row["rebalances_before_scoring"] > 0, row


@pytest.mark.parametrize("preset", ["cpu-dp2-ep2-tp2", "cpu-cp4"])
def test_quantized_residency_with_another_split_is_refused_naming_weights(prefix_checks, preset):
    row = prefix_checks[f"quantized_refused_{preset}"]  # refused before loading (LLM) and by the runner itself
    assert row["llm"]["type"] == "WeightsError" and row["llm"]["field"] == "weights", row
    assert row["runner"]["type"] == "QWeightError" and row["runner"]["field"] == "weights", row
    assert preset in row["llm"]["message"] and preset in row["runner"]["message"], row
