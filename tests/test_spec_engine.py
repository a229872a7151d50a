"""Speculative decoding on the host: the engine loop against a fake speculative runner whose model is
known, and the verification policies (issue 9).

The fake keeps, per slot, what the device would (the sequence it knows, the anchor, the drafts) and
checks every verify row: the slot holds a decoding sequence, the row's blocks cover every position it
may write, its ``ctx_len`` bounds the anchor from above. Drafts follow the known model with
deterministic mistakes, so rows accept 0 .. k drafts; any bookkeeping bug (a lost or duplicated
token, a stale length, a wrong stop) changes the outputs, which must equal the plain model's.
"""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import numpy as np
import pytest
from test_scheduler import EOS, VOCAB, FakeRunner, next_token, prompts_mix, reference, run_all

from deepinfer_jax.engine import EngineCore, SamplingParams, Scheduler
from deepinfer_jax.engine.spec_decode import SpecDecoding
from deepinfer_jax.engine.spec_policy import (
    AcceptanceStats,
    DSparkPolicy,
    FixedPolicy,
    StepTimes,
    VerifyRow,
    make_policy,
    solve_budget,
)
from deepinfer_jax.runner import Buckets, StepOutput


@contextlib.contextmanager
def plain_priced_out(spec):
    """Draft whatever the step times say: plain steps (and plain search steps) priced out of reach, so that the
    cost decision to stop drafting, which follows this machine's measured step times and its load, cannot
    make a test that is about losslessness or programs verify nothing. (The speculator hands its own tables to
    the policy at every step, so it is ``spec``'s tables that must change, not the policy's.)"""
    saved = spec.plain_times, spec.search_times
    slow = lambda: StepTimes(spec.times.buckets, [1e15] * len(spec.times.buckets))
    spec.plain_times = slow()
    spec.search_times = None if saved[1] is None else (saved[1][0], slow())
    try:
        yield
    finally:
        spec.plain_times, spec.search_times = saved


K = 5


def select_counts_np(conf, caps, forced, budget):
    """numpy twin of ``model.speculative.select_counts``."""
    r, k = conf.shape
    surv = np.cumprod(conf, axis=1)
    allowed = np.arange(k)[None] < np.asarray(caps)[:, None]
    score = np.where(allowed, surv + 2.0 * np.asarray(forced)[:, None], -np.inf).ravel()
    order = np.argsort(-score, kind="stable")
    n = int(sum(c for c, f in zip(caps, forced) if f)) + budget
    chosen = np.zeros(r * k, bool)
    chosen[order[:n]] = True
    return (chosen.reshape(r, k) & allowed).sum(1)


def draft_for(seq: list[int], k: int, salt: int) -> list[int]:
    """The known model's next k tokens, with a deterministic mistake now and then."""
    seq, out = list(seq), []
    for i in range(k):
        tok = next_token(seq)
        if (tok + salt + 3 * i) % 4 == 0:  # about one draft in four is wrong
            tok = 3 + (tok + 1) % (VOCAB - 3)
        out.append(tok)
        seq.append(tok)
    return out


