"""The lightning indexer of CSA2 and the selection of global entries (model.md §4.4).

FULL layers own the index keys (projected from the compressor's pre-RoPE latent); FULL and
REINDEX layers score every visible global entry per query and keep the top-k; the candidate
source layer also publishes a block-level candidate pool that later REINDEX layers are confined to.

Tie rule: among equal scores the lowest entry index wins (``jax.lax.top_k`` order).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.model.layers import Linear, RMSNorm
from deepinfer_jax.model.quant import fake_quant_mxfp4
from deepinfer_jax.model.rope import apply_rope


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
        """``score[t, j] = sum_h w[t, h] * relu(qi[t, h] . K_j)``; invisible entries get -inf. fp32 [B, T, W]."""
        q, w = self.query(x_BTd, q_lat_BTq, angles_BTP)
        dots = jnp.einsum("bthk,bwk->bthw", q.astype(jnp.float32), keys_BWk.astype(jnp.float32))
        return _combine(dots, w, visible_BTW)

    def scores_per_token(self, x_1Nd, q_lat_1Nq, angles_1NP, keys_NEk, visible_NE) -> jax.Array:
        """As ``scores`` for a flat batch whose tokens each see their own entries: keys [N, E, hd] -> [N, E]."""
        q, w = self.query(x_1Nd, q_lat_1Nq, angles_1NP)
        dots = jnp.einsum("nhk,nek->nhe", q[0].astype(jnp.float32), keys_NEk.astype(jnp.float32))
        return _combine(dots, w[0], visible_NE)


def _combine(dots: jax.Array, w: jax.Array, visible: jax.Array) -> jax.Array:
    s = jnp.sum(jax.nn.relu(dots) * w[..., None], axis=-2)
    return jnp.where(visible, s, -jnp.inf)


def candidate_pool(scores: jax.Array, n_visible: jax.Array, topk_blocks: int, block: int) -> jax.Array:
    """Boolean [..., W]: the top ``topk_blocks`` blocks of ``block`` consecutive entries by max score.

    scores [..., W] (any leading axes); n_visible [...]. The block holding the newest visible entry
    is always kept (forced to +inf); blocks with no finite score are never kept.
    """
    *lead, w = scores.shape
    nb = -(-w // block)
    padded = jnp.pad(scores, [(0, 0)] * len(lead) + [(0, nb * block - w)], constant_values=-jnp.inf)
    block_scores = jnp.max(padded.reshape(*lead, nb, block), axis=-1)
    newest = (n_visible - 1) // block
    block_scores = jnp.where(jnp.arange(nb) == newest[..., None], jnp.inf, block_scores)
    vals, idx = jax.lax.top_k(block_scores, min(topk_blocks, nb))
    flat_keep = jnp.zeros((math.prod(lead), nb), bool)
    flat_keep = jax.vmap(lambda k, i, v: k.at[i].set(v > -jnp.inf))(
        flat_keep, idx.reshape(-1, idx.shape[-1]), vals.reshape(-1, vals.shape[-1]))
    return jnp.repeat(flat_keep.reshape(*lead, nb), block, axis=-1)[..., :w]


def select_topk(scores_BTW: jax.Array, k: int) -> jax.Array:
    """Indices [..., k] of the top-k entries, ascending; slots without a finite score (or past W) are -1."""
    w = scores_BTW.shape[-1]
    if w == 0:
        return jnp.full((*scores_BTW.shape[:-1], k), -1, jnp.int32)
    vals, idx = jax.lax.top_k(scores_BTW, min(k, w))
    idx = jnp.where(vals > -jnp.inf, idx, w)  # sort invalid slots last, then mark them
    idx = jnp.sort(idx, axis=-1)
    idx = jnp.where(idx == w, -1, idx).astype(jnp.int32)
    return jnp.pad(idx, [(0, 0)] * (idx.ndim - 1) + [(0, k - idx.shape[-1])], constant_values=-1)
