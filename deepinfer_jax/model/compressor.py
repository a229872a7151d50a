"""The KV compressor of a FULL (KV-source) layer (model.md §4.4).

Ratio r > 1: non-overlapping groups of r consecutive tokens starting at position 0 are pooled with
a per-channel softmax gate; ratio 1 is a plain projection. Either way the latent is RMS-normalised.
An incomplete trailing group produces no entry.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.model.layers import Linear, RMSNorm


class Compressor(nnx.Module):
    """``compressor.wkv`` [D, d], ``compressor.wgate`` [D, d] (ratio > 1 only), ``compressor.norm`` [D]."""

    def __init__(self, d: int, head_dim: int, ratio: int, eps: float, *, rngs: nnx.Rngs, std: float):
        self.ratio = ratio
        self.wkv = Linear(d, head_dim, rngs=rngs, std=std)
        if ratio > 1:
            self.wgate = Linear(d, head_dim, rngs=rngs, std=std)
        self.norm = RMSNorm(head_dim, eps)

    def __call__(self, x_BTd: jax.Array) -> jax.Array:
        """Normalised latent entries [B, T // ratio, D] (pre-RoPE) for the complete groups of x."""
        if self.ratio == 1:
            return self.norm(self.wkv(x_BTd))
        b, t, _ = x_BTd.shape
        n = t // self.ratio
        x = x_BTd[:, : n * self.ratio].astype(jnp.float32)
        values = self.wkv(x).reshape(b, n, self.ratio, -1)
        gates = jax.nn.softmax(self.wgate(x).reshape(b, n, self.ratio, -1), axis=2)
        pooled = jnp.sum(values * gates, axis=2).astype(x_BTd.dtype)
        return self.norm(pooled)