class FakeSpecRunner(FakeRunner):
    """The speculative runner's interface over the known model: verify rows take their tokens from the slot.

    Per slot: ``kv`` the computed tokens (the cache), ``last`` the anchor (known, not computed yet),
    ``drafts`` / ``conf`` the next block."""

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.drafts: dict[int, list[int]] = {}
        self.conf: dict[int, np.ndarray] = {}
        self.verified_total = self.accepted_total = 0

    def forward(self, chunks, budget=0, draft=True, logprobs=True):
        return SimpleNamespace(chunks=chunks, rows=Buckets.pick(self.buckets.requests, len(chunks), "requests"),
                               budget=budget, draft=draft)

    def sample(self, fwd, mask=None):
        chunks = fwd.chunks
        ver = [i for i, c in enumerate(chunks) if c.verify]
        caps, forced = [], []
        for i in ver:
            c = chunks[i]
            a = len(self.kv[c.slot])
            assert c.ctx_len >= a, "ctx_len must bound the anchor position from above"
            caps.append(max(0, min(c.max_drafts, c.limit - a - 1)))
            forced.append(c.forced)
        conf = np.array([self.conf.get(chunks[i].slot, np.full(K, 0.5)) for i in ver]).reshape(len(ver), K)
        count = dict(zip(ver, select_counts_np(conf, caps, forced, fwd.budget) if ver else []))
        results, verified, anchors, confidence = [], [], [], []
        for i, c in enumerate(chunks):
            seq = self.kv.setdefault(c.slot, [])
            verified.append(0)
            anchors.append(0)
            if not c.verify:
                assert not c.feed_last, "speculative engines feed decoding requests through verify rows"
                assert c.ctx_len <= len(seq), "the chunk skips tokens"
                del seq[c.ctx_len:]
                seq.extend(c.token_ids)
                assert len(c.block_table) * self.block_size >= len(seq)
                if c.sample is None:
                    results.append(None)
                    confidence.append(np.zeros(K))
                    continue
                new = [self.next_fn(seq)]
            else:
                a = len(seq)
                if a + 1 > c.limit:  # past the context limit: the row runs nothing
                    results.append([])
                    confidence.append(np.zeros(K))
                    continue
                n = int(count[i])
                assert n == 0 or c.slot in self.drafts, "a row verifies drafts its slot never got"
                drafts = self.drafts.get(c.slot, [])[:n]
                assert len(c.block_table) * self.block_size >= a + 1 + n, "a verified position lies beyond the blocks"
                ctx, new, m = seq + [self.last[c.slot]], [], 0
                while True:
                    tok = self.next_fn(ctx + new)
                    new.append(tok)
                    if m < n and drafts[m] == tok:
                        m += 1
                        continue
                    break
                verified[-1], anchors[-1] = n, a
                self.verified_total += n
                self.accepted_total += m
                seq.append(self.last[c.slot])
                seq.extend(new[:-1])  # the anchor and the accepted drafts are now in the cache
            self.last[c.slot] = new[-1]
            if fwd.draft:
                self.drafts[c.slot] = draft_for(seq + [new[-1]], K, c.slot)
                self.conf[c.slot] = np.linspace(0.9, 0.5, K)
            results.append([(t, -1.0, np.array([t]), np.array([-1.0])) for t in new])
            confidence.append(self.conf.get(c.slot, np.zeros(K)))
        self.steps.append(chunks)
        return SimpleNamespace(result=lambda: results, verified=verified, anchors=anchors, confidence=confidence,
                               output=lambda: StepOutput(results, verified, anchors, confidence))


def make_spec_engine(policy="dspark", *, block_size=4, max_seqs=4, max_len=256, budget=64, async_scheduling=False,
                     num_blocks=128, fixed_k=3, plain_times=None, search_times=None):
    sched = Scheduler(num_blocks=num_blocks, block_size=block_size, max_blocks_per_request=max_len // block_size,
                      max_num_seqs=max_seqs, max_model_len=max_len, max_num_batched_tokens=budget, chunking="tokens",
                      spec_tokens=K)
    runner = FakeSpecRunner(block_size)
    times = StepTimes((4, 8, 16, 32, 64), [10.0, 11.0, 13.0, 20.0, 40.0])
    stats = AcceptanceStats(K)
    spec = SpecDecoding(make_policy(policy, k=K, num_speculative_tokens=fixed_k, times=times, stats=stats,
                                    plain_times=plain_times), K, times, stats, plain_times, search_times=search_times)
    engine = EngineCore(runner, sched, tokenizer=None, eos_token_id=EOS, async_scheduling=async_scheduling, spec=spec)
    return engine, runner


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("policy", ["dspark", "fixed"])
def test_speculative_outputs_equal_the_known_model(policy, async_scheduling):
    rng = np.random.default_rng(3)
    prompts = prompts_mix(rng, 10, 1, 40)
    params = [SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 40)), ignore_eos=True) for _ in prompts]
    engine, runner = make_spec_engine(policy, async_scheduling=async_scheduling)
    outs = run_all(engine, prompts, params)
    for p, sp, o in zip(prompts, params, outs):
        assert o.outputs[0].token_ids == reference(p, sp.max_tokens, eos=False)
        assert o.outputs[0].finish_reason == "length"
    assert runner.accepted_total > 20 and runner.verified_total > runner.accepted_total  # drafts both pass and fail
    assert engine.stats.steps < sum(sp.max_tokens for sp in params)  # fewer steps than tokens
    s = engine.spec.summary()
    assert s["spec_drafts_accepted"] == runner.accepted_total and s["spec_verify_rows"] > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stops_inside_accepted_drafts_cut_the_output_there(async_scheduling):
    """EOS, stop ids and max_tokens landing in the middle of a row's accepted tokens end the request at
    exactly that token; the later tokens of the row are dropped."""
    rng = np.random.default_rng(5)
    prompts = prompts_mix(rng, 6, 2, 20)
    refs = [reference(p, 30, eos=False) for p in prompts]
    params = [SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[refs[1][9]], ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[refs[3][0]], ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[refs[5][4]], ignore_eos=True)]
    engine, _ = make_spec_engine(async_scheduling=async_scheduling)
    outs = run_all(engine, prompts, params)
    for ref, sp, o in zip(refs, params, outs):
        want = ref[: sp.max_tokens]
        if sp.stop_token_ids:
            want = want[: want.index(sp.stop_token_ids[0]) + 1]
        assert o.outputs[0].token_ids == want


