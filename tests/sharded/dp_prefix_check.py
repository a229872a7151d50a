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
one-device engine with the same setting. Then ``{"check": "done"}``.
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

PREFIX_SETTINGS = {**SETTINGS, "enable_prefix_caching": True}
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


def prefix_row(cfg, params, preset: str, sp) -> None:
    start = time.perf_counter()
    batches = prefix_batches(cfg.vocab_size)
    ref = LLM(config=cfg, params=params, **PREFIX_SETTINGS)
    want, want_cached = run_batches(ref, batches, sp, sync_last=False)
    llm = LLM(config=cfg, params=params, sharding=preset, **PREFIX_SETTINGS)
    traces = llm.runner.traces
    got, got_cached = run_batches(llm, batches, sp, sync_last=True)
    stats = llm.stats
    print(json.dumps({"check": f"prefix_{preset}", **compare(want, got), "ref_cached": want_cached,
                      "cached": got_cached, "prefix": stats["prefix"], "ref_prefix": ref.stats["prefix"],
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
    ref = LLM(config=cfg, params=params, **DECODER_SETTINGS)
    want = summary(ref.generate(prompts, sp, use_tqdm=False))
    exact = summary(LLM(config=cfg, params=params, **PREFIX_SETTINGS).generate(prompts, sp, use_tqdm=False))
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


def main(presets: list[str]) -> None:
    assert jax.device_count() == 8, f"expected 8 fake devices, got {jax.device_count()}"
    cfg, params, _ = model_and_inputs()
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    for preset in presets:
        prefix_row(cfg, params, preset, sp)
        decoder_row(cfg, params, preset, sp)
    print(json.dumps({"check": "done"}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
