"""The scheduler and the host loop against a fake model runner whose outputs are known.

The fake keeps, per slot, the token sequence whose KV the real cache would hold, checks that every
chunk continues it exactly (ctx_len, block capacity, the fed-back token), and answers with a
deterministic function of the whole sequence: any scheduling bug (a lost token, a wrong position,
a stale slot, a wrong fed-back id) changes the outputs.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from deepinfer_jax.engine import CostModel, EngineCore, RequestError, SamplingParams, Scheduler
from deepinfer_jax.runner import Buckets, StepOutput
from deepinfer_jax.tokenizer import load_tokenizer

VOCAB = 1000
EOS = 1


def next_token(seq: list[int]) -> int:
    h = 0
    for t in seq:
        h = (h * 1000003 + t + 7) % 2_147_483_647
    return 3 + h % (VOCAB - 3)


class _Pending:
    def __init__(self, results):
        self._results = results

    def result(self):
        return self._results

    def output(self):
        return StepOutput.plain(self._results)


class FakeRunner:
    def __init__(self, block_size: int, next_fn=next_token):
        self.cfg = SimpleNamespace(vocab_size=VOCAB)
        self.block_size, self.next_fn = block_size, next_fn
        self.kv: dict[int, list[int]] = {}
        self.last: dict[int, int] = {}
        self.steps: list[list] = []

    buckets = Buckets(requests=(1, 2, 4, 8, 16, 32, 64))

    def launch(self, chunks):
        return self.sample(self.forward(chunks))

    def forward(self, chunks):
        return SimpleNamespace(chunks=chunks, rows=Buckets.pick(self.buckets.requests, len(chunks), "requests"))

    def sample(self, fwd, mask=None):
        """The known model's token, or under a mask the first allowed id at or after it (cyclic)."""
        chunks = fwd.chunks
        self.steps.append(chunks)
        assert len({c.slot for c in chunks}) == len(chunks)
        assert mask is None or mask.shape[0] == fwd.rows
        results = []
        for i, c in enumerate(chunks):
            toks = list(c.token_ids)
            if c.feed_last:
                assert len(toks) == 1
                toks[0] = self.last[c.slot]
            seq = self.kv.setdefault(c.slot, [])
            assert c.ctx_len <= len(seq), "the chunk skips tokens"
            del seq[c.ctx_len:]
            seq.extend(toks)
            assert len(c.block_table) * self.block_size >= len(seq)
            if c.sample is None:
                results.append(None)
                continue
            tok = self.next_fn(seq)
            if mask is not None:
                allowed = np.unpackbits(mask[i].view(np.uint8), bitorder="little")[:VOCAB].astype(bool)
                assert allowed.any(), "a row with no allowed token reached the device"
                tok = int(np.roll(np.arange(VOCAB), -tok)[np.roll(allowed, -tok)][0])
            self.last[c.slot] = tok
            results.append((tok, -1.0, np.array([tok]), np.array([-1.0])))
        return _Pending(results)


def make_engine(*, num_blocks=64, block_size=4, max_seqs=4, max_len=256, budget=16, chunking="tokens",
                cost_model=None, step_budget_ns=None, async_scheduling=False, tokenizer=None, next_fn=next_token):
    sched = Scheduler(num_blocks=num_blocks, block_size=block_size, max_blocks_per_request=max_len // block_size,
                      max_num_seqs=max_seqs, max_model_len=max_len, max_num_batched_tokens=budget,
                      chunking=chunking, cost_model=cost_model, step_budget_ns=step_budget_ns)
    runner = FakeRunner(block_size, next_fn)
    return EngineCore(runner, sched, tokenizer=tokenizer, eos_token_id=EOS, async_scheduling=async_scheduling), runner


def run_all(engine, prompts, params, order=None):
    order = list(range(len(prompts))) if order is None else order
    rids = {engine.add_request(prompts[i], params[i] if isinstance(params, list) else params): i for i in order}
    done = {}
    for _ in range(10_000):
        for out in engine.step():
            done[rids[out.request_id]] = out
        if not engine.has_unfinished:
            break
    assert len(done) == len(prompts)
    return [done[i] for i in range(len(prompts))]


def reference(prompt, max_tokens, eos=True):
    seq, out = list(prompt), []
    while len(out) < max_tokens:
        tok = next_token(seq)
        out.append(tok)
        seq.append(tok)
        if eos and tok == EOS:
            break
    return out


def prompts_mix(rng, n, lo=1, hi=60):
    return [rng.integers(3, VOCAB, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_outputs_equal_the_known_model_for_any_mix(async_scheduling):
    rng = np.random.default_rng(0)
    prompts = prompts_mix(rng, 13)
    params = [SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 20))) for _ in prompts]
    engine, runner = make_engine(async_scheduling=async_scheduling)
    outs = run_all(engine, prompts, params)
    for p, sp, o in zip(prompts, params, outs):
        assert o.outputs[0].token_ids == reference(p, sp.max_tokens)
        assert o.outputs[0].finish_reason == "length"
    assert engine.scheduler.pool.used_count == 0 and len(engine.scheduler.free_slots) == 4
    assert max(sum(len(c.token_ids) for c in step) for step in runner.steps) <= 16
    assert max(len(step) for step in runner.steps) <= 4


