"""Engram memory write into the mHC streams (model.md §4.3).

Before an Engram layer's attention site, each token looks up ``(max_ngram - 1) * n_heads`` rows of
its layer's table (row ids from ``engram_hash.ngram_hash_ids``), projects them to one key per
stream plus a shared value, and adds the value to each stream through a signed-sqrt sigmoid gate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.model.layers import Linear, row_mean, row_sum, take_rows


class Table(nnx.Module):
    """An embedding table ``weight`` [rows, dim] (float, or a ``QWeight``: only looked-up rows are decoded)."""

    def __init__(self, rows: int, dim: int, *, rngs: nnx.Rngs, std: float):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (rows, dim)) * std)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return take_rows(self.weight[...], ids)


class Engram(nnx.Module):
    """``engram.embed.weight`` [rows, hd], ``engram.wkv.weight`` [(n+1) d, heads hd],
    ``engram.q_weight`` / ``engram.k_weight`` [n, d]."""

    def __init__(self, cfg, rows: int, *, rngs: nnx.Rngs):
        std, d, n = cfg.initializer_range, cfg.hidden_size, cfg.hc_mult
        heads = cfg.num_engram_hash_heads
        self.eps = cfg.rms_norm_eps
        self.embed = Table(rows, cfg.engram_head_dim, rngs=rngs, std=std)
        self.wkv = Linear(heads * cfg.engram_head_dim, (n + 1) * d, rngs=rngs, std=std)
        self.q_weight = nnx.Param(jnp.ones((n, d), jnp.float32))
        self.k_weight = nnx.Param(jnp.ones((n, d), jnp.float32))

    def __call__(self, streams_BTnd: jax.Array, rows_BTh: jax.Array, token_mask_BT=None) -> jax.Array:
        """Streams [B, T, n, d] plus the gated memory value; masked tokens are left unchanged."""
        b, t, n, d = streams_BTnd.shape
        emb = self.embed(rows_BTh).reshape(b, t, -1).astype(streams_BTnd.dtype)
        kv = self.wkv(emb)
        key = kv[..., : n * d].astype(jnp.float32).reshape(b, t, n, d)
        value = kv[..., n * d :].astype(jnp.float32)
        r = streams_BTnd.astype(jnp.float32)
        w = self.q_weight[...].astype(jnp.float32) * self.k_weight[...].astype(jnp.float32)
        rstd = jax.lax.rsqrt(row_mean(r * r)[..., 0] + self.eps) * jax.lax.rsqrt(row_mean(key * key)[..., 0] + self.eps)
        dot = row_sum(r * w * key)[..., 0] * rstd * d**-0.5
        gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)), dot))
        if token_mask_BT is not None:
            gate = jnp.where(token_mask_BT[..., None], gate, 0.0)
        return (r + gate[..., None] * value[:, :, None, :]).astype(streams_BTnd.dtype)
