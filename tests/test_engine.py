"""The engine end to end on a 5-layer cut of the tiny config (``tests/cut_model.py``: every attention role, the
encoder/decoder split, Engram; the 12-layer schedule is ``test_paged_step.py``'s): greedy equals a ``forward_full``
argmax loop, batch invariance, async on/off, the jitted ``generate``, logprobs, bad input."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from cut_model import tiny_cut
from test_paged_step import robust_params

from deepinfer_jax import LLM, RequestError, SamplingParams, forward_full, generate, generate_ragged, pad_prompts
from deepinfer_jax.model import generate as generate_module
from deepinfer_jax.cache.block_store import StoreError

CFG = tiny_cut()
MAX_LEN = 128


@pytest.fixture(scope="module")
def params():
    return robust_params(cfg=CFG)


@pytest.fixture(scope="module")
def llm(params):
    return LLM(config=CFG, params=params, max_num_seqs=32, max_num_batched_tokens=64, token_buckets=(32, 64),
               block_size=16, max_model_len=MAX_LEN, chunking="tokens", use_tqdm=False, precompile="all")


@pytest.fixture(scope="module")
def fwd():
    return jax.jit(forward_full, static_argnums=1)


def _prompts(seed, n, lo=2, hi=60):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, CFG.vocab_size, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _run(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_greedy_equals_a_forward_full_argmax_loop(llm, params, fwd):
    prompts = _prompts(0, 5)
    n_new = 8
    traces = llm.runner.traces
    outs = _run(llm, prompts, SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True))
    for p, o in zip(prompts, outs):
        seq = list(p)
        for _ in range(n_new):
            padded = np.zeros((1, MAX_LEN), np.int32)
            padded[0, : len(seq)] = seq  # causal: the padding after the sequence changes nothing
            seq.append(int(np.argmax(np.asarray(fwd(params, CFG, padded))[0, len(seq) - 1])))
        assert o.outputs[0].token_ids == seq[len(p):]
        assert o.outputs[0].finish_reason == "length" and o.prompt_token_ids == p
        assert o.metrics.ttft is not None and o.metrics.ttft >= 0
    assert llm.runner.traces == traces, "the engine recompiled after start-up"


def test_batch_invariance_alone_and_in_shuffled_batches(llm):
    prompts = _prompts(1, 32)
    rng = np.random.default_rng(2)
    params = [SamplingParams(temperature=0, max_tokens=int(rng.integers(3, 12)), ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.9, top_p=0.9, top_k=40, min_p=0.02, seed=i, max_tokens=int(rng.integers(3, 12)),
                             ignore_eos=True)
              for i in range(32)]
    alone = [_ids(_run(llm, [p], sp))[0] for p, sp in zip(prompts, params)]
    assert len({tuple(a) for a in alone}) == 32
    for size in (2, 7, 32):
        order = rng.permutation(32)[:size]
        got = _ids(_run(llm, [prompts[i] for i in order], [params[i] for i in order]))
        assert got == [alone[i] for i in order], f"batch of {size}"


def test_async_on_and_off_give_identical_outputs(llm):
    prompts = _prompts(3, 12)
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=10) for i in range(12)]
    params[3] = SamplingParams(temperature=0.7, seed=3, max_tokens=10, stop_token_ids=list(range(0, 512, 3)))
    results = []
    for mode in (True, False):
        llm.engine.async_scheduling = mode
        try:
            results.append([(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in _run(llm, prompts, params)])
        finally:
            llm.engine.async_scheduling = True
    assert results[0] == results[1]
    assert results[0][3][1] == "stop"  # a request stopping early while others go on


def test_jitted_generate_equals_the_engine(llm, params):
    """A user's own ``jax.jit(generate)`` over a [B, T] batch with per-row lengths, [B] sampling settings and a
    run-time token count (the shapes ``generate_ragged`` uses for these prompts, so the persistent compilation
    cache shares the program with the next test): greedy rows equal the engine's; the columns past the count
    hold -1; new settings, keys and counts reuse the one program."""
    prompts = _prompts(7, 3, 3, 40)
    ids, lens = pad_prompts(prompts, batch_to=4)
    gen = jax.jit(generate, static_argnames=("cfg", "max_new_tokens", "storage", "stop_at_eos"))
    width = generate_module.new_tokens_width(6)

    def run(key, temperature, count=6):
        settings = (np.full(4, temperature, np.float32), np.ones(4, np.float32), np.zeros(4, np.int32),
                    np.zeros(4, np.float32))
        out = np.asarray(gen(params, CFG, ids, jax.random.key(key), width, *settings, prompt_lengths=lens,
                             new_tokens=count, stop_at_eos=False))[:3]
        assert (out[:, count:] == -1).all() and (out[:, :count] >= 0).all()
        return out[:, :count].tolist()

    toks = run(0, 0.0)
    assert gen._cache_size() == 1
    assert toks == _ids(_run(llm, prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
    sampled, again = run(1, 1.0), run(1, 1.0)  # other settings and key: the same compiled program
    assert sampled == again and sampled != toks
    longer = run(0, 0.0, count=9)  # another count: the same program, and the first 6 tokens as before
    assert [row[:6] for row in longer] == toks and gen._cache_size() == 1
    with pytest.raises(ValueError, match="new_tokens must lie in"):  # checked where it is known (not traced)
        generate(params, CFG, ids, jax.random.key(0), width, prompt_lengths=lens, new_tokens=width + 1)


def test_ragged_generate_equals_the_engine_per_prompt_and_settings_never_recompile(llm, params):
    """Rows of different lengths: no padding reaches the model (each row equals the engine's output for
    that prompt alone, which left-padding with BOS would change); new sampling values reuse the program."""
    prompts = _prompts(7, 3, 3, 40)
    assert len({len(p) for p in prompts}) == 3
    want = [_ids(_run(llm, [p], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))[0] for p in prompts]
    got = generate_ragged(params, CFG, prompts, 6, stop_at_eos=False)
    assert got == want
    program = generate_module._ragged_program()  # its programs, stored (runner/program_store.StoredLowering)
    compiled = program.programs
    sampled = generate_ragged(params, CFG, prompts, 6, key=jax.random.key(3), temperature=[0.0, 1.0, 1.0], top_p=0.9,
                              top_k=20, stop_at_eos=False)
    assert program.programs == compiled, "new sampling settings recompiled"
    assert sampled[0] == want[0] and sampled[1:] != want[1:]  # the greedy row stays greedy
    # another token count within the program's width (64): no recompile, and the same first tokens
    longer = generate_ragged(params, CFG, prompts, 9, stop_at_eos=False)
    assert program.programs == compiled, "another max_new_tokens recompiled"
    assert [len(r) for r in longer] == [9] * 3 and [r[:6] for r in longer] == want
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
            generate_ragged(params, CFG, prompts, bad)
    room = CFG.max_position_embeddings - max(len(p) for p in prompts)
    with pytest.raises(ValueError, match=f"max_new_tokens must fit the model's context.* at most {room} new"):
        generate_ragged(params, CFG, prompts, room + 1)  # refused before anything compiles
    ids, lens = pad_prompts(prompts)
    assert ids.shape[1] % 16 == 0 and lens.tolist() == [len(p) for p in prompts]
    # a rectangular [B, T] batch with per-row lengths through the public jitted ``generate`` (the batch padded to
    # the ragged call's 4 rows and the settings given as [B] arrays: the same program)
    ids, lens = pad_prompts(prompts, batch_to=4)
    greedy = (np.zeros(4, np.float32), np.ones(4, np.float32), np.zeros(4, np.int32), np.zeros(4, np.float32))
    rect = np.asarray(generate_module._jitted(params, CFG, ids, jax.random.key(0), 64, *greedy, prompt_lengths=lens,
                                              new_tokens=6, storage="quantized", stop_at_eos=False))
    assert rect[:3, :6].tolist() == want


def test_generate_ragged_compiles_64_128_256_wide_programs():
    widths = [generate_module.new_tokens_width(n) for n in (1, 24, 64, 65, 128, 129, 300)]
    assert widths == [64, 64, 64, 128, 128, 256, 512]


@pytest.mark.parametrize("bad, field", [([], "at least one"), ([[1, 2], []], "prompts[1]"), ([[1, 2.5]], "prompts[0]"),
                                        ([[1, 10**6]], "prompts[0]")])
def test_pad_prompts_names_the_bad_row(bad, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[")):
        pad_prompts(bad, vocab_size=CFG.vocab_size)


def test_logprobs_match_the_model(llm, params, fwd):
    p = _prompts(5, 1, 10, 11)[0]
    out = _run(llm, [p], SamplingParams(temperature=0, max_tokens=3, logprobs=3, ignore_eos=True))[0].outputs[0]
    padded = np.zeros((1, MAX_LEN), np.int32)
    seq = p + out.token_ids
    padded[0, : len(seq)] = seq
    logits = np.asarray(fwd(params, CFG, padded))[0].astype(np.float64)
    for i, lp in enumerate(out.logprobs):
        row = logits[len(p) - 1 + i]
        ref = row - row.max() - np.log(np.exp(row - row.max()).sum())
        assert lp.token_id == out.token_ids[i] and abs(lp.logprob - ref[lp.token_id]) < 1e-4
        assert list(lp.top) == list(np.argsort(-ref, kind="stable")[:3])
        assert all(abs(v - ref[k]) < 1e-4 for k, v in lp.top.items())


def test_prompt_logprobs_agree_with_the_generated_ones_and_the_model(llm, params, fwd):
    p = _prompts(6, 1, 20, 21)[0]
    gen = _run(llm, [p], SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True))[0]
    assert gen.prompt_logprobs is None  # off unless asked
    g = gen.outputs[0]
    seq = p + g.token_ids[:-1]
    scored = _run(llm, [seq], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))[0]
    plp = scored.prompt_logprobs
    assert len(plp) == len(seq) and plp[0] is None
    assert [e.token_id for e in plp[1:]] == seq[1:]
    # the paged step's logprobs of the greedy tokens = the full pass's at those prompt positions
    for j, lp in enumerate(g.logprobs[:-1]):
        e = plp[len(p) + j]
        assert e.token_id == lp.token_id and abs(e.logprob - lp.logprob) < 1e-4
        assert list(e.top)[0] == lp.token_id and len(e.top) == 3
    # and the model's log_softmax at every position (float64 reference from forward_full)
    padded = np.zeros((1, MAX_LEN), np.int32)
    padded[0, : len(seq)] = seq
    logits = np.asarray(fwd(params, CFG, padded))[0].astype(np.float64)
    for t in range(1, len(seq)):
        row = logits[t - 1]
        ref = row - row.max() - np.log(np.exp(row - row.max()).sum())
        assert abs(plp[t].logprob - ref[seq[t]]) < 1e-4
        assert list(plp[t].top) == list(np.argsort(-ref, kind="stable")[:3])
    streamed = list(llm.generate_stream([{"prompt_token_ids": seq}], SamplingParams(max_tokens=2, prompt_logprobs=1)))
    assert streamed[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in streamed[1:])


@pytest.mark.parametrize("value, message", [(-1, "prompt_logprobs"), (6, "max_logprobs"), (1.5, "prompt_logprobs")])
def test_bad_prompt_logprobs_are_named(llm, value, message):
    with pytest.raises(RequestError, match=message):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(prompt_logprobs=value), use_tqdm=False)


def test_bad_input_raises_before_anything_runs_and_leaves_running_requests_alone(llm):
    prompts = _prompts(6, 3)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = _ids(_run(llm, prompts, sp))
    engine = llm.engine
    rids = [engine.add_request(p, sp) for p in prompts]
    engine.step()
    engine.step()
    steps = engine.stats.steps
    bad = [
        ([{"prompt_token_ids": [5, 6]}, ""], "prompts[1].prompt"),
        ([{"prompt_token_ids": [5] * MAX_LEN}], "prompts[0].prompt"),
        ([{"prompt_token_ids": []}], "prompts[0].prompt"),
        ([{"prompt_token_ids": [5, CFG.vocab_size]}], "prompts[0].prompt_token_ids"),
        ([{"tokens": [5]}], "prompts[0].prompt"),
        ([42], "prompts[0].prompt"),
    ]
    for prompts_bad, field in bad:
        with pytest.raises(RequestError) as e:
            llm.generate(prompts_bad, sp, use_tqdm=False)
        assert e.value.field == field
    with pytest.raises(RequestError, match="sampling_params"):
        llm.generate([{"prompt_token_ids": [5]}] * 2, [sp], use_tqdm=False)
    with pytest.raises(RequestError, match="logprobs"):
        llm.generate([{"prompt_token_ids": [5]}], SamplingParams(logprobs=6), use_tqdm=False)
    assert engine.stats.steps == steps, "a rejected request ran a step"
    done = {}
    while engine.has_unfinished:
        done.update({o.request_id: o for o in engine.step()})
    assert [done[r].outputs[0].token_ids for r in rids] == want


def test_unknown_engine_setting_is_named():
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM("tiny", max_num_seq=3)
    with pytest.raises(ValueError, match="chunking"):
        LLM("tiny", chunking="fast")


def _cold(llm, prompts, params):
    """The same engine with the prefix cache switched off."""
    sched = llm.engine.scheduler
    prefix, sched.prefix = sched.prefix, None
    try:
        return _run(llm, prompts, params)
    finally:
        sched.prefix = prefix


def _lps(out):
    return [(lp.token_id, lp.logprob, tuple(lp.top.items())) for lp in out.outputs[0].logprobs]


def test_prefix_cache_hits_are_bit_identical_to_cold_runs(llm):
    rng = np.random.default_rng(7)
    prompt = rng.integers(3, CFG.vocab_size, 75).tolist()
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    first, second = _run(llm, [prompt], sp)[0], _run(llm, [prompt], sp)[0]
    # L = 75, ring 8 + 6 = 14: a repeat hits floor((75 - 14) / 16) * 16 = 48 tokens
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 48
    assert _lps(second) == _lps(first)
    follow = prompt + first.outputs[0].token_ids + rng.integers(3, CFG.vocab_size, 30).tolist()
    hit = _run(llm, [follow], sp)[0]
    # the first run's 75 + 6 tokens filled 5 blocks (the fifth in its last step) and kept the window at 80
    assert hit.num_cached_tokens == 80
    cold = _cold(llm, [follow], sp)[0]
    # the producer computed rows 48..79 in other chunk shapes than a cold run does; the step's rows
    # are batch-shape independent only up to rounding (test_paged_step), so here: equal tokens and
    # logprobs within 1e-5 (bit-identical when the chunkings agree, as for the repeat above)
    assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
    assert max(abs(a[1] - b[1]) for a, b in zip(_lps(hit), _lps(cold))) < 1e-5


def test_a_turn_whose_last_block_fills_in_its_last_step_leaves_that_block_cached(llm):
    """A request of 4 * 16 + 1 tokens: its fourth block is complete only once its last step ran, after the
    scheduler gave its slot back (asynchronous scheduling: certain to finish); the block is indexed at the
    finish, so the next turn of the conversation hits all 64 tokens (the window kept at 64), not only the
    prefill's 16. Before, that block was lost to the cache."""
    rng = np.random.default_rng(11)
    prompt = rng.integers(3, CFG.vocab_size, 30).tolist()
    first = _run(llm, [prompt], SamplingParams(temperature=0, max_tokens=35, ignore_eos=True))[0]
    follow = prompt + first.outputs[0].token_ids + rng.integers(3, CFG.vocab_size, 20).tolist()
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    hit = _run(llm, [follow], sp)[0]
    assert len(prompt) + len(first.outputs[0].token_ids) == 65 and hit.num_cached_tokens == 64
    assert _ids([hit]) == _ids(_cold(llm, [follow], sp))
    assert llm.engine.scheduler.pool.used_count == 0  # every block back in the pool (the kept ones at the finish)


