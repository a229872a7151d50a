"""Pallas kernels of mHC (contracts of ``reference``): one fused mixer kernel (the RMS statistic, the
[n*d] x [n*(n+2)] projection, sigmoid gates and all Sinkhorn rounds in registers, one read of the
streams; ``mhc_mix_collapse`` also collapses the same streams with the lagged pre in that pass),
and the collapse and expand kernels. Each program handles ``ROW_BLOCK`` token rows; the
leading axes of every input are flattened to rows and padded to a whole number of blocks.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.ops.compiler_params import compiler_params
from deepinfer_jax.ops.mhc.reference import site_scales

# Token rows per program. Not measured (no accelerator was available): 16 rows (Triton's smallest dot
# tile) of 4 streams keep interpret-mode tests cheap; on a GPU the mixer is bound by reading the streams, so larger blocks
# (32-128) should be tried with benchmarks/kernels.py.
ROW_BLOCK = 16


def _rows(x, keep: int, n_pad: int):
    """Flatten all but the last ``keep`` axes to rows and pad the rows to ``n_pad``."""
    flat = x.reshape(-1, *x.shape[x.ndim - keep :])
    return jnp.pad(flat, [(0, n_pad - flat.shape[0])] + [(0, 0)] * keep)


def _plan(lead: tuple[int, ...], row_block: int) -> tuple[int, int, int]:
    m = math.prod(lead)
    tm = max(1, min(row_block, m))
    return m, tm, -(-m // tm) * tm


def _mix_kernel(x_ref, w_pre_ref, w_post_ref, w_comb_ref, bs_ref, *refs, n, iters, hc_eps, norm_eps, collapse):
    """w_*_ref [P, n*d] (zero rows past each part's width); bs_ref [8, P]: base and scale of the pre, post
    and comb parts (rows 0-1, 2-3, 4-5), zero padded; every output is P wide."""
    if collapse:  # fused: also the sublayer input collapsed with the lagged pre
        lag_ref, pre_ref, post_ref, comb_ref, col_ref = refs
    else:
        pre_ref, post_ref, comb_ref = refs
    x = x_ref[...].astype(jnp.float32)  # [TM, n*d]
    tm = x.shape[0]
    if collapse:
        col_ref[...] = jnp.sum(lag_ref[...][:, :, None] * x.reshape(tm, n, -1), axis=1).astype(col_ref.dtype)
    r = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + norm_eps)

    def part(w_ref, row):  # z of one part, [TM, P]; all parts share the width P (Triton lowers no slices)
        w = w_ref[...].astype(jnp.float32)
        z = jnp.dot(x, w.T, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32) * r
        return bs_ref[row, :][None, :] + z * bs_ref[row + 1, :][None, :]

    pre_ref[...] = jax.nn.sigmoid(part(w_pre_ref, 0)) + hc_eps
    post_ref[...] = 2.0 * jax.nn.sigmoid(part(w_post_ref, 2))
    zc = part(w_comb_ref, 4)
    c = (zc if zc.shape[1] == n * n else zc[:, : n * n]).reshape(tm, n, n)  # n = 4: no slice
    c = jnp.exp(c - jnp.max(c, axis=-1, keepdims=True))
    c = c / jnp.sum(c, axis=-1, keepdims=True) + hc_eps
    c = c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)

    def one_round(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + hc_eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + hc_eps)

    c = jax.lax.fori_loop(0, iters - 1, one_round, c).reshape(tm, n * n)
    comb_ref[...] = c if comb_ref.shape[1] == n * n else jnp.pad(c, [(0, 0), (0, comb_ref.shape[1] - n * n)])


def _width(w: int) -> int:
    """Padded width of a projection part: a power of two, at least 16 (Triton's smallest dot tile)."""
    return max(16, pl.next_power_of_2(w))


def _mix_call(streams, fn, base, scale, pre_lag, iters, hc_eps, norm_eps, interpret, row_block):
    *lead, n, d = streams.shape
    m, tm, m_pad = _plan(tuple(lead), row_block)
    pw = _width(n * n)
    fn, base, scales = fn.astype(jnp.float32), base.astype(jnp.float32), site_scales(scale, n)
    bounds = ((0, n), (n, 2 * n), (2 * n, n * (n + 2)))
    weights = [jnp.pad(fn[lo:hi], [(0, pw - (hi - lo)), (0, 0)]) for lo, hi in bounds]
    bs = jnp.stack([jnp.pad(v[lo:hi], [(0, pw - (hi - lo))]) for lo, hi in bounds for v in (base, scales)])
    bs = jnp.pad(bs, [(0, 2), (0, 0)])  # 8 rows
    collapse = pre_lag is not None
    kernel = functools.partial(_mix_kernel, n=n, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps, collapse=collapse)
    row = lambda w: pl.BlockSpec((tm, w), lambda i: (i, 0))
    whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0, 0))
    args = [_rows(streams.reshape(*lead, n * d), 1, m_pad), *weights, bs]
    in_specs = [row(n * d), *(whole(w) for w in weights), whole(bs)]
    out_shape = [jax.ShapeDtypeStruct((m_pad, pw), jnp.float32)] * 3
    out_specs = [row(pw)] * 3
    if collapse:
        args.append(_rows(jnp.broadcast_to(pre_lag, (*lead, n)).astype(jnp.float32), 1, m_pad))
        in_specs.append(row(n))
        out_shape.append(jax.ShapeDtypeStruct((m_pad, d), streams.dtype))
        out_specs.append(row(d))
    outs = pl.pallas_call(kernel, out_shape=tuple(out_shape), grid=(m_pad // tm,), in_specs=in_specs,
                          out_specs=tuple(out_specs), interpret=interpret,
                          compiler_params=compiler_params(interpret))(*args)
    pre, post = outs[0][:m, :n].reshape(*lead, n), outs[1][:m, :n].reshape(*lead, n)
    comb = outs[2][:m, : n * n].reshape(*lead, n, n)
    return (pre, post, comb, outs[3][:m].reshape(*lead, d)) if collapse else (pre, post, comb)


@functools.partial(jax.jit, static_argnames=("iters", "hc_eps", "norm_eps", "interpret", "row_block"))
def mhc_mix(streams, fn, base, scale, iters: int, hc_eps: float, norm_eps: float, *, interpret: bool = False,
            row_block: int = ROW_BLOCK):
    """(pre [..., n], post [..., n], comb [..., n, n]) fp32; see ``reference.mhc_mix``."""
    return _mix_call(streams, fn, base, scale, None, iters, hc_eps, norm_eps, interpret, row_block)


@functools.partial(jax.jit, static_argnames=("iters", "hc_eps", "norm_eps", "interpret", "row_block"))
def mhc_mix_collapse(streams, fn, base, scale, pre_lag, iters: int, hc_eps: float, norm_eps: float, *,
                     interpret: bool = False, row_block: int = ROW_BLOCK):
    """(pre, post, comb, x [..., d]) from one read of the streams; see ``reference.mhc_mix_collapse``."""
    return _mix_call(streams, fn, base, scale, pre_lag, iters, hc_eps, norm_eps, interpret, row_block)


def _collapse_kernel(r_ref, pre_ref, o_ref):
    r = r_ref[...].astype(jnp.float32)  # [TM, n, d]
    o_ref[...] = jnp.sum(pre_ref[...][:, :, None] * r, axis=1).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "row_block"))
