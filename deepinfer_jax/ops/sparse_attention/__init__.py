"""Sparse paged attention: SWA window rows + top-k global entries via the block table + the sink.

``sparse_attention(...)`` dispatches (``deepinfer_jax.ops.dispatch``); ``reference`` is the jnp
path, ``pallas`` the kernel.
"""

from __future__ import annotations

from deepinfer_jax.ops import dispatch


def sparse_attention(q_NHD, window_NWD, window_valid_NW, pool_PED, block_tables_RM, token_req_N, topk_NK, sink_H):
    """o [N, H, D]: see ``deepinfer_jax.ops.sparse_attention.reference`` for the contract."""
    return dispatch.get("sparse_attention")(q_NHD, window_NWD, window_valid_NW, pool_PED, block_tables_RM,
                                            token_req_N, topk_NK, sink_H)
