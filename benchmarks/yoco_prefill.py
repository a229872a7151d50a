"""Prefill compute with decoder bounded replay (YOCO prefill) on vs off, prompts of 1K to 16K tokens.

    python benchmarks/yoco_prefill.py [--model DIR|tiny|small] [--lengths 1024,4096,16384] [--chunk 2048]

One request's prompt is prefilled in chunks of ``--chunk`` tokens through the paged step, exactly
(every token runs every layer) and with decoder bounded replay (only the last K =
``$DEEPINFER_YOCO_PREFILL_KEEP_TOKENS`` tokens, default 140, run the layers after the decoder's KV
source). FLOPs are XLA's count for each compiled step variant times the chunks that use it; time
is measured, best of ``--repeats``, both in this process. ``run()`` returns the rows for
``benchmarks/prefix_cache.py``. Last line: the FLOP ratio at the longest prompt.
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import CacheConfig, yoco_keep_tokens
from deepinfer_jax.llm import _load_model
from deepinfer_jax.model.kv_cache import init_cache
from deepinfer_jax.model.paged import StepInputs, paged_step


def _inputs(ids, start, block_table, keep_from, d):
    n = len(ids)
    one = jnp.zeros(1, jnp.int32)
    inp = StepInputs(token_ids=jnp.asarray(ids, jnp.int32), positions=jnp.arange(start, start + n, dtype=jnp.int32),
                     token_req=jnp.zeros(n, jnp.int32), token_valid=jnp.ones(n, bool),
                     block_tables=jnp.asarray(block_table)[None], req_slot=one, req_start=one, ctx_len=one + start,
                     new_len=one + start + n, logit_rows=jnp.array([n - 1], jnp.int32), window_floor=one,
                     global_write_from=one)
    if d is None:
        return inp
    first = max(0, keep_from - start)
    rows = np.zeros(d, np.int32)
    rows[: n - first] = np.arange(first, n)
    valid = np.arange(d) < n - first
    last = max(0, n - first - 1)
    return inp._replace(decoder_rows=jnp.asarray(rows), decoder_valid=jnp.asarray(valid),
                        decoder_floor=one + keep_from, logit_rows=jnp.array([last], jnp.int32))


def run(model=None, lengths=(1024, 2048, 4096, 8192, 16384), chunk=2048, repeats=2) -> list[dict]:
    cfg, params, _ = _load_model(model, "float32")
    keep = yoco_keep_tokens()
    d_keep = 1 << math.ceil(math.log2(keep))
    rows = []
    compiled: dict = {}
    for length in lengths:
        bs = 64
        nb = math.ceil(length / bs)
        cc = CacheConfig(block_size=bs, num_blocks=nb, max_requests=1, max_blocks_per_request=nb)
        ids = np.random.default_rng(0).integers(3, cfg.vocab_size, length)
        table = np.arange(nb, dtype=np.int32)
        out = {}
        for mode in ("exact", "replay"):
            flops, best = 0.0, math.inf
            for rep in range(repeats + 1):  # pass 0 compiles and counts FLOPs; the others are timed
                cache = init_cache(cfg, cc)
                jax.block_until_ready(cache)
                t0 = time.perf_counter()
                for start in range(0, length, chunk):
                    part = ids[start : start + chunk]
                    d = None
                    if mode == "replay":
                        d = d_keep if start + len(part) > length - keep else 16
                    inp = _inputs(part, start, table, length - keep, d)
                    key = (length, len(part), d)
                    if key not in compiled:
                        c = jax.jit(paged_step, static_argnums=(1, 2), donate_argnums=(3,)).lower(
                            params, cfg, cc, cache, inp).compile()
                        cost = c.cost_analysis()
                        compiled[key] = (c, (cost[0] if isinstance(cost, list) else cost)["flops"])
                    fn, f = compiled[key]
                    logits, cache = fn(params, cache, inp)
                    if rep == 0:
                        flops += f
                np.asarray(logits)
                if rep:
                    best = min(best, time.perf_counter() - t0)
            out[mode] = (flops, best)
        rows.append({"tokens": length, "exact_gflop": out["exact"][0] / 1e9, "replay_gflop": out["replay"][0] / 1e9,
                     "flop_ratio": out["replay"][0] / out["exact"][0], "exact_s": out["exact"][1],
                     "replay_s": out["replay"][1], "time_ratio": out["replay"][1] / out["exact"][1], "keep": keep})
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"\ndecoder bounded replay (keep {rows[0]['keep']} tokens) vs exact prefill:")
    print(f"{'tokens':>7} {'exact GFLOP':>12} {'replay GFLOP':>13} {'FLOP ratio':>11} {'exact s':>8} {'replay s':>9} "
          f"{'time ratio':>11}")
    for r in rows:
        print(f"{r['tokens']:7d} {r['exact_gflop']:12.1f} {r['replay_gflop']:13.1f} {r['flop_ratio']:11.3f} "
              f"{r['exact_s']:8.2f} {r['replay_s']:9.2f} {r['time_ratio']:11.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    rows = run(args.model, tuple(int(x) for x in args.lengths.split(",")), args.chunk, args.repeats)
    print_rows(rows)
    print(f"replay/exact prefill FLOPs at {rows[-1]['tokens']} tokens: {rows[-1]['flop_ratio']:.3f}")


if __name__ == "__main__":
    main()