def mhc_collapse(streams, pre, *, interpret: bool = False, row_block: int = ROW_BLOCK):
    """[..., d] in streams' dtype; see ``reference.mhc_collapse``."""
    *lead, n, d = streams.shape
    m, tm, m_pad = _plan(tuple(lead), row_block)
    out = pl.pallas_call(
        _collapse_kernel,
        out_shape=jax.ShapeDtypeStruct((m_pad, d), streams.dtype),
        grid=(m_pad // tm,),
        in_specs=[pl.BlockSpec((tm, n, d), lambda i: (i, 0, 0)), pl.BlockSpec((tm, n), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((tm, d), lambda i: (i, 0)),
        interpret=interpret,
        compiler_params=compiler_params(interpret),
    )(_rows(streams, 2, m_pad), _rows(jnp.broadcast_to(pre, (*lead, n)).astype(jnp.float32), 1, m_pad))
    return out[:m].reshape(*lead, d)


def _expand_kernel(y_ref, r_ref, post_ref, comb_ref, o_ref):
    r = r_ref[...].astype(jnp.float32)  # [TM, n, d]
    comb = comb_ref[...]  # [TM, n_in, n_out]
    mixed = jnp.sum(comb[:, :, :, None] * r[:, :, None, :], axis=1)  # [TM, n_out, d]
    update = post_ref[...][:, :, None] * y_ref[...].astype(jnp.float32)[:, None, :]
    o_ref[...] = (update + mixed).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "row_block"))
def mhc_expand(out, streams, post, comb, *, interpret: bool = False, row_block: int = ROW_BLOCK):
    """[..., n, d] in ``out``'s dtype; see ``reference.mhc_expand``."""
    *lead, n, d = streams.shape
    m, tm, m_pad = _plan(tuple(lead), row_block)
    res = pl.pallas_call(
        _expand_kernel,
        out_shape=jax.ShapeDtypeStruct((m_pad, n, d), out.dtype),
        grid=(m_pad // tm,),
        in_specs=[pl.BlockSpec((tm, d), lambda i: (i, 0)), pl.BlockSpec((tm, n, d), lambda i: (i, 0, 0)),
                  pl.BlockSpec((tm, n), lambda i: (i, 0)), pl.BlockSpec((tm, n, n), lambda i: (i, 0, 0))],
        out_specs=pl.BlockSpec((tm, n, d), lambda i: (i, 0, 0)),
        interpret=interpret,
        compiler_params=compiler_params(interpret),
    )(_rows(out, 1, m_pad), _rows(streams, 2, m_pad), _rows(post.astype(jnp.float32), 1, m_pad),
      _rows(comb.astype(jnp.float32), 2, m_pad))
    return res[:m].reshape(*lead, n, d)
