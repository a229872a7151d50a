"""The sharded engine on 8 fake devices: output tokens/s vs one device (issue 7 item 7c), and EPLB's moe_lb
measured inside the running engine with and without rebalancing (item 4).

    python benchmarks/dp_engine.py [--part all|cost|eplb] [--model tiny|small] [--requests 32] [--repeats 2]
                                   [--eplb-model PATH] [--eplb-presets cpu-dp2-ep4,cpu-dp1-ep8] [--eplb-requests 64]
                                   [--window 8] [--period 8]

Part "cost":

A COST CHECK, NOT A SPEED CLAIM: the 8 "devices" are fake XLA:CPU devices
(``--xla_force_host_platform_device_count=8``, set here before jax starts) sharing this machine's
CPU cores, so sharding cannot make anything faster; the table shows what the sharded step costs
(partitioning overhead, collectives, padding of idle ranks) relative to the one-device engine.

One ``LLM`` per layout, all with the same total concurrency and per-step token budget: one device
(``max_num_seqs=16``, 128 tokens per step) and each preset with both split over its DP ranks
(``cpu-dp2-ep4``: 8 requests and 64 tokens per rank; ``cpu-dp8-ep1``: 2 and 16). The prefix cache
is off and chunking is the token budget (what DP supports). ``--requests`` greedy requests with
log-normal prompt and output lengths, all submitted at once; best of ``--repeats`` runs after a
warm-up. Also checks that every layout generated the same tokens. Prints a table whose last line
is the headline ratio; writes benchmarks/results/dp_engine.json.

Part "eplb": the shipped trained checkpoint (default; its router's learned, uneven expert choice) on
``--eplb-requests`` greedy requests whose prompts are consecutive pieces of Python standard-library
source (what the model was trained on), run twice per preset on the same engine layout: the baseline
never rebalances (the load-blind identity placement, redundant slots holding the first experts again)
and EPLB rebalances every ``--period`` steps from a ``--window``-step window (short, since a CPU run
has tens of steps, not thousands). Per step and MoE layer, the rank loads are *measured* from the
step's per-slot pair counts (``ModelRunner.slot_counts``); reported: the mean per-step moe_lb (max rank
load / mean rank load) over the steps after the first rebalance, for both runs on the same steps, the
same over the whole run's summed loads, the rebalances, output tok/s and whether the tokens are equal.
Prints a table whose last line is the moe_lb after / baseline ratio; writes
benchmarks/results/dp_engine_eplb.json.
"""

from __future__ import annotations

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # before jax starts
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import json
import sysconfig
import time
from pathlib import Path

import jax
import numpy as np

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.parallel.eplb import slot_rank_loads
from deepinfer_jax.sharding import resolve_preset

ROOT = Path(__file__).resolve().parent.parent
TOTAL_SEQS, TOTAL_TOKENS = 16, 128
LAYOUTS = ((None, 1), ("cpu-dp2-ep4", 2), ("cpu-dp8-ep1", 8))


def workload(rng, n: int, vocab: int):
    plen = np.clip(np.round(rng.lognormal(np.log(40), 0.8, n)), 4, 200).astype(int)
    olen = np.clip(np.round(rng.lognormal(np.log(16), 0.6, n)), 2, 48).astype(int)
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, int(p)).tolist()} for p in plen]
    return prompts, [SamplingParams(temperature=0, max_tokens=int(o), ignore_eos=True) for o in olen]


def measure(llm, prompts, params, repeats: int) -> dict:
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    best = None
    for _ in range(repeats):
        before = llm.engine.stats.steps
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = llm.engine.stats.steps - before
        run = {"wall_s": wall, "out_tokens": n_out, "tok_s": n_out / wall, "steps": steps,
               "step_ms": 1e3 * wall / max(steps, 1), "tokens": [o.outputs[0].token_ids for o in outs]}
        if best is None or run["tok_s"] > best["tok_s"]:
            best = run
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("all", "cost", "eplb"), default="all")
    ap.add_argument("--model", default="tiny", help="a preset (tiny, small) or a checkpoint directory")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--eplb-model", default=None, help="checkpoint directory (default: the shipped trained one)")
    ap.add_argument("--eplb-presets", default="cpu-dp2-ep4,cpu-dp1-ep8")
    ap.add_argument("--eplb-requests", type=int, default=64)
    ap.add_argument("--window", type=int, default=8)
    ap.add_argument("--period", type=int, default=8)
    args = ap.parse_args()
    assert jax.device_count() >= 8, f"needs 8 (fake) devices, got {jax.device_count()}"
    if args.part in ("all", "cost"):
        cost_check(args)
    if args.part in ("all", "eplb"):
        eplb_in_the_engine(args)


