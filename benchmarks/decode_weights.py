"""Quantized-resident vs float32-resident weights: decode tok/s and bytes per step (``decode.py --weights``).

On the shipped checkpoint (``checkpoints/small-trained``, loaded both ways: ``weights="quantized"``
and ``"float32"``), for each batch size ``batch`` requests are prefilled to ``context`` tokens through
the paged cache and then decoded one token per request per step, exactly as ``decode.py`` does.
Bytes per step = the resident weight bytes (storage bytes for quantized leaves: every weight is read
once per step) + the cache bytes the batch reads; the bandwidth fraction divides that by the step time
and by this machine's large-copy bandwidth (``decode.memory_bandwidth``). Writes
``benchmarks/results/decode_weights.json``.
"""

from __future__ import annotations

import json

import numpy as np

from deepinfer_jax.cache import BlockPool, RequestBlocks
from deepinfer_jax.checkpoint import load_hf_checkpoint
from deepinfer_jax.config import CacheConfig
from deepinfer_jax.llm import DEFAULT_CHECKPOINT
from deepinfer_jax.params import resident_bytes
from deepinfer_jax.runner import Buckets, ChunkSpec, ModelRunner

PREFILL_CHUNK = 256


def decode_step_s(cfg, params, batch: int, context: int, steps: int, cache_bytes_read) -> tuple[float, int]:
    """(median decode step seconds, cache bytes read per step) for ``batch`` requests at ``context``."""
    block = 64
    blocks_per_req = -(-(context + steps + 1) // block)
    cc = CacheConfig(block_size=block, num_blocks=batch * blocks_per_req, max_requests=batch,
                     max_blocks_per_request=blocks_per_req)
    prefill_rows = max(1, min(batch, PREFILL_CHUNK // 64))
    runner = ModelRunner(cfg, params, cc, Buckets(tokens=tuple(sorted({batch, PREFILL_CHUNK})),
                                                  requests=tuple(sorted({prefill_rows, batch})),
                                                  blocks=(blocks_per_req,)))
    runner.precompile()
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, (batch, context + steps + 1))
    pool = BlockPool(cc.num_blocks)
    reqs = [RequestBlocks(pool, blocks_per_req, block) for _ in range(batch)]
    for i, r in enumerate(reqs):
        r.ensure_capacity(context + steps + 1)
        for s in range(0, context, PREFILL_CHUNK):
            k = min(PREFILL_CHUNK, context - s)
            runner.execute([ChunkSpec(slot=i, block_table=r.block_ids, ctx_len=s, token_ids=ids[i, s:s + k].tolist())])
    from decode import decode_step_seconds  # the decode benchmark's loop (this module runs from it)

    return decode_step_seconds(runner, reqs, ids, batch, context, steps), batch * cache_bytes_read(cfg, cc, context)


def compare(batches, context: int, steps: int, bandwidth: float, cache_bytes_read, out_dir) -> list[dict]:
    """Run both residencies at every batch size; print the table and return its rows."""
    loaded = {w: load_hf_checkpoint(DEFAULT_CHECKPOINT, progress=False, weights=w) for w in ("quantized", "float32")}
    rows = []
    for batch in batches:
        for weights, (cfg, params) in loaded.items():
            step_s, cache_b = decode_step_s(cfg, params, batch, context, steps, cache_bytes_read)
            wb = resident_bytes(params)
            rows.append(dict(weights=weights, batch=batch, context=context, tok_s=batch / step_s, step_ms=1e3 * step_s,
                             weight_bytes=wb, bytes_per_step=wb + cache_b,
                             bw_frac=(wb + cache_b) / step_s / bandwidth))
            print(f"  measured {weights} batch {batch}: step {1e3 * step_s:.1f} ms")
    print()
    print(f"shipped checkpoint, {context}-token context: quantized-resident vs float32-resident weights")
    print(f"{'batch':>5} {'weights':>10} {'tok/s':>8} {'step ms':>8} {'MB/step':>8} {'% mem bw':>9} {'q/f32 tok/s':>12}")
    for r in rows:
        f32 = next(x for x in rows if x["batch"] == r["batch"] and x["weights"] == "float32")
        ratio = f"{r['tok_s'] / f32['tok_s']:11.2f}x" if r["weights"] == "quantized" else ""
        print(f"{r['batch']:5d} {r['weights']:>10} {r['tok_s']:8.1f} {r['step_ms']:8.1f} {r['bytes_per_step'] / 1e6:8.1f} "
              f"{100 * r['bw_frac']:8.2f}% {ratio:>12}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decode_weights.json").write_text(json.dumps(dict(memory_bandwidth=bandwidth, rows=rows), indent=2))
    return rows
