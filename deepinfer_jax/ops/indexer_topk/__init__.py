"""Indexer scoring, candidate pooling and top-k selection, dispatched by platform.

``indexer_scores`` and ``indexer_topk`` look up the selected implementation
(``deepinfer_jax.ops.dispatch``); ``reference`` holds the jnp contracts, ``pallas`` the kernels.
"""

from __future__ import annotations

from deepinfer_jax.ops import dispatch


def indexer_scores(q_NHK, w_NH, keys_REK, token_req_N, visible_NE):
    """fp32 scores [N, E]; see ``deepinfer_jax.ops.indexer_topk.reference.indexer_scores``."""
    return dispatch.get("indexer_scores")(q_NHK, w_NH, keys_REK, token_req_N, visible_NE)


def indexer_topk(scores, n_visible, k: int, mode: str = "plain", candidates=None, pool_blocks: int = 0,
                 pool_block_size: int = 1):
    """(top-k ids [..., k], candidate pool [..., E]); see ``deepinfer_jax.ops.indexer_topk.reference.indexer_topk``."""
    return dispatch.get("indexer_topk")(scores, n_visible, k, mode, candidates, pool_blocks, pool_block_size)
