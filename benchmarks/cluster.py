"""Prefill/decode disaggregation against colocated engines on a mixed trace (issue 23 item 7).

    python benchmarks/cluster.py [--model tiny] [--long 6] [--short 12] [--long-len 200] [--short-out 24]

The trace mixes long prompts with few output tokens and short prompts with many, all sent at
once in an interleaved order. Two set-ups, each with two engines as Ray actors (one process
each) on this machine:

- **1P+1D**: ``cluster.Cluster(prefill=1, decode=1)``: one engine runs every prompt, the other
  every decode step; the handoff carries the state between them (blocks via the shared store);
- **2 colocated**: two plain engines, the trace split between them round robin.

Each set-up first runs the trace once to compile (not measured). Reported per set-up: output
tokens/s over the wall time, TTFT p50/p99, TPOT p50/p99 (per request: decode time / tokens after the
first), and for PD the handoff bytes and time per request. One table on stdout (markdown). On a
2-core CPU both set-ups share the same cores, so this measures the scheduling effect, not a
production deployment's.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from deepinfer_jax import SamplingParams


class _Colocated:
    """A plain engine as a Ray actor (the baseline)."""

    def __init__(self, model, settings):
        from deepinfer_jax.llm import LLM

        self.llm = LLM(model, use_tqdm=False, **settings)

    def generate(self, items, params):
        outs = self.llm.generate(items, params, use_tqdm=False)
        return [(len(o.outputs[0].token_ids), o.metrics.ttft, o.metrics.finished_time - o.metrics.first_token_time)
                for o in outs]


def _trace(args):
    rng = np.random.default_rng(args.seed)
    items, params = [], []
    longs = [(rng.integers(3, 500, args.long_len).tolist(), args.long_out) for _ in range(args.long)]
    shorts = [(rng.integers(3, 500, args.short_len).tolist(), args.short_out) for _ in range(args.short)]
    order = []
    while longs or shorts:  # interleave: one long, then shorts in proportion
        if longs:
            order.append(longs.pop())
        for _ in range(max(1, args.short // max(1, args.long))):
            if shorts:
                order.append(shorts.pop())
    for ids, n in order:
        items.append({"prompt_token_ids": ids})
        params.append(SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return items, params


def _row(name, wall, stats, extra=""):
    toks = sum(n for n, _, _ in stats)
    ttft = np.array([t for _, t, _ in stats])
    tpot = np.array([d / (n - 1) for n, _, d in stats if n > 1])
    p = lambda a, q: float(np.percentile(a, q)) * 1e3
    return (f"| {name} | {toks / wall:.1f} | {p(ttft, 50):.0f} | {p(ttft, 99):.0f} | {p(tpot, 50):.1f} | "
            f"{p(tpot, 99):.1f} | {extra} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--long", type=int, default=6)
    ap.add_argument("--short", type=int, default=12)
    ap.add_argument("--long-len", type=int, default=200)
    ap.add_argument("--long-out", type=int, default=4)
    ap.add_argument("--short-len", type=int, default=12)
    ap.add_argument("--short-out", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import ray

    from deepinfer_jax.cluster.live import Cluster, ray_init_options

    settings = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 16, "max_model_len": 256, "chunking": "tokens",
                    "speculation": "none"}
    items, params = _trace(args)
    ray.init(**ray_init_options())
    rows = []
    with Cluster(prefill=1, decode=1, model=args.model, **settings) as c:
        c.generate(items, params)  # compile
        c.stats = type(c.stats)()
        t0 = time.perf_counter()
        outs = c.generate(items, params)
        wall = time.perf_counter() - t0
        stats = [(len(o.outputs[0].token_ids), o.metrics.ttft, o.metrics.finished_time - o.metrics.first_token_time)
                 for o in outs]
        s = c.stats
        n = max(1, s.handoffs)
        rows.append(_row("1P+1D (Cluster)", wall, stats,
                         f"{s.handoff_bytes / n / 1024:.1f} KiB, {s.handoff_s / n * 1e3:.2f} ms; exact {s.exact}"))
    actor = ray.remote(num_cpus=0)(_Colocated)
    engines = [actor.remote(args.model, settings) for _ in range(2)]
    split = lambda k: ([x for i, x in enumerate(items) if i % 2 == k], [x for i, x in enumerate(params) if i % 2 == k])
    ray.get([e.generate.remote(*split(k)) for k, e in enumerate(engines)])  # compile
    t0 = time.perf_counter()
    parts = ray.get([e.generate.remote(*split(k)) for k, e in enumerate(engines)])
    wall = time.perf_counter() - t0
    rows.append(_row("2 colocated", wall, [x for part in parts for x in part], "-"))
    ray.shutdown()
    print(f"trace: {args.long} x {args.long_len}-token prompts -> {args.long_out} tokens, "
          f"{args.short} x {args.short_len} -> {args.short_out}; model {args.model}, CPU\n")
    print("| set-up | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | handoff / request |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
