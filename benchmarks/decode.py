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

Context sweep (issue 19, item 6): decode tokens/s of one engine-shaped runner at several contexts,

    python benchmarks/decode.py --contexts 128,1024,4096,16384 [--sweep-batches 1,8] [--sweep-steps 6]
        [--sweep-config small] [--block-buckets engine|max] [--prefill]

One runner per batch size, laid out as ``LLM`` lays out one engine for the longest context: block 64,
``max_blocks_per_request`` for ``max(contexts) + steps`` tokens, ``batch x len(contexts)`` slots and a
pool of that many full tables (each context decodes its own ``batch`` requests), and the engine's
block-table buckets (``engine``: ``runner.buckets.block_buckets``, or the single full-width bucket of
a tree that has none; ``max``: always the full width, as the engine before issue 19). Each request's
``ctx_len`` is set to the context and ``steps`` decode steps are timed after one warm-up (compile)
step. The contexts' steps interleave (a step of each in turn, each context its own
requests and slots of the one runner), and tok/s is from the best step (the median beside it): on a
shared machine both move with the load, the best one least. The cached entries are left as
initialised unless ``--prefill`` (a step's cost depends on its shapes only, not on the values it
reads; ``--prefill`` really prefills, slowly).

Beside each row, the analytical per-token cost at context c (batch B), storage formats of the cache:

    bytes(c) = W / B + L * w * swa_row
             + sum_{KV sources s} (c // r_s) * index_key            (the indexer's linear scan)
             + sum_{compressed layers l} min(k, c // r_l) * main_entry   (the top-k entries)
    FLOPs(c) = 2 * P_active + sum_{all layers} 4 * H * D * w
             + sum_{index layers i} 2 * n_ih * d_ih * (c // r_i)
             + sum_{compressed layers l} 4 * H * D * min(k, c // r_l)

W: bytes of every parameter but the embedding tables (read once per step, shared by its B tokens);
P_active: matmul parameters one token uses (routed experts x top-k / n_routed; no embedding tables);
L layers, window w, H heads of dim D, top-k k, n_ih x d_ih indexer heads, r the layer's compress
ratio. Only the scan grows with c, linearly; the rest is bounded. Prints a table and writes
benchmarks/results/decode_context.json.
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


def decode_step_seconds(runner, reqs, ids, batch: int, context: int, steps: int) -> float:
    """Median time of ``steps`` decode steps (one teacher-forced token per request after ``context``),
    the first left out when there are more (it may wait on a compilation)."""
    times = []
    for step in range(steps):
        pos = context + step
        chunks = [ChunkSpec(slot=i, block_table=reqs[i].block_ids, ctx_len=pos, token_ids=[int(ids[i, pos])])
                  for i in range(batch)]
        t0 = time.perf_counter()
        runner.execute(chunks)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:] if len(times) > 1 else times)


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
    cached = decode_step_seconds(runner, reqs, ids, batch, context, steps)
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
    add_sweep_args(parser)
    parser.add_argument("--weights", action="store_true",
                        help="instead: quantized- vs float32-resident weights on the shipped checkpoint (decode_weights.py)")
    args = parser.parse_args()
    if args.contexts:
        return context_sweep_main(args)
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


# -- the context sweep (issue 19, item 6) ---------------------------------------------------------


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--contexts", default="", help="context sweep: comma-separated contexts, e.g. 128,1024,4096")
    parser.add_argument("--sweep-batches", default="1,8")
    parser.add_argument("--sweep-steps", type=int, default=6)
    parser.add_argument("--sweep-config", default="small")
    parser.add_argument("--block-buckets", default="engine", choices=("engine", "max"))
    parser.add_argument("--prefill", action="store_true", help="really prefill each context (slow)")
    parser.add_argument("--label", default="", help="a name for this run in the JSON (e.g. before / after)")


def engine_block_buckets(max_blocks: int, block_size: int, mode: str) -> tuple[int, ...]:
    """The block buckets an engine of this tree uses (``mode='engine'``) or the full width alone."""
    if mode == "max":
        return (max_blocks,)
    try:
        from deepinfer_jax.runner.buckets import block_buckets
    except ImportError:  # a tree from before block buckets: its engine has the full width only
        return (max_blocks,)
    return block_buckets(max_blocks, block_size)


def analytic_per_token(cfg, cc: CacheConfig, params, context: int, batch: int) -> dict:
    """Bytes and FLOPs one decode token needs at ``context`` (the module docstring's formulas)."""
    from deepinfer_jax.config import LayerRole

    weights, active = 0, 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path)
        if "embed" in name:  # the token and Engram embedding tables: one row per token
            continue
        weights += leaf.nbytes
        if leaf.ndim >= 2 and np.issubdtype(leaf.dtype, np.floating):
            routed = "['experts']" in name
            active += leaf.size * (cfg.num_experts_per_tok / cfg.n_routed_experts if routed else 1)
    h, d, w, k = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window, cfg.index_topk
    layers = range(cfg.num_hidden_layers)
    compressed = [i for i in layers if cfg.compress_ratio(i)]
    index = [i for i in compressed if cfg.layer_role(i) in (LayerRole.FULL, LayerRole.REINDEX)]
    scan = sum(context // cfg.compress_ratio(s) for s in kv_source_layers(cfg)) * cc.index_key_bytes(cfg)
    topk = sum(min(k, context // cfg.compress_ratio(i)) for i in compressed)
    window = cfg.num_hidden_layers * w * cc.swa_row_bytes(cfg)
    bytes_ = weights / batch + window + scan + topk * cc.main_entry_bytes(cfg)
    flops = (2 * active + cfg.num_hidden_layers * 4 * h * d * w + 4 * h * d * topk
             + sum(2 * cfg.index_n_heads * cfg.index_head_dim * (context // cfg.compress_ratio(i)) for i in index))
    return dict(bytes_per_token=bytes_, flops_per_token=flops, scan_bytes=scan, weight_bytes=weights)


def sweep_batch(cfg, params, contexts: list[int], batch: int, steps: int, mode: str, prefill: bool) -> list[dict]:
    """Decode tok/s of one engine-shaped runner (see the module docstring) at each context. The
    contexts' steps interleave (one step of each in turn), so a noisy machine slows all alike."""
    block = 64
    mbpr = -(-(max(contexts) + steps + 2) // block)
    cc = CacheConfig(block_size=block, num_blocks=batch * len(contexts) * mbpr, max_requests=batch * len(contexts),
                     max_blocks_per_request=mbpr)
    blocks = engine_block_buckets(mbpr, block, mode)
    tokens = tuple(sorted({batch, PREFILL_CHUNK})) if prefill else (batch,)
    runner = ModelRunner(cfg, params, cc, Buckets(tokens=tokens, requests=(batch,), blocks=blocks))
    rng = np.random.default_rng(0)
    reqs = []  # per context: (slots, block tables, token ids)
    for c, context in enumerate(contexts):
        slots = [c * batch + i for i in range(batch)]
        tables = [list(range(s * mbpr, s * mbpr + -(-(context + steps + 2) // block))) for s in slots]
        ids = rng.integers(0, cfg.vocab_size, (batch, context + steps + 2))
        if prefill:
            for s, t, row in zip(slots, tables, ids):
                for at in range(0, context, PREFILL_CHUNK):
                    runner.execute([ChunkSpec(slot=s, block_table=t, ctx_len=at,
                                              token_ids=row[at : at + min(PREFILL_CHUNK, context - at)].tolist())])
        reqs.append((slots, tables, ids))
    times: list[list[float]] = [[] for _ in contexts]
    for step in range(steps + 1):  # step 0 compiles (a new block bucket) or warms up: not timed
        for c, context in enumerate(contexts):
            slots, tables, ids = reqs[c]
            pos = context + step
            chunks = [ChunkSpec(slot=s, block_table=t, ctx_len=pos, token_ids=[int(row[pos])])
                      for s, t, row in zip(slots, tables, ids)]
            t0 = time.perf_counter()
            runner.execute(chunks)
            if step:
                times[c].append(time.perf_counter() - t0)
    rows = []
    for c, context in enumerate(contexts):
        width = Buckets.pick(blocks, len(reqs[c][1][0]), "block_table length")
        best, median = min(times[c]), statistics.median(times[c])
        rows.append(dict(batch=batch, context=context, tok_s=batch / best, tok_s_median=batch / median,
                         step_ms=1e3 * best, step_ms_median=1e3 * median, bucket_tokens=width * block,
                         max_model_len=mbpr * block, block_buckets=list(blocks), pool_blocks=cc.num_blocks,
                         **analytic_per_token(cfg, cc, params, context, batch)))
        print(f"  batch {batch} context {context}: step {rows[-1]['step_ms']:.1f} ms best, {1e3 * median:.1f} median "
              f"(block bucket {width * block} tokens)", flush=True)
    return rows


def context_sweep_main(args) -> None:
    contexts = [int(c) for c in args.contexts.split(",")]
    cfg = getattr(ModelConfig, args.sweep_config)()
    params = init_params(cfg, seed=0)
    import deepinfer_jax

    print(f"machine: {os.cpu_count()} CPU cores, jax {jax.__version__}; deepinfer_jax from "
          f"{Path(deepinfer_jax.__file__).parent.parent}; config {args.sweep_config}, quantized cache, "
          f"block buckets: {args.block_buckets}; {'prefilled' if args.prefill else 'synthetic'} contexts")
    rows = []
    for batch in (int(b) for b in args.sweep_batches.split(",")):
        rows += sweep_batch(cfg, params, contexts, batch, args.sweep_steps, args.block_buckets, args.prefill)
    print()
    print(f"{'batch':>5} {'context':>7} {'tok/s':>8} {'median':>8} {'step ms':>8} {'bucket tok':>10} {'MB/token':>9} "
          f"{'scan KB':>8} {'MFLOP/token':>11}")
    for r in rows:
        print(f"{r['batch']:5d} {r['context']:7d} {r['tok_s']:8.1f} {r['tok_s_median']:8.1f} {r['step_ms']:8.1f} "
              f"{r['bucket_tokens']:10d} {r['bytes_per_token'] / 1e6:9.2f} {r['scan_bytes'] / 1e3:8.1f} "
              f"{r['flops_per_token'] / 1e6:11.1f}")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "decode_context.json"
    runs = json.loads(path.read_text()) if path.exists() else {}
    runs[args.label or args.block_buckets] = dict(config=args.sweep_config, prefill=args.prefill, rows=rows)
    path.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
