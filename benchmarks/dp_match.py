"""Matched prompt chunks over DP ranks (``dp_match_floor_ns``, layer 4 of the prefill balancer) in the real engine.

    python benchmarks/dp_match.py [--model tiny] [--preset cpu-dp2-ep4] [--requests 40] [--gap-ms 150] [--repeats 3]

A COST CHECK ON FAKE DEVICES, NOT A PRODUCTION CLAIM: the DP ranks are fake XLA:CPU devices
(``--xla_force_host_platform_device_count=8``, set here before jax starts) sharing this machine's cores, so a
rank's padding is computed on the same cores as the others' work, where on accelerators it is idle time.

One ``LLM`` on ``--preset`` with ``chunking="cost"`` and a step budget of one fresh ``--chunk``-token chunk per
rank, so the cost model, not the token cap, sizes prompt chunks (the model's guess, not refitted meanwhile, so
every run plans with the same one). Two workloads, each run with matching off (the default), with
``dp_match_floor_ns=0`` and with a floor of a quarter of the budget:

- *arrivals*: ``--requests`` requests, a fifth of them long (300-450 prompt tokens) and the rest short (8-40),
  arriving one by one with exponential gaps of mean ``--gap-ms`` (seeded), each admitted when it is due and the
  engine stepped in between (``EngineCore.add_request`` / ``step``, as a server's loop does); TTFT counts from the
  scheduled arrival;
- *offline*: the same prompts all at once through ``LLM.generate``.

Greedy, 8 output tokens each. Reported per setting and workload, averaged over ``--repeats`` runs after a warm-up:
wall time, steps, matched steps, TTFT p50/p99 of the short and the long prompts, and whether every run's tokens
equal the unmatched run's. Writes benchmarks/results/dp_match.json.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before jax starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

from deepinfer_jax import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
METRICS = ("wall_s", "steps", "matched_steps", "ttft_short_p50_ms", "ttft_short_p99_ms", "ttft_long_p50_ms",
           "ttft_long_p99_ms")


def workload(rng, n: int, vocab: int, gap_ms: float):
    """Prompts (a fifth long), whether each is "short" or "long", and the gaps between their arrivals (s)."""
    kinds = ["long" if rng.random() < 0.2 else "short" for _ in range(n)]
    prompts = [rng.integers(3, vocab, int(rng.integers(300, 451) if k == "long" else rng.integers(8, 41))).tolist()
               for k in kinds]
    return prompts, kinds, rng.exponential(gap_ms / 1e3, n)


def _summary(outs, kinds, wall, steps, matched) -> dict:
    ttft = {k: [o.metrics.ttft * 1e3 for o, kind in zip(outs, kinds) if kind == k] for k in ("short", "long")}
    return {"wall_s": wall, "steps": steps, "matched_steps": matched,
            **{f"ttft_{k}_p{p}_ms": float(np.percentile(v, p)) for k, v in ttft.items() for p in (50, 99)},
            "tokens": [o.outputs[0].token_ids for o in outs]}


def run_arrivals(llm, prompts, kinds, gaps, sp) -> dict:
    """Admit each request when due, step the engine in between; sleep only when nothing is running."""
    core = llm.engine
    steps0, matched0 = core.stats.steps, core.stats.matched_steps
    t0 = time.perf_counter()
    due = t0 + np.cumsum(gaps)
    index, done, i = {}, {}, 0
    while i < len(prompts) or core.has_unfinished:
        while i < len(prompts) and due[i] <= time.perf_counter():
            index[core.add_request(prompts[i], sp, arrival=float(due[i]))] = i
            i += 1
        if core.has_unfinished:
            done.update({index[o.request_id]: o for o in core.step()})
        elif i < len(prompts):
            time.sleep(max(0.0, due[i] - time.perf_counter()))
    outs = [done[k] for k in range(len(prompts))]
    return _summary(outs, kinds, time.perf_counter() - t0, core.stats.steps - steps0,
                    core.stats.matched_steps - matched0)


def run_offline(llm, prompts, kinds, gaps, sp) -> dict:
    core = llm.engine
    steps0, matched0 = core.stats.steps, core.stats.matched_steps
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return _summary(outs, kinds, time.perf_counter() - t0, core.stats.steps - steps0,
                    core.stats.matched_steps - matched0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--preset", default="cpu-dp2-ep4")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--gap-ms", type=float, default=150.0, help="mean gap between arrivals")
    ap.add_argument("--chunk", type=int, default=64, help="the step budget: one fresh chunk of this many tokens")
    ap.add_argument("--seqs", type=int, default=4, help="max_num_seqs per rank")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    assert jax.device_count() >= 8, f"needs 8 (fake) devices, got {jax.device_count()}"
    t0 = time.perf_counter()
    llm = LLM(args.model, sharding=args.preset, max_num_seqs=args.seqs, max_num_batched_tokens=128,
              token_buckets=(32, 128), request_buckets=(args.seqs,), block_size=16, max_model_len=512,
              chunking="cost", enable_prefix_caching=False, precompile="all", use_tqdm=False)
    startup = time.perf_counter() - t0
    model = llm.engine.cost_model
    model.observe = lambda shape, ns: None  # every run plans with the same model
    budget = int(model.predict([(args.chunk, 0)]))
    for s in llm.engine.schedulers:
        s.step_budget_ns = budget
    overhead = float(model.coef[0])
    prompts, kinds, gaps = workload(np.random.default_rng(0), args.requests, llm.model_config.vocab_size, args.gap_ms)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], sp, use_tqdm=False)  # warm-up: compiles the buckets
    settings = [("off", None), ("floor 0", 0), ("floor budget/4", int((budget - overhead) / 4))]
    rows, reference = [], {}
    for workload_name, run in (("arrivals", run_arrivals), ("offline", run_offline)):
        for name, floor in settings:
            llm.engine.dp_match_floor_ns = floor
            runs = [run(llm, prompts, kinds, gaps, sp) for _ in range(args.repeats)]
            reference.setdefault(workload_name, runs[0]["tokens"])
            row = {"workload": workload_name, "setting": name, "floor_ns": floor,
                   **{m: float(np.mean([r[m] for r in runs])) for m in METRICS},
                   "same_tokens": all(r["tokens"] == reference[workload_name] for r in runs)}
            rows.append(row)
            print(f"{workload_name}, {name}: {row['wall_s']:.2f} s, TTFT short p50 {row['ttft_short_p50_ms']:.0f} ms",
                  flush=True)
    print(f"\n{args.preset} on fake CPU devices ({os.cpu_count()} cores), model {args.model}, {args.requests} requests "
          f"(a fifth long), budget {budget / 1e6:.1f} ms (one {args.chunk}-token chunk; step overhead "
          f"{overhead / 1e6:.1f} ms), start-up {startup:.1f} s, mean of {args.repeats} runs — a cost check, not a claim")
    print("| workload | setting | wall s | steps | matched steps | TTFT short p50/p99 ms | TTFT long p50/p99 ms | "
          "same tokens |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['setting']} | {r['wall_s']:.2f} | {r['steps']:.1f} | {r['matched_steps']:.1f} | "
              f"{r['ttft_short_p50_ms']:.0f}/{r['ttft_short_p99_ms']:.0f} | "
              f"{r['ttft_long_p50_ms']:.0f}/{r['ttft_long_p99_ms']:.0f} | {r['same_tokens']} |")
    out = ROOT / "benchmarks" / "results" / "dp_match.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "preset": args.preset, "budget_ns": budget, "startup_s": startup,
                               "requests": args.requests, "gap_ms": args.gap_ms, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