def test_chunks_follow_the_token_budget():
    engine, runner = make_engine(budget=16, max_seqs=2)
    run_all(engine, [list(range(3, 103))], SamplingParams(temperature=0, max_tokens=3))
    sizes = [len(step[0].token_ids) for step in runner.steps]
    assert sizes == [16] * 6 + [4, 1, 1]


def test_chunks_follow_the_cost_model():
    """Same budget, longer cached prefix -> smaller chunks; every step fits its time budget."""
    cm = CostModel((1000.0, 100.0, 2.0, 0.5))
    engine, runner = make_engine(budget=64, chunking="cost", cost_model=cm, step_budget_ns=6000, max_len=512,
                                 num_blocks=128)
    cm.observe = lambda *a, **k: None  # keep the coefficients fixed for this test
    run_all(engine, [list(range(3, 303))], SamplingParams(temperature=0, max_tokens=2))
    sizes = [len(step[0].token_ids) for step in runner.steps]
    starts = [step[0].ctx_len for step in runner.steps]
    prefill = sizes[:-1]
    assert sum(prefill) == 300
    assert all(a >= b for a, b in itertools.pairwise(prefill)), sizes  # shrinking with the prefix
    assert prefill[0] > 2 * prefill[-2]
    for q, c in zip(prefill, starts):
        assert cm.predict([(q, c)]) <= 6000
        assert cm.predict([(q + 1, c)]) > 6000 or q == 300 - c or q == 64  # the largest that fits


def test_cost_model_fit_recovers_coefficients_and_solves_for_q():
    true = np.array([5e5, 2e3, 3.0, 1.5])
    rng = np.random.default_rng(1)
    steps = [[(int(rng.integers(1, 200)), int(rng.integers(0, 2000))) for _ in range(int(rng.integers(1, 4)))]
             for _ in range(60)]
    times = [float(true @ np.array([1, sum(q for q, _ in s), sum(q * c for q, c in s), sum(q * q for q, _ in s)]))
             for s in steps]
    cm = CostModel()
    cm.fit(steps, times)
    assert np.allclose(cm.coef, true, rtol=1e-6)
    q = cm.largest_q(1e6, 500, 10_000)
    assert cm.chunk_cost(q, 500) <= 1e6 < cm.chunk_cost(q + 1, 500)
    for s, t in zip(steps, times):
        cm.observe(s, t)
    assert cm.mean_relative_error < 1e-6 and cm.num_refits > 0
    with pytest.raises(ValueError, match="coef"):
        CostModel((1.0, 2.0))


def test_preemption_and_resume_give_identical_tokens():
    rng = np.random.default_rng(2)
    prompts = prompts_mix(rng, 8, 10, 40)
    sp = SamplingParams(temperature=0, max_tokens=24)
    want = [reference(p, 24) for p in prompts]
    for async_scheduling in (False, True):
        engine, _ = make_engine(num_blocks=20, block_size=4, max_seqs=4, async_scheduling=async_scheduling)
        outs = run_all(engine, prompts, sp)
        assert engine.stats.preemptions > 0
        assert [o.outputs[0].token_ids for o in outs] == want
        assert engine.scheduler.pool.used_count == 0


def test_admission_is_fcfs_and_nothing_starves():
    """A long request behind short ones is admitted in its turn, and short ones arriving later
    never jump ahead of it while it waits for blocks."""
    engine, _runner = make_engine(num_blocks=24, block_size=4, max_seqs=3, budget=16)
    rng = np.random.default_rng(3)
    long_prompt = list(range(3, 70))
    engine.add_request(prompts_mix(rng, 1, 5, 10)[0], SamplingParams(temperature=0, max_tokens=30))
    rid_long = engine.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=4))
    seen, finished, order = set(), {}, []
    for step in range(2000):
        if step % 2 == 0 and step < 200:
            engine.add_request(prompts_mix(rng, 1, 2, 6)[0], SamplingParams(temperature=0, max_tokens=3))
        for out in engine.step():
            finished[out.request_id] = out
        for r in engine.scheduler.running:
            if r.request_id not in seen:
                seen.add(r.request_id)
                order.append(int(r.request_id))
        if not engine.has_unfinished:
            break
    assert rid_long in finished and finished[rid_long].outputs[0].token_ids == reference(long_prompt, 4)
    assert order == sorted(order), "admission left arrival order"
    assert len(finished) == len(engine.requests)


def scripted(scripts):
    """A model that, after a prompt starting with marker m, emits scripts[m] token by token."""

    def fn(seq):
        script = scripts[seq[0]]
        return script[min(len(seq) - PROMPT_LEN, len(script) - 1)]

    return fn


