"""Matmuls over weights resident in their storage formats (``model.qweight.QWeight``), by platform.

``quantized_matmul(x, w)``: ``x [M, K] @ decode(w).T`` for a 2-D ``QWeight`` ``w [N, K]``;
``quantized_grouped_matmul(x, w, sizes)``: the grouped matmul over expert-sorted rows
(``ops.grouped_matmul`` contract) for a stacked ``QWeight`` ``w [G, N, K]`` (the FP4 experts).

The dispatch table (``ops.dispatch``) picks the implementation: ``cpu`` is ``reference`` (an XLA
formulation that decodes the weight tile by tile inside a loop, so no full-size float copy of a
weight exists at any time); ``cuda_ffi`` sends FP8 weights to the ``fp8_block_gemm`` custom call
(``cuda.py``: activations quantized to E4M3 per 1 x 32, an approximation the reference does not
make); ``pallas`` runs the grouped FP4 kernel (``pallas.py``, interpret-mode tested only).
"""

from __future__ import annotations

from deepinfer_jax.ops import dispatch


def quantized_matmul(x_MK, w_NK):
    """[M, N] in x's dtype; see ``reference.quantized_matmul``."""
    return dispatch.get("quantized_matmul")(x_MK, w_NK)


def quantized_grouped_matmul(x_MK, w_GNK, group_sizes_G):
    """[M, N] in x's dtype; see ``reference.quantized_grouped_matmul``."""
    return dispatch.get("quantized_grouped_matmul")(x_MK, w_GNK, group_sizes_G)
