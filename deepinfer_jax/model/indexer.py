"""The lightning indexer of CSA2 and the selection of global entries (model.md §4.4).

FULL layers own the index keys (projected from the compressor's pre-RoPE latent); FULL and
REINDEX layers score every visible global entry per query and keep the top-k; the candidate
source layer also publishes a block-level candidate pool that later REINDEX layers are confined to.

Tie rule: among equal scores the lowest entry index wins (``jax.lax.top_k`` order). Scoring and
selection run the kernels selected in ``deepinfer_jax.ops.dispatch`` (``ops/indexer_topk``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.model.layers import Linear, RMSNorm
from deepinfer_jax.model.quant import fake_quant_mxfp4
from deepinfer_jax.model.rope import apply_rope
from deepinfer_jax.ops import dispatch
from deepinfer_jax.ops.indexer_topk import indexer_scores
from deepinfer_jax.ops.indexer_topk.reference import candidate_pool, select_topk  # noqa: F401 (re-exported)
from deepinfer_jax.ops.indexer_topk.reference import combine as _combine


class Indexer(nnx.Module):
    """``indexer.wq_b`` [nh*hd, q_lora], ``indexer.weights_proj`` [nh, d]; FULL layers add
    ``indexer.wk`` [hd, D] and ``indexer.k_norm`` [hd]."""

    def __init__(self, cfg, owns_keys: bool, *, rngs: nnx.Rngs):
        std = cfg.initializer_range
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.fake_quant = cfg.fake_quant
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, rngs=rngs, std=std)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, rngs=rngs, std=std)
        if owns_keys:
            self.wk = Linear(cfg.head_dim, self.head_dim, rngs=rngs, std=std)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def _q(self, x: jax.Array, raw: bool = False) -> jax.Array:
        return fake_quant_mxfp4(x) if self.fake_quant and not raw else x

    def keys(self, latent: jax.Array, angles: jax.Array, raw: bool = False) -> jax.Array:
        """Index keys [..., W, hd] of global entries: RoPE(k_norm(latent . wk)), MXFP4 unless ``raw``."""
        return self._q(apply_rope(self.k_norm(self.wk(latent)), angles), raw)

    def query(self, x_BTd, q_lat_BTq, angles_BTP) -> tuple[jax.Array, jax.Array]:
        """(index queries [B, T, nh, hd] (MXFP4), head weights [B, T, nh] fp32)."""
        b, t, _ = x_BTd.shape
        q = self.wq_b(q_lat_BTq).reshape(b, t, self.n_heads, self.head_dim)
        q = self._q(apply_rope(q, angles_BTP))
        w = self.weights_proj(x_BTd) * (self.head_dim**-0.5 * self.n_heads**-0.5)
        return q, w.astype(jnp.float32)

    def scores(self, x_BTd, q_lat_BTq, angles_BTP, keys_BWk, visible_BTW) -> jax.Array:
        """``score[t, j] = sum_h w[t, h] * relu(qi[t, h] . K_j)``; invisible entries get -inf. fp32 [B, T, W].

        The reference path keeps its [B, T] einsum; kernels score the flat tokens of every row.
        """
        q, w = self.query(x_BTd, q_lat_BTq, angles_BTP)
        if dispatch.uses_reference():
            dots = jnp.einsum("bthk,bwk->bthw", q.astype(jnp.float32), keys_BWk.astype(jnp.float32))
            return _combine(dots, w, visible_BTW)
        b, t = q.shape[:2]
        s = indexer_scores(q.reshape(b * t, *q.shape[2:]), w.reshape(b * t, -1), keys_BWk,
                           jnp.repeat(jnp.arange(b), t), visible_BTW.reshape(b * t, -1))
        return s.reshape(b, t, -1)

    def scores_per_token(self, x_1Nd, q_lat_1Nq, angles_1NP, keys_NEk, visible_NE) -> jax.Array:
        """As ``scores`` for a flat batch whose tokens each see their own entries: keys [N, E, hd] -> [N, E]."""
        q, w = self.query(x_1Nd, q_lat_1Nq, angles_1NP)
        return indexer_scores(q[0], w[0], keys_NEk, jnp.arange(keys_NEk.shape[0]), visible_NE)