PROMPT_LEN = 3


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stops_eos_stop_ids_strings_length(async_scheduling):
    tok = load_tokenizer()
    ids = tok.encode("Hello world, the stop sequence END is here.", add_special_tokens=False).ids
    assert len(ids) > 6
    scripts = {
        10: [5, 6, EOS, 7, 8],  # EOS
        11: [5, 6, 42, 7, 8],  # stop token id 42
        12: ids + [9] * 5,  # stop string "stop seq" spans several tokens
        13: [5] * 50,  # max_tokens
        14: [5] * 50,  # the context limit
        15: [5, 6, EOS, 7, 8],  # ignore_eos
    }
    engine, _ = make_engine(async_scheduling=async_scheduling, tokenizer=tok, max_len=40, next_fn=scripted(scripts))
    engine.vocab_size = 200_000  # the scripted ids come from the real tokenizer
    prompts = [[m, 3, 4] for m in scripts]
    params = [SamplingParams(temperature=0, max_tokens=20), SamplingParams(temperature=0, stop_token_ids=[42]),
              SamplingParams(temperature=0, max_tokens=30, stop=["zzz", "stop seq"]),
              SamplingParams(temperature=0, max_tokens=7), SamplingParams(temperature=0, max_tokens=None),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    outs = run_all(engine, prompts, params)
    got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs]
    assert got[0] == ([5, 6, EOS], "stop", None)
    assert got[1] == ([5, 6, 42], "stop", 42)
    text = tok.decode(ids)
    cut = text.index("stop seq")
    assert outs[2].outputs[0].text == text[:cut] and got[2][1:] == ("stop", "stop seq")
    n = len(tok.encode(text[: cut + len("stop seq")], add_special_tokens=False).ids)
    assert got[2][0] == ids[:n]
    assert got[3] == ([5] * 7, "length", None)
    assert got[4] == ([5] * (40 - PROMPT_LEN), "length", None)
    assert got[5] == ([5, 6, EOS, 7, 8], "length", None)


def test_bad_requests_raise_before_anything_runs_and_leave_the_engine_intact():
    rng = np.random.default_rng(4)
    prompts = prompts_mix(rng, 5, 5, 30)
    sp = SamplingParams(temperature=0, max_tokens=12)
    engine, _ = make_engine(max_len=64)
    rids = [engine.add_request(p, sp) for p in prompts]
    for _ in range(5):
        engine.step()
    state = (engine.scheduler.pool.used_count, len(engine.scheduler.waiting), len(engine.scheduler.running))
    bad = [([], sp, "prompt"), ([3] * 64, sp, "prompt"), ([3, VOCAB], sp, "prompt_token_ids"),
           (["x"], sp, "prompt_token_ids"), ([3, 4], "greedy", "sampling_params"),
           ([3, 4], SamplingParams(logprobs=50), "logprobs"),
           ([3, 4], SamplingParams(stop_token_ids=[VOCAB + 5]), "stop_token_ids")]
    for ids, params, field in bad:
        with pytest.raises(RequestError) as e:
            engine.add_request(ids, params)
        assert e.value.field == field
    assert state == (engine.scheduler.pool.used_count, len(engine.scheduler.waiting), len(engine.scheduler.running))
    done = {}
    while engine.has_unfinished:
        done.update({o.request_id: o for o in engine.step()})
    assert [done[r].outputs[0].token_ids for r in rids] == [reference(p, 12) for p in prompts]


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"min_p": 1.1}, "min_p"), ({"max_tokens": 0}, "max_tokens"), ({"stop": [""]}, "stop"), ({"stop": 5}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"seed": -1}, "seed"), ({"seed": 2**32}, "seed"),
    ({"logprobs": -1}, "logprobs"), ({"ignore_eos": 1}, "ignore_eos"),
])
def test_sampling_params_validate_on_construction(kwargs, field):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and isinstance(e.value, ValueError)


def test_online_refit_stays_sane_on_look_alike_steps():
    """A window of decode-only steps (sum q == sum q**2) cannot identify the coefficients alone;
    the profiled base steps and the ridge prior keep the refit close to the truth."""
    true = np.array([2e6, 1e5, 50.0, 200.0])

    def t(s):
        return float(true @ np.array([1, sum(q for q, _ in s), sum(q * c for q, c in s), sum(q * q for q, _ in s)]))

    base = [[(q, c)] for q in (1, 16, 64, 128) for c in (0, 256, 1024)]
    cm = CostModel(refit_every=8)
    cm.fit(base, [t(s) for s in base], base=True)
    rng = np.random.default_rng(5)
    for _ in range(64):
        s = [(1, int(rng.integers(0, 1024)))] * int(rng.integers(1, 8))
        cm.observe(s, t(s) * (1 + 0.02 * rng.standard_normal()))
    assert cm.num_refits >= 4
    assert np.allclose(cm.coef, true, rtol=0.2), cm.coef
    assert cm.mean_relative_error < 0.05