def cost_check(args) -> None:
    rows = []
    for preset, dp in LAYOUTS:
        t0 = time.perf_counter()
        seqs, tokens = TOTAL_SEQS // dp, TOTAL_TOKENS // dp
        llm = LLM(args.model, sharding=preset, max_num_seqs=seqs, max_num_batched_tokens=tokens,
                  token_buckets=tuple(sorted({seqs, tokens})), request_buckets=(seqs,), block_size=16,
                  max_model_len=512, chunking="tokens", enable_prefix_caching=False, use_tqdm=False)
        startup = time.perf_counter() - t0
        prompts, params = workload(np.random.default_rng(0), args.requests, llm.model_config.vocab_size)
        run = measure(llm, prompts, params, args.repeats)
        rows.append({"layout": preset or "one device", "dp": dp, "ep": 8 // dp if preset else 1,
                     "seqs_per_rank": seqs, "tokens_per_rank": tokens, "startup_s": startup, **run})
        print(f"{rows[-1]['layout']}: {run['tok_s']:.1f} tok/s", flush=True)
        del llm
    base = rows[0]
    for r in rows:
        r["ratio"] = r["tok_s"] / base["tok_s"]
        r["same_tokens"] = r["tokens"] == base["tokens"]
    print(f"\nengine on 8 fake CPU devices ({os.cpu_count()} cores), model {args.model}, {args.requests} requests, "
          f"best of {args.repeats} — a cost check, not a speed claim")
    print("| layout | dp x ep | seqs/rank | tokens/rank | output tok/s | steps | step ms | start-up s | same tokens | "
          "vs one device |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['layout']} | {r['dp']} x {r['ep']} | {r['seqs_per_rank']} | {r['tokens_per_rank']} | "
              f"{r['tok_s']:.1f} | {r['steps']} | {r['step_ms']:.1f} | {r['startup_s']:.1f} | {r['same_tokens']} | "
              f"{r['ratio']:.2f}x |")
    out = ROOT / "benchmarks" / "results" / "dp_engine.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "requests": args.requests, "repeats": args.repeats,
                               "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}, indent=1))
    worst = min(rows[1:], key=lambda r: r["ratio"])
    print(f"sharded/unsharded output tok/s (cost check): {rows[1]['layout']} {rows[1]['ratio']:.2f}x, "
          f"{rows[2]['layout']} {rows[2]['ratio']:.2f}x (worst {worst['ratio']:.2f}x)")


