"""Prefix caching and decoder bounded replay in the attention data-parallel engine against one device, on 8 fake
CPU devices.

Run from the repository root with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``:
``python tests/sharded/dp_prefix_check.py PRESET [PRESET ...]``. Per preset, one JSON row ``prefix_<preset>``:
three batches of greedy requests sharing a prefix (the second repeats and extends the first in another order,
so requests land on other ranks than the ones that computed their prefix; the third repeats the second through
the synchronous loop) through the one-device engine and the DP engine, both with prefix caching: whether the
token ids and finish reasons are equal, the largest logprob difference, every request's ``num_cached_tokens``
in both, the DP engine's prefix counters (summed and per rank) and whether anything recompiled. Then one row
``decoder_<preset>``: ``decoder_replay=True`` with prompts shorter and longer than the kept tokens, against the
one-device engine with the same setting. Then one row ``spec_<preset>``: speculative decoding (``speculation=
"dspark"`` with a drafter that often agrees with the model; greedy requests with and without their own seed, so
forced counts and the confidence-driven budget both run) through the asynchronous, then the synchronous loop,
against the one-device speculative engine and plain greedy decoding, with the per-rank acceptance counters and
the error for a ``num_speculative_tokens`` past the drafter's block size. Then the same model written as a
quantized checkpoint, loaded with quantized-resident weights (``quantized_rows``). Then ``{"check": "done"}``.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import numpy as np
from dp_engine_check import SETTINGS, compare, summary
from shard_common import model_and_inputs

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.model.dspark import init_drafter_params
from deepinfer_jax.model.host_arrays import to_device

PREFIX_SETTINGS = {**SETTINGS, "enable_prefix_caching": True}
SPEC_SETTINGS = {**SETTINGS, "speculation": "dspark", "num_speculative_tokens": 2}
DECODER_SETTINGS = {**PREFIX_SETTINGS, "decoder_replay": True, "yoco_keep_tokens": 4}  # fewer than the window (8)


def prefix_batches(vocab: int) -> list[list[dict]]:
    """Three batches: prompts sharing a 36-token prefix and unrelated ones; the second batch repeats the first's
    prompts in another order (so the DP router puts them on other ranks) and adds a new continuation of the
    shared prefix; the third is the second again."""
    rng = np.random.default_rng(11)
    draw = lambda n: rng.integers(3, vocab, n).tolist()
    base = draw(36)
    first = [base + draw(12), draw(40), base + draw(8), draw(20), base + draw(4)]
    second = [first[1], first[0], first[4], base + draw(10), first[2], first[3]]
    return [[{"prompt_token_ids": p} for p in batch] for batch in (first, second, second)]


def run_batches(llm, batches, sp, sync_last: bool) -> tuple[list[dict], list[int]]:
    outs, cached = [], []
    for i, batch in enumerate(batches):
        if sync_last and i == len(batches) - 1:
            llm.engine.async_scheduling = False
        got = llm.generate(batch, sp, use_tqdm=False)
        outs += summary(got)
        cached += [o.num_cached_tokens for o in got]
    return outs, cached


#: One-device references by row kind: the same settings and prompts for every preset, so computed once.
_REFERENCES: dict[str, tuple] = {}


def reference(kind: str, make) -> tuple:
    if kind not in _REFERENCES:
        _REFERENCES[kind] = make()
    return _REFERENCES[kind]


def prefix_row(cfg, params, preset: str, sp) -> None:
    start = time.perf_counter()
    batches = prefix_batches(cfg.vocab_size)

    def one_device():
        ref = LLM(config=cfg, params=params, **PREFIX_SETTINGS)
        return (*run_batches(ref, batches, sp, sync_last=False), ref.stats["prefix"])

    want, want_cached, ref_prefix = reference("prefix", one_device)
    llm = LLM(config=cfg, params=params, sharding=preset, **PREFIX_SETTINGS)
    traces = llm.runner.traces
    got, got_cached = run_batches(llm, batches, sp, sync_last=True)
    stats = llm.stats
    print(json.dumps({"check": f"prefix_{preset}", **compare(want, got), "ref_cached": want_cached,
                      "cached": got_cached, "prefix": stats["prefix"], "ref_prefix": ref_prefix,
                      "rank_hits": stats["dp_rank_prefix_hits"], "rank_requests": stats["dp_rank_requests"],
                      "windows": len(llm.engine.schedulers[0].prefix.snapshots),
                      "shared_windows": all(s.prefix.snapshots is llm.engine.schedulers[0].prefix.snapshots
                                            for s in llm.engine.schedulers),
                      "recompiled": llm.runner.traces != traces, "unfinished": llm.engine.has_unfinished,
                      "seconds": round(time.perf_counter() - start, 2)}), flush=True)


def decoder_row(cfg, params, preset: str, sp) -> None:
    start = time.perf_counter()
    rng = np.random.default_rng(12)
    prompts = [{"prompt_token_ids": rng.integers(3, cfg.vocab_size, n).tolist()} for n in (3, 40, 9, 30, 48)]
    want, exact = reference("decoder", lambda: tuple(
        summary(LLM(config=cfg, params=params, **settings).generate(prompts, sp, use_tqdm=False))
        for settings in (DECODER_SETTINGS, PREFIX_SETTINGS)))
    llm = LLM(config=cfg, params=params, sharding=preset, **DECODER_SETTINGS)
    traces = llm.runner.traces
    got = summary(llm.generate(prompts, sp, use_tqdm=False))
    llm.engine.async_scheduling = False  # the synchronous loop: the same prompts again
    again = compare(want, summary(llm.generate(prompts, sp, use_tqdm=False)))
    print(json.dumps({"check": f"decoder_{preset}", **compare(want, got), "sync_ids_equal": again["ids_equal"],
                      "sync_max_logprob_diff": again["max_logprob_diff"], "decoder_replay": llm.runner.decoder_replay,
                      "decoder_keep": [s.decoder_keep for s in llm.engine.schedulers],
                      # the prompts past the kept tokens are approximate: they differ from the exact engine's
                      "differs_from_exact": [w["lp"] != e["lp"] for w, e in zip(want, exact)],
                      "recompiled": llm.runner.traces != traces, "unfinished": llm.engine.has_unfinished,
                      "seconds": round(time.perf_counter() - start, 2)}), flush=True)


def agreeing_drafter(cfg, outs, seed: int = 1, scale: float = 10.0):
    """A random drafter whose Markov head favours, after each token, the token that most often followed it in
    ``outs`` (greedy outputs of the model): its drafts are often right and often wrong."""
    d = init_drafter_params(cfg, seed=seed)
    mk = d["mtp"][cfg.num_nextn_predict_layers - 1]["markov_head"]
    u = np.random.default_rng(seed).standard_normal((cfg.vocab_size, cfg.dspark_markov_rank)).astype(np.float32)
    u = scale * u / np.linalg.norm(u, axis=1, keepdims=True)
    follows: dict[int, dict[int, int]] = {}
    for o in outs:
        ids = o["ids"]
        for a, b in zip(ids, ids[1:]):
            follows.setdefault(a, {}).setdefault(b, 0)
            follows[a][b] += 1
    head = np.zeros_like(u)
    for a, nxt in follows.items():
        head[max(nxt, key=nxt.get)] += u[a]
    mk["embed"]["weight"][...] = to_device(u)
    mk["head"]["weight"][...] = to_device(head)
    return d


def spec_setup(cfg, params):
    """(prompts, params, plain greedy outputs, the drafter, the one-device speculative outputs): greedy requests,
    every other one with its own seed (a forced draft count; the rest verify the budget's drafts)."""
    rng = np.random.default_rng(13)
    prompts = [{"prompt_token_ids": rng.integers(3, cfg.vocab_size, int(n)).tolist()} for n in rng.integers(3, 30, 7)]
    sps = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, seed=None if i % 2 else 50 + i)
           for i in range(len(prompts))]
    plain = summary(LLM(config=cfg, params=params, speculation="none", **SETTINGS).generate(prompts, sps,
                                                                                            use_tqdm=False))
    drafter = agreeing_drafter(cfg, plain)
    one = LLM(config=cfg, params=params, drafter=drafter, **SPEC_SETTINGS)
    want = summary(one.generate(prompts, sps, use_tqdm=False))
    return prompts, sps, plain, drafter, want, one.stats