def test_context_limit_and_preemption_under_speculation():
    """Requests running into max_model_len stop at it; a pool too small for all of them preempts and
    recomputes, and the outputs stay exact."""
    rng = np.random.default_rng(11)
    prompts = prompts_mix(rng, 8, 10, 40)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    engine, runner = make_spec_engine(num_blocks=40, max_len=64, async_scheduling=True)
    outs = run_all(engine, prompts, [params] * len(prompts))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == reference(p, 64 - len(p), eos=False)
        assert o.outputs[0].finish_reason == "length"
    assert engine.stats.preemptions > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_plain_decoding_when_drafting_does_not_pay_and_back_when_it_does(async_scheduling):
    """While the plain step times beat any budget the engine stops drafting: its verify rows verify
    nothing and reserve one token of the step budget each (not 1 + K); when drafting pays again (the
    plain times rise), rows that have been decoding plainly draft and verify again. Outputs stay exact."""
    fast_plain = StepTimes((4, 8, 16, 32, 64), [1.0, 1.1, 1.3, 2.0, 4.0])  # 10x cheaper than drafting steps
    engine, runner = make_spec_engine(plain_times=fast_plain, async_scheduling=async_scheduling)
    rng = np.random.default_rng(8)
    prompts = prompts_mix(rng, 4, 3, 12)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    rids = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    done, plans = {}, []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda *budget: plans.append(schedule(*budget)) or plans[-1]

    def steps(n):
        for _ in range(n):
            for out in engine.step():
                done[rids[out.request_id]] = out

    steps(6)  # prefill, then at most a step verifying the first drafts
    v0, steps0, plans0 = runner.verified_total, len(runner.steps), len(plans)
    steps(12)
    assert runner.verified_total == v0  # no drafts in the steady state
    later = [c for chunks in runner.steps[steps0 + 2:] for c in chunks if c.verify]
    assert later and all(c.max_drafts == 0 for c in later)
    reserved = [c.num_tokens for p in plans[plans0 + 2:] for c in p.chunks if c.verify]
    assert reserved and set(reserved) == {1}
    fast_plain.times = [100.0] * 5  # now plain decoding is the slow option
    steps(10)
    assert runner.verified_total > v0 and runner.accepted_total > 0
    while engine.has_unfinished:
        steps(1)
    for i, p in enumerate(prompts):
        assert done[i].outputs[0].token_ids == reference(p, 60, eos=False)


def test_steps_that_search_top_p_use_their_own_step_times():
    """A step with a top-p sampled row plans with (and teaches) the search tables; greedy steps the others."""
    search = (StepTimes((4, 8, 16, 32, 64), [10.0] * 5), StepTimes((4, 8, 16, 32, 64), [10.0] * 5))
    plain = StepTimes((4, 8, 16, 32, 64), [10.0] * 5)
    engine, _ = make_spec_engine(plain_times=plain, search_times=search)
    rng = np.random.default_rng(2)
    prompts = prompts_mix(rng, 2, 3, 8)
    run_all(engine, prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    greedy_times = list(engine.spec.times.times) + list(plain.times)
    assert search[0].times == [10.0] * 5 and search[1].times == [10.0] * 5  # untouched by greedy steps
    run_all(engine, prompts, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=10, ignore_eos=True, seed=1))
    assert search[0].times != [10.0] * 5 or search[1].times != [10.0] * 5
    assert list(engine.spec.times.times) + list(plain.times) == greedy_times


# ---- policies -----------------------------------------------------------------------------------


def test_select_counts_reference_takes_prefixes_and_respects_the_budget():
    rng = np.random.default_rng(0)
    for _ in range(300):
        r = int(rng.integers(1, 7))
        conf = rng.choice([0.0, 0.3, 0.5, 0.9, 1.0], size=(r, K)) if rng.random() < 0.5 else rng.random((r, K))
        caps = rng.integers(0, K + 1, r)
        forced = rng.random(r) < 0.3
        budget = int(rng.integers(0, r * K + 2))
        counts = select_counts_np(conf, caps, forced, budget)
        assert np.all(counts <= caps)
        assert np.all(counts[forced] == caps[forced])
        free = ~forced
        assert counts[free].sum() == min(budget, caps[free].sum())
        # the kept drafts are the best survivals: no dropped draft beats a kept one
        surv = np.cumprod(conf, axis=1)
        kept = [surv[i, c - 1] for i, c in enumerate(counts) if free[i] and c > 0]
        dropped = [surv[i, c] for i, c in enumerate(counts) if free[i] and c < caps[i]]
        if kept and dropped:
            assert min(kept) >= max(dropped) - 1e-12


