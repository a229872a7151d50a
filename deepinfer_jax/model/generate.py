"""``generate``: the notebook entry point, a pure function that ``jax.jit`` compiles as a whole.

    gen = jax.jit(generate, static_argnames=("cfg", "max_new_tokens", "storage"))
    tokens = gen(params, cfg, prompt_token_ids, jax.random.key(0), max_new_tokens=32)

It builds a per-batch paged cache (one slot and a fixed run of blocks per row), prefills all rows
in one flat step, samples, and runs the decode steps in a ``lax.fori_loop``; every step is the
engine's ``paged_step`` and sampler, so greedy results equal the engine's. After a row emits the
end-of-sequence token its later tokens are ``cfg.eos_token_id`` too (``stop_at_eos``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from deepinfer_jax.config import CacheConfig
from deepinfer_jax.model.kv_cache import init_cache
from deepinfer_jax.model.paged import StepInputs, paged_step
from deepinfer_jax.model.sampler import sample_tokens

__all__ = ["generate"]


def _cache_config(cfg, batch: int, total: int, storage: str) -> CacheConfig:
    ratios = {cfg.compress_ratio(i) for i in range(cfg.num_hidden_layers)} - {0}
    bs = math.lcm(*ratios) if ratios else 1
    bs *= max(1, 16 // bs)  # blocks of at least 16 tokens
    per_row = math.ceil(total / bs)
    return CacheConfig(block_size=bs, num_blocks=batch * per_row, max_requests=batch, max_blocks_per_request=per_row,
                       storage=storage)


def generate(params, cfg, prompt_token_ids: jax.Array, key: jax.Array, max_new_tokens: int,
             temperature: float | jax.Array = 0.0, top_p: float | jax.Array = 1.0, top_k: int | jax.Array = 0,
             min_p: float | jax.Array = 0.0, *, storage: str = "quantized", stop_at_eos: bool = True) -> jax.Array:
    """Generate ``max_new_tokens`` tokens after each row of ``prompt_token_ids`` [B, T] (int).

    ``key``: a ``jax.random.key``; row b's token i uses ``fold_in(fold_in(key, b), i)``.
    Sampling settings are scalars or [B] arrays (temperature 0 = greedy). Returns int32
    [B, max_new_tokens]. ``cfg``, ``max_new_tokens``, ``storage`` and ``stop_at_eos`` are static.
    """
    ids = jnp.asarray(prompt_token_ids, jnp.int32)
    batch, t = ids.shape
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cc = _cache_config(cfg, batch, t + max_new_tokens, storage)
    per_row = cc.max_blocks_per_request
    tables = jnp.arange(batch * per_row, dtype=jnp.int32).reshape(batch, per_row)
    rows = jnp.arange(batch, dtype=jnp.int32)
    vec = lambda v, dtype: jnp.broadcast_to(jnp.asarray(v, dtype), (batch,))
    temp, tp, tk, mp = vec(temperature, jnp.float32), vec(top_p, jnp.float32), vec(top_k, jnp.int32), vec(
        min_p, jnp.float32)
    row_keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(rows)

    def pick(logits, i):
        keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(row_keys)
        return sample_tokens(logits, keys, temp, tk, tp, mp)

    prefill = StepInputs(token_ids=ids.reshape(-1), positions=jnp.tile(jnp.arange(t, dtype=jnp.int32), batch),
                         token_req=jnp.repeat(rows, t), token_valid=jnp.ones(batch * t, bool), block_tables=tables,
                         req_slot=rows, req_start=rows * t, ctx_len=jnp.zeros(batch, jnp.int32),
                         new_len=jnp.full(batch, t, jnp.int32), logit_rows=rows * t + t - 1,
                         window_floor=jnp.zeros(batch, jnp.int32), global_write_from=jnp.zeros(batch, jnp.int32))
    logits, cache = paged_step(params, cfg, cc, init_cache(cfg, cc), prefill)
    first = pick(logits, 0)
    out = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(first)

    def body(i, carry):
        cache, out, done = carry
        last = out[:, i - 1]
        pos = jnp.full(batch, t + i - 1, jnp.int32)
        step = StepInputs(token_ids=last, positions=pos, token_req=rows, token_valid=jnp.ones(batch, bool),
                          block_tables=tables, req_slot=rows, req_start=rows, ctx_len=pos, new_len=pos + 1,
                          logit_rows=rows, window_floor=jnp.zeros(batch, jnp.int32),
                          global_write_from=jnp.zeros(batch, jnp.int32))
        logits, cache = paged_step(params, cfg, cc, cache, step)
        tok = pick(logits, i)
        done = done | (stop_at_eos & (last == cfg.eos_token_id))
        tok = jnp.where(done, cfg.eos_token_id, tok)
        return cache, out.at[:, i].set(tok), done

    _, out, _ = jax.lax.fori_loop(1, max_new_tokens, body, (cache, out, jnp.zeros(batch, bool)))
    return out