def spec_row(cfg, params, preset: str, setup) -> None:
    start = time.perf_counter()
    prompts, sps, plain, drafter, want, one_stats = setup
    llm = LLM(config=cfg, params=params, drafter=drafter, sharding=preset, **SPEC_SETTINGS)
    traces = llm.runner.traces
    got = summary(llm.generate(prompts, sps, use_tqdm=False))
    llm.engine.async_scheduling = False  # the synchronous loop: the same prompts again
    again = summary(llm.generate(prompts, sps, use_tqdm=False))
    stats = llm.stats
    try:
        LLM(config=cfg, params=params, drafter=drafter, sharding=preset,
            **{**SPEC_SETTINGS, "num_speculative_tokens": cfg.dspark_block_size + 1})
        bad = None
    except ValueError as e:
        bad = str(e)
    keys = ("spec_drafts_verified", "spec_drafts_accepted", "spec_verify_rows", "spec_steps", "spec_drafting_steps",
            "dp_rank_spec_drafts_verified", "dp_rank_spec_accepted", "dp_rank_requests")
    print(json.dumps({"check": f"spec_{preset}", **compare(want, got), "vs_plain": compare(plain, got),
                      "sync_vs_plain": compare(plain, again), "speculation": stats["speculation"],
                      "one_device_verified": one_stats["spec_drafts_verified"],
                      "one_device_accepted": one_stats["spec_drafts_accepted"],
                      **{k: stats[k] for k in keys}, "bad_budget": bad, "recompiled": llm.runner.traces != traces,
                      "unfinished": llm.engine.has_unfinished, "seconds": round(time.perf_counter() - start, 2)}),
          flush=True)


