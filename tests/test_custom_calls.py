"""The CUDA custom calls (custom_calls/, deepinfer_jax.ops.ffi): build, exported symbols, loading, errors.

On CPU: the missing-library error, input validation, the FP8 GEMM reference against a numpy loop,
and (when nvcc and cmake are on PATH) a compile-only CMake build for sm_90a + sm_100a whose exported
handler symbols are checked with ``nm -D`` and which loads and registers through ``ffi.load``.
On a GPU backend: both handlers against their jnp references.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.ops import ffi

REPO = Path(__file__).resolve().parents[1]
HAVE_NVCC = shutil.which("nvcc") is not None and shutil.which("cmake") is not None
ON_GPU = jax.default_backend() == "gpu"


@pytest.fixture(scope="module")
def built_lib(tmp_path_factory) -> Path:
    """Configure and build custom_calls/ with CMake for sm_90a and sm_100a into a tmp dir (compile only)."""
    if not HAVE_NVCC:
        pytest.skip("nvcc or cmake not on PATH: the CUDA custom calls cannot be compiled here")
    build = tmp_path_factory.mktemp("ffi_build")
    t0 = time.perf_counter()
    cfg = ["cmake", "-S", str(REPO / "custom_calls"), "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}",
           "-DCMAKE_CUDA_ARCHITECTURES=90a;100a", "-DCMAKE_BUILD_TYPE=Release"]
    for cmd in (cfg, ["cmake", "--build", str(build), "-j2"]):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    print(f"\ncustom_calls CMake build (sm_90a + sm_100a): {time.perf_counter() - t0:.1f} s")
    lib = build / ffi.LIB_NAME
    assert lib.is_file()
    return lib


@pytest.fixture
def fresh_ffi(monkeypatch):
    """ffi with nothing loaded (restored afterwards)."""
    monkeypatch.setattr(ffi, "_loaded", None)
    return ffi


# ---- CPU: errors and validation -------------------------------------------------------------------


def test_missing_library_error_says_how_to_build(fresh_ffi, monkeypatch, tmp_path):
    monkeypatch.delenv(ffi.ENV_VAR, raising=False)
    monkeypatch.setattr(ffi, "DEFAULT_LOCATIONS", (tmp_path / "build" / ffi.LIB_NAME,))
    with pytest.raises(ffi.FFILibraryNotFoundError, match="libdeepinfer_ffi.so not found") as err:
        ffi.load()
    assert "cmake -S custom_calls" in str(err.value) and ffi.ENV_VAR in str(err.value)
    x = jnp.zeros((2, 32), jnp.float8_e4m3fn)
    s = jnp.ones((2, 1), jnp.float32)
    with pytest.raises(ffi.FFILibraryNotFoundError):  # the wrappers load on first use
        ffi.fp8_block_gemm(x, s, x, s)
    monkeypatch.setenv(ffi.ENV_VAR, str(tmp_path / "nope.so"))
    with pytest.raises(ffi.FFILibraryNotFoundError, match=r"\$DEEPINFER_FFI_LIB=.*nope.so is not a file"):
        ffi.load()
    assert ffi._loaded is None


def test_bad_inputs_are_value_errors_naming_the_field():
    x = jnp.zeros((4, 64), jnp.float8_e4m3fn)
    w = jnp.zeros((8, 64), jnp.float8_e4m3fn)
    xs, ws = jnp.ones((4, 2), jnp.float32), jnp.ones((1, 2), jnp.float32)
    with pytest.raises(ValueError, match="^x:"):
        ffi.fp8_block_gemm(x.astype(jnp.bfloat16), xs, w, ws)
    with pytest.raises(ValueError, match="^w_scale:"):
        ffi.fp8_block_gemm(x, xs, w, jnp.ones((1, 4), jnp.float32))
    with pytest.raises(ValueError, match="^block_n:"):
        ffi.fp8_block_gemm(x, xs, w, jnp.ones((3, 2), jnp.float32))  # 8 rows do not split into 3 blocks
    with pytest.raises(ValueError, match="^block_k:"):
        ffi.fp8_block_gemm(x, jnp.ones((4, 4), jnp.float32), w, jnp.ones((1, 4), jnp.float32))  # 16 < 32
    with pytest.raises(ValueError, match="^out_dtype:"):
        ffi.fp8_block_gemm(x, xs, w, ws, out_dtype=jnp.float16)
    n, h, d, wn = 3, 2, 8, 4
    args = {"q_NHD": jnp.zeros((n, h, d)), "window_NWD": jnp.zeros((n, wn, d)),
            "window_valid_NW": jnp.ones((n, wn), bool), "pool_PED": jnp.zeros((5, 4, d)),
            "block_tables_RM": jnp.zeros((2, 3), jnp.int32), "token_req_N": jnp.zeros((n,), jnp.int32),
            "topk_NK": jnp.zeros((n, 6), jnp.int32), "sink_H": jnp.zeros((h,))}
    for field, bad in (("window_valid_NW", jnp.ones((n, wn), jnp.int32)), ("topk_NK", jnp.zeros((n, 6))),
                       ("pool_PED", jnp.zeros((5, 4, d + 1))), ("sink_H", jnp.zeros((h + 1,)))):
        with pytest.raises(ValueError, match=f"^{field}:"):
            ffi.sparse_attention_decode(**{**args, field: bad})


def _fp8_operands(rng, m, n, k, bn, bk):
    """Random e4m3 operands with power-of-two (UE8M0-like) block scales."""
    x = jnp.asarray(rng.normal(size=(m, k)) * 2, jnp.float8_e4m3fn)
    w = jnp.asarray(rng.normal(size=(n, k)) * 2, jnp.float8_e4m3fn)
    xs = jnp.asarray(2.0 ** rng.integers(-3, 3, size=(m, k // bk)), jnp.float32)
    ws = jnp.asarray(2.0 ** rng.integers(-3, 3, size=(-(-n // bn), k // bk)), jnp.float32)
    return x, xs, w, ws


def test_fp8_gemm_reference_matches_a_numpy_block_loop():
    m, n, k, bn, bk = 5, 40, 64, 32, 32  # N = 40: a partial last weight block (block_n must be given)
    x, xs, w, ws = _fp8_operands(np.random.default_rng(0), m, n, k, bn, bk)
    got = ffi.fp8_block_gemm_reference(x, xs, w, ws, out_dtype=jnp.float32, block_n=bn)
    xf, wf = np.asarray(x.astype(jnp.float32), np.float64), np.asarray(w.astype(jnp.float32), np.float64)
    want = np.zeros((m, n))
    for kb in range(k // bk):
        ks = slice(kb * bk, (kb + 1) * bk)
        part = xf[:, ks] @ wf[:, ks].T
        want += part * np.asarray(xs)[:, kb : kb + 1] * np.asarray(ws)[np.arange(n) // bn, kb][None, :]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="^block_n:"):  # 40 rows, 3 scale rows: not inferable
        ffi.fp8_block_gemm_reference(x, xs, w, jnp.ones((3, k // bk), jnp.float32))


# ---- nvcc: compile-only build ---------------------------------------------------------------------


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc or cmake not on PATH: the CUDA custom calls cannot be compiled here")
def test_cmake_build_exports_the_handlers_for_both_archs(built_lib, fresh_ffi, monkeypatch):
    nm = subprocess.run(["nm", "-D", "--defined-only", str(built_lib)], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in nm.stdout.splitlines() if line.strip()}
    assert exported == set(ffi.TARGETS.values())  # the handlers and nothing else
    blob = built_lib.read_bytes()
    assert b"sm_90a" in blob and b"sm_100a" in blob
    monkeypatch.setenv(ffi.ENV_VAR, str(built_lib))
    assert ffi.load() == built_lib  # dlopen works without a GPU; targets register for CUDA
    assert ffi.load() == built_lib  # idempotent


# ---- GPU: handlers against the references ---------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_library(request) -> Path:
    """$DEEPINFER_FFI_LIB if set (a library built on the GPU machine), else the tmp CMake build."""
    env = os.environ.get(ffi.ENV_VAR)
    return Path(env) if env else request.getfixturevalue("built_lib")


def _reference_lse(sa_ref, q, win, valid, pool, tables, req, topk, sink):
    """Merged lse [N, H] of the reference's two parts and the sink."""
    qf, scale = q.astype(jnp.float32), q.shape[-1] ** -0.5
    wf = jnp.where(valid[..., None], win.astype(jnp.float32), 0.0)
    lw = jnp.where(valid[:, None, :], jnp.einsum("nhd,nsd->nhs", qf, wf) * scale, -jnp.inf)
    rows, ok = sa_ref.global_rows(pool, tables, req, topk)
    lg = jnp.where(ok[:, None, :], jnp.einsum("nhd,nsd->nhs", qf, rows) * scale, -jnp.inf)
    parts = jnp.concatenate([lw, lg, jnp.broadcast_to(sink[None, :, None], (*lw.shape[:2], 1))], axis=-1)
    return jax.nn.logsumexp(parts, axis=-1)


