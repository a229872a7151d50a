"""Single-pass mHC: 4-stream hyper-connections with Sinkhorn-constrained mixing (model.md §4.2).

The streams R have shape [B, T, n, d]. Each site (attn, ffn) of a layer predicts its mixing
coefficients from the streams entering it; the sublayer reads the streams collapsed with the
*previous* site's ``pre`` ("lagged pre"), and writes back with its own ``post`` and ``comb``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from deepinfer_jax.ops import mhc as ops_mhc
from deepinfer_jax.ops.mhc.reference import sinkhorn  # noqa: F401 (re-exported)


class Mix(NamedTuple):
    """fp32 coefficients of one site: pre/post [B, T, n], comb [B, T, n_in, n_out]."""

    pre: jax.Array
    post: jax.Array
    comb: jax.Array


def hc_mix(
    streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, iters: int, hc_eps: float,
    norm_eps: float,
) -> Mix:
    """Coefficients of one site from the streams entering it.

    streams [B, T, n, d]; fn [n*(n+2), n*d]; base [n*(n+2)]; scale [3].
    ``m = (flat . fn^T) * rsqrt(mean(flat^2) + eps)``; ``z = base + m * [s0 x n, s1 x n, s2 x n^2]``.
    Runs the selected ``mhc_mix`` kernel (``deepinfer_jax.ops.mhc``).
    """
    return Mix(*ops_mhc.mhc_mix(streams, fn, base, scale, iters, hc_eps, norm_eps))


def collapse(streams: jax.Array, pre: jax.Array) -> jax.Array:
    """``sum_i pre[i] * R[i]``: [B, T, n, d] x [B, T, n] -> [B, T, d] (fp32 sum, streams' dtype)."""
    return ops_mhc.mhc_collapse(streams, pre)


def expand(out: jax.Array, streams: jax.Array, mix: Mix) -> jax.Array:
    """``R'[j] = post[j] * y + sum_i comb[i, j] * R[i]`` -> [B, T, n, d] in ``out``'s dtype."""
    return ops_mhc.mhc_expand(out, streams, mix.post, mix.comb)