def stdlib_prompts(n: int, rng) -> list[str]:
    """``n`` pieces of Python standard-library source, 150-900 characters each, from consecutive files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, files = [], sorted(p for p in root.glob("*.py") if p.stat().st_size > 4000)
    for path in files:
        text = path.read_text(errors="replace")
        at = 0
        while len(texts) < n and at + 1000 < len(text):
            size = int(rng.integers(150, 900))
            texts.append(text[at:at + size])
            at += size + 500
        if len(texts) >= n:
            break
    return texts


class StepLog:
    """Wraps ``Rebalancer.record_slots`` to keep every step's measured rank loads [L, R] (the step's placement)."""

    def __init__(self, reb):
        self.loads, self._record = [], reb.record_slots

        def record(slot_counts, placement=None):
            used = reb.placement if placement is None else placement
            self.loads.append(slot_rank_loads(slot_counts, used.n_ranks))
            return self._record(slot_counts, placement)

        reb.record_slots = record


def eplb_in_the_engine(args) -> None:
    rng = np.random.default_rng(0)
    prompts = stdlib_prompts(args.eplb_requests, rng)
    params = [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True)
              for n in rng.integers(8, 32, len(prompts))]
    rows = []
    for name in args.eplb_presets.split(","):
        base = resolve_preset(name)
        runs = {}
        for label, period in (("baseline", 10**9), ("eplb", args.period)):
            preset = base.replace(eplb=dataclasses.replace(base.eplb, enabled=True, window_steps=args.window,
                                                           rebalance_period=period))
            t0 = time.perf_counter()
            llm = LLM(args.eplb_model, sharding=preset, max_num_seqs=16, max_num_batched_tokens=128,
                      token_buckets=(16, 128), request_buckets=(16,), block_size=16, max_model_len=512,
                      chunking="tokens", enable_prefix_caching=False, use_tqdm=False)
            startup = time.perf_counter() - t0
            log = StepLog(llm.engine.eplb)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            stats = llm.stats
            runs[label] = {"loads": np.stack(log.loads), "wall_s": wall, "startup_s": startup,
                           "tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
                           "tokens": [o.outputs[0].token_ids for o in outs], "rebalances": stats["eplb_rebalances"],
                           "engine_moe_lb_before": stats["eplb_moe_lb_before"],
                           "engine_moe_lb_after": stats["eplb_moe_lb_after"], "steps": stats["steps"],
                           "slots_per_rank": llm.runner.placement.slots_per_rank,
                           "layers": llm.model_config.num_hidden_layers, "experts": llm.model_config.n_routed_experts}
            print(f"{name} {label}: {stats['steps']} steps, {stats['eplb_rebalances']} rebalances, "
                  f"{runs[label]['tok_s']:.1f} tok/s", flush=True)
            del llm
        base_run, eplb_run = runs["baseline"], runs["eplb"]
        after = slice(args.period, None)  # the steps that ran after the first rebalance (same steps in both runs)
        lb = lambda loads: loads.max(-1) / np.maximum(loads.mean(-1), 1e-9)  # [..., L]
        row = {"preset": name, "ep": base.ep_size, "slots_per_rank": eplb_run["slots_per_rank"],
               "layers": eplb_run["layers"], "experts": eplb_run["experts"], "steps": eplb_run["steps"],
               "window": args.window, "period": args.period, "rebalances": eplb_run["rebalances"],
               "same_tokens": base_run["tokens"] == eplb_run["tokens"],
               "moe_lb_first_period": float(lb(eplb_run["loads"][:args.period]).mean()),
               "moe_lb_baseline": float(lb(base_run["loads"][after]).mean()),
               "moe_lb_eplb": float(lb(eplb_run["loads"][after]).mean()),
               "moe_lb_summed_baseline": float(lb(base_run["loads"][after].sum(0)).mean()),
               "moe_lb_summed_eplb": float(lb(eplb_run["loads"][after].sum(0)).mean()),
               "moe_lb_per_layer_baseline": lb(base_run["loads"][after]).mean(0).tolist(),
               "moe_lb_per_layer_eplb": lb(eplb_run["loads"][after]).mean(0).tolist(),
               "engine_moe_lb_before": eplb_run["engine_moe_lb_before"],
               "engine_moe_lb_after": eplb_run["engine_moe_lb_after"],
               "tok_s_baseline": base_run["tok_s"], "tok_s_eplb": eplb_run["tok_s"]}
        row["ratio"] = row["moe_lb_eplb"] / row["moe_lb_baseline"]
        rows.append(row)
    model = args.eplb_model or "checkpoints/small-trained"
    print(f"\nEPLB inside the engine on 8 fake CPU devices ({os.cpu_count()} cores), {model}, "
          f"{args.eplb_requests} requests, window {args.window} / period {args.period} steps; moe_lb measured per step "
          f"from the slot counts, mean over layers and the steps after the first rebalance")
    print("| preset | ep | slots/rank | steps | rebalances | moe_lb baseline | moe_lb EPLB | summed baseline | "
          "summed EPLB | tok/s baseline | tok/s EPLB | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['ep']} | {r['slots_per_rank']} | {r['steps']} | {r['rebalances']} | "
              f"{r['moe_lb_baseline']:.3f} | {r['moe_lb_eplb']:.3f} | {r['moe_lb_summed_baseline']:.3f} | "
              f"{r['moe_lb_summed_eplb']:.3f} | {r['tok_s_baseline']:.1f} | {r['tok_s_eplb']:.1f} | "
              f"{r['same_tokens']} |")
    out = ROOT / "benchmarks" / "results" / "dp_engine_eplb.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "requests": args.eplb_requests, "rows": rows}, indent=1))
    print("moe_lb EPLB / baseline (per step, after the first rebalance): "
          + ", ".join(f"{r['preset']} {r['moe_lb_baseline']:.3f} -> {r['moe_lb_eplb']:.3f} ({r['ratio']:.2f}x)"
                      for r in rows))


if __name__ == "__main__":
    main()
