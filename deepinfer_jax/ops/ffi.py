"""Native CUDA custom calls through XLA FFI (``custom_calls/``): load, register, call.

The handlers live in one shared library, ``libdeepinfer_ffi.so``, built separately (installing the
package never needs CUDA)::

    cmake -S custom_calls -B custom_calls/build -DPython_EXECUTABLE=$(which python)
    cmake --build custom_calls/build -j2

It is found through ``$DEEPINFER_FFI_LIB`` (a path to the .so), else ``custom_calls/build/`` or
Bazel's ``bazel-bin/custom_calls/`` in the source tree (the Bazel build runs from the root ``WORKSPACE``). The first call of a wrapper loads it and
registers its handlers for the CUDA platform; a missing library is one ``FFILibraryNotFoundError``
saying how to build it.

Handlers (custom_calls/README.md has the full layouts):

- ``fp8_block_gemm``: ``y[M, N] = (x * x_scale) @ (w * w_scale)^T`` with e4m3 ``x [M, K]``
  (one scale per 1 x block_k), e4m3 ``w [N, K]`` (one scale per block_n x block_k), fp32 scales.
- ``sparse_attention_decode``: one query token per row over its window rows, its top-k global
  entries (through the block table) and the per-head sink, merged by log-sum-exp; the layout of
  ``deepinfer_jax.ops.sparse_attention.reference`` (the jnp definition it is tested against).

``fp8_block_gemm_reference`` is the jnp definition of the GEMM handler.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ENV_VAR = "DEEPINFER_FFI_LIB"
LIB_NAME = "libdeepinfer_ffi.so"
_REPO = Path(__file__).resolve().parents[2]
#: Where the library is looked for when ``$DEEPINFER_FFI_LIB`` is not set (CMake first, then Bazel).
DEFAULT_LOCATIONS = (_REPO / "custom_calls" / "build" / LIB_NAME, _REPO / "bazel-bin" / "custom_calls" / LIB_NAME)
#: XLA custom-call target name -> exported handler symbol.
TARGETS = {
    "deepinfer_fp8_block_gemm": "DeepinferFp8BlockGemm",
    "deepinfer_sparse_attention_decode": "DeepinferSparseAttentionDecode",
}
BUILD_HINT = (
    "build it with `make kernels` or `cmake -S custom_calls -B custom_calls/build "
    "-DPython_EXECUTABLE=$(which python) && cmake --build custom_calls/build -j2` (needs nvcc), "
    f"or point ${ENV_VAR} at an existing {LIB_NAME}"
)

_loaded: Path | None = None


class FFILibraryNotFoundError(RuntimeError):
    """The custom-call library is not built (or ``$DEEPINFER_FFI_LIB`` names a missing file)."""


def library_path() -> Path:
    """The library's path: ``$DEEPINFER_FFI_LIB`` if set (it must exist), else the first default location."""
    env = os.environ.get(ENV_VAR)
    if env:
        path = Path(env)
        if not path.is_file():
            raise FFILibraryNotFoundError(f"${ENV_VAR}={env} is not a file; {BUILD_HINT}")
        return path
    for path in DEFAULT_LOCATIONS:
        if path.is_file():
            return path
    looked = ", ".join(str(p) for p in DEFAULT_LOCATIONS)
    raise FFILibraryNotFoundError(f"{LIB_NAME} not found (${ENV_VAR} unset; looked in {looked}); {BUILD_HINT}")


def load() -> Path:
    """Load the library once and register its handlers as CUDA custom-call targets; returns its path."""
    global _loaded
    if _loaded is not None:
        return _loaded
    path = library_path()
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
    except OSError as err:
        raise FFILibraryNotFoundError(f"cannot load {path}: {err}; {BUILD_HINT}") from err
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA")
    _loaded = path
    return path


