"""Small building blocks shared by the V4.1 modules: Linear (torch layout) and RMSNorm.

A weight may be a float array or a ``qweight.QWeight`` (resident in its checkpoint format):
``matmul_t`` then decodes it inside the matmul (``ops.quantized_matmul``) and ``take_rows`` decodes
only the rows it gathers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.model.qweight import QWeight, take_rows  # noqa: F401 -- take_rows re-exported for the model


def row_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis (keepdims), computed as a matmul so that every row rounds the same way
    whatever the number of rows (XLA:CPU vectorises plain row reductions differently by row count)."""
    return matmul_t(x, jnp.ones((1, x.shape[-1]), x.dtype))


def row_mean(x: jax.Array) -> jax.Array:
    """Mean over the last axis (keepdims), batch-shape independent like ``row_sum``."""
    return row_sum(x) / x.shape[-1]


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """``weight * x * rsqrt(mean(x^2) + eps)`` in fp32, cast back to x's dtype (model.md §4.7)."""
    v = x.astype(jnp.float32)
    v = v * jax.lax.rsqrt(row_mean(v * v) + eps)
    if weight is not None:
        v = weight.astype(jnp.float32) * v
    return v.astype(x.dtype)


def matmul_t(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w.T`` for x [..., in], w [out, in], with row results that never depend on the batch shape.

    XLA:CPU's matrix-matrix kernels give each row the same bits whatever the number of rows, but
    its matrix-vector path (one row) rounds differently. With fake-quant boundaries downstream, a
    one-ulp difference can flip a bin, so a single row is padded to two: the paged step and the
    full forward then compute identical values for the same token. A ``QWeight`` ``w`` is decoded
    tile by tile inside the matmul (the values, hence the results, equal the float-resident path's).
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    single = x2.shape[0] == 1
    if single:
        x2 = jnp.concatenate([x2, jnp.zeros_like(x2)], axis=0)
    if isinstance(w, QWeight):
        from deepinfer_jax.ops.quantized_matmul import quantized_matmul

        y = quantized_matmul(x2, w.astype(x.dtype))
    else:
        y = jnp.einsum("ni,oi->no", x2, w.astype(x.dtype))
    return (y[:1] if single else y).reshape(*lead, w.shape[0])


class Linear(nnx.Module):
    """``y = x @ weight.T`` with ``weight`` stored [out, in] like the checkpoint."""

    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs, std: float = 0.02, dtype=jnp.float32):
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (d_out, d_in)) * std).astype(dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return matmul_t(x, self.weight[...])


class RMSNorm(nnx.Module):
    """RMSNorm with a learned weight (initialised to ones)."""

    def __init__(self, dim: int, eps: float, dtype=jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)
