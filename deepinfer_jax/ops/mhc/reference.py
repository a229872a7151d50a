"""jnp reference of single-pass mHC (the CPU path): mixer statistics + Sinkhorn, collapse, expand.

Streams R are [..., n, d]. ``mhc_mix`` predicts one site's fp32 coefficients from the streams
entering it: ``m = (flat . fn^T) * rsqrt(mean(flat^2) + eps)``, ``z = base + m * [s0 x n, s1 x n,
s2 x n^2]``, ``pre = sigmoid(z[:n]) + hc_eps``, ``post = 2 sigmoid(z[n:2n])``, ``comb =
sinkhorn(z[2n:])`` as [n_in, n_out]. ``mhc_collapse`` = ``sum_i pre[i] R[i]``; ``mhc_expand`` =
``R'[j] = post[j] y + sum_i comb[i, j] R[i]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.model.layers import matmul_t, row_mean


def sinkhorn(logits: jax.Array, iters: int, eps: float) -> jax.Array:
    """Row softmax (+eps), a column normalisation, then ``iters - 1`` rounds of row then column.

    The rounds run as one ``fori_loop`` body: unrolled, 20 rounds at every mHC site were most of a
    step's compiled program (a 12-layer step's optimized HLO shrank 5x and its compile time 2x).
    """
    x = jax.nn.softmax(logits, axis=-1) + eps
    x = x / (jnp.sum(x, axis=-2, keepdims=True) + eps)

    def round_(_, x):
        x = x / (jnp.sum(x, axis=-1, keepdims=True) + eps)
        return x / (jnp.sum(x, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, iters - 1, round_, x) if iters > 1 else x


def site_scales(scale: jax.Array, n: int) -> jax.Array:
    """The per-output scale vector [n*(n+2)]: s0 x n, s1 x n, s2 x n^2 (fp32)."""
    return jnp.concatenate([jnp.repeat(scale[0], n), jnp.repeat(scale[1], n),
                            jnp.repeat(scale[2], n * n)]).astype(jnp.float32)


def mhc_mix(streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, iters: int, hc_eps: float,
            norm_eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(pre [..., n], post [..., n], comb [..., n, n]) fp32 from streams [..., n, d]; fn [n*(n+2), n*d]."""
    n = streams.shape[-2]
    flat = streams.reshape(*streams.shape[:-2], -1).astype(jnp.float32)
    m = matmul_t(flat, fn.astype(jnp.float32))
    m = m * jax.lax.rsqrt(row_mean(flat * flat) + norm_eps)
    z = base.astype(jnp.float32) + m * site_scales(scale, n)
    pre = jax.nn.sigmoid(z[..., :n]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(z[..., n : 2 * n])
    comb = sinkhorn(z[..., 2 * n :].reshape(*z.shape[:-1], n, n), iters, hc_eps)
    return pre, post, comb


def mhc_collapse(streams: jax.Array, pre: jax.Array) -> jax.Array:
    """``sum_i pre[i] * R[i]``: [..., n, d] x [..., n] -> [..., d] (fp32 sum, streams' dtype)."""
    out = jnp.sum(pre[..., None] * streams.astype(jnp.float32), axis=-2)
    return out.astype(streams.dtype)


def mhc_expand(out: jax.Array, streams: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """``R'[j] = post[j] * y + sum_i comb[i, j] * R[i]`` -> [..., n, d] in ``out``'s dtype."""
    update = post[..., None] * out[..., None, :].astype(jnp.float32)
    mixed = jnp.einsum("...ij,...id->...jd", comb, streams.astype(jnp.float32))
    return (update + mixed).astype(out.dtype)


def mhc_mix_collapse(streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, pre_lag: jax.Array,
                     iters: int, hc_eps: float, norm_eps: float):
    """A site's ``mhc_mix`` and the sublayer input ``mhc_collapse(streams, pre_lag)`` (the previous site's
    pre) from one read of the streams: (pre, post, comb, x [..., d])."""
    return (*mhc_mix(streams, fn, base, scale, iters, hc_eps, norm_eps), mhc_collapse(streams, pre_lag))
