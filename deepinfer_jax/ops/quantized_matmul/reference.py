"""The CPU formulation of the quantized matmuls: decode inside the matmul, one row tile at a time.

``quantized_matmul(x [M, K], w [N, K])`` walks the weight's rows in tiles of ``tile_rows(N, K)`` rows
(a multiple of the row block and of ``ALIGN_ROWS``, about ``TILE_BYTES`` of float32 once decoded); a
weight that fits one tile is decoded whole and multiplied once. Each iteration of one XLA
while loop slices the tile's storage bytes and scale rows, decodes them to float32 and multiplies;
the rows past the last full tile run once after the loop. The only float copy of the weight is one
tile (``TILE_BYTES``), and each step reads the weight in its storage bytes. Each tile's product is
the same ``einsum`` over the same decoded values as the float-resident path. XLA:CPU's dot kernel
(YNNPACK) gives an output column the same bits whatever the number of columns as long as the column
splits fall on multiples of ``ALIGN_ROWS`` (measured: 64 yes, 8/16/32 no), so with a tail that is a
multiple of 64 too the results agree bit for bit with the float-resident path; otherwise they agree to
float32 reassociation (~1e-7 relative). ``tests/test_quantized_residency.py`` checks both.

``quantized_grouped_matmul`` is the plain definition (decode the stacked weight, ``ragged_dot``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from deepinfer_jax.model.qweight import QWeight, decode, dequantize

#: Float32 bytes of one decoded weight tile (4 MiB: measured faster than 1, 2 or 8 MiB for the shipped
#: head at 1-32 rows on this 2-core machine, docs/residency.md).
TILE_BYTES = 4 << 20
#: Tiles are a multiple of this many rows (the dot kernel's column tile on XLA:CPU, see above).
ALIGN_ROWS = 64


def tile_rows(n: int, k: int, row_block: int, tile_bytes: int = TILE_BYTES) -> int:
    """Rows per tile: a multiple of ``row_block`` and ``ALIGN_ROWS`` near ``tile_bytes / (4 K)``, at most ``n``."""
    step = math.lcm(row_block, ALIGN_ROWS)
    rows = max(step, (tile_bytes // max(4 * k, 1)) // step * step)
    return min(rows, n)


def _dot(x, wf):
    return jnp.einsum("ni,oi->no", x, wf.astype(x.dtype))


def quantized_matmul(x_MK: jax.Array, w_NK: QWeight, *, tile_bytes: int = TILE_BYTES) -> jax.Array:
    """``x @ decode(w).T`` -> [M, N] in x's dtype, decoding one row tile of ``w`` per loop iteration."""
    n, k = w_NK.shape
    m = x_MK.shape[0]
    br = 1 if w_NK.kind == "bf16" else w_NK.block[0]
    rows = tile_rows(n, k, br, tile_bytes)
    if rows >= n:
        return _dot(x_MK, decode(w_NK, w_NK.data, w_NK.scale))
    tiles, srows = n // rows, rows // br
    data, scale = w_NK.data, w_NK.scale

    def body(i, y):
        d = jax.lax.dynamic_slice_in_dim(data, i * rows, rows, axis=0)
        s = None if scale is None else jax.lax.dynamic_slice_in_dim(scale, i * srows, srows, axis=0)
        return jax.lax.dynamic_update_index_in_dim(y, _dot(x_MK, decode(w_NK, d, s)), i, axis=0)

    ys = jax.lax.fori_loop(0, tiles, body, jnp.zeros((tiles, m, rows), x_MK.dtype))
    y = jnp.transpose(ys, (1, 0, 2)).reshape(m, tiles * rows)
    done = tiles * rows
    if done == n:
        return y
    tail_scale = None if scale is None else scale[done // br:]
    return jnp.concatenate([y, _dot(x_MK, decode(w_NK, data[done:], tail_scale))], axis=1)


def quantized_grouped_matmul(x_MK: jax.Array, w_GNK: QWeight, group_sizes_G: jax.Array) -> jax.Array:
    """[M, N] = per-row ``x @ decode(w[group]).T`` (the ``grouped_matmul`` contract; decodes the whole stack)."""
    from deepinfer_jax.ops.grouped_matmul.reference import grouped_matmul

    return grouped_matmul(x_MK, dequantize(w_GNK, jnp.float32), group_sizes_G)
