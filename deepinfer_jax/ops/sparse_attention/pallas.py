"""Pallas kernel of sparse paged attention (same contract as ``reference.sparse_attention``).

Grid: one program per ``TOKEN_BLOCK`` flat query tokens (decode: one token per request; prefill:
a request's ``T`` tokens are consecutive, any mix of both in one call). Per token, all heads at
once: the window part is one [H, D] x [D, W] product and a masked softmax; the global part walks
the token's ``k`` selected entries, translating each entry id through the block table to a
(block, offset) of the pool and loading that one row (holes and empty slots are skipped by a
-inf logit and a zeroed row), with an online (running max / running sum) softmax. The two
(out, lse) parts and the sink merge by log-sum-exp, as in the reference.

The block table, pool and sink are whole-array operands read with dynamic indices: the pool is
never copied per program, only the selected rows are read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.ops.compiler_params import compiler_params

# Query tokens per program. Not measured yet (no accelerator was available when it was written):
# 8 keeps the per-program working set (q, window rows and output of 8 tokens) small for interpret-mode
# tests; rerun benchmarks/kernels.py on a GPU over TOKEN_BLOCK in {1, 4, 8, 16} to tune it.
TOKEN_BLOCK = 8


def _kernel(req_ref, q_ref, win_ref, wvalid_ref, topk_ref, tables_ref, pool_ref, sink_ref, o_ref, *, n_topk: int):
    tb, h, d = q_ref.shape
    e = pool_ref.shape[1]
    scale = d**-0.5
    sink = sink_ref[0, :].astype(jnp.float32)  # [H]

    def one_token(t, carry):
        q = q_ref[t].astype(jnp.float32)  # [H, D]
        ok_w = wvalid_ref[t] > 0  # [W]
        win = jnp.where(ok_w[:, None], win_ref[t].astype(jnp.float32), 0.0)  # [W, D]
        s = jnp.where(ok_w[None, :], jnp.dot(q, win.T) * scale, -jnp.inf)  # [H, W]
        m_w = jnp.max(s, axis=-1)
        m_w = jnp.where(jnp.isfinite(m_w), m_w, 0.0)
        p = jnp.exp(s - m_w[:, None])
        l_w = jnp.sum(p, axis=-1)
        o_w = jnp.dot(p, win) / jnp.where(l_w > 0, l_w, 1.0)[:, None]
        lse_w = jnp.log(l_w) + m_w
        lse = jnp.logaddexp(sink, lse_w)
        out = o_w * jnp.exp(lse_w - lse)[:, None]
        if n_topk:
            req = req_ref[t]

            def one_entry(i, acc):
                m, l, o = acc
                j = topk_ref[t, i]
                jj = jnp.maximum(j, 0)
                blk = tables_ref[req, jj // e]
                ok = (j >= 0) & (blk >= 0)
                row = jnp.where(ok, pool_ref[jnp.maximum(blk, 0), jj % e, :].astype(jnp.float32), 0.0)  # [D]
                logit = jnp.where(ok, jnp.sum(q * row[None, :], axis=-1) * scale, -jnp.inf)  # [H]
                m_new = jnp.maximum(m, logit)
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                alpha, pr = jnp.exp(m - m_safe), jnp.exp(logit - m_safe)
                return m_new, l * alpha + pr, o * alpha[:, None] + pr[:, None] * row[None, :]

            init = (jnp.full((h,), -jnp.inf, jnp.float32), jnp.zeros((h,), jnp.float32), jnp.zeros((h, d), jnp.float32))
            m_g, l_g, o_g = jax.lax.fori_loop(0, n_topk, one_entry, init)
            m_g = jnp.where(jnp.isfinite(m_g), m_g, 0.0)
            lse_g = jnp.log(l_g) + m_g
            o_g = o_g / jnp.where(l_g > 0, l_g, 1.0)[:, None]
            lse_all = jnp.logaddexp(lse, lse_g)
            out = out * jnp.exp(lse - lse_all)[:, None] + o_g * jnp.exp(lse_g - lse_all)[:, None]
        o_ref[t] = out.astype(o_ref.dtype)
        return carry

    jax.lax.fori_loop(0, tb, one_token, 0)


def _origin(ndim: int):
    """Index map of a whole-array operand: every program sees block (0, ..., 0)."""
    return lambda i: (0,) * ndim


@functools.partial(jax.jit, static_argnames=("interpret", "token_block"))
def sparse_attention(q_NHD, window_NWD, window_valid_NW, pool_PED, block_tables_RM, token_req_N, topk_NK, sink_H,
                     *, interpret: bool = False, token_block: int = TOKEN_BLOCK) -> jax.Array:
    """o [N, H, D] in q's dtype; inputs as in ``reference.sparse_attention``."""
    n, h, d = q_NHD.shape
    w, k = window_NWD.shape[1], topk_NK.shape[1]
    tb = max(1, min(token_block, n))
    n_pad = -(-n // tb) * tb
    pad = n_pad - n

    def padded(x, value=0):
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1), constant_values=value)

    topk = topk_NK.astype(jnp.int32) if k else jnp.full((n, 1), -1, jnp.int32)
    args = (padded(token_req_N.astype(jnp.int32)), padded(q_NHD), padded(window_NWD),
            padded(window_valid_NW.astype(jnp.int32)), padded(topk, -1), block_tables_RM.astype(jnp.int32),
            pool_PED, sink_H.astype(jnp.float32).reshape(1, h))
    whole = lambda a: pl.BlockSpec(a.shape, _origin(a.ndim))
    in_specs = [pl.BlockSpec((tb,), lambda i: (i,)), pl.BlockSpec((tb, h, d), lambda i: (i, 0, 0)),
                pl.BlockSpec((tb, w, d), lambda i: (i, 0, 0)), pl.BlockSpec((tb, w), lambda i: (i, 0)),
                pl.BlockSpec((tb, topk.shape[1]), lambda i: (i, 0)), whole(args[5]), whole(args[6]), whole(args[7])]
    out = pl.pallas_call(
        functools.partial(_kernel, n_topk=k),
        out_shape=jax.ShapeDtypeStruct((n_pad, h, d), q_NHD.dtype),
        grid=(n_pad // tb,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((tb, h, d), lambda i: (i, 0, 0)),
        interpret=interpret,
        compiler_params=compiler_params(interpret),
    )(*args)
    return out[:n]
