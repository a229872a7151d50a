"""Pallas kernels (interpret mode) against their jnp references, the dispatch table, and the model
step run through the kernels (``use_kernels("pallas_interpret")``) against the reference path.

Inputs are fresh random draws with ragged lengths, block tables with holes (-1), poisoned (NaN)
pool blocks and window rows that must never be read, and group sizes with zeros. Unwritten output
rows are caught by the interpreter's poisoned output buffers (NaN / INT_MIN; checked first).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from deepinfer_jax import compile_options
from deepinfer_jax.model.attention import attend
from deepinfer_jax.ops import dispatch, use_kernels
from deepinfer_jax.ops.grouped_matmul import pallas as gmm_pallas
from deepinfer_jax.ops.grouped_matmul import reference as gmm_ref
from deepinfer_jax.ops.indexer_topk import pallas as ix_pallas
from deepinfer_jax.ops.indexer_topk import reference as ix_ref
from deepinfer_jax.ops.mhc import pallas as mhc_pallas
from deepinfer_jax.ops.mhc import reference as mhc_ref
from deepinfer_jax.ops.sparse_attention import pallas as sa_pallas
from deepinfer_jax.ops.sparse_attention import reference as sa_ref

#: compile-bound: level 0 (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("xla_cpu_level0")


def _jit(fn, static_argnums=(), **kwargs):
    """``fn`` with ``kwargs`` bound, compiled at the module's level (``compile_options.jit``): the kernels' own
    ``jax.jit`` would compile them at XLA's default."""
    return compile_options.jit(functools.partial(fn, **kwargs), static_argnums=static_argnums)


