"""Context-parallel prefill against the unsharded paged step on fake CPU devices (issue 25).

Run from the repository root with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``:
``python tests/sharded/cp_check.py``. For each case (cp ranks, chunk start, chunk length, cache storage) it
prefills the same prompt once with ``paged_step`` on one device and once with ``cp_prefill`` over a ``cp``
mesh axis, then decodes a few greedy tokens from each cache with the ordinary step, and prints one JSON row:
the largest logit difference, how many cache entries differ, and whether the greedy tokens agree. Ends with
``{"check": "done"}``.
"""

from __future__ import annotations

import functools
import json
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from deepinfer_jax.config import CacheConfig
from deepinfer_jax.model.host_arrays import to_device
from deepinfer_jax.model.kv_cache import init_cache
from deepinfer_jax.model.paged import paged_step
from deepinfer_jax.parallel.context_parallel import cp_inputs, cp_prefill, tail_rows_for
from deepinfer_jax.parallel.cp_layout import cp_align, cp_layout
from deepinfer_jax.runner.step_batch import ChunkSpec, build_inputs

#: the engine row's cache (``ENGINE``: 2 sequences of 512 tokens, dequantized), so that its CP program is the cp4
#: cases' one (same cache config and padded shapes: a compilation cache hit, not a second compile)
BLOCK, BLOCKS_PER_REQ, MAX_REQUESTS = 16, 32, 2
DECODE = 4
#: (name, cp, prefix tokens run by the ordinary step first, CP chunk length, storage)
CASES = [  # the cp4 dequantized cases share one compiled CP program (pieces padded to 64, the chunk to 512)
    ("cp4_301", 4, 0, 301, "dequantized"),
    ("cp4_37_pieces_below_window", 4, 0, 37, "dequantized"),
    ("cp4_5_below_halo", 4, 0, 5, "dequantized"),
    ("cp4_203_after_61_prefix", 4, 61, 203, "dequantized"),
    ("cp8_389_quantized_no_engram", 8, 0, 389, "quantized"),  # Engram's hash graph doubles the compile time
    ("cp4_301_tiles8", 4, 0, 301, "dequantized"),  # the CP step's indexer in 8-token tiles (``tiled_run``)
]


def config():
    """The 5-layer test model of tests/sharded (every attention role) plus one Engram layer (look-back 3)."""
    from shard_common import tiny_config

    return tiny_config().replace(engram_layer_ids=(1,), engram_num_embeddings=(2048,))


def params_for(cfg):
    """Random weights drawn with numpy (as shard_common.model_and_inputs; output projections scaled by 0.1)."""
    from flax import nnx

    from deepinfer_jax.model.deepseek_v41 import abstract_params
    from deepinfer_jax.params import params_from_tree

    rng = np.random.default_rng(7)

    def draw(path, shape):
        leaf = path.rsplit(".", 1)[-1]
        if path.endswith("norm.weight") or leaf.endswith("_scale"):
            return np.ones(shape, np.float32)
        if leaf in ("bias", "bias_vl", "attn_sink") or leaf.endswith("_base"):
            return np.zeros(shape, np.float32)
        if leaf == "engram_token_map":
            return np.arange(shape[0], dtype=np.int32)
        scale = 0.1 if path.endswith(("attn.wo_b.weight", "experts.w2", "shared_experts.w2.weight")) else 1.0
        return (rng.standard_normal(shape) * cfg.initializer_range * scale).astype(np.float32)

    def fill(tree, prefix=""):
        return {k: fill(v, f"{prefix}{k}.") if isinstance(v, dict) else draw(f"{prefix}{k}", v.shape)
                for k, v in tree.items()}

    return params_from_tree(cfg, fill(nnx.to_pure_dict(abstract_params(cfg))))


