"""jnp reference of the grouped matmul over expert-sorted rows (the CPU path), and the MoE expert
computation built on any grouped matmul.

``grouped_matmul(x_MK, w_GNK, group_sizes_G)``: rows are sorted by group; the first
``group_sizes[0]`` rows use ``w[0]``, the next ``group_sizes[1]`` rows ``w[1]``, and so on
(``y[m] = x[m] @ w[g(m)].T``, weights in the checkpoint's [out, in] layout). Rows past
``sum(group_sizes)`` are zero. fp32 accumulation, output in x's dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp


def grouped_matmul(x_MK: jax.Array, w_GNK: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
    """[M, N] = per-row ``x @ w[group].T`` (``jax.lax.ragged_dot``)."""
    y = jax.lax.ragged_dot(x_MK, jnp.swapaxes(w_GNK, 1, 2).astype(x_MK.dtype), group_sizes_G.astype(jnp.int32),
                           preferred_element_type=jnp.float32)
    rows = jnp.arange(x_MK.shape[0]) < jnp.sum(group_sizes_G)
    return jnp.where(rows[:, None], y, 0.0).astype(x_MK.dtype)


def sort_by_expert(ids_NK: jax.Array, n_experts: int) -> tuple[jax.Array, jax.Array]:
    """(order [N*k]: flat (token, slot) pairs sorted by expert (stable), group sizes [E])."""
    flat = ids_NK.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return order, jnp.bincount(flat, length=n_experts).astype(jnp.int32)


def moe_experts(x_Nd: jax.Array, w1_EId: jax.Array, w3_EId: jax.Array, w2_EdI: jax.Array, ids_NK: jax.Array,
                weights_NK: jax.Array, act: Callable[[jax.Array, jax.Array], jax.Array],
                gmm: Callable = grouped_matmul) -> jax.Array:
    """Routed experts on expert-sorted rows: ``sum_k weights[n, k] * w2[e] . act(w1[e] . x, w3[e] . x)``.

    x [N, d]; w1/w3 [E, inter, d]; w2 [E, d, inter]; ids/weights [N, k]. Each token is repeated once
    per selected expert, sorted by expert, run through three grouped matmuls (``gmm``), weighted and
    summed back per token. Returns fp32 [N, d].
    """
    n, k = ids_NK.shape
    order, sizes = sort_by_expert(ids_NK, w1_EId.shape[0])
    token = order // k
    xs = x_Nd[token]
    h = act(gmm(xs, w1_EId, sizes), gmm(xs, w3_EId, sizes))
    h = (h * weights_NK.reshape(-1)[order][:, None]).astype(x_Nd.dtype)
    y = gmm(h, w2_EdI, sizes).astype(jnp.float32)
    return jnp.zeros((n, y.shape[-1]), jnp.float32).at[token].add(y)