QUANTIZED_SETTINGS = {**SETTINGS, "max_model_len": 64, "speculation": "none"}


#: Presets on which quantized-resident weights are refused (tensor or context split, or experts split without EPLB).
QUANTIZED_REFUSED = ("cpu-dp2-ep2-tp2", "cpu-cp4")


def quantized_rows(cfg, params, presets: list[str]) -> None:
    """``cfg`` / ``params`` written as a quantized checkpoint (FP8 dense weights, FP4 experts, as the shipped one;
    the test model compiles several times faster than the shipped one: 33 s for these rows against 102 s) and
    loaded with its weights resident quantized (``weights="quantized"``): greedy outputs and prompt logprobs of
    each preset against one device (row ``quantized_<preset>``; with the EP MoE, EPLB rebalances forced every 3
    steps so the quantized expert stacks move between slots), then for ``QUANTIZED_REFUSED`` the typed errors,
    from ``LLM`` before anything loads and from ``ModelRunner`` given quantized parameters (row
    ``quantized_refused_<preset>``)."""
    import dataclasses
    import shutil
    import tempfile

    from flax import nnx

    from deepinfer_jax import sharding as sh
    from deepinfer_jax.checkpoint.hf_export import save_hf_checkpoint
    from deepinfer_jax.model.qweight import QWeight
    from deepinfer_jax.runner import ModelRunner

    tree = nnx.to_pure_dict(params)
    tree.pop("engram_token_map", None)  # the identity map: not stored in a checkpoint
    numpy = lambda t: {k: numpy(v) if isinstance(v, dict) else np.asarray(v, np.float32) for k, v in t.items()}
    ckpt = tempfile.mkdtemp(prefix="dp_quantized_")
    save_hf_checkpoint(ckpt, cfg, numpy(tree), quantize=True)
    settings = {**QUANTIZED_SETTINGS, "model": ckpt}

    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng.integers(3, cfg.vocab_size, int(n)).tolist()} for n in (5, 17, 30, 9, 24)]
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    scored = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    prompt_lp = lambda outs: [[(t.token_id, t.logprob, sorted(t.top.items())) for t in o.prompt_logprobs if t]
                              for o in outs]
    # a plain batch, then the 17- and 30-token prompts (one length bucket) with prompt logprobs: on the EP preset
    # they arrive after EPLB rebalances, so scoring them needs the experts in the model's own layout
    batches = lambda llm: (llm.generate(prompts, plain, use_tqdm=False),
                           llm.generate(prompts[1:3], scored, use_tqdm=False))
    ref = LLM(weights="quantized", **settings)
    first, second = batches(ref)
    want, want_prompt = summary(first + second), prompt_lp(second)
    for name in presets:
        start = time.perf_counter()
        preset = sh.resolve_preset(name)
        if preset.engine_expert_parallel:
            preset = preset.replace(eplb=dataclasses.replace(preset.eplb, window_steps=2, rebalance_period=3))
        llm = LLM(weights="quantized", sharding=preset, **settings)
        first = llm.generate(prompts, plain, use_tqdm=False)
        moved = llm.stats.get("eplb_rebalances", 0)  # before the scored requests arrive
        second = llm.generate(prompts[1:3], scored, use_tqdm=False)
        got, got_prompt = summary(first + second), prompt_lp(second)
        prompt_diff = [abs(a[1] - b[1]) for pa, pb in zip(want_prompt, got_prompt) for a, b in zip(pa, pb)]
        w1 = llm.runner.params["layers"][0]["ffn"]["experts"]["w1"][...]
        print(json.dumps({"check": f"quantized_{name}", **compare(want, got), "resident": llm.weights_resident,
                          "ref_resident": ref.weights_resident, "experts_quantized": isinstance(w1, QWeight),
                          "experts_spec": str(w1.data.sharding.spec) if isinstance(w1, QWeight) else None,
                          "rebalances_before_scoring": moved,
                          "prompt_ids_equal": [[(t[0], [k for k, _ in t[2]]) for t in p] for p in want_prompt]
                          == [[(t[0], [k for k, _ in t[2]]) for t in p] for p in got_prompt],
                          "num_prompt_logprobs": len(prompt_diff), "max_prompt_logprob_diff": max(prompt_diff),
                          "seconds": round(time.perf_counter() - start, 2)}), flush=True)
    for name in QUANTIZED_REFUSED:
        preset = sh.resolve_preset(name)
        runner = lambda: ModelRunner(ref.model_config, ref.params, ref.runner.cache_cfg, ref.runner.buckets,
                                     mesh=sh.make_mesh(preset), preset=preset)
        errors = {}
        for where, make in (("llm", lambda: LLM(weights="quantized", sharding=name, **settings)),
                            ("runner", runner)):
            try:
                make()
                errors[where] = None
            except ValueError as e:
                errors[where] = {"type": type(e).__name__, "field": getattr(e, "field", None), "message": str(e)}
        print(json.dumps({"check": f"quantized_refused_{name}", **errors}), flush=True)
    shutil.rmtree(ckpt, ignore_errors=True)


def main(presets: list[str]) -> None:
    assert jax.device_count() == 8, f"expected 8 fake devices, got {jax.device_count()}"
    cfg, params, _ = model_and_inputs()
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    for preset in presets:
        prefix_row(cfg, params, preset, sp)
        decoder_row(cfg, params, preset, sp)
    setup = spec_setup(cfg, params)
    for preset in presets:
        spec_row(cfg, params, preset, setup)
    quantized_rows(cfg, params, presets)
    print(json.dumps({"check": "done"}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
