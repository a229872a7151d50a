"""EPLB: placement decision time and moe_lb before/after rebalancing on drifting Zipf loads (issue 7 (a), (b)).

    python benchmarks/eplb.py [--layers 4] [--cases 0.6:1000,0.6:100,1.0:100,0.6:10] [--periods 3] [--repeats 20]

(a) ``compute_placement`` for the full model's shape (40 layers x 384 experts) at decode (EP64, 1 redundant
slot per rank), prefill (EP8, 4 per rank) and hierarchical decode (8 nodes): median wall time over
``repeats`` calls on Zipf loads (wall and process CPU time: the CPU time is less sensitive to a busy
machine); the target is < 10 ms for decode.

(b) A synthetic load per layer: expert popularity is Zipf (``p ~ rank^-s``) over a latent score per expert that
drifts as an AR(1) process with a correlation time of ``tau`` rebalance periods (the hot set changes slowly;
``--cases`` lists ``zipf_exponent:tau`` pairs);
each step's per-expert pairs are Poisson around ``pairs_per_step * p``. The engine loop is the project's
``Rebalancer`` (identity placement at the start; statistics over the last ``window`` steps; a new placement
every ``period`` steps). moe_lb per step and layer = max rank load / mean rank load of that step's counts
(each expert's pairs split evenly over its copies); reported: the mean over the first period (the
load-blind start, "before") and over the ``periods`` periods after the first rebalance ("after"), plus a
noise floor: the same step counts under a placement computed from that step's *true* popularity (what a
perfect, instant EPLB would get; sampling noise alone). Settings follow engine.md §3: prefill EP8, 4
redundant, window 100, every 1,000 steps, 64K tokens per step (8 ranks x 8K); decode EP64, 1 redundant,
window 1,000, every 10,000 steps, 16K tokens per step (64 ranks x 64 requests x 4 tokens with DSpark);
6 experts per token. Design figures: 1.032 (EP2) / 1.062 (EP4) prefill, 1.090 decode.

Prints a table; the last line is the decode moe_lb before/after ratio. Writes benchmarks/results/eplb.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from deepinfer_jax.parallel.eplb import compute_placement, rank_loads
from deepinfer_jax.parallel.eplb_policy import RebalancePolicy, Rebalancer

ROOT = Path(__file__).resolve().parent.parent
N_EXPERTS, TOP_K = 384, 6
SETTINGS = {
    "prefill": {"n_ranks": 8, "policy": RebalancePolicy.prefill(), "tokens": 65536, "design": "1.03-1.06"},
    "decode": {"n_ranks": 64, "policy": RebalancePolicy.decode(), "tokens": 16384, "design": "1.09"},
}


def zipf_p(score_LE: np.ndarray, exponent: float) -> np.ndarray:
    """Popularity [..., E]: Zipf over the experts ranked by descending score."""
    rank = np.argsort(np.argsort(-score_LE, axis=-1), axis=-1) + 1.0
    p = rank ** -exponent
    return p / p.sum(-1, keepdims=True)


def decision_time(repeats: int) -> list[dict]:
    rng = np.random.default_rng(0)
    load = rng.poisson(1e5 * zipf_p(rng.standard_normal((40, N_EXPERTS)), 0.8)).astype(np.int64)
    rows = []
    for name, n_ranks, redundant, n_nodes in (("decode EP64, 1 redundant", 64, 1, 1),
                                              ("prefill EP8, 4 redundant", 8, 4, 1),
                                              ("decode EP64, 1 redundant, 8 nodes", 64, 1, 8)):
        compute_placement(load, n_ranks, redundant, n_nodes)
        times, cpu = [], []
        for _ in range(repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            compute_placement(load, n_ranks, redundant, n_nodes)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        rows.append({"case": f"40 layers x 384 experts, {name}", "median_ms": 1e3 * statistics.median(times),
                     "min_ms": 1e3 * min(times), "cpu_median_ms": 1e3 * statistics.median(cpu)})
    return rows


def simulate(setting: str, exponent: float, n_layers: int, tau_periods: float, periods: int, seed: int) -> dict:
    cfg = SETTINGS[setting]
    policy, n_ranks = cfg["policy"], cfg["n_ranks"]
    pairs = cfg["tokens"] * TOP_K
    rng = np.random.default_rng(seed)
    rho = 1.0 - 1.0 / (tau_periods * policy.period)
    kick = np.sqrt(1.0 - rho * rho)
    score = rng.standard_normal((n_layers, N_EXPERTS))
    reb = Rebalancer(n_layers, N_EXPERTS, n_ranks, policy)
    before, after, floor = [], [], []
    n_steps = (periods + 1) * policy.period
    chunk = min(1000, policy.period)
    for start in range(0, n_steps, chunk):
        scores = np.empty((chunk, n_layers, N_EXPERTS))
        for i in range(chunk):
            score = rho * score + kick * rng.standard_normal(score.shape)
            scores[i] = score
        p = zipf_p(scores, exponent)
        counts = rng.poisson(pairs * p)
        for i in range(chunk):
            step = start + i
            lb = _step_lb(counts[i], reb.placement)
            (before if step < policy.period else after).append(lb)
            if step % (policy.period // 10) == 0:  # noise floor on a subsample: placement from the true p
                oracle = compute_placement(p[i] * pairs, n_ranks, policy.redundant_per_rank)
                floor.append(_step_lb(counts[i], oracle))
            reb.record(counts[i])
    return {"setting": setting, "zipf": exponent, "tau": tau_periods, "ep": n_ranks, "redundant": policy.redundant_per_rank,
            "window": policy.window, "period": policy.period, "layers": n_layers, "steps": n_steps,
            "before": float(np.mean(before)), "after": float(np.mean(after)),
            "after_p99": float(np.percentile(np.concatenate(after), 99)), "noise_floor": float(np.mean(floor)),
            "design": cfg["design"]}


def _step_lb(counts_LE: np.ndarray, placement) -> np.ndarray:
    rl = rank_loads(counts_LE, placement)
    return rl.max(1) / rl.mean(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="layers simulated in (b) (independent; more only average)")
    ap.add_argument("--cases", default="0.6:1000,0.6:100,1.0:100,0.6:10",
                    help="zipf_exponent:tau pairs for (b); tau = drift correlation time in rebalance periods")
    ap.add_argument("--periods", type=int, default=3, help="periods measured after the first rebalance")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    timing = decision_time(args.repeats)
    print("| placement decision | wall median ms | wall min ms | CPU median ms |\n|---|---:|---:|---:|")
    for r in timing:
        print(f"| {r['case']} | {r['median_ms']:.2f} | {r['min_ms']:.2f} | {r['cpu_median_ms']:.2f} |")

    cases = [tuple(float(v) for v in c.split(":")) for c in args.cases.split(",")]
    sims = [simulate(s, z, args.layers, tau, args.periods, args.seed) for s in ("prefill", "decode") for z, tau in cases]
    print("\n| setting | zipf s | drift tau (periods) | EP | redundant/rank | window / period "
          "| moe_lb before (identity) | moe_lb after EPLB | after, p99 | noise floor (instant oracle) | design docs |")
    print("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|")
    for r in sims:
        print(f"| {r['setting']} | {r['zipf']} | {r['tau']:g} | {r['ep']} | {r['redundant']} | {r['window']} / {r['period']} "
              f"| {r['before']:.3f} | {r['after']:.3f} | {r['after_p99']:.3f} | {r['noise_floor']:.3f} "
              f"| {r['design']} |")
    out = ROOT / "benchmarks" / "results" / "eplb.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "decision_time": timing, "moe_lb": sims}, indent=2))
    dec = [r for r in sims if r["setting"] == "decode"][min(1, len(cases) - 1)]
    print(f"\ndecode (zipf {dec['zipf']}) moe_lb before/after EPLB: {dec['before'] / dec['after']:.2f}x "
          f"({dec['before']:.3f} -> {dec['after']:.3f}; design docs {dec['design']})")


if __name__ == "__main__":
    main()
