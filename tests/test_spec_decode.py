"""DSpark speculative decoding on the device (issue 9): budgeted selection, lossless acceptance, rollback,
and the engine end to end on a 5-layer cut of the tiny config (``tests/cut_model.py``).

A random drafter almost never agrees with the tiny random target, so the engine tests use one whose
Markov head encodes the target's most frequent greedy transitions, read off plain decoding
(``transition_drafter``): its drafts are often right and often wrong, which exercises every acceptance
length. The shipped (trained) drafter is checked in ``test_spec_shipped.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cut_model import tiny_cut
from scipy import stats as sps
from test_paged_step import robust_params
from test_spec_engine import plain_priced_out, select_counts_np

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.config import CacheConfig, EngineConfig
from deepinfer_jax.engine.spec_policy import FixedPolicy
from deepinfer_jax.model import speculative as S
from deepinfer_jax.model.dspark import init_drafter_params
from deepinfer_jax.model.sampler import SamplingInputs
from deepinfer_jax.runner import Buckets, ChunkSpec, ModelRunner, SampleSpec, StepInputError

CFG = tiny_cut()  # speculation's mechanics, not the 12-layer schedule (test_spec_shipped.py runs that)
K = CFG.dspark_block_size


def transition_drafter(cfg, pairs, seed=1, scale=10.0):
    """A random drafter whose Markov transition logits favour ``next`` after ``prev`` for the given
    (prev, next) token pairs (the most frequent next per prev) by ~scale**2."""
    d = init_drafter_params(cfg, seed=seed)
    mk = d["mtp"][cfg.num_nextn_predict_layers - 1]["markov_head"]
    u = np.asarray(jax.random.normal(jax.random.key(seed), (cfg.vocab_size, cfg.dspark_markov_rank)))
    u = scale * u / np.linalg.norm(u, axis=1, keepdims=True)
    best: dict[int, dict[int, int]] = {}
    for a, b in pairs:
        best.setdefault(a, {}).setdefault(b, 0)
        best[a][b] += 1
    head = np.zeros_like(u)
    for a, nxt in best.items():
        head[max(nxt, key=nxt.get)] += u[a]
    mk["embed"]["weight"][...] = jnp.asarray(u)
    mk["head"]["weight"][...] = jnp.asarray(head)
    return d


# ---- device pieces ------------------------------------------------------------------------------


def test_select_counts_on_device_matches_the_reference():
    rng = np.random.default_rng(1)
    fn = jax.jit(S.select_counts)
    for _ in range(60):
        r = int(rng.integers(1, 9))
        conf = rng.choice([0.0, 0.25, 0.5, 1.0], size=(r, K)) if rng.random() < 0.5 else rng.random((r, K))
        conf = conf.astype(np.float32)
        caps = rng.integers(0, K + 1, r).astype(np.int32)
        forced = rng.random(r) < 0.3
        budget = int(rng.integers(0, r * K + 3))
        got = np.asarray(fn(conf, caps, forced, np.int32(budget)))
        np.testing.assert_array_equal(got, select_counts_np(conf, caps, forced, budget))
        assert np.all(got <= caps) and got[~forced].sum() <= budget


def _accept_inputs(r, logits_JV, drafts_K, dlogits_KV, temperature, top_k=0, top_p=1.0):
    """Every row the same verify row (count K) of one slot-less step; rows differ only by seed."""
    j, v = logits_JV.shape
    layout = S.SpecLayout(counts=jnp.full(r, K, jnp.int32), anchor=jnp.full(r, 10, jnp.int32),
                          active=jnp.ones(r, bool), logit_start=jnp.arange(r, dtype=jnp.int32) * j,
                          new_len=jnp.full(r, 10 + j, jnp.int32))
    rows = S.SpecRows(is_verify=jnp.ones(r, bool), cap=jnp.full(r, K, jnp.int32), forced=jnp.zeros(r, bool),
                      limit=jnp.full(r, 100, jnp.int32), prompt_len=jnp.full(r, 5, jnp.int32),
                      host_logit=jnp.full(r, -1, jnp.int32), ctx_from=jnp.zeros(r, jnp.int32), budget=jnp.int32(0),
                      prefill_tokens=jnp.int32(0), prefill_logits=jnp.int32(0), logit_base=jnp.int32(0))
    sampling = SamplingInputs(temperature=jnp.full(r, temperature, jnp.float32), top_k=jnp.full(r, top_k, jnp.int32),
                              top_p=jnp.full(r, top_p, jnp.float32), min_p=jnp.zeros(r, jnp.float32),
                              seed=jnp.arange(r, dtype=jnp.uint32), stream=jnp.zeros(r, jnp.uint32),
                              position=jnp.zeros(r, jnp.int32))
    spec = S.SpecState(length=jnp.zeros(r), ctx_from=jnp.zeros(r), feat=jnp.zeros((r, 1, 1)),
                       feat_pos=jnp.zeros((r, 1), jnp.int32), drafts=drafts_K, conf=jnp.zeros((r, K)),
                       draft_logits=jnp.broadcast_to(dlogits_KV, (r, K, v)))
    return jnp.tile(logits_JV, (r, 1)), layout, rows, sampling, spec, jnp.arange(r, dtype=jnp.int32)


@pytest.mark.parametrize("filters", [dict(temperature=1.0), dict(temperature=0.7, top_k=4)])
def test_sampled_acceptance_is_lossless(filters):
    """Fixed target distributions p_t per position and drafts drawn from p_d: the token produced at each
    position follows p_t exactly (chi-square over 6,000 seeds), whatever p_d is, and rejections happen."""
    v, r = 8, 6000
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, (K + 1, v)).astype(np.float32)
    dlogits = rng.normal(0, 1.5, (K, v)).astype(np.float32)
    t = filters["temperature"]
    p_d = np.exp(dlogits / t) / np.exp(dlogits / t).sum(1, keepdims=True)
    drafts = np.stack([rng.choice(v, size=r, p=p_d[i]) for i in range(K)], 1).astype(np.int32)
    args = _accept_inputs(r, jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(dlogits), **filters)
    out = jax.jit(lambda *a: S.accept(*a, 5, jnp.arange(v, dtype=jnp.int32)))(*args)
    tokens, n_new = np.asarray(out.tokens), np.asarray(out.n_new)
    scaled = logits / t
    p_t = np.exp((scaled - scaled.max(1, keepdims=True)).astype(np.float64))
    if filters.get("top_k"):
        kth = np.sort(p_t, 1)[:, -filters["top_k"]][:, None]
        p_t = np.where(p_t >= kth, p_t, 0.0)
    p_t /= p_t.sum(1, keepdims=True)
    assert 1 < n_new.mean() < K + 1  # some rows accept, some reject
    for pos in range(3):  # rows that reached position pos (all drafts before it accepted)
        got = tokens[n_new > pos, pos]
        counts = np.bincount(got, minlength=v)
        keep = p_t[pos] > 0
        assert counts[~keep].sum() == 0, "a token outside the filtered distribution was produced"
        expected = p_t[pos][keep].astype(np.float64)
        res = sps.chisquare(counts[keep], expected / expected.sum() * counts[keep].sum())
        assert res.pvalue > 1e-3, (pos, counts, p_t[pos])


def test_sampled_acceptance_with_the_wrong_draft_distribution_is_caught():
    """The chi-square check has teeth: verifying drafts against a p_d they were not drawn from (here
    uniform) produces the wrong distribution at the first position."""
    v, r = 8, 6000
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, (K + 1, v)).astype(np.float32)
    dlogits = rng.normal(0, 1.5, (K, v)).astype(np.float32)
    p_d = np.exp(dlogits.astype(np.float64))
    p_d /= p_d.sum(1, keepdims=True)
    drafts = np.stack([rng.choice(v, size=r, p=p_d[i]) for i in range(K)], 1).astype(np.int32)
    args = _accept_inputs(r, jnp.asarray(logits), jnp.asarray(drafts), jnp.zeros((K, v)), temperature=1.0)
    out = jax.jit(lambda *a: S.accept(*a, 5, jnp.arange(v, dtype=jnp.int32)))(*args)
    p_t = np.exp(logits[0].astype(np.float64))
    p_t /= p_t.sum()
    res = sps.chisquare(np.bincount(np.asarray(out.tokens)[:, 0], minlength=v), p_t * r)
    assert res.pvalue < 1e-6


# ---- the runner: injected drafts, rollback --------------------------------------------------------


@pytest.fixture(scope="module")
def params():
    return robust_params(cfg=CFG)


@pytest.fixture(scope="module")
def exact_cfg():
    return CFG.replace(fake_quant=False)  # no rounding bins: cache rows compare to ~1e-7


def test_rejected_drafts_leave_the_cache_as_a_plain_run_would(exact_cfg, params):
    """Drive three requests through verify rows whose drafts are the true continuation with random
    mistakes; tokens equal plain greedy decoding, and every cache row a later step can read (window
    rows, compressor ring, Engram ring, block KV entries) equals the plain run's."""
    cfg = exact_cfg
    cc = CacheConfig(block_size=16, num_blocks=32, max_requests=4, max_blocks_per_request=8, storage="dequantized")
    bk = Buckets(tokens=(48,), requests=(4,), blocks=(8,))  # one shape: one compile per runner
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).tolist() for n in (5, 13, 21)]
    new = 30
    plain = ModelRunner(cfg, params, cc, bk)
    tables = [list(range(s * 8, s * 8 + 8)) for s in range(4)]
    ref = []
    for s, p in enumerate(prompts):
        toks = [plain.launch([ChunkSpec(slot=s, block_table=tables[s], ctx_len=0, token_ids=p, sample=SampleSpec())])
                .result()[0][0]]
        for i in range(1, new):
            toks.append(plain.launch([ChunkSpec(slot=s, block_table=tables[s], ctx_len=len(p) + i - 1,
                                                token_ids=[toks[-1]], sample=SampleSpec())]).result()[0][0])
        ref.append(toks)
    spec = ModelRunner(cfg, params, cc, bk, drafter=init_drafter_params(cfg, seed=4))
    assert plain.speculation is None and spec.speculation is not None
    out = [[t for t, *_ in res] for res in spec.launch(
        [ChunkSpec(slot=s, block_table=tables[s], ctx_len=0, token_ids=p, sample=SampleSpec(), prompt_len=len(p))
         for s, p in enumerate(prompts)], draft=False).result()]
    accepted = 0
    while min(len(o) for o in out) < new:
        drafts = np.zeros((4, K), np.int32)
        for s in range(3):
            d = np.array((ref[s][len(out[s]):] + [0] * K)[:K])
            bad = rng.random(K) < 0.3
            drafts[s] = np.where(bad, (d + 1) % cfg.vocab_size, d)
        state = spec.speculation.state
        spec.speculation.state = state._replace(drafts=jnp.asarray(drafts),
                                                conf=jnp.asarray(rng.random((4, K)), jnp.float32))
        rows = [ChunkSpec(slot=s, block_table=tables[s], ctx_len=len(prompts[s]) + len(out[s]) - 1, token_ids=[0],
                          verify=True, max_drafts=K, limit=len(prompts[s]) + new, prompt_len=len(prompts[s]),
                          sample=SampleSpec()) for s in range(3)]
        pend = spec.launch(rows, budget=int(rng.integers(0, 3 * K + 1)), draft=False)
        for s, res in enumerate(pend.result()):
            out[s] += [t for t, *_ in res]
            accepted += len(res) - 1
    assert [o[:new] for o in out] == ref
    assert accepted > 10
    for s, p in enumerate(prompts):
        n = len(p) + new - 1  # tokens both caches hold (the newest token is not computed)
        got, want = spec.cache, plain.cache
        cap = cc.ring_capacity(cfg)
        ring = [q % cap for q in range(n - cfg.sliding_window, n)]
        np.testing.assert_allclose(got["swa"][:, s, ring], want["swa"][:, s, ring], rtol=1e-5, atol=1e-6)
        for layer, comp in want["comp"].items():
            r_ = cfg.compress_ratio(layer)
            at = [q % comp["v"].shape[1] for q in range(n - n % r_, n)]
            for leaf in ("v", "g"):
                np.testing.assert_allclose(got["comp"][layer][leaf][s, at], comp[leaf][s, at], rtol=1e-5, atol=1e-6)
        e = want["engram"].shape[1]
        at = [q % e for q in range(n - CFG.engram_max_ngram_size + 1, n)]
        np.testing.assert_array_equal(got["engram"][s, at], want["engram"][s, at])
        for layer, glob in want["global"].items():
            r_ = cfg.compress_ratio(layer)
            per = cc.block_size // r_
            entries = [(tables[s][j * r_ // cc.block_size], j % per) for j in range(n // r_)]
            for leaf in ("kv", "index"):
                a = np.stack([got["global"][layer][leaf][b, i] for b, i in entries])
                w = np.stack([glob[leaf][b, i] for b, i in entries])
                np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-6)


def test_spec_runner_refuses_bad_input(params):
    bk = Buckets(tokens=(8,), requests=(2,), blocks=(4,))
    cc = CacheConfig(block_size=16, num_blocks=8, max_requests=2, max_blocks_per_request=4, spec_slack=2)
    with pytest.raises(ValueError, match="spec_slack"):
        ModelRunner(CFG, params, cc, bk, drafter=init_drafter_params(CFG))
    cc = CacheConfig(block_size=16, num_blocks=8, max_requests=2, max_blocks_per_request=4)
    with pytest.raises(ValueError, match="draft_vocab"):
        ModelRunner(CFG, params, cc, bk, drafter=init_drafter_params(CFG), draft_vocab=[3, 3, 4])
    plain = ModelRunner(CFG, params, cc, bk)  # speculation's keywords need the speculative step
    prefill = ChunkSpec(slot=0, block_table=[0], ctx_len=0, token_ids=[5, 6], sample=SampleSpec())
    with pytest.raises(StepInputError, match="no drafter"):
        plain.forward([prefill], budget=2)
    with pytest.raises(StepInputError, match="no drafter"):
        plain.launch([prefill], draft=False)
    with pytest.raises(ValueError, match="context parallelism"):  # refused before any device is used
        ModelRunner(CFG, params, cc, bk, mesh=object(), preset="cpu-cp4", drafter=init_drafter_params(CFG))
    runner = ModelRunner(CFG, params, cc, bk, drafter=init_drafter_params(CFG))
    row = ChunkSpec(slot=0, block_table=[0], ctx_len=15, token_ids=[0], verify=True, max_drafts=K, limit=100,
                    sample=SampleSpec())
    with pytest.raises(StepInputError, match="beyond"):  # 15 + 1 + 5 positions need two blocks
        runner.forward([row])
    with pytest.raises(StepInputError, match="budget"):
        runner.forward([dataclasses.replace(row, block_table=[0, 1])], budget=-1)
    with pytest.raises(StepInputError, match="verify row"):
        runner.forward([ChunkSpec(slot=0, block_table=[0, 1], ctx_len=3, token_ids=[0], verify=True, limit=100)])


def test_a_step_that_verifies_nothing_runs_one_logit_row_per_request(exact_cfg, params):
    """A budget of 0 and no forced row: the narrow program (one logit row per request row) gives the tokens,
    logprobs and cache the wide one (K + 1 per row) gives for the same step; a lazy runner's forward picks it
    once the bucket has run ``compile_after`` such steps, an eager one never. (The runner is the rollback
    test's, so the wide programs come from the program store: only the narrow pair compiles here.)"""
    cc = CacheConfig(block_size=16, num_blocks=32, max_requests=4, max_blocks_per_request=8, storage="dequantized")
    runner = ModelRunner(exact_cfg, params, cc, Buckets(tokens=(48,), requests=(4,), blocks=(8,)),
                         drafter=init_drafter_params(exact_cfg, seed=4))
    spec = runner.speculation
    runner.bucket_use.lazy, runner.bucket_use.compile_after = True, 0  # the narrow program from the first step
    prompts = [[5, 9, 31, 7, 2], [40, 41, 3]]
    hot = SampleSpec(temperature=0.8, top_p=0.9, seed=11)
    tables = [list(range(8 * s, 8 * s + 8)) for s in range(2)]
    first = runner.launch([ChunkSpec(slot=s, block_table=tables[s], ctx_len=0, token_ids=p, prompt_len=len(p),
                                     sample=SampleSpec() if s == 0 else hot) for s, p in enumerate(prompts)]).result()
    rows = [ChunkSpec(slot=s, block_table=tables[s], ctx_len=len(p), token_ids=[0], verify=True,
                      max_drafts=K, limit=len(p) + 10, prompt_len=len(p), sample=SampleSpec() if s == 0 else hot)
            for s, p in enumerate(prompts)]
    copy = lambda tree: jax.tree.map(jnp.copy, tree)
    saved = copy((runner.cache, spec.state, runner.last_ids))
    fwd = runner.forward(rows, budget=0, draft=False)
    assert fwd.logits.shape[0] == 4  # one row per request row of the bucket
    narrow, narrow_cache = spec.sample(fwd).result(), copy(runner.cache)
    runner.cache, spec.state, runner.last_ids = saved
    wide_fwd = spec._dispatch([rows], [0], [False], 48, 4, 8, verify=True)
    assert wide_fwd.logits.shape[0] == 4 * (K + 1)
    wide = spec.sample(wide_fwd).result()
    assert [[t.token for t in r] for r in narrow] == [[t.token for t in r] for r in wide]
    assert all(len(r) == 1 for r in narrow) and len(first) == 2
    np.testing.assert_allclose([r[0].logprob for r in narrow], [r[0].logprob for r in wide], rtol=0, atol=1e-5)
    for a, b in zip(jax.tree.leaves(narrow_cache), jax.tree.leaves(runner.cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert runner.forward(rows, budget=3, draft=False).logits.shape[0] == 4 * (K + 1)  # drafts to verify: wide
    runner.bucket_use.compile_after = 10**6  # a bucket that has not run enough such steps keeps the wide program
    assert runner.forward(rows, budget=0, draft=False).logits.shape[0] == 4 * (K + 1)
    runner.bucket_use.lazy = False  # precompile="all": never the narrow program
    assert runner.forward(rows, budget=0, draft=False).logits.shape[0] == 4 * (K + 1)


# ---- the engine ---------------------------------------------------------------------------------

SETTINGS = dict(max_num_seqs=8, max_num_batched_tokens=48, token_buckets=(48,), block_size=16, max_model_len=128,
                chunking="tokens", use_tqdm=False)


@pytest.fixture(scope="module")
def plain_llm(params):
    return LLM(config=CFG, params=params, speculation="none", **SETTINGS)


def _prompts(seed, n, lo=2, hi=40):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, CFG.vocab_size, int(rng.integers(lo, hi))).tolist()} for _ in range(n)]


@pytest.fixture(scope="module")
def spec_llm(params, plain_llm):
    outs = plain_llm.generate(_prompts(99, 24), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                              use_tqdm=False)
    pairs = [(a, b) for o in outs for a, b in zip(o.outputs[0].token_ids, o.outputs[0].token_ids[1:])]
    return LLM(config=CFG, params=params, drafter=transition_drafter(CFG, pairs), speculation="dspark", **SETTINGS)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_speculation_is_on_with_a_drafter_and_off_without(spec_llm, plain_llm):
    assert spec_llm.speculation == "dspark" and spec_llm.stats["speculation"] == "dspark"
    assert plain_llm.speculation == "none"
    assert LLM._speculation(EngineConfig(), None) == "none"


def test_auto_defers_the_drafters_program_until_it_is_stored_or_wanted(params, plain_llm, spec_llm, tmp_path,
                                                                        monkeypatch):
    """A lazy engine under speculation="auto" starts with the accept-only program (no drafter compiled), drafts
    once drafting was wanted ``compile_after`` times, and a later engine finds that program stored and drafts
    at once; greedy tokens are plain decoding's throughout. A program store of its own (nothing stored yet)."""
    from deepinfer_jax import compile_cache

    monkeypatch.setattr(compile_cache, "cache_dir", lambda: tmp_path / "xla")  # the store: tmp_path/xla-programs
    prompts = _prompts(7, 12)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = _ids(plain_llm.generate(prompts, sp, use_tqdm=False))
    auto = LLM(config=CFG, params=params, drafter=spec_llm.drafter, **SETTINGS)
    step, spec = auto.runner.speculation, auto.engine.spec
    assert auto.speculation == "dspark" and not step.drafting_ready
    with plain_priced_out(spec):  # draft whatever the step times say (as in the test below)
        assert _ids(auto.generate(prompts, sp, use_tqdm=False)) == want
        assert spec.stats.steps_drafting == spec.stats.drafts_verified == 0 and step._draft_wants > 0
        assert auto.stats["spec_drafter_ready"] is False and spec_llm.stats["spec_drafter_ready"] is True
        assert step._accept_fn._programs and not step._sample_fn._programs  # the drafter was never compiled
        seeded = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=i, ignore_eos=True) for i in range(12)]
        assert _ids(auto.generate(prompts, seeded, use_tqdm=False)) == _ids(plain_llm.generate(prompts, seeded,
                                                                                                use_tqdm=False))
        step._draft_wants = auto.runner.bucket_use.compile_after - 3  # a long run: a few more wants, then it drafts
        # compiled here rather than answered by the suite's compilation cache, so that the store keeps it
        suite_cache = jax.config.jax_compilation_cache_dir
        compile_cache.enable(str(tmp_path / "fresh"))
        try:
            assert _ids(auto.generate(prompts, sp, use_tqdm=False)) == want
        finally:
            compile_cache.enable(suite_cache)
        assert step.drafting_ready and step._sample_fn._programs and auto.stats["spec_drafter_ready"]
        assert spec.stats.steps_drafting > 0 and spec.stats.drafts_accepted > 0

        # a later process, as far as the drafting program goes: not in memory, deferred again, but in the store
        step._sample_fn._programs.clear()
        step._sample_fn._absent.clear()
        step.drafting_ready, step._draft_wants, accepted = False, 0, spec.stats.drafts_accepted
        assert _ids(auto.generate(prompts, sp, use_tqdm=False)) == want
        assert step.drafting_ready and step._draft_wants <= 1 and step._sample_fn._programs  # loaded at the first step
        assert spec.stats.drafts_accepted > accepted


