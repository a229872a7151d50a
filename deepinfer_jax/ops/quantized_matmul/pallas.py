"""Pallas grouped matmul over packed FP4 (or FP8) expert weights, decoded inside the kernel.

The contract of ``reference.quantized_grouped_matmul`` with the structure of
``ops.grouped_matmul.pallas`` (row tiles x column tiles; a program visits only the groups whose rows
overlap its tile), except that each program reads its group's ``[TN, K/2]`` packed bytes and
``[TN, K/bc]`` scale bytes and decodes that tile in registers / shared memory: the float weight never
exists outside the kernel. Interpret-mode tested on CPU only (no accelerator run yet): the tile sizes
are the grouped kernel's, not tuned.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from deepinfer_jax.model.qweight import QWeight, decode
from deepinfer_jax.ops.compiler_params import compiler_params
from deepinfer_jax.ops.grouped_matmul.pallas import COL_BLOCK, ROW_BLOCK


def _kernel(first_ref, offs_ref, x_ref, d_ref, s_ref, o_ref, *, n_groups: int, like: QWeight):
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
        w = decode(like, d_ref[g, pl.ds(j * tn, tn), :], s_ref[g, pl.ds(j * tn, tn), :])  # [TN, K] f32

        def add():
            y = jax.lax.dot_general(x, w.astype(x.dtype), (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
            return acc + jnp.where((rows >= start) & (rows < end), y, 0.0)

        return g + 1, jax.lax.cond(end > start, add, lambda: acc)

    _, acc = jax.lax.while_loop(cond, body, (first_ref[i], jnp.zeros((tm, tn), jnp.float32)))
    o_ref[...] = acc.astype(o_ref.dtype)


def quantized_grouped_matmul(x_MK, w_GNK: QWeight, group_sizes_G, *, interpret: bool = False,
                             row_block: int = ROW_BLOCK, col_block: int = COL_BLOCK) -> jax.Array:
    """[M, N] in x's dtype; see ``reference.quantized_grouped_matmul`` (row block 1 weights: FP4 experts)."""
    if w_GNK.kind == "bf16" or w_GNK.block[0] != 1:
        raise ValueError(f"w_GNK: the Pallas kernel takes row-block-1 quantized experts, got {w_GNK!r}")
    return _call(x_MK, w_GNK, group_sizes_G, interpret=interpret, row_block=row_block, col_block=col_block)


@functools.partial(jax.jit, static_argnames=("interpret", "row_block", "col_block"))
def _call(x_MK, w_GNK, group_sizes_G, *, interpret, row_block, col_block):
    m, _ = x_MK.shape
    g, n, _ = w_GNK.shape
    tm = min(row_block, max(8, pl.next_power_of_2(m)))
    tn = min(col_block, n)
    m_pad, n_pad = -(-m // tm) * tm, -(-n // tn) * tn
    x = jnp.pad(x_MK, [(0, m_pad - m), (0, 0)])
    data = jnp.pad(w_GNK.data, [(0, 0), (0, n_pad - n), (0, 0)])
    scale = jnp.pad(w_GNK.scale, [(0, 0), (0, n_pad - n), (0, 0)])
    like = w_GNK.replace(None, None, (tn, w_GNK.shape[2]))  # static layout of one decoded tile
    offs = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes_G.astype(jnp.int32))])
    first = jnp.searchsorted(offs[1:], jnp.arange(0, m_pad, tm, dtype=jnp.int32), side="right").astype(jnp.int32)
    out = pl.pallas_call(
        functools.partial(_kernel, n_groups=g, like=like),
        out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), x_MK.dtype),
        grid=(m_pad // tm, n_pad // tn),
        in_specs=[pl.BlockSpec(first.shape, lambda i, j: (0,)), pl.BlockSpec(offs.shape, lambda i, j: (0,)),
                  pl.BlockSpec((tm, x.shape[1]), lambda i, j: (i, 0)),
                  pl.BlockSpec(data.shape, lambda i, j: (0, 0, 0)), pl.BlockSpec(scale.shape, lambda i, j: (0, 0, 0))],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=compiler_params(interpret),
    )(first, offs, x, data, scale)
    return out[:m, :n]
