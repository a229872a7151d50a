"""Pallas grouped matmul (contract of ``reference.grouped_matmul``), written for this project.

Grid: (row tiles of ``ROW_BLOCK``, column tiles of ``COL_BLOCK``). A program visits only the
groups whose row range overlaps its tile (a while loop from the first such group, found from the
group offsets outside the kernel), multiplies the whole row tile by that group's [COL_BLOCK, K]
weight slice and keeps the rows that belong to the group; rows no group covers stay zero. Empty
groups are skipped. Every output row of every tile is written.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.ops.compiler_params import compiler_params

# Tile sizes. Not measured (no accelerator was available): 16 rows x 128 columns is the smallest
# MMA-friendly tile on current GPUs and keeps interpret-mode tests cheap; tune with
# benchmarks/kernels.py (ROW_BLOCK in {16, 64, 128}, COL_BLOCK in {128, 256}).
ROW_BLOCK = 16
COL_BLOCK = 128


def _kernel(first_ref, offs_ref, x_ref, w_ref, o_ref, *, n_groups: int):
    i, j = pl.program_id(0), pl.program_id(1)
    tm, tn = o_ref.shape
    row0 = i * tm
    rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
    x = x_ref[...]

    def cond(carry):
        g, _ = carry
        return (g < n_groups) & (offs_ref[jnp.minimum(g, n_groups - 1)] < row0 + tm)

    def body(carry):
        g, acc = carry
        start, end = offs_ref[g], offs_ref[g + 1]
        w = w_ref[g, pl.ds(j * tn, tn), :]  # [TN, K]

        def add():
            y = jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
            return acc + jnp.where((rows >= start) & (rows < end), y, 0.0)

        return g + 1, jax.lax.cond(end > start, add, lambda: acc)

    _, acc = jax.lax.while_loop(cond, body, (first_ref[i], jnp.zeros((tm, tn), jnp.float32)))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "row_block", "col_block"))
def grouped_matmul(x_MK, w_GNK, group_sizes_G, *, interpret: bool = False, row_block: int = ROW_BLOCK,
                   col_block: int = COL_BLOCK) -> jax.Array:
    """[M, N] in x's dtype; see ``reference.grouped_matmul``."""
    m, kdim = x_MK.shape
    g, n, _ = w_GNK.shape
    tm = min(row_block, max(8, pl.next_power_of_2(m)))
    tn = min(col_block, n)
    m_pad, n_pad = -(-m // tm) * tm, -(-n // tn) * tn
    x = jnp.pad(x_MK, [(0, m_pad - m), (0, 0)])
    w = jnp.pad(w_GNK, [(0, 0), (0, n_pad - n), (0, 0)])
    offs = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes_G.astype(jnp.int32))])
    # first group whose rows reach into each row tile (groups ending at or before the tile are skipped)
    first = jnp.searchsorted(offs[1:], jnp.arange(0, m_pad, tm, dtype=jnp.int32), side="right").astype(jnp.int32)
    out = pl.pallas_call(
        functools.partial(_kernel, n_groups=g),
        out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), x_MK.dtype),
        grid=(m_pad // tm, n_pad // tn),
        in_specs=[pl.BlockSpec(first.shape, lambda i, j: (0,)), pl.BlockSpec(offs.shape, lambda i, j: (0,)),
                  pl.BlockSpec((tm, kdim), lambda i, j: (i, 0)), pl.BlockSpec(w.shape, lambda i, j: (0, 0, 0))],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=compiler_params(interpret),
    )(first, offs, x, w)
    return out[:m, :n]
