"""Small building blocks shared by the V4.1 modules: Linear (torch layout) and RMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """``weight * x * rsqrt(mean(x^2) + eps)`` in fp32, cast back to x's dtype (model.md §4.7)."""
    v = x.astype(jnp.float32)
    v = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + eps)
    if weight is not None:
        v = weight.astype(jnp.float32) * v
    return v.astype(x.dtype)


class Linear(nnx.Module):
    """``y = x @ weight.T`` with ``weight`` stored [out, in] like the checkpoint."""

    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs, std: float = 0.02, dtype=jnp.float32):
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (d_out, d_in)) * std).astype(dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype))


class RMSNorm(nnx.Module):
    """RMSNorm with a learned weight (initialised to ones)."""

    def __init__(self, dim: int, eps: float, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)
