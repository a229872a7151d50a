"""The CUDA path of ``quantized_matmul``: FP8 weights through the ``fp8_block_gemm`` custom call.

The custom call multiplies FP8 by FP8, so the activations are quantized first: E4M3 with one
float32 scale per row and ``block_k`` columns (``amax / 448``). That rounding is not in the model's
reference numerics (model.md §4.8: dynamic activation quantization is an engine detail), so this
path is an opt-in (``use_kernels("cuda_ffi")``), never the oracle path. Other kinds (FP4, bf16) and
shapes the kernel does not take (``block_k`` not a multiple of 32) use the XLA formulation.
Not yet run on a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.model.qweight import QWeight, ue8m0_to_f32
from deepinfer_jax.ops.quantized_matmul import reference

E4M3_MAX = 448.0


def quantize_activations(x_MK: jax.Array, block_k: int) -> tuple[jax.Array, jax.Array]:
    """(E4M3 [M, K], float32 scales [M, K / block_k]) with ``x ~= q * scale`` per 1 x block_k."""
    m, k = x_MK.shape
    g = x_MK.astype(jnp.float32).reshape(m, k // block_k, block_k)
    scale = jnp.maximum(jnp.max(jnp.abs(g), axis=-1), 1e-30) / E4M3_MAX
    q = jnp.clip(g / scale[..., None], -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(m, k), scale


def _gemm():
    from deepinfer_jax.ops import ffi

    return ffi.fp8_block_gemm


def quantized_matmul(x_MK: jax.Array, w_NK: QWeight, *, gemm=None) -> jax.Array:
    """[M, N] in x's dtype through ``fp8_block_gemm`` (``gemm`` overrides the call: tests pass the reference)."""
    br, bc = w_NK.block if w_NK.kind != "bf16" else (1, 1)
    k = w_NK.shape[1]
    if w_NK.kind != "fp8" or bc % 32 or k % bc:
        return reference.quantized_matmul(x_MK, w_NK)
    xq, xs = quantize_activations(x_MK, bc)
    call = gemm or _gemm()
    wq = w_NK.data if w_NK.data.dtype == jnp.float8_e4m3fn else jax.lax.bitcast_convert_type(w_NK.data, jnp.float8_e4m3fn)
    y = call(xq, xs, wq, ue8m0_to_f32(w_NK.scale), out_dtype=jnp.float32, block_n=br, block_k=bc)
    return y.astype(x_MK.dtype)
