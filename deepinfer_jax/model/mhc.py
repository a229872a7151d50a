"""Single-pass mHC: 4-stream hyper-connections with Sinkhorn-constrained mixing (model.md §4.2).

The streams R have shape [B, T, n, d]. Each site (attn, ffn) of a layer predicts its mixing
coefficients from the streams entering it; the sublayer reads the streams collapsed with the
*previous* site's ``pre`` ("lagged pre"), and writes back with its own ``post`` and ``comb``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from deepinfer_jax.model.layers import matmul_t, row_mean


class Mix(NamedTuple):
    """fp32 coefficients of one site: pre/post [B, T, n], comb [B, T, n_in, n_out]."""

    pre: jax.Array
    post: jax.Array
    comb: jax.Array


def sinkhorn(logits: jax.Array, iters: int, eps: float) -> jax.Array:
    """Row softmax (+eps), a column normalisation, then ``iters - 1`` rounds of row then column."""
    x = jax.nn.softmax(logits, axis=-1) + eps
    x = x / (jnp.sum(x, axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        x = x / (jnp.sum(x, axis=-1, keepdims=True) + eps)
        x = x / (jnp.sum(x, axis=-2, keepdims=True) + eps)
    return x


def hc_mix(
    streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, iters: int, hc_eps: float,
    norm_eps: float,
) -> Mix:
    """Coefficients of one site from the streams entering it.

    streams [B, T, n, d]; fn [n*(n+2), n*d]; base [n*(n+2)]; scale [3].
    ``m = (flat . fn^T) * rsqrt(mean(flat^2) + eps)``; ``z = base + m * [s0 x n, s1 x n, s2 x n^2]``.
    """
    n = streams.shape[-2]
    flat = streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32)
    m = matmul_t(flat, fn.astype(jnp.float32))
    m = m * jax.lax.rsqrt(row_mean(flat * flat) + norm_eps)
    scales = jnp.concatenate([jnp.repeat(scale[0], n), jnp.repeat(scale[1], n), jnp.repeat(scale[2], n * n)])
    z = base.astype(jnp.float32) + m * scales.astype(jnp.float32)
    pre = jax.nn.sigmoid(z[..., :n]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(z[..., n : 2 * n])
    comb = sinkhorn(z[..., 2 * n :].reshape(*z.shape[:-1], n, n), iters, hc_eps)
    return Mix(pre, post, comb)


def collapse(streams: jax.Array, pre: jax.Array) -> jax.Array:
    """``sum_i pre[i] * R[i]``: [B, T, n, d] x [B, T, n] -> [B, T, d] (fp32 sum, streams' dtype)."""
    out = jnp.sum(pre[..., None] * streams.astype(jnp.float32), axis=-2)
    return out.astype(streams.dtype)


def expand(out: jax.Array, streams: jax.Array, mix: Mix) -> jax.Array:
    """``R'[j] = post[j] * y + sum_i comb[i, j] * R[i]`` -> [B, T, n, d] in ``out``'s dtype."""
    update = mix.post[..., None] * out[..., None, :].astype(jnp.float32)
    mixed = jnp.einsum("...ij,...id->...jd", mix.comb, streams.astype(jnp.float32))
    return (update + mixed).astype(out.dtype)
