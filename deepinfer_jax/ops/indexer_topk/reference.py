"""jnp reference of the lightning indexer's scoring, candidate pooling and top-k (the CPU path).

Scoring: ``score[n, e] = sum_h w[n, h] * relu(q[n, h] . K[req(n), e])``; invisible entries -inf.
Selection modes (model.md §4.4): ``"source"`` (the candidate source layer) publishes a block-level
candidate pool and selects over the visible entries; ``"confined"`` selects only inside a given
pool; ``"plain"`` selects over the visible entries. Tie rule: among equal scores the lowest entry
index wins (``jax.lax.top_k`` order); the k ids come back ascending, -1 for empty slots.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

MODES = ("plain", "source", "confined")


def combine(dots: jax.Array, w: jax.Array, visible: jax.Array) -> jax.Array:
    """``sum_h relu(dots[..., h, e]) * w[..., h]`` masked by ``visible``: dots [..., H, E], w [..., H] -> [..., E]."""
    s = jnp.sum(jax.nn.relu(dots) * w[..., None], axis=-2)
    return jnp.where(visible, s, -jnp.inf)


def indexer_scores(q_NHK: jax.Array, w_NH: jax.Array, keys_REK: jax.Array, token_req_N: jax.Array,
                   visible_NE: jax.Array) -> jax.Array:
    """fp32 scores [N, E] of each token against its request row's index keys (keys_REK[token_req_N])."""
    keys = keys_REK[token_req_N]
    dots = jnp.einsum("nhk,nek->nhe", q_NHK.astype(jnp.float32), keys.astype(jnp.float32))
    return combine(dots, w_NH.astype(jnp.float32), visible_NE)


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


def indexer_topk(scores: jax.Array, n_visible: jax.Array, k: int, mode: str = "plain",
                 candidates: jax.Array | None = None, pool_blocks: int = 0,
                 pool_block_size: int = 1) -> tuple[jax.Array, jax.Array | None]:
    """(top-k ids [..., k] int32, candidate pool [..., E] bool) from scores [..., E] (-inf = invisible).

    ``n_visible`` [...]: entries ``e < n_visible`` are visible. ``"source"`` returns the new pool
    (top ``pool_blocks`` blocks of ``pool_block_size`` entries, & visible); ``"confined"`` masks the
    scores with ``candidates`` first; otherwise ``candidates`` is passed through unchanged.
    """
    check_mode(mode, candidates)
    if mode == "source":
        visible = jnp.arange(scores.shape[-1]) < n_visible[..., None]
        candidates = candidate_pool(scores, n_visible, pool_blocks, pool_block_size) & visible
    elif mode == "confined":
        scores = jnp.where(candidates, scores, -jnp.inf)
    return select_topk(scores, k), candidates


def check_mode(mode: str, candidates) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "confined" and candidates is None:
        raise ValueError("mode='confined' needs candidates (the source layer's pool)")