@pytest.mark.skipif(not ON_GPU, reason="needs jax.default_backend() == 'gpu' (runs the CUDA handlers)")
def test_handlers_match_references_on_gpu(gpu_library, fresh_ffi, monkeypatch):
    from deepinfer_jax.ops.sparse_attention import reference as sa_ref

    monkeypatch.setenv(ffi.ENV_VAR, str(gpu_library))
    rng = np.random.default_rng(1)
    # FP8 block GEMM: V4.1 32 x 32 blocks, ragged M / N (partial tiles), both output dtypes.
    for m, n, k, bn, bk in ((5, 40, 64, 32, 32), (70, 130, 256, 128, 128), (1, 64, 96, 32, 32)):
        x, xs, w, ws = _fp8_operands(rng, m, n, k, bn, bk)
        for out in (jnp.float32, jnp.bfloat16):
            got = jax.jit(lambda *a, out=out, bn=bn: ffi.fp8_block_gemm(*a, out_dtype=out, block_n=bn))(x, xs, w, ws)
            with jax.default_matmul_precision("highest"):
                want = np.asarray(ffi.fp8_block_gemm_reference(x, xs, w, ws, out_dtype=jnp.float32, block_n=bn))
            tol = 1e-5 if out == jnp.float32 else 1e-2  # fp32 sums in another order; bf16 output rounding
            np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol * np.abs(want).max())
    # Sparse attention decode: ragged windows, block tables with holes, empty and -1 top-k slots.
    n, h, d, wn, p, e, r, mb, kk = 7, 4, 96, 6, 9, 4, 3, 4, 5
    req = jnp.asarray(rng.integers(0, r, n), jnp.int32)
    tables = jnp.asarray(rng.integers(0, p, (r, mb)), jnp.int32).at[1, 2].set(-1).at[0, 0].set(-1)
    topk = jnp.asarray(rng.integers(-1, mb * e, (n, kk)), jnp.int32).at[2].set(-1).at[3].set(-1)  # 3: sink only
    valid = jnp.asarray(rng.random((n, wn)) < 0.7).at[3].set(False)
    for qd, kvd in ((jnp.float32, jnp.float32), (jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.bfloat16)):
        q = jnp.asarray(rng.normal(size=(n, h, d)), qd)
        win = jnp.asarray(rng.normal(size=(n, wn, d)), kvd)
        pool = jnp.asarray(rng.normal(size=(p, e, d)), kvd)
        sink = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
        args = (q, win, valid, pool, tables, req, topk, sink)
        got, lse = jax.jit(lambda *a: ffi.sparse_attention_decode(*a, return_lse=True))(*args)
        with jax.default_matmul_precision("highest"):  # no TF32 in the reference
            want = sa_ref.sparse_attention(*args)
            want_lse = _reference_lse(sa_ref, *args)
        tol = 1e-5 if qd == jnp.float32 else 2e-2
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=tol, atol=tol)