def test_interpreter_poisons_unwritten_outputs():
    """The premise of every kernel test below: rows a kernel forgets to write come back NaN / INT_MIN."""

    def kernel(o_ref, i_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
            i_ref[...] = jnp.zeros(i_ref.shape, i_ref.dtype)

    f, i = pl.pallas_call(kernel, grid=(2,), interpret=True,
                          out_shape=(jax.ShapeDtypeStruct((4, 2), jnp.float32), jax.ShapeDtypeStruct((4, 2), jnp.int32)),
                          out_specs=(pl.BlockSpec((2, 2), lambda g: (g, 0)), pl.BlockSpec((2, 2), lambda g: (g, 0))))()
    assert np.all(np.asarray(f)[:2] == 0) and np.all(np.isnan(np.asarray(f)[2:]))
    assert np.all(np.asarray(i)[2:] == np.iinfo(np.int32).min)


# -- (a) sparse paged attention ---------------------------------------------------------------------


def _attention_inputs(rng, lengths, h=4, d=32, w=8, k=6, e=4, mb=3):
    """Random flat-batch inputs: request r has lengths[r] query tokens; tables with holes; NaN poison."""
    r = len(lengths)
    n_blocks = r * mb + 3
    token_req = np.repeat(np.arange(r), lengths).astype(np.int32)
    n = len(token_req)
    q = rng.normal(size=(n, h, d)).astype(np.float32)
    win = rng.normal(size=(n, w, d)).astype(np.float32)
    win_valid = rng.random((n, w)) < 0.7
    win_valid[: max(1, n // 4)] = False  # some tokens with an empty window (sink + globals only)
    win[~win_valid] = np.nan  # stale ring rows must never leak
    tables = rng.permutation(n_blocks)[: r * mb].reshape(r, mb).astype(np.int32)
    tables[rng.random((r, mb)) < 0.3] = -1  # holes
    pool = rng.normal(size=(n_blocks, e, d)).astype(np.float32)
    used = set(tables[tables >= 0].tolist())
    pool[[b for b in range(n_blocks) if b not in used]] = np.nan  # blocks no table references
    topk = rng.integers(-1, mb * e, (n, k)).astype(np.int32)  # -1 slots and entries in holes
    sink = rng.normal(size=h).astype(np.float32)
    return q, win, win_valid, pool, tables, token_req, topk, sink


@pytest.mark.parametrize(("mode", "token_block"), [("decode", 1), ("decode", 4), ("prefill", 3)])
def test_sparse_attention_kernel_matches_reference(mode, token_block):
    rng = np.random.default_rng({"decode": 10, "prefill": 20}[mode] + token_block)
    lengths = [1] * 5 if mode == "decode" else [int(x) for x in rng.integers(0, 7, 4)] + [3]  # ragged, a 0
    args = _attention_inputs(rng, lengths)
    want = np.asarray(_jit(sa_ref.sparse_attention)(*args))
    got = np.asarray(_jit(sa_pallas.sparse_attention, interpret=True, token_block=token_block)(*args))
    assert np.isfinite(want).all() and want.shape == got.shape == args[0].shape
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def test_sparse_attention_reference_matches_model_attend():
    """The (out, lse) merge equals the model's one softmax over the concatenated keys plus the sink."""
    rng = np.random.default_rng(3)
    q, win, win_valid, pool, tables, token_req, topk, sink = _attention_inputs(rng, [3, 1, 4])

    @compile_options.jit
    def model_attend(q, win, win_valid, pool, tables, token_req, topk, sink):
        rows, valid = sa_ref.global_rows(pool, tables, token_req, topk)
        keys, ok = jnp.concatenate([win, rows], 1), jnp.concatenate([win_valid, valid], 1)
        return attend(q[None], keys[None], ok[None], sink)[0]

    want = np.asarray(model_attend(q, win, win_valid, pool, tables, token_req, topk, sink))
    got = np.asarray(_jit(sa_ref.sparse_attention)(q, win, win_valid, pool, tables, token_req, topk, sink))
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
    # the entries really matter: dropping them changes the output
    alone = np.asarray(_jit(sa_ref.sparse_attention)(q, win, win_valid, pool, tables, token_req, topk[:, :0], sink))
    assert np.abs(alone - want).max() > 1e-2


# -- (b) indexer scoring, candidate pool, top-k ------------------------------------------------------


def test_indexer_scores_kernel_matches_reference():
    rng = np.random.default_rng(5)
    n, h, hd, e, r = 11, 2, 32, 21, 3
    q = rng.normal(size=(n, h, hd)).astype(np.float32)
    w = rng.normal(size=(n, h)).astype(np.float32)
    keys = rng.normal(size=(r, e, hd)).astype(np.float32)
    token_req = np.sort(rng.integers(0, r, n)).astype(np.int32)
    visible = np.arange(e) < rng.integers(0, e + 1, n)[:, None]
    want = np.asarray(_jit(ix_ref.indexer_scores)(q, w, keys, token_req, visible))
    got = np.asarray(_jit(ix_pallas.indexer_scores, interpret=True, token_block=4)(q, w, keys, token_req, visible))
    np.testing.assert_array_equal(np.isfinite(got), visible)
    np.testing.assert_allclose(got[visible], want[visible], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", ["plain", "source", "confined"])
def test_indexer_topk_kernel_matches_reference(mode):
    rng = np.random.default_rng({"plain": 1, "source": 2, "confined": 3}[mode])
    n, e, k = 9, 22, 5
    n_visible = rng.integers(0, e + 1, n)
    n_visible[0] = 0
    scores = np.round(rng.normal(size=(n, e)), 1).astype(np.float32)  # many ties: lowest index must win
    scores[:, ::3] = 0.0
    scores[np.arange(e) >= n_visible[:, None]] = -np.inf
    cand = rng.random((n, e)) < 0.5 if mode == "confined" else None
    args = (jnp.asarray(scores), jnp.asarray(n_visible), k, mode, None if cand is None else jnp.asarray(cand), 2, 4)
    want_top, want_pool = _jit(ix_ref.indexer_topk, (2, 3, 5, 6))(*args)
    got_top, got_pool = _jit(ix_pallas.indexer_topk, (2, 3, 5, 6), interpret=True, token_block=4)(*args)
    np.testing.assert_array_equal(np.asarray(got_top), np.asarray(want_top))
    assert (np.asarray(want_top) == -1).any() and (np.asarray(want_top) >= 0).any()
    if mode == "plain":
        assert got_pool is None and want_pool is None
    else:
        np.testing.assert_array_equal(np.asarray(got_pool), np.asarray(want_pool))


def test_indexer_topk_rejects_bad_mode():
    with pytest.raises(ValueError, match="mode"):
        ix_ref.indexer_topk(jnp.zeros((2, 4)), jnp.ones(2, jnp.int32), 2, "sideways")
    with pytest.raises(ValueError, match="candidates"):
        ix_pallas.indexer_topk(jnp.zeros((2, 4)), jnp.ones(2, jnp.int32), 2, "confined", interpret=True)


# -- (c) grouped matmul ------------------------------------------------------------------------------


@pytest.mark.parametrize(("sizes", "row_block", "col_block"),
                         [((3, 0, 20, 0, 9), 8, 16), ((0, 0, 37, 0, 0), 16, 128), ((5, 7, 0, 1, 0), 8, 24)])
def test_grouped_matmul_kernel_matches_reference(sizes, row_block, col_block):
    rng = np.random.default_rng(sum(sizes) + row_block)
    m, kd, n = 37, 32, 40
    x = rng.normal(size=(m, kd)).astype(np.float32)
    w = rng.normal(size=(len(sizes), n, kd)).astype(np.float32)
    sizes = np.asarray(sizes, np.int32)
    oracle, start = np.zeros((m, n), np.float32), 0
    for g, s in enumerate(sizes):
        oracle[start : start + s] = x[start : start + s] @ w[g].T
        start += s
    want = np.asarray(_jit(gmm_ref.grouped_matmul)(x, w, sizes))
    gmm = _jit(gmm_pallas.grouped_matmul, interpret=True, row_block=row_block, col_block=col_block)
    got = np.asarray(gmm(x, w, sizes))
    np.testing.assert_allclose(want, oracle, atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(got, oracle, atol=1e-4, rtol=1e-5)  # rows past sum(sizes) are exactly zero too


def test_sorted_moe_experts_match_the_dense_experts():
    """The expert-sorted path (any grouped matmul) equals the model's dense all-experts formulation."""
    import functools

    from deepinfer_jax.model.moe import route, swiglu

    rng = np.random.default_rng(9)
    n, d, inter, e, k, limit = 13, 32, 24, 6, 2, 7.0
    x = rng.normal(size=(n, d)).astype(np.float32)
    w1, w3 = (rng.normal(size=(e, inter, d)) * 0.2).astype(np.float32), (rng.normal(size=(e, inter, d)) * 0.2).astype(
        np.float32)
    w2 = (rng.normal(size=(e, d, inter)) * 0.2).astype(np.float32)
    weights, ids = route(jnp.asarray(rng.normal(size=(n, e)), jnp.float32), jnp.zeros(e), k, 1.5, True)
    ids = ids.at[:4].set(jnp.asarray([[0, 1]] * 4))  # a popular pair; some experts get no token
    ids = jnp.where(ids == 5, 4, ids).at[5].set(jnp.asarray([4, 2]))
    onehot = jnp.zeros((n, e)).at[jnp.arange(n)[:, None], ids].add(weights)
    dense = jnp.einsum("ne,nei->nei", onehot, swiglu(jnp.einsum("nd,eid->nei", x, w1), jnp.einsum("nd,eid->nei", x, w3),
                                                     limit))
    want = np.asarray(jnp.einsum("nei,edi->nd", dense, w2))
    act = functools.partial(swiglu, limit=limit)
    for gmm in (gmm_ref.grouped_matmul, functools.partial(gmm_pallas.grouped_matmul, interpret=True, row_block=8)):
        experts = compile_options.jit(lambda *a, gmm=gmm: gmm_ref.moe_experts(*a, act, gmm=gmm))
        got = experts(x, w1, w3, w2, ids, weights)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)


# -- (d) mHC -----------------------------------------------------------------------------------------


def test_mhc_kernels_match_reference():
    rng = np.random.default_rng(8)
    b, t, n, d = 2, 5, 4, 16
    streams = rng.normal(size=(b, t, n, d)).astype(np.float32)
    fn = (rng.normal(size=(n * (n + 2), n * d)) * 0.1).astype(np.float32)
    base, scale = rng.normal(size=n * (n + 2)).astype(np.float32), rng.normal(size=3).astype(np.float32)
    want = _jit(mhc_ref.mhc_mix, (4, 5, 6))(streams, fn, base, scale, 20, 1e-6, 1e-6)
    got = _jit(mhc_pallas.mhc_mix, (4, 5, 6), interpret=True, row_block=3)(streams, fn, base, scale, 20, 1e-6, 1e-6)
    for g, w_ in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w_), atol=1e-6, rtol=1e-5)
    pre, post, comb = (np.asarray(a) for a in want)
    np.testing.assert_allclose(comb.sum(-2), 1.0, atol=1e-4)  # Sinkhorn: doubly stochastic
    np.testing.assert_allclose(np.asarray(_jit(mhc_pallas.mhc_collapse, interpret=True, row_block=4)(streams, pre)),
                               np.asarray(_jit(mhc_ref.mhc_collapse)(streams, pre)), atol=1e-6, rtol=1e-5)
    lag = rng.random((b, t, n)).astype(np.float32)
    mix_collapse = _jit(mhc_pallas.mhc_mix_collapse, (5, 6, 7), interpret=True, row_block=3)
    fused = mix_collapse(streams, fn, base, scale, lag, 20, 1e-6, 1e-6)
    for g, w_ in zip(fused, (*want, _jit(mhc_ref.mhc_collapse)(streams, lag)), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w_), atol=1e-6, rtol=1e-5)
    y = rng.normal(size=(b, t, d)).astype(np.float32)
    expand = _jit(mhc_pallas.mhc_expand, interpret=True, row_block=4)
    np.testing.assert_allclose(np.asarray(expand(y, streams, post, comb)),
                               np.asarray(_jit(mhc_ref.mhc_expand)(y, streams, post, comb)), atol=1e-6, rtol=1e-5)


def test_kernels_lower_to_triton_for_cuda(monkeypatch):
    """Every kernel lowers for CUDA through Pallas' Triton backend (cross-platform export on this CPU
    machine: the Triton front end, not a GPU compile). Shapes are powers of two, as Triton requires."""
    from jax import export

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # compiler_params() picks Triton
    S, f32, i32 = jax.ShapeDtypeStruct, jnp.float32, jnp.int32
    mix = (S((64, 4, 128), f32), S((24, 512), f32), S((24,), f32), S((3,), f32))
    kernels = {
        "sparse_attention": (sa_pallas.sparse_attention, (S((32, 16, 64), f32), S((32, 64, 64), f32),
                             S((32, 64), jnp.bool_), S((128, 16, 64), f32), S((8, 16), i32), S((32,), i32),
                             S((32, 32), i32), S((16,), f32))),
        "indexer_scores": (ix_pallas.indexer_scores, (S((32, 16, 64), f32), S((32, 16), f32), S((8, 128, 64), f32),
                           S((32,), i32), S((32, 128), jnp.bool_))),
        "indexer_topk": (lambda sc, nv: ix_pallas.indexer_topk(sc, nv, 16, "source", None, 4, 4),
                         (S((32, 128), f32), S((32,), i32))),
        "grouped_matmul": (gmm_pallas.grouped_matmul, (S((128, 256), f32), S((8, 128, 256), f32), S((8,), i32))),
        "mhc_mix": (lambda *a: mhc_pallas.mhc_mix(*a, 20, 1e-6, 1e-6), mix),
        "mhc_mix_collapse": (lambda *a: mhc_pallas.mhc_mix_collapse(*a, 20, 1e-6, 1e-6), (*mix, S((64, 4), f32))),
        "mhc_collapse": (mhc_pallas.mhc_collapse, (S((64, 4, 128), f32), S((64, 4), f32))),
        "mhc_expand": (mhc_pallas.mhc_expand, (S((64, 128), f32), S((64, 4, 128), f32), S((64, 4), f32),
                                               S((64, 4, 4), f32))),
    }
    allow = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    for name, (fn, args) in kernels.items():
        text = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=allow)(*args).mlir_module()
        assert "__gpu$xla.gpu.triton" in text, name