def _round(n, m=512):
    return -(-n // m) * m


def flat_inputs(cfg, cache_cfg, ids, ctx, table, pad=None):
    chunk = ChunkSpec(slot=0, block_table=table, ctx_len=ctx, token_ids=list(ids))
    inp = build_inputs([chunk], pad or _round(len(ids)), 1, BLOCKS_PER_REQ, cache_cfg.max_requests)
    return inp._replace(logit_rows=np.array([len(ids) - 1], np.int32))


def cache_diff(a, b, where=None):
    """(entries that differ, entries in all) over every cache leaf (bytes compared); ``where``: a list that
    gets (leaf path, differing entries, largest value difference) per leaf that differs."""
    diff = total = 0
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        xb = x.view(np.uint8).reshape(*x.shape[:-1], -1) if x.ndim else x.reshape(1).view(np.uint8)
        yb = y.view(np.uint8).reshape(*y.shape[:-1], -1) if y.ndim else y.reshape(1).view(np.uint8)
        rows = (xb != yb).any(-1)
        diff += int(rows.sum())
        if where is not None and rows.any():
            big = float(np.abs(x.astype(np.float32) - y.astype(np.float32)).max())
            where.append((jax.tree_util.keystr(path), int(rows.sum()), big))
        total += rows.size
    return diff, total


def tiled_run(args, mesh):
    """``cp_prefill`` traced with the indexer's tile budget forced down to 8-token tiles (``model.index_tiles``;
    each rank's pieces are then many tiles), against the ordinary, untiled, one-device step as the reference.
    Returns (logits, cache, how many layer traces scored in tiles)."""
    from deepinfer_jax.model import index_tiles

    calls, score, budget = [], index_tiles._tile_scores, index_tiles.TILE_BUDGET
    index_tiles._tile_scores = lambda *a: calls.append(1) or score(*a)
    index_tiles.TILE_BUDGET = 1  # tile = MIN_TILE tokens
    try:  # a function of its own: nothing traced under the default budget is reused
        run = jax.jit(functools.partial(cp_prefill), static_argnums=(1, 2),
                      static_argnames=("mesh", "axis", "comm_log"), donate_argnums=(3,))
        got, cache = run(*args, mesh=mesh, comm_log=None)
    finally:
        index_tiles._tile_scores, index_tiles.TILE_BUDGET = score, budget
    return got, cache, len(calls)


def main():
    cfg = config()
    params = params_for(cfg)
    models = {True: (cfg, params)}
    step = jax.jit(paged_step, static_argnums=(1, 2), donate_argnums=(3,))
    devices = jax.devices()
    only = sys.argv[1:]
    for name, cp, prefix, length, storage in CASES:
        engram = "no_engram" not in name
        if engram not in models:
            from shard_common import tiny_config

            models[engram] = (tiny_config(), params_for(tiny_config()))
        cfg, params = models[engram]
        if only and name not in only or "engine_only" in only:
            continue
        t0 = time.perf_counter()
        cache_cfg = CacheConfig(block_size=BLOCK, num_blocks=MAX_REQUESTS * BLOCKS_PER_REQ, max_requests=MAX_REQUESTS,
                                max_blocks_per_request=BLOCKS_PER_REQ, storage=storage)
        rng = np.random.default_rng(length)
        ids = rng.integers(3, cfg.vocab_size, prefix + length + DECODE)
        if length >= 12:
            ids[prefix + 7 : prefix + 10] = ids[prefix + 1 : prefix + 4]  # a repeated trigram (Engram hits)
        table = list(range(1, 1 + BLOCKS_PER_REQ))
        mesh = Mesh(np.array(devices[:cp]), ("cp",))
        repl = NamedSharding(mesh, PartitionSpec())
        # every one-device argument committed to the first device, as the continuation's cache below: one
        # compiled step (an uncommitted first call lowers, and compiles, a second program for the same shapes)
        params0 = jax.device_put(params, devices[0])
        ref = jax.device_put(init_cache(cfg, cache_cfg), devices[0])
        if prefix:
            _, ref = step(params0, cfg, cache_cfg, ref, flat_inputs(cfg, cache_cfg, ids[:prefix], 0, table))
        cp_cache = jax.device_put(jax.tree.map(np.asarray, ref), repl)
        cp_params = jax.device_put(params, repl)
        inp = flat_inputs(cfg, cache_cfg, ids[prefix : prefix + length], prefix, table)
        want, ref = step(params0, cfg, cache_cfg, ref, inp)
        lay = cp_layout(prefix, length, cp, align=cp_align(cfg), tail_rows=tail_rows_for(cfg, cache_cfg), multiple=64)
        lin = cp_inputs(lay)
        shard = NamedSharding(mesh, PartitionSpec("cp"))
        lin = lin._replace(**{k: jax.device_put(getattr(lin, k), shard)
                              for k in ("positions", "valid", "flat", "tail_at")})
        log = []
        args = (cp_params, cfg, cache_cfg, cp_cache, jax.device_put(inp, repl), lin)
        tiles = 0
        if "tiles8" in name:
            got, cp_cache, tiles = tiled_run(args, mesh)
        else:
            run = jax.jit(cp_prefill, static_argnums=(1, 2), static_argnames=("mesh", "axis", "comm_log"),
                          donate_argnums=(3,))
            got, cp_cache = run(*args, mesh=mesh, comm_log=None)
        want, got = np.asarray(want), np.asarray(got)
        leaves = []
        diff, total = cache_diff(ref, cp_cache, leaves)
        # greedy continuation from each cache with the ordinary one-device step (the prefill's program: no compile)
        cont = jax.device_put(jax.tree.map(np.asarray, cp_cache), devices[0])
        seq_r, seq_c = [int(want[0].argmax())], [int(got[0].argmax())]
        pos = prefix + length
        for _ in range(DECODE - 1):
            lr, ref = step(params0, cfg, cache_cfg, ref, flat_inputs(cfg, cache_cfg, [seq_r[-1]], pos, table))
            lc, cont = step(params0, cfg, cache_cfg, cont, flat_inputs(cfg, cache_cfg, [seq_c[-1]], pos, table))
            seq_r.append(int(np.asarray(lr)[0].argmax()))
            seq_c.append(int(np.asarray(lc)[0].argmax()))
            pos += 1
        scale = float(np.abs(want).max())
        print(json.dumps({"check": name, "cp": cp, "prefix": prefix, "length": length, "storage": storage,
                          "max_logit_diff": float(np.abs(want - got).max()),
                          "rel_logit_diff": float(np.abs(want - got).max() / scale),
                          "cache_entries_differ": diff, "cache_entries": total, "differing_leaves": leaves,
                          "greedy_ref": seq_r, "greedy_cp": seq_c, "tiled_layers": tiles,
                          "seconds": round(time.perf_counter() - t0, 1)}),
              flush=True)
    if not only or "engine" in only:
        engine_row(*models[True])
    print(json.dumps({"check": "done"}), flush=True)


ENGINE = {"max_num_seqs": MAX_REQUESTS, "max_num_batched_tokens": 64, "token_buckets": (64,), "request_buckets": (2,),
          "block_size": BLOCK, "max_model_len": BLOCK * BLOCKS_PER_REQ, "chunking": "tokens", "max_logprobs": 1,
          "use_tqdm": False, "enable_prefix_caching": True, "kv_storage": "dequantized"}


def engine_row(cfg, params):
    """``LLM(sharding="cpu-cp4", cp_threshold=128)`` against the one-device engine (dequantized storage, as the cp4
    cases: the CP program is theirs, from the compilation cache; quantized CP is the cp8 case): a 300-token prompt
    prefills by CP (alone in its step), two short ones as ordinary chunks, then the long prompt again (a
    prefix hit on the blocks the CP prefill wrote; what is left is short: ordinary chunks)."""
    from deepinfer_jax import LLM, SamplingParams

    t0 = time.perf_counter()
    rng = np.random.default_rng(11)
    long = rng.integers(3, cfg.vocab_size, 300).tolist()
    prompts = [long, rng.integers(3, cfg.vocab_size, 20).tolist(), rng.integers(3, cfg.vocab_size, 9).tolist()]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1)
    outs = {}
    for name, extra in (("one_device", {}), ("cp4", {"sharding": "cpu-cp4", "cp_threshold": 128})):
        llm = LLM(config=cfg, params=params, **ENGINE, **extra)
        first = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        again = llm.generate([{"prompt_token_ids": long + [7]}], sp)
        outs[name] = {"ids": [o.outputs[0].token_ids for o in first + again],
                      "lp": [[t.logprob for t in o.outputs[0].logprobs] for o in first + again],
                      "cached": again[0].num_cached_tokens,
                      "cp_steps": 0 if llm.runner.context_parallel is None else llm.runner.context_parallel.steps,
                      "components": [k for k in ("speculation", "context_parallel") if getattr(llm.runner, k)]}
    a, b = outs["one_device"], outs["cp4"]
    print(json.dumps({"check": "engine", "ids_equal": a["ids"] == b["ids"], "ids": b["ids"],
                      "max_logprob_diff": max(abs(x - y) for la, lb in zip(a["lp"], b["lp"]) for x, y in zip(la, lb)),
                      "cached_ref": a["cached"], "cached_cp": b["cached"], "cp_steps": b["cp_steps"],
                      "components": b["components"], "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