@pytest.mark.parametrize("policy", ["fixed1", "fixed5", "dspark"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_outputs_equal_decoding_without_speculation(spec_llm, plain_llm, policy, async_scheduling):
    prompts = _prompts(7, 12)
    sp = [SamplingParams(temperature=0.0, max_tokens=int(m), ignore_eos=True)
          for m in np.random.default_rng(3).integers(1, 40, len(prompts))]
    want = _ids(plain_llm.generate(prompts, sp, use_tqdm=False))
    engine = spec_llm.engine
    saved = engine.spec.policy, engine.async_scheduling
    try:
        if policy.startswith("fixed"):
            engine.spec.policy = FixedPolicy(int(policy[5:]))
        engine.async_scheduling = async_scheduling
        before = engine.spec.stats.drafts_accepted
        # dspark: draft whatever the step times say; stopping is a cost decision, losslessness is the point here
        with plain_priced_out(engine.spec):
            got = _ids(spec_llm.generate(prompts, sp, use_tqdm=False))
        accepted = engine.spec.stats.drafts_accepted - before
    finally:
        engine.spec.policy, engine.async_scheduling = saved
    assert got == want
    assert accepted > 0


def test_seeded_requests_do_not_depend_on_the_batch(spec_llm):
    """A request with its own seed verifies a fixed number of drafts (engine.md §2.5): its tokens are the
    same alone and among others, under the dynamic budget."""
    sp = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=24, seed=1234, ignore_eos=True)
    target = _prompts(1, 1)[0]
    alone = _ids(spec_llm.generate([target], sp, use_tqdm=False))[0]
    others = _prompts(2, 6)
    busy = spec_llm.generate(others[:3] + [target] + others[3:],
                             [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 3 + [sp]
                             + [SamplingParams(temperature=1.0, max_tokens=20)] * 3, use_tqdm=False)
    assert busy[3].outputs[0].token_ids == alone


def test_sampled_outputs_follow_the_same_distribution(spec_llm, plain_llm):
    """Two-sample chi-square over the first two tokens of 400 seeded samples each (top-k 3 keeps the
    table small): speculation changes which tokens a seed gives, never their distribution."""
    prompt = _prompts(11, 1, 6, 7)[0]
    n = 400

    def sample(llm):
        sp = [SamplingParams(temperature=1.0, top_k=3, max_tokens=2, seed=i, ignore_eos=True) for i in range(n)]
        return [tuple(ids) for ids in _ids(llm.generate([prompt] * n, sp, use_tqdm=False))]

    a, b = sample(plain_llm), sample(spec_llm)
    cells = sorted(set(a) | set(b))
    table = np.array([[a.count(c) for c in cells], [b.count(c) for c in cells]])
    table = table[:, table.sum(0) >= 5]
    assert table.shape[1] >= 3
    res = sps.chi2_contingency(table)
    assert res.pvalue > 1e-3, table
    assert spec_llm.engine.spec.stats.drafts_verified > 0


def test_prefix_cache_hits_stay_exact_with_speculation(spec_llm, plain_llm):
    """A second turn extending the first one's prompt + output hits the blocks (and the decode window
    copied when a verify row crossed a block boundary) and still decodes like the plain engine."""
    first = _prompts(21, 2, 30, 31)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    turn1 = spec_llm.generate(first, sp, use_tqdm=False)
    plain_llm.generate(first, sp, use_tqdm=False)
    tail = list(range(5, 25))  # 30 + 40 + 20 tokens: the hit rule allows 64 (the last decode boundary)
    second = [{"prompt_token_ids": p["prompt_token_ids"] + o.outputs[0].token_ids + tail} for p, o in zip(first, turn1)]
    got = spec_llm.generate(second, sp, use_tqdm=False)
    want = plain_llm.generate(second, sp, use_tqdm=False)
    assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in want] == [64, 64]
    assert _ids(got) == _ids(want)


def test_bad_speculation_settings_name_the_field(params):
    for bad, field in ((dict(speculation="maybe"), "speculation"), (dict(num_speculative_tokens=0),
                       "num_speculative_tokens"), (dict(draft_vocab_size=0), "draft_vocab_size"),
                       (dict(sharding="cpu-dp2-ep4", speculation="dspark", num_speculative_tokens=0),
                        "num_speculative_tokens")):  # speculation runs with DP; a bad count still names its field
        with pytest.raises(ValueError, match=field):
            EngineConfig(**bad)
    with pytest.raises(ValueError, match="drafter"):
        LLM(config=CFG, params=params, speculation="dspark", **SETTINGS)
    with pytest.raises(ValueError, match="num_speculative_tokens"):  # past the drafter's block size
        LLM(config=CFG, params=params, drafter=init_drafter_params(CFG), speculation="fixed",
            num_speculative_tokens=K + 1, **SETTINGS)
    with pytest.raises(ValueError, match="draft_vocab_size"):  # no draft_vocab.json to take it from
        LLM(config=CFG, params=params, drafter=init_drafter_params(CFG), speculation="dspark", draft_vocab_size=16,
            **SETTINGS)


def test_decoder_bounded_replay_with_speculation_equals_it_without(params, spec_llm):
    """Decoder bounded replay (YOCO prefill) under speculation: the verify tokens run every decoder layer
    over the features the replayed prompt tail captured; outputs equal the plain engine's with replay."""
    kw = dict(SETTINGS, token_buckets=(48,), decoder_replay=True, yoco_keep_tokens=16, enable_prefix_caching=False)
    drafter = spec_llm.drafter
    spec = LLM(config=CFG, params=params, drafter=drafter, speculation="dspark", **kw)
    plain = LLM(config=CFG, params=params, speculation="none", **kw)
    prompts = _prompts(31, 6, 20, 40)  # longer than the 16 kept tokens: the replay is approximate
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert _ids(spec.generate(prompts, sp, use_tqdm=False)) == _ids(plain.generate(prompts, sp, use_tqdm=False))
    assert spec.engine.spec.stats.drafts_accepted > 0
