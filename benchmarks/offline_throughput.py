"""Offline engine throughput: asynchronous vs synchronous scheduling, cost-model vs token-budget chunking.

    python benchmarks/offline_throughput.py [--model DIR|tiny|small] [--requests 32] [--repeats 2]

One ``LLM`` (default: the shipped small checkpoint) serves every run, so all variants share the
weights, the compiled buckets and the machine state; only the engine's settings switch between runs.
The prefix cache is off here (the runs repeat the same prompts; ``benchmarks/prefix_cache.py`` is
where hits are measured).

1. Throughput: ``--requests`` requests with long-tailed (log-normal) prompt and output lengths,
   all submitted at once; output tokens/s, TTFT, and the host time on the critical path, with
   asynchronous scheduling on vs off (runs interleaved, best of ``--repeats``).
2. Chunking: a mixed workload (long prompts arriving first, short requests arriving every few
   steps while they prefill); the short requests' TTFT p50/p99 with cost-model chunking vs a plain
   token budget. The time budget of cost mode is the fitted model's prediction for a full
   token-budget step at context 0, so both modes aim at the same step size when the prefix is short.

Host time on the critical path: synchronous, all host work (the device idles during it); asynchronous,
only the part of each step's host work that exceeds the device time of the step it overlaps.
Prints a table; the last line is the async/sync throughput ratio. Writes
benchmarks/results/offline_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from deepinfer_jax import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def lognormal_lengths(rng, n, median, sigma, lo, hi):
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(int).tolist()


def run_batch(llm, prompts, params, async_on):
    eng = llm.engine
    eng.async_scheduling = async_on
    before = dict(vars(eng.stats))
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    s = eng.stats
    steps = s.steps - before["steps"]
    host = (s.schedule_s - before["schedule_s"]) + (s.reconcile_s - before["reconcile_s"])
    device = s.device_s - before["device_s"]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = np.array([o.metrics.ttft for o in outs])
    if async_on:  # host work hides under the device time of the step in flight
        critical = max(0.0, host - device) if steps else 0.0
    else:
        critical = host
    return dict(mode="async" if async_on else "sync", wall_s=wall, out_tokens=n_out, tok_s=n_out / wall,
                ttft_p50_ms=1e3 * float(np.median(ttft)), ttft_p99_ms=1e3 * float(np.percentile(ttft, 99)),
                steps=steps, host_ms_per_step=1e3 * host / max(steps, 1), step_ms=1e3 * wall / max(steps, 1),
                host_critical_frac=critical / wall)


def run_mixed(llm, chunking, longs, shorts, every):
    eng, sched = llm.engine, llm.engine.scheduler
    eng.async_scheduling = True
    sched.chunking = chunking
    rids_short = []
    for p in longs:
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    pending, done, step = list(shorts), {}, 0
    t0 = time.perf_counter()
    while pending or eng.has_unfinished:
        if pending and step % every == 0:
            rid = eng.add_request(pending.pop(0), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            rids_short.append(rid)
        for out in eng.step():
            done[out.request_id] = out
        step += 1
    wall = time.perf_counter() - t0
    ttft = np.array([done[r].metrics.ttft for r in rids_short])
    for rid in list(done):
        eng.requests.pop(rid, None)
    return dict(chunking=chunking, short_ttft_p50_ms=1e3 * float(np.median(ttft)),
                short_ttft_p99_ms=1e3 * float(np.percentile(ttft, 99)), wall_s=wall, steps=step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    budget = 128
    llm = LLM(args.model, max_num_seqs=8, max_num_batched_tokens=budget, block_size=32, max_model_len=640,
              chunking="cost", step_budget_ns=10**9, use_tqdm=False, enable_prefix_caching=False)
    cm = llm.engine.cost_model
    sched = llm.engine.scheduler
    sched.step_budget_ns = int(cm.predict([(budget, 0)]))
    vocab = llm.model_config.vocab_size
    rng = np.random.default_rng(0)

    # 1. async vs sync throughput (token-budget chunking so both see the same plans)
    sched.chunking = "tokens"
    n = args.requests
    p_len = lognormal_lengths(rng, n, 24, 1.0, 4, 400)
    o_len = lognormal_lengths(rng, n, 16, 0.8, 2, 128)
    prompts = [rng.integers(3, vocab, k).tolist() for k in p_len]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=o, ignore_eos=True) for i, o in enumerate(o_len)]
    run_batch(llm, prompts[:4], params[:4], True)  # warm-up
    results = {"sync": [], "async": []}
    for _ in range(args.repeats):
        for mode in (False, True):
            results["async" if mode else "sync"].append(run_batch(llm, prompts, params, mode))
    best = {k: max(v, key=lambda r: r["tok_s"]) for k, v in results.items()}

    # 2. cost-model vs token-budget chunking on a mixed long/short workload
    longs = [rng.integers(3, vocab, 480).tolist() for _ in range(4)]
    shorts = [rng.integers(3, vocab, int(k)).tolist() for k in rng.integers(4, 16, 16)]
    mixed = []
    for _ in range(args.repeats):
        for chunking in ("tokens", "cost"):
            mixed.append(run_mixed(llm, chunking, longs, shorts, every=2))
    mixed_best = {c: min((m for m in mixed if m["chunking"] == c), key=lambda m: m["short_ttft_p50_ms"])
                  for c in ("tokens", "cost")}

    print(f"\nmodel: {llm.model_config.num_hidden_layers} layers, hidden {llm.model_config.hidden_size}; "
          f"{n} requests, prompt len p50 {int(np.median(p_len))} max {max(p_len)}, output p50 {int(np.median(o_len))} "
          f"max {max(o_len)}; buckets {llm.buckets}")
    print(f"cost model (ns): a0 {cm.coef[0]:.3g}, a1 {cm.coef[1]:.3g}/token, a2 {cm.coef[2]:.3g}/(token*ctx), "
          f"a3 {cm.coef[3]:.3g}/token^2; mean relative prediction error {100 * (cm.mean_relative_error or 0):.1f}%")
    print(f"\n{'mode':6} {'tok/s':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'steps':>6} {'step ms':>8} "
          f"{'host ms/step':>13} {'host critical':>14}")
    for k in ("sync", "async"):
        r = best[k]
        print(f"{k:6} {r['tok_s']:8.1f} {r['ttft_p50_ms']:12.0f} {r['ttft_p99_ms']:12.0f} {r['steps']:6d} "
              f"{r['step_ms']:8.1f} {r['host_ms_per_step']:13.2f} {100 * r['host_critical_frac']:13.1f}%")
    print(f"\n{'chunking':8} {'short TTFT p50 ms':>18} {'short TTFT p99 ms':>18} {'steps':>6} {'wall s':>7}")
    for c in ("tokens", "cost"):
        m = mixed_best[c]
        print(f"{c:8} {m['short_ttft_p50_ms']:18.0f} {m['short_ttft_p99_ms']:18.0f} {m['steps']:6d} {m['wall_s']:7.2f}")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "offline_throughput.json").write_text(json.dumps(dict(
        throughput=results, mixed=mixed, cost_model=cm.coef.tolist(), cost_model_error=cm.mean_relative_error,
        step_budget_ns=sched.step_budget_ns), indent=2))
    print(f"\nasync/sync output throughput ratio: {best['async']['tok_s'] / best['sync']['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
