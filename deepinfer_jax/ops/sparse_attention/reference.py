"""jnp reference of sparse paged attention (the CPU path).

Each query token attends to two parts with one shared zero-valued sink key (K = V everywhere):

* its window rows ``window_NWD`` (the SWA ring rows, already gathered by the caller) where
  ``window_valid_NW`` holds;
* its ``k`` selected global entries ``topk_NK`` (entry ids of the token's request, -1 = empty),
  read from the block pool ``pool_PED`` through the request's block table: entry ``j`` lives in
  block ``block_tables_RM[token_req_N, j // E]`` at offset ``j % E`` (E = entries per block); a
  block id < 0 (a hole) makes the entry invalid.

Each part gives (out, lse); the parts and the sink logit ``sink_H`` merge by log-sum-exp. Scale
``1/sqrt(D)``, fp32 math, output in q's dtype. Mathematically equal to one softmax over the
concatenated keys plus the sink (``deepinfer_jax.model.attention.attend``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def part_softmax(logits: jax.Array, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(out, lse) of one part: logits [N, H, S] (-inf = masked), rows [N, S, D] fp32 -> ([N, H, D], [N, H]).

    A part with no valid key has lse = -inf and out = 0.
    """
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    total = jnp.sum(p, axis=-1)
    out = jnp.einsum("nhs,nsd->nhd", p, rows) / jnp.where(total > 0, total, 1.0)[..., None]
    return out, jnp.log(total) + m[..., 0]


def merge_with_sink(parts: list[tuple[jax.Array, jax.Array]], sink_H: jax.Array) -> jax.Array:
    """Merge (out [N, H, D], lse [N, H]) parts and a zero-valued sink key of logit ``sink_H``."""
    sink = jnp.broadcast_to(sink_H.astype(jnp.float32), parts[0][1].shape)
    lse = jnp.logaddexp(sink, parts[0][1])
    for _, part_lse in parts[1:]:
        lse = jnp.logaddexp(lse, part_lse)
    out = sum(o * jnp.exp(part_lse - lse)[..., None] for o, part_lse in parts)
    return out


def global_rows(pool_PED, block_tables_RM, token_req_N, topk_NK) -> tuple[jax.Array, jax.Array]:
    """(rows [N, K, D] fp32 (zero where invalid), valid [N, K]) of the selected entries, via the block table."""
    e = pool_PED.shape[1]
    j = jnp.maximum(topk_NK, 0)
    blk = block_tables_RM[token_req_N[:, None], j // e]
    valid = (topk_NK >= 0) & (blk >= 0)
    rows = pool_PED[jnp.maximum(blk, 0), j % e].astype(jnp.float32)
    return jnp.where(valid[..., None], rows, 0.0), valid


def sparse_attention(q_NHD, window_NWD, window_valid_NW, pool_PED, block_tables_RM, token_req_N, topk_NK,
                     sink_H) -> jax.Array:
    """o [N, H, D] in q's dtype; see the module docstring for the inputs."""
    q = q_NHD.astype(jnp.float32)
    scale = q.shape[-1] ** -0.5
    win = jnp.where(window_valid_NW[..., None], window_NWD.astype(jnp.float32), 0.0)  # never let a stale row leak
    logits = jnp.einsum("nhd,nsd->nhs", q, win) * scale
    parts = [part_softmax(jnp.where(window_valid_NW[:, None, :], logits, -jnp.inf), win)]
    if topk_NK.shape[-1]:
        rows, valid = global_rows(pool_PED, block_tables_RM, token_req_N, topk_NK)
        logits = jnp.einsum("nhd,nsd->nhs", q, rows) * scale
        parts.append(part_softmax(jnp.where(valid[:, None, :], logits, -jnp.inf), rows))
    return merge_with_sink(parts, sink_H).astype(q_NHD.dtype)
