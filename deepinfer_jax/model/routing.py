"""The MoE's router score and expert activation (model.md §4.6): a leaf module, shared by every strategy.

``route`` (fp32 ``sqrt(softplus)`` scores, top-k of ``score + bias`` over the logical experts,
weights renormalised and scaled) and ``swiglu`` (the clamped expert activation) are what the dense
reference and the grouped-matmul path (``model.moe``) and the expert-parallel ``shard_map``
(``parallel.ep_moe``) all compute with. It imports nothing from ``deepinfer_jax``, so every layer can
use it without an import circle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["route", "swiglu"]


def swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """``silu(min(gate, limit)) * clip(up, -limit, limit)`` in fp32 (no clamp when limit <= 0)."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return jax.nn.silu(gate) * up


def route(logits_NE: jax.Array, bias_E: jax.Array, k: int, scale: float, renormalize: bool):
    """(weights [N, k] fp32, expert ids [N, k]) from fp32 router logits."""
    s = jnp.sqrt(jax.nn.softplus(logits_NE.astype(jnp.float32)))
    _, ids = jax.lax.top_k(s + bias_E.astype(jnp.float32), k)
    w = jnp.take_along_axis(s, ids, axis=-1)
    if renormalize and k > 1:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * scale, ids