def _check(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{field}: {msg}")


def _block(total: int, blocks: int, given: int | None, field: str) -> int:
    """Block size along an axis of ``total`` elements split into ``blocks`` scale entries."""
    if given is not None:
        _check(given > 0 and -(-total // given) == blocks, field, f"{given} does not give {blocks} blocks of {total}")
        return given
    _check(blocks > 0 and total % blocks == 0, field, f"cannot infer the block size of {total} from {blocks} scales")
    return total // blocks


def _gemm_blocks(x, x_scale, w, w_scale, block_n, block_k) -> tuple[int, int]:
    """Validated (block_n, block_k) of an FP8 block GEMM's operands."""
    _check(x.ndim == 2 and x.dtype == jnp.float8_e4m3fn, "x", f"expected float8_e4m3fn [M, K], got {x.dtype}{x.shape}")
    _check(w.ndim == 2 and w.dtype == jnp.float8_e4m3fn, "w", f"expected float8_e4m3fn [N, K], got {w.dtype}{w.shape}")
    (m, k), (n, kw) = x.shape, w.shape
    _check(kw == k, "w", f"K={kw} differs from x's K={k}")
    for name, s in (("x_scale", x_scale), ("w_scale", w_scale)):
        _check(s.ndim == 2 and s.dtype == jnp.float32, name, f"expected float32 rank 2, got {s.dtype}{s.shape}")
    _check(x_scale.shape[0] == m, "x_scale", f"expected {m} rows, got {x_scale.shape[0]}")
    block_k = _block(k, x_scale.shape[1], block_k, "block_k")
    _check(k % block_k == 0, "block_k", f"K={k} is not a multiple of {block_k}")
    _check(w_scale.shape[1] == k // block_k, "w_scale", f"expected {k // block_k} K blocks, got {w_scale.shape[1]}")
    return _block(n, w_scale.shape[0], block_n, "block_n"), block_k


def fp8_block_gemm_reference(x, x_scale, w, w_scale, *, out_dtype=jnp.bfloat16, block_n=None, block_k=None):
    """jnp definition of ``fp8_block_gemm``: dequantise both operands, fp32 matmul, cast."""
    block_n, block_k = _gemm_blocks(x, x_scale, w, w_scale, block_n, block_k)
    xf = x.astype(jnp.float32) * jnp.repeat(x_scale, block_k, axis=1)
    ws = jnp.repeat(jnp.repeat(w_scale, block_n, axis=0)[: w.shape[0]], block_k, axis=1)
    y = jnp.einsum("mk,nk->mn", xf, w.astype(jnp.float32) * ws, precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype)


def fp8_block_gemm(x, x_scale, w, w_scale, *, out_dtype=jnp.bfloat16, block_n=None, block_k=None) -> jax.Array:
    """FP8 block-scaled GEMM on a CUDA device: ``y [M, N]`` in ``out_dtype`` (bfloat16 or float32).

    x [M, K] e4m3, x_scale [M, K/block_k] f32, w [N, K] e4m3 (the checkpoint's [out, in]),
    w_scale [ceil(N/block_n), K/block_k] f32. Block sizes are inferred from the scale shapes when
    they divide exactly (V4.1: 32 x 32), else must be given. block_k must be a multiple of 32.
    """
    block_n, block_k = _gemm_blocks(x, x_scale, w, w_scale, block_n, block_k)
    _check(block_k % 32 == 0, "block_k", f"the CUDA kernel needs a multiple of 32, got {block_k}")
    out_dtype = jnp.dtype(out_dtype)
    _check(out_dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)), "out_dtype", f"got {out_dtype}")
    load()
    call = jax.ffi.ffi_call("deepinfer_fp8_block_gemm", jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), out_dtype))
    return call(x, x_scale, w, w_scale, block_n=np.int64(block_n), block_k=np.int64(block_k))


def _check_decode(q, window, window_valid, pool, block_tables, token_req, topk, sink) -> None:
    floats = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
    _check(q.ndim == 3 and q.dtype in floats, "q_NHD", f"expected f32/bf16 [N, H, D], got {q.dtype}{q.shape}")
    n, h, d = q.shape
    _check(d <= 1024, "q_NHD", f"head dim must be <= 1024, got {d}")
    for name, a in (("window_NWD", window), ("pool_PED", pool)):
        _check(a.ndim == 3 and a.shape[2] == d and a.dtype in floats, name,
               f"expected f32/bf16 [*, *, {d}], got {a.dtype}{a.shape}")
    _check(window.shape[0] == n, "window_NWD", f"expected {n} rows, got {window.shape[0]}")
    _check(window_valid.shape == window.shape[:2] and window_valid.dtype == jnp.bool_, "window_valid_NW",
           f"expected bool {window.shape[:2]}, got {window_valid.dtype}{window_valid.shape}")
    for name, a, rank in (("block_tables_RM", block_tables, 2), ("token_req_N", token_req, 1), ("topk_NK", topk, 2)):
        _check(a.dtype == jnp.int32 and a.ndim == rank, name, f"expected int32 rank {rank}, got {a.dtype}{a.shape}")
    _check(token_req.shape[0] == n and topk.shape[0] == n, "token_req_N/topk_NK", f"expected leading dim {n}")
    _check(sink.shape == (h,), "sink_H", f"expected [{h}], got {sink.shape}")
    if topk.shape[1]:
        _check(min(*block_tables.shape, *pool.shape[:2]) > 0, "block_tables_RM/pool_PED",
               "must be non-empty when topk_NK has entries")


def sparse_attention_decode(q_NHD, window_NWD, window_valid_NW, pool_PED, block_tables_RM, token_req_N, topk_NK,
                            sink_H, *, return_lse: bool = False):
    """CSA2 sparse attention on a CUDA device, one query token per row: o [N, H, D] in q's dtype.

    The layout and rules of ``deepinfer_jax.ops.sparse_attention.reference.sparse_attention``: q
    [N, H, D]; the gathered SWA rows window [N, W, D] with window_valid [N, W]; the block pool
    [P, E, D]; block_tables [R, M] i32 (-1 = hole); token_req [N] i32; topk [N, K] i32 (entry ids of
    the token's request, -1 = empty); sink [H]. Window and pool share one dtype (the window is cast to
    the pool's if not). Scale D^-1/2. ``return_lse`` also returns the merged lse [N, H] f32.
    """
    _check_decode(q_NHD, window_NWD, window_valid_NW, pool_PED, block_tables_RM, token_req_N, topk_NK, sink_H)
    load()
    n, h, d = q_NHD.shape
    call = jax.ffi.ffi_call(
        "deepinfer_sparse_attention_decode",
        (jax.ShapeDtypeStruct(q_NHD.shape, q_NHD.dtype), jax.ShapeDtypeStruct((n, h), jnp.float32)),
    )
    out, lse = call(q_NHD, window_NWD.astype(pool_PED.dtype), window_valid_NW, pool_PED, block_tables_RM, token_req_N,
                    topk_NK, sink_H.astype(jnp.float32), scale=np.float32(d**-0.5))
    return (out, lse) if return_lse else out
