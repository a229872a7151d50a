"""Pallas kernels of the indexer: scoring, and candidate pooling + top-k (contracts of ``reference``).

``indexer_scores``: one program per ``TOKEN_BLOCK`` tokens; per token the request's index keys
[E, hd] are read from the whole-array key table with a dynamic row index, one [H, hd] x [hd, E]
product, ReLU, the head-weighted sum and the visibility mask.

``indexer_topk``: one program per ``TOKEN_BLOCK`` token rows, vectorised over them. Selection is
``k`` rounds of "take the first maximum" (lowest index among ties, like ``lax.top_k``) over a
working copy whose taken entries drop to -inf; a slot whose maximum is -inf selects nothing. The
selected set is compacted to ascending ids with a running count. The candidate pool uses the
same rounds over block maxima (newest visible block forced to +inf).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.ops.compiler_params import compiler_params
from deepinfer_jax.ops.indexer_topk.reference import check_mode

# Token rows per program. Not measured (no accelerator yet): 8 rows of E scores keep a program's
# working set small in interpret-mode tests; tune with benchmarks/kernels.py on a GPU.
TOKEN_BLOCK = 8


def _pad_rows(x, n_pad, value=0):
    return jnp.pad(x, [(0, n_pad - x.shape[0])] + [(0, 0)] * (x.ndim - 1), constant_values=value)


def _scores_kernel(req_ref, q_ref, w_ref, vis_ref, keys_ref, o_ref):
    def one_token(t, carry):
        keys = keys_ref[req_ref[t]].astype(jnp.float32)  # [E, hd]
        dots = jnp.dot(q_ref[t].astype(jnp.float32), keys.T)  # [H, E]
        s = jnp.sum(jnp.maximum(dots, 0.0) * w_ref[t].astype(jnp.float32)[:, None], axis=0)
        o_ref[t] = jnp.where(vis_ref[t] > 0, s, -jnp.inf)
        return carry

    jax.lax.fori_loop(0, q_ref.shape[0], one_token, 0)


@functools.partial(jax.jit, static_argnames=("interpret", "token_block"))
def indexer_scores(q_NHK, w_NH, keys_REK, token_req_N, visible_NE, *, interpret: bool = False,
                   token_block: int = TOKEN_BLOCK) -> jax.Array:
    """fp32 scores [N, E]; see ``reference.indexer_scores``."""
    n, h, hd = q_NHK.shape
    e = keys_REK.shape[1]
    if n == 0 or e == 0:
        return jnp.full((n, e), -jnp.inf, jnp.float32)
    tb = max(1, min(token_block, n))
    n_pad = -(-n // tb) * tb
    args = (_pad_rows(token_req_N.astype(jnp.int32), n_pad), _pad_rows(q_NHK, n_pad), _pad_rows(w_NH, n_pad),
            _pad_rows(visible_NE.astype(jnp.int32), n_pad), keys_REK)
    out = pl.pallas_call(
        _scores_kernel,
        out_shape=jax.ShapeDtypeStruct((n_pad, e), jnp.float32),
        grid=(n_pad // tb,),
        in_specs=[pl.BlockSpec((tb,), lambda i: (i,)), pl.BlockSpec((tb, h, hd), lambda i: (i, 0, 0)),
                  pl.BlockSpec((tb, h), lambda i: (i, 0)), pl.BlockSpec((tb, e), lambda i: (i, 0)),
                  pl.BlockSpec(keys_REK.shape, lambda i: (0, 0, 0))],
        out_specs=pl.BlockSpec((tb, e), lambda i: (i, 0)),
        interpret=interpret,
        compiler_params=compiler_params(interpret),
    )(*args)
    return out[:n]


def _first_max(x, iota, size):
    """(max [rows], index of its first occurrence [rows]) along the last axis."""
    mx = jnp.max(x, axis=-1)
    return mx, jnp.min(jnp.where(x == mx[:, None], iota, size), axis=-1)


def _take_top(x, rounds: int):
    """Boolean [rows, S]: the entries taken by ``rounds`` first-maximum rounds with a finite maximum."""
    size = x.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)

    def one_round(_, carry):
        work, taken = carry
        mx, idx = _first_max(work, iota, size)
        hit = iota == idx[:, None]
        return jnp.where(hit, -jnp.inf, work), taken | (hit & (mx > -jnp.inf)[:, None])

    return jax.lax.fori_loop(0, rounds, one_round, (x, jnp.zeros(x.shape, bool)))[1]


def _topk_kernel(s_ref, nvis_ref, cand_ref, topk_ref, cand_out_ref, *, k, mode, pool_blocks, block, e):
    s = s_ref[...]  # [TB, Ep] (padding entries are -inf)
    tb, ep = s.shape
    iota = jax.lax.broadcasted_iota(jnp.int32, (tb, ep), 1)
    nvis = nvis_ref[...]
    cand = cand_ref[...] > 0
    if mode == "source":
        nb = ep // block
        block_max = jnp.max(s.reshape(tb, nb, block), axis=-1)
        newest = jnp.floor_divide(nvis - 1, block)
        block_max = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (tb, nb), 1) == newest[:, None], jnp.inf, block_max)
        keep = _take_top(block_max, min(pool_blocks, nb))
        cand = jnp.broadcast_to(keep[:, :, None], (tb, nb, block)).reshape(tb, ep) & (iota < nvis[:, None])
    elif mode == "confined":
        s = jnp.where(cand, s, -jnp.inf)
    sel = _take_top(s, min(k, e))
    rank = jnp.cumsum(sel.astype(jnp.int32), axis=-1) - 1  # slot of each selected entry (ascending ids)
    count = jnp.sum(sel.astype(jnp.int32), axis=-1)

    def one_slot(slot, carry):
        idx = jnp.sum(jnp.where(sel & (rank == slot), iota, 0), axis=-1)
        topk_ref[:, pl.ds(slot, 1)] = jnp.where(count > slot, idx, -1)[:, None].astype(jnp.int32)
        return carry

    jax.lax.fori_loop(0, k, one_slot, 0)
    cand_out_ref[...] = cand.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("k", "mode", "pool_blocks", "pool_block_size", "interpret",
                                             "token_block"))
def indexer_topk(scores, n_visible, k: int, mode: str = "plain", candidates=None, pool_blocks: int = 0,
                 pool_block_size: int = 1, *, interpret: bool = False, token_block: int = TOKEN_BLOCK):
    """(top-k ids [..., k] int32, candidate pool [..., E] bool or None); see ``reference.indexer_topk``."""
    check_mode(mode, candidates)
    *lead, e = scores.shape
    s = scores.reshape(-1, e).astype(jnp.float32)
    n = s.shape[0]
    if e == 0 or n == 0:
        pool = jnp.zeros(scores.shape, bool) if mode == "source" else candidates
        return jnp.full((*lead, k), -1, jnp.int32), pool
    block = pool_block_size if mode == "source" else 1
    ep = -(-e // block) * block
    tb = max(1, min(token_block, n))
    n_pad = -(-n // tb) * tb
    s = jnp.pad(s, [(0, n_pad - n), (0, ep - e)], constant_values=-jnp.inf)
    nvis = _pad_rows(jnp.broadcast_to(n_visible, lead).reshape(-1).astype(jnp.int32), n_pad)
    cand = jnp.zeros((n, e), jnp.int32) if candidates is None else candidates.reshape(-1, e).astype(jnp.int32)
    cand = jnp.pad(cand, [(0, n_pad - n), (0, ep - e)])
    kernel = functools.partial(_topk_kernel, k=k, mode=mode, pool_blocks=pool_blocks, block=block, e=e)
    topk, pool = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((n_pad, k), jnp.int32), jax.ShapeDtypeStruct((n_pad, ep), jnp.int32)),
        grid=(n_pad // tb,),
        in_specs=[pl.BlockSpec((tb, ep), lambda i: (i, 0)), pl.BlockSpec((tb,), lambda i: (i,)),
                  pl.BlockSpec((tb, ep), lambda i: (i, 0))],
        out_specs=(pl.BlockSpec((tb, k), lambda i: (i, 0)), pl.BlockSpec((tb, ep), lambda i: (i, 0))),
        interpret=interpret,
        compiler_params=compiler_params(interpret),
    )(s, nvis, cand)
    topk = topk[:n].reshape(*lead, k)
    if mode == "source":
        return topk, pool[:n, :e].reshape(*lead, e) > 0
    return topk, candidates