# -- the dispatch table ------------------------------------------------------------------------------


def test_dispatch_selection_and_errors(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    assert dispatch.platform() == ("cpu", False)  # this machine's default backend is the CPU
    assert dispatch.get("mhc_mix") is mhc_ref.mhc_mix
    with use_kernels("pallas_interpret"):
        impl = dispatch.get("grouped_matmul")
        assert impl.func is gmm_pallas.grouped_matmul and impl.keywords == {"interpret": True}
        with use_kernels("reference"):
            assert dispatch.uses_reference()
        assert not dispatch.uses_reference()
    monkeypatch.setenv(dispatch.ENV_VAR, "pallas")
    assert dispatch.platform() == ("pallas", False)
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda_ffi")  # no custom call for the indexer: falls back to Pallas
    assert dispatch.get("indexer_topk").func is ix_pallas.indexer_topk
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    with pytest.raises(ValueError, match="DEEPINFER_KERNELS"):
        dispatch.get("mhc_mix")
    monkeypatch.delenv(dispatch.ENV_VAR)
    with pytest.raises(ValueError, match=r"use_kernels\(setting\)"), use_kernels("fast"):
        pass
    with pytest.raises(ValueError, match="kernel must be one of"):
        dispatch.get("flash_attention")


def test_use_kernels_retraces_jitted_functions():
    """The selection is part of the jit key: a function traced under one setting retraces under another."""
    f = jax.jit(lambda x: x + (1.0 if dispatch.uses_reference() else 2.0))
    assert float(f(0.0)) == 1.0
    with use_kernels("pallas_interpret"):
        assert float(f(0.0)) == 2.0
    assert float(f(0.0)) == 1.0


def test_optional_backends_are_lazy(monkeypatch):
    """Custom-call / Ascend implementations are registered by name and imported only when selected."""
    entry = dispatch.TABLE["sparse_attention"]["ascend"]
    assert isinstance(entry, dispatch._Lazy)
    assert (entry.module, entry.attr) == ("deepinfer_jax.ops.ascend", "sparse_attention")
    assert dispatch.TABLE["grouped_matmul"]["ascend"].attr == "grouped_matmul"
    ffi = dispatch.TABLE["sparse_attention"]["cuda_ffi"]
    assert (ffi.module, ffi.attr) == ("deepinfer_jax.ops.ffi", "sparse_attention_decode")
    assert dispatch.TABLE["fp8_block_gemm"]["cuda_ffi"].module == "deepinfer_jax.ops.ffi"
    probe = {"cpu": sa_ref.sparse_attention, "ascend": dispatch._Lazy("deepinfer_jax.ops.not_built", "kernel")}
    monkeypatch.setitem(dispatch.TABLE, "probe", probe)
    with use_kernels("reference"):
        assert dispatch.get("probe") is sa_ref.sparse_attention  # the missing module is never imported
    with use_kernels("ascend"), pytest.raises(ImportError, match="deepinfer_jax.ops.not_built.kernel is not available"):
        dispatch.get("probe")
    monkeypatch.setitem(dispatch.TABLE, "probe", {"cuda_ffi": probe["ascend"]})
    with pytest.raises(ValueError, match="no implementation for platform 'cpu'"):
        dispatch.get("probe")


# -- the model through the kernels -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    """A 2-layer cut of the tiny model: a ratio-1 KV source that publishes the candidate pool, and a
    REINDEX layer confined to it (no Engram: it has no kernel). The SWA-only branch runs in the forward
    test below; REUSE layers take the same attention call. Weights made robust to rounding-level noise
    as in test_paged_step.robust_params."""
    from deepinfer_jax import ModelConfig, init_params

    cfg = ModelConfig.tiny().replace(
        num_hidden_layers=2, compress_ratios=(1, 1), kv_source_layer_ids=(0,), index_source_layer_ids=(0, 1),
        candidate_source_layer_id=0, engram_layer_ids=(), engram_num_embeddings=(), dspark_target_layer_ids=(0, 1))
    params = init_params(cfg, seed=11)
    for block in params["layers"].values():
        block["attn"]["wo_b"]["weight"][...] = block["attn"]["wo_b"]["weight"][...] * 0.1
        block["ffn"]["experts"]["w2"][...] = block["ffn"]["experts"]["w2"][...] * 0.1
        block["ffn"]["shared_experts"]["w2"]["weight"][...] = block["ffn"]["shared_experts"]["w2"]["weight"][...] * 0.1
    return cfg, params


def _run_paged(cfg, params, setting):
    """Two paged steps of one compiled shape (16 tokens, 3 request rows: two requests + a padding row):
    a ragged prefill of both requests, then one decode token each -> the logits of both steps."""
    from deepinfer_jax.config import CacheConfig
    from deepinfer_jax.model.kv_cache import init_cache
    from deepinfer_jax.model.paged import StepInputs, paged_step

    cache_cfg = CacheConfig(block_size=4, num_blocks=10, max_requests=2, max_blocks_per_request=4)
    rng = np.random.default_rng(4)
    tables = np.array([[7, 2, 5, -1], [1, 8, -1, -1], [-1, -1, -1, -1]], np.int32)  # holes past each request
    ids = [rng.integers(0, cfg.vocab_size, 12), rng.integers(0, cfg.vocab_size, 5)]
    n_tok = 16

    def inputs(chunks):  # chunks: (request, start, count) for requests 0 and 1; row 2 holds the padding
        tok = np.concatenate([ids[r][s : s + c] for r, s, c in chunks])
        pos = np.concatenate([np.arange(s, s + c) for _, s, c in chunks])
        req = np.concatenate([np.full(c, i) for i, (_, _, c) in enumerate(chunks)])
        pad = n_tok - len(tok)
        i32 = lambda a: jnp.asarray(np.asarray(a), jnp.int32)
        return StepInputs(
            token_ids=i32(np.pad(tok, (0, pad))), positions=i32(np.pad(pos, (0, pad))),
            token_req=i32(np.pad(req, (0, pad), constant_values=2)),
            token_valid=jnp.asarray(np.arange(n_tok) < len(tok)), block_tables=i32(tables),
            req_slot=i32([0, 1, 2]), req_start=i32([0, chunks[0][2], len(tok)]),
            ctx_len=i32([s for _, s, _ in chunks] + [0]), new_len=i32([s + c for _, s, c in chunks] + [0]),
            logit_rows=i32(np.cumsum([c for _, _, c in chunks]) - 1))

    with use_kernels(setting):
        step = compile_options.jit(lambda p, c, x: paged_step(p, cfg, cache_cfg, c, x))
        cache = init_cache(cfg, cache_cfg)
        out1, cache = step(params, cache, inputs([(0, 0, 11), (1, 0, 4)]))
        out2, _ = step(params, cache, inputs([(0, 11, 1), (1, 4, 1)]))
    return np.asarray(out1), np.asarray(out2)


def test_paged_step_through_pallas_kernels_matches_reference(tiny):
    cfg, params = tiny
    ref = _run_paged(cfg, params, "reference")
    got = _run_paged(cfg, params, "pallas_interpret")
    for want, have in zip(ref, got, strict=True):
        assert np.isfinite(have).all()
        np.testing.assert_allclose(have, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_forward_through_pallas_kernels_matches_reference():
    from deepinfer_jax import ModelConfig, forward_full, init_params

    # two layers are enough for the full-forward wiring (the SWA-only and the compressed branch, the
    # candidate-source selection); the paged test above covers every layer role
    cfg = ModelConfig.tiny().replace(
        num_hidden_layers=2, compress_ratios=(0, 1), kv_source_layer_ids=(1,), index_source_layer_ids=(1,),
        candidate_source_layer_id=1, engram_layer_ids=(), engram_num_embeddings=(), dspark_target_layer_ids=(1,))
    params = init_params(cfg, seed=12)
    ids = np.random.default_rng(6).integers(0, cfg.vocab_size, (2, 12))
    want = np.asarray(compile_options.jit(lambda p, x: forward_full(p, cfg, x))(params, ids))
    with use_kernels("pallas_interpret"):
        got = np.asarray(compile_options.jit(lambda p, x: forward_full(p, cfg, x))(params, ids))
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)
