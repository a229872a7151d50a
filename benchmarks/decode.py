"""Decode throughput of the paged step against recomputing ``forward_full`` every step.

    python benchmarks/decode.py [--configs tiny,small] [--batches 1,8,32] [--context 1024] [--steps 8]
    python benchmarks/decode.py --weights [--batches 1,8,32]   # quantized- vs float32-resident weights

For each config and batch size, ``batch`` requests are prefilled to ``context`` tokens through the
paged cache, then decoded one token per request per step (teacher-forced ids); the baseline runs
the jitted ``forward_full`` over the whole ``[batch, context + 1]`` sequence for each new token,
as an engine without a cache would. Both run in this process on the same weights. Memory traffic
per cached step = the weights read (all parameters) + the cache read (every layer's window rows,
and for every KV source all entries of each request: main KV and index keys, in the storage
format), divided by the step time, as a fraction of this machine's memory bandwidth measured in
the same run by copying a large array. Prints a table; the last line is the cached/uncached speed
ratio at the given context. Writes benchmarks/results/decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from deepinfer_jax import ModelConfig, forward_full, init_params
from deepinfer_jax.cache import BlockPool, RequestBlocks
from deepinfer_jax.config import CacheConfig
from deepinfer_jax.model.kv_cache import kv_source_layers
from deepinfer_jax.runner import Buckets, ChunkSpec, ModelRunner

ROOT = Path(__file__).resolve().parent.parent
PREFILL_CHUNK = 256


def memory_bandwidth(nbytes: int = 512 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of copying a large array in host memory (read + write counted), median of repeats."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def cache_bytes_read(cfg, cc: CacheConfig, context: int) -> int:
    """Cache bytes one decode token reads (window rows + all entries of its request per KV source)."""
    swa = cfg.num_hidden_layers * cfg.sliding_window * cc.swa_row_bytes(cfg)
    entries = sum((context // cfg.compress_ratio(layer)) * (cc.main_entry_bytes(cfg) + cc.index_key_bytes(cfg))
                  for layer in kv_source_layers(cfg))
    return swa + entries


def bench(cfg: ModelConfig, batch: int, context: int, steps: int, storage: str) -> dict:
    params = init_params(cfg, seed=0)
    block = 64
    blocks_per_req = -(-(context + steps + 1) // block)
    cc = CacheConfig(block_size=block, num_blocks=batch * blocks_per_req, max_requests=batch,
                     max_blocks_per_request=blocks_per_req, storage=storage)
    prefill_rows = max(1, min(batch, PREFILL_CHUNK // 64))
    runner = ModelRunner(cfg, params, cc, Buckets(tokens=tuple(sorted({batch, PREFILL_CHUNK})),
                                                  requests=tuple(sorted({prefill_rows, batch})),
                                                  blocks=(blocks_per_req,)))
    t0 = time.perf_counter()
    runner.precompile()
    compile_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (batch, context + steps + 1))
    pool = BlockPool(cc.num_blocks)
    reqs = [RequestBlocks(pool, blocks_per_req, block) for _ in range(batch)]
    for r in reqs:
        r.ensure_capacity(context + steps + 1)
    t0 = time.perf_counter()
    for i in range(batch):  # prefill, one request at a time in chunks
        for s in range(0, context, PREFILL_CHUNK):
            k = min(PREFILL_CHUNK, context - s)
            runner.execute([ChunkSpec(slot=i, block_table=reqs[i].block_ids, ctx_len=s,
                                      token_ids=ids[i, s : s + k].tolist())])
    prefill_s = time.perf_counter() - t0
    times = []
    for step in range(steps):
        pos = context + step
        chunks = [ChunkSpec(slot=i, block_table=reqs[i].block_ids, ctx_len=pos, token_ids=[int(ids[i, pos])])
                  for i in range(batch)]
        t0 = time.perf_counter()
        runner.execute(chunks)
        times.append(time.perf_counter() - t0)
    cached = statistics.median(times[1:] if len(times) > 1 else times)
    fwd = jax.jit(forward_full, static_argnums=1)
    seq = ids[:, : context + 1]
    fwd(params, cfg, seq).block_until_ready()  # compile
    t0 = time.perf_counter()
    fwd(params, cfg, seq).block_until_ready()
    uncached = time.perf_counter() - t0
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    traffic = weight_bytes + batch * cache_bytes_read(cfg, cc, context)
    return dict(batch=batch, context=context, cached_tok_s=batch / cached, uncached_tok_s=batch / uncached,
                speedup=uncached / cached, step_ms=1e3 * cached, bytes_per_step=traffic,
                compile_s=compile_s, prefill_tok_s=batch * context / prefill_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="tiny,small")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--storage", default="quantized", choices=("quantized", "dequantized"))
    parser.add_argument("--weights", action="store_true",
                        help="instead: quantized- vs float32-resident weights on the shipped checkpoint (decode_weights.py)")
    args = parser.parse_args()
    bw = memory_bandwidth()
    if args.weights:  # a separate section: benchmarks/decode_weights.py
        import decode_weights

        print(f"machine: {os.cpu_count()} CPU cores, jax {jax.__version__}; large-copy memory bandwidth {bw / 1e9:.1f} GB/s")
        decode_weights.compare([int(b) for b in args.batches.split(",")], args.context, args.steps, bw,
                               cache_bytes_read, ROOT / "benchmarks" / "results")
        return
    print(f"machine: {os.cpu_count()} CPU cores, jax {jax.__version__}; large-copy memory bandwidth "
          f"{bw / 1e9:.1f} GB/s; storage {args.storage}")
    rows = []
    for name in args.configs.split(","):
        cfg = getattr(ModelConfig, name)()
        for batch in (int(b) for b in args.batches.split(",")):
            row = dict(config=name, **bench(cfg, batch, args.context, args.steps, args.storage))
            row["bw_frac"] = row["bytes_per_step"] / (row["step_ms"] / 1e3) / bw
            rows.append(row)
            print(f"  measured {name} batch {batch}: step {row['step_ms']:.1f} ms (compile {row['compile_s']:.0f} s)")
    print()
    print(f"{'config':7} {'batch':>5} {'cached tok/s':>13} {'uncached tok/s':>15} {'speedup':>8} {'step ms':>8} "
          f"{'MB/step':>8} {'% mem bw':>9}")
    for r in rows:
        print(f"{r['config']:7} {r['batch']:5d} {r['cached_tok_s']:13.1f} {r['uncached_tok_s']:15.2f} "
              f"{r['speedup']:7.1f}x {r['step_ms']:8.1f} {r['bytes_per_step'] / 1e6:8.1f} {100 * r['bw_frac']:8.1f}%")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps(dict(memory_bandwidth=bw, rows=rows), indent=2))
    geo = float(np.exp(np.mean([np.log(r["speedup"]) for r in rows])))
    print(f"decode tokens/s cached/uncached at a {args.context}-token context (geometric mean over "
          f"{len(rows)} rows): {geo:.1f}x")


if __name__ == "__main__":
    main()