def test_solve_budget_maximises_tokens_per_time():
    times = StepTimes((4, 8, 16), [10.0, 12.0, 40.0])
    gains = [0.9, 0.8, 0.7, 0.2, 0.1, 0.05]
    b, expected = solve_budget(gains, 4, 4.0, times.time, [0, 4, 12])
    # B=0: 4/10; B=4: 6.6/12 (best); B=6 (capped): 6.75/40
    assert b == 4 and math.isclose(expected, 4 + 0.9 + 0.8 + 0.7 + 0.2)
    flat = StepTimes((4, 8, 16), [10.0, 10.0, 10.0])
    assert solve_budget(gains, 4, 4.0, flat.time, [0, 4, 12])[0] == 6  # free verification: take everything
    steep = StepTimes((4, 8, 16), [10.0, 30.0, 90.0])
    assert solve_budget(gains, 4, 4.0, steep.time, [0, 4, 12])[0] == 0  # verification costs more than it gains


def test_dspark_policy_fixes_deterministic_rows_and_fixed_policy_forces_all():
    times = StepTimes((4, 8, 16, 32), [10.0, 10.5, 11.0, 60.0])
    pol = DSparkPolicy(K, times, deterministic_k=2)
    rows = [VerifyRow(K, False, True, np.array([0.9, 0.8, 0.6, 0.3, 0.1])),
            VerifyRow(K, True, False, None), VerifyRow(0, False, True, None)]
    plan = pol.plan(rows, host_tokens=0)
    assert plan.caps == (K, 2, 0) and plan.forced == (False, True, False)
    assert 0 < plan.budget <= K
    fixed = FixedPolicy(3).plan(rows, 0)
    assert fixed.caps == (3, 3, 0) and all(fixed.forced) and fixed.budget == 0


def test_dspark_policy_drafts_only_with_a_margin_over_plain_decoding():
    times = StepTimes((4, 8, 16, 32), [10.0] * 4)
    rows = [VerifyRow(K, False, True, 0.5 ** np.arange(1, K + 1))] * 4
    # with drafts: every draft verified (free), 4 x (1 + 0.5 + 0.25 + ...) tokens in 10 ns; plain: 4 in t ns
    expected = 4 * (1 + sum(0.5 ** np.arange(1, K + 1)))
    for plain_t, want in ((10.0, True), (4 * 10.0 / expected * 1.02, False), (4 * 10.0 / expected * 1.1, True)):
        pol = DSparkPolicy(K, times, plain_times=StepTimes((4, 8, 16, 32), [plain_t] * 4))
        assert pol.worth_drafting(rows, 0) is want, plain_t
    seeded = [VerifyRow(K, True, True, None)]
    fast = StepTimes((4, 8, 16, 32), [0.001] * 4)
    assert DSparkPolicy(K, times, deterministic_k=3, plain_times=fast).worth_drafting(seeded, 0)
    assert not DSparkPolicy(K, times, deterministic_k=0, plain_times=fast).worth_drafting(seeded, 0)


def test_acceptance_calibration_follows_observations():
    stats = AcceptanceStats(K, prior=2.0)
    surv = np.array([0.9, 0.8, 0.7, 0.6, 0.5])
    for _ in range(200):  # the drafter claims 0.9 but only half of the first drafts pass
        stats.observe(True, 2, 1 if stats.rows % 2 else 0, surv)
    cal = stats.calibration(True)
    assert 0.5 < cal[0] < 0.6 and stats.acceptance_rate()[0] == pytest.approx(0.5)
    assert stats.calibration(False)[0] == pytest.approx(1.0)  # nothing seen for sampled rows


def test_step_times_validate_and_follow_measurements():
    with pytest.raises(ValueError, match="times_ns"):
        StepTimes((4, 8), [1.0])
    with pytest.raises(ValueError, match="times_ns"):
        StepTimes((4, 8), [1.0, -2.0])
    t = StepTimes((4, 8), [10.0, 20.0], alpha=0.5)
    t.observe(6, 40.0)
    assert t.time(5) == 30.0 and t.time(3) == 10.0 and t.time(9) == math.inf
    t.observe(2, 1e9)  # a step that waited on a compilation counts as twice the bucket's time at most
    assert t.time(2) == 15.0
    with pytest.raises(ValueError, match="speculation"):
        make_policy("sometimes", k=K, num_speculative_tokens=2)