def test_a_request_shares_the_blocks_of_a_running_request(llm):
    rng = np.random.default_rng(8)
    base = rng.integers(3, CFG.vocab_size, 70).tolist()
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    eng, pool = llm.engine, llm.engine.scheduler.pool
    a = eng.add_request(base, sp)
    while eng.requests[a].num_computed < len(base):
        eng.step()
    eng.step()  # the step that saved the window at P = 64 is reconciled
    b = eng.add_request(base + rng.integers(3, CFG.vocab_size, 20).tolist(), sp)
    eng.step()
    ra, rb = eng.requests[a], eng.requests[b]
    assert not ra.finished and rb.num_cached_tokens == 64
    shared = rb.blocks.block_ids[:4]
    assert shared == ra.blocks.block_ids[:4] and all(pool.refcount(x) == 2 for x in shared)
    done = {}
    while eng.has_unfinished:
        done.update({o.request_id: o for o in eng.step()})
    eng.requests.pop(a), eng.requests.pop(b)
    assert _ids([done[b]]) == _ids(_cold(llm, [rb.prompt_ids], sp))


def test_encoder_bounded_replay_reuses_blocks_and_caches_nothing(llm):
    rng = np.random.default_rng(9)
    prompt, *others = [rng.integers(3, CFG.vocab_size, 75).tolist() for _ in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    prefix = llm.engine.scheduler.prefix
    cold = _run(llm, [prompt], sp)[0]
    colds = [cold] + [_run(llm, [p], sp)[0] for p in others]
    blocks = prefix.pool.lookup(prefix.digests(_digest_req(prompt)))[:3]
    before = jax.tree.map(lambda a: np.asarray(a)[np.asarray(blocks)], llm.runner.cache["global"])
    prefix.snapshots._items.clear()  # the windows are gone: an exact hit is impossible
    assert _run(llm, [prompt], sp)[0].num_cached_tokens == 0
    prefix.encoder_replay = True
    try:
        # replaying the whole hit prefix is exact: the plumbing (reused blocks, no rewrites) is right
        prefix.replay_tokens = 10**6
        prefix.snapshots._items.clear()  # (the cold run above saved windows again)
        full = _run(llm, [prompt], sp)[0]
        assert full.num_cached_tokens == 48 and full.outputs[0].token_ids == cold.outputs[0].token_ids
        assert max(abs(a[1] - b[1]) for a, b in zip(_lps(full), _lps(cold))) < 1e-5
        # a bounded replay is approximate, and nothing of it enters the cache; it replays a single token here, as
        # on this 3-layer encoder a window's replay comes within ~2e-5 of exact (test_replay_research measures
        # the truncation on the 12-layer model)
        prefix.replay_tokens = 1
        assert len(prefix.snapshots) == 0  # the replayed request saved none
        registered, register = [], prefix.pool.register
        prefix.pool.register = lambda b, d: registered.append(d) or register(b, d)
        snaps = prefix.snapshots.saved
        try:
            approx = [_run(llm, [p], sp)[0] for p in [prompt] + others]
        finally:
            del prefix.pool.register
        assert all(a.num_cached_tokens == 48 and len(a.outputs[0].token_ids) == 6 for a in approx)
        err = max(abs(x[1] - y[1]) for a, c in zip(approx, colds) for x, y in zip(_lps(a), _lps(c)))
        assert err > 1e-4  # truncation is real
        assert registered == [] and prefix.snapshots.saved == snaps
    finally:
        prefix.encoder_replay, prefix.replay_tokens = False, CFG.sliding_window
    after = jax.tree.map(lambda a: np.asarray(a)[np.asarray(blocks)], llm.runner.cache["global"])
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


def _digest_req(prompt):
    from deepinfer_jax.engine.request import Request

    return Request("probe", 0, None, prompt, SamplingParams(), None)


def test_restarted_engine_hits_the_block_store(params, tmp_path):
    # the module engine's settings (so its compiled step programs serve these engines), plus the store
    kw = dict(config=CFG, params=params, max_num_seqs=32, max_num_batched_tokens=64, token_buckets=(32, 64),
              block_size=16, max_model_len=MAX_LEN, chunking="tokens", use_tqdm=False, block_store=str(tmp_path))
    prompt = np.random.default_rng(10).integers(3, CFG.vocab_size, 75).tolist()
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    writer = LLM(**kw)
    first = _run(writer, [prompt], sp)[0]
    writer.flush()
    assert len(list(tmp_path.rglob("*.blk"))) == 4  # the 4 full blocks of 75 + 5 tokens
    # a new engine: block KV from the store, the window (never stored) rebuilt by bounded replay
    restarted = LLM(**kw, encoder_replay=True)
    again = _run(restarted, [prompt], sp)[0]
    assert again.num_cached_tokens == 48 and len(again.outputs[0].token_ids) == 5
    assert first.num_cached_tokens == 0
    assert writer.stats["prefix"]["miss_reasons"]["no_cached_blocks"] == 1
    assert restarted.stats["prefix"]["tier_hits"] == {"device": 0, "host": 0, "file": 3}
    assert restarted.stats["prefix"]["hits"] == 1 and restarted.stats["prefix"]["hit_tokens"] == 48
    (tmp_path / "blocker").write_text("a file where the store's directory should be")
    bad = str(tmp_path / "blocker" / "store")
    with pytest.raises(StoreError, match="not writable"):
        LLM(**{**kw, "block_store": bad})
    fallback = LLM(**{**kw, "block_store": bad, "block_store_fallback": True})
    assert fallback.engine.scheduler.prefix.files is None
