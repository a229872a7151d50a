"""The lightning indexer of CSA2 and the selection of global entries (model.md §4.4).

FULL layers own the index keys (projected from the compressor's pre-RoPE latent); FULL and
REINDEX layers score every visible global entry per query and keep the top-k; the candidate
source layer also publishes a block-level candidate pool that later REINDEX layers are confined to.

Tie rule: among equal scores the lowest entry index wins (``jax.lax.top_k`` order).
"""

from __future__ import annotations

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

    def _q(self, x: jax.Array) -> jax.Array:
        return fake_quant_mxfp4(x) if self.fake_quant else x

    def keys(self, latent_BWD: jax.Array, angles_BWP: jax.Array) -> jax.Array:
        """Index keys [B, W, hd] of the global entries: RoPE(k_norm(latent . wk)), MXFP4."""
        return self._q(apply_rope(self.k_norm(self.wk(latent_BWD)), angles_BWP))

    def scores(self, x_BTd, q_lat_BTq, angles_BTP, keys_BWk, visible_BTW) -> jax.Array:
        """``score[t, j] = sum_h w[t, h] * relu(qi[t, h] . K_j)``; invisible entries get -inf. fp32 [B, T, W]."""
        b, t, _ = x_BTd.shape
        q = self.wq_b(q_lat_BTq).reshape(b, t, self.n_heads, self.head_dim)
        q = self._q(apply_rope(q, angles_BTP))
        w = self.weights_proj(x_BTd) * (self.head_dim**-0.5 * self.n_heads**-0.5)
        dots = jnp.einsum("bthk,bwk->bthw", q.astype(jnp.float32), keys_BWk.astype(jnp.float32))
        s = jnp.sum(jax.nn.relu(dots) * w.astype(jnp.float32)[..., None], axis=2)
        return jnp.where(visible_BTW, s, -jnp.inf)


def candidate_pool(scores_BTW: jax.Array, n_visible_BT: jax.Array, topk_blocks: int, block: int) -> jax.Array:
    """Boolean [B, T, W]: the top ``topk_blocks`` blocks of ``block`` consecutive entries by max score.

    The block holding the newest visible entry is always kept (forced to +inf); blocks with no
    finite score are never kept.
    """
    b, t, w = scores_BTW.shape
    nb = -(-w // block)
    padded = jnp.pad(scores_BTW, ((0, 0), (0, 0), (0, nb * block - w)), constant_values=-jnp.inf)
    block_scores = jnp.max(padded.reshape(b, t, nb, block), axis=-1)
    newest = (n_visible_BT - 1) // block
    block_scores = jnp.where(jnp.arange(nb) == newest[..., None], jnp.inf, block_scores)
    vals, idx = jax.lax.top_k(block_scores, min(topk_blocks, nb))
    keep = jnp.zeros((b, t, nb), bool)
    keep = jax.vmap(jax.vmap(lambda k, i, v: k.at[i].set(v > -jnp.inf)))(keep, idx, vals)
    return jnp.repeat(keep, block, axis=-1)[..., :w]


def select_topk(scores_BTW: jax.Array, k: int) -> jax.Array:
    """Indices [B, T, min(k, W)] of the top-k entries, ascending; slots without a finite score are -1."""
    w = scores_BTW.shape[-1]
    vals, idx = jax.lax.top_k(scores_BTW, min(k, w))
    valid = vals > -jnp.inf
    idx = jnp.where(valid, idx, w)  # sort invalid slots last, then mark them
    idx = jnp.sort(idx, axis=-1)
    return jnp.where(idx == w, -1, idx).astype(jnp.int32)
