"""Fused mHC: mixer statistics + Sinkhorn (``mhc_mix``), ``mhc_collapse`` and ``mhc_expand``,
dispatched by platform (``deepinfer_jax.ops.dispatch``); ``reference`` holds the jnp contracts."""

from __future__ import annotations

from deepinfer_jax.ops import dispatch


def mhc_mix(streams, fn, base, scale, iters: int, hc_eps: float, norm_eps: float):
    """(pre, post, comb) fp32; see ``deepinfer_jax.ops.mhc.reference.mhc_mix``."""
    return dispatch.get("mhc_mix")(streams, fn, base, scale, iters, hc_eps, norm_eps)


def mhc_collapse(streams, pre):
    """[..., d]; see ``deepinfer_jax.ops.mhc.reference.mhc_collapse``."""
    return dispatch.get("mhc_collapse")(streams, pre)


def mhc_expand(out, streams, post, comb):
    """[..., n, d]; see ``deepinfer_jax.ops.mhc.reference.mhc_expand``."""
    return dispatch.get("mhc_expand")(out, streams, post, comb)


def mhc_mix_collapse(streams, fn, base, scale, pre_lag, iters: int, hc_eps: float, norm_eps: float):
    """(pre, post, comb, x) in one pass; see ``deepinfer_jax.ops.mhc.reference.mhc_mix_collapse``."""
    return dispatch.get("mhc_mix_collapse")(streams, fn, base, scale, pre_lag, iters, hc_eps, norm_eps)
