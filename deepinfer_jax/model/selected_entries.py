"""The selected global entries of a paged step, read out of the block pool in storage format first.

A KV-source layer's pool holds every request's compressed entries (``[P, E, ...]`` storage rows:
NVFP4 codes + scales, or fp32 values). A token attends to at most ``k`` entries of its own request
(its top-k), so the step gathers exactly those storage rows through the block table and decodes
only them: the per-token read is ``k`` rows whatever the size of the pool or the width of the
block table (decoding the whole pool first cost ``P * E`` rows per KV source and step).

Decoding is row-wise (every scale group lies inside one row), so decoding the gathered rows gives
the rows of the decoded pool bit for bit, and attention computes the same numbers.

The rows come back as a compact pool in ``attend_step``'s contract (``ops.sparse_attention``), so
the reference path and the kernels both read them unchanged: token ``n`` is its own "request" with
one block ``n`` of ``k`` entries, and its selection is ``i`` for slot ``i`` (-1 where the slot is
empty or the entry's block is a hole).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.model import kv_cache as kc


def compact_selection(stored, fmt: str, quantized: bool, block_tables_RM: jax.Array, token_req_N: jax.Array,
                      topk_NK: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(pool [N, K, D] in ``dtype``, block_tables [N, 1], token_req [N], topk [N, K]) of each token's
    selected entries ``topk_NK`` (entry ids of its request, -1 = empty) from the pool ``stored``
    ([P, E, ...] storage in format ``fmt``) through ``block_tables_RM`` (-1 = hole)."""
    n, k = topk_NK.shape
    e = jax.tree.leaves(stored)[0].shape[1]
    j = jnp.maximum(topk_NK, 0)
    blk = block_tables_RM[token_req_N[:, None], j // e]
    valid = (topk_NK >= 0) & (blk >= 0)
    rows = kc.decode(kc.gather(stored, (jnp.maximum(blk, 0), j % e)), fmt, quantized)
    local = jnp.where(valid, jnp.arange(k, dtype=jnp.int32), -1)
    return rows.astype(dtype), jnp.arange(n, dtype=jnp.int32)[:, None], jnp.arange(n, dtype=jnp.int32), local
