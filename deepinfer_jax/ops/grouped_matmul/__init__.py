"""The MoE grouped matmul over expert-sorted rows, dispatched by platform.

``grouped_matmul`` looks up the selected implementation (``deepinfer_jax.ops.dispatch``);
``reference`` holds the jnp contract and ``moe_experts`` (routed experts on sorted rows over any
grouped matmul), ``pallas`` the kernel.
"""

from __future__ import annotations

from deepinfer_jax.ops import dispatch


def grouped_matmul(x_MK, w_GNK, group_sizes_G):
    """[M, N]; see ``deepinfer_jax.ops.grouped_matmul.reference.grouped_matmul``."""
    return dispatch.get("grouped_matmul")(x_MK, w_GNK, group_sizes_G)
