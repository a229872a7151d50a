"""Component tests of the model's numerics against small, independent numpy references."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.config import ModelConfig, RopeScaling
from deepinfer_jax.model import mhc, quant
from deepinfer_jax.model.indexer import candidate_pool, select_topk
from deepinfer_jax.model.moe import route, swiglu
from deepinfer_jax.model.rope import apply_rope, rope_angles, rope_frequencies

# ---------------------------------------------------------------- fake quant (hand-computed values)


def test_pow2_ceil_exact_powers_and_between():
    x = jnp.asarray([1.0, 1.5, 0.25, 0.3, 3.0e-5, 448.0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(quant.pow2_ceil(x)), [1.0, 2.0, 0.25, 0.5, 2.0**-15, 512.0])


def test_e2m1_levels_and_ties_to_even_index():
    v = jnp.asarray([0.2, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.9, -0.75, -2.6], jnp.float32)
    # ties: 0.25 -> 0 (index 0 even), 0.75 -> 1.0 (idx 2), 1.25 -> 1.0 (idx 2), 1.75 -> 2 (idx 4),
    # 2.5 -> 2 (idx 4), 3.5 -> 4 (idx 6), 5.0 -> 4 (idx 6)
    expect = [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -3.0]
    np.testing.assert_array_equal(np.asarray(quant.round_e2m1(v)), expect)


def test_fake_quant_fp8_group_scale():
    x = np.zeros(32, np.float32)
    x[0], x[1], x[2] = 1.0, 0.3, -0.0111  # amax 1 -> scale pow2_ceil(1/448) = 2^-8
    y = np.asarray(quant.fake_quant_fp8(jnp.asarray(x)))
    assert y[0] == 1.0
    # 0.3 / 2^-8 = 76.8 -> e4m3 has 3 mantissa bits: step 8 in [64, 128) -> 80
    assert y[1] == 80.0 / 256
    # 0.0111 * 256 = 2.8416 -> step 0.25 in [2, 4) -> 2.75
    assert y[2] == -2.75 / 256


def test_fake_quant_nvfp4_and_mxfp4_scales():
    x = np.zeros(32, np.float32)
    x[:4] = [3.0, 1.1, -0.6, 0.2]  # nvfp4 group 0: amax 3 -> scale e4m3(0.5) = 0.5
    y = np.asarray(quant.fake_quant_nvfp4(jnp.asarray(x)))
    # normalised [6, 2.2, -1.2, 0.4] -> levels [6, 2, -1, 0.5] -> times the scale 0.5
    np.testing.assert_array_equal(y[:4], [3.0, 1.0, -0.5, 0.25])
    x2 = np.zeros(16, np.float32)
    x2[:2] = [6.0, 0.2]  # scale 1.0 -> 0.2 -> 0.0 (below 0.25)
    np.testing.assert_array_equal(np.asarray(quant.fake_quant_nvfp4(jnp.asarray(x2)))[:2], [6.0, 0.0])
    m = np.zeros(32, np.float32)
    m[:3] = [5.0, 0.9, -2.2]  # mxfp4: scale pow2_ceil(5/6) = 1 -> 5 -> 4 (tie to even idx), 0.9 -> 1, -2.2 -> -2
    np.testing.assert_array_equal(np.asarray(quant.fake_quant_mxfp4(jnp.asarray(m)))[:3], [4.0, 1.0, -2.0])


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_fake_quant_grids_and_error_bounds(seed):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(3, 64)) * 10.0 ** rng.uniform(-3, 2)).astype(np.float32)
    y8 = quant.fake_quant_fp8(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(quant.fake_quant_fp8(y8)), np.asarray(y8))  # a fixed point
    assert np.abs(np.asarray(y8) - x).max() <= np.abs(x).max() / 16 + 1e-12
    for fq, group in ((quant.fake_quant_nvfp4, 16), (quant.fake_quant_mxfp4, 32)):
        y = np.asarray(fq(jnp.asarray(x))).reshape(3, -1, group)
        # E2M1: at most 15 distinct values per scale group (8 magnitudes, two signs, one zero)
        assert max(len(np.unique(g)) for g in y.reshape(-1, group)) <= 15
        assert np.abs(y.reshape(x.shape) - x).max() <= np.abs(x).max() / 3 + 1e-12


# ---------------------------------------------------------------- Sinkhorn and mHC


def _sinkhorn_np(z, iters, eps):
    x = np.exp(z - z.max(-1, keepdims=True))
    x = x / x.sum(-1, keepdims=True) + eps
    x = x / (x.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        x = x / (x.sum(-1, keepdims=True) + eps)
        x = x / (x.sum(-2, keepdims=True) + eps)
    return x


def test_sinkhorn_matches_numpy_and_is_doubly_stochastic():
    z = np.random.default_rng(0).normal(size=(5, 4, 4)) * 3
    got = np.asarray(mhc.sinkhorn(jnp.asarray(z, jnp.float32), 20, 1e-6))
    np.testing.assert_allclose(got, _sinkhorn_np(z, 20, 1e-6), atol=2e-6)
    np.testing.assert_allclose(got.sum(-2), 1.0, atol=1e-5)
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-2)  # rows converge more slowly; columns are exact


def test_hc_mix_collapse_expand_against_numpy():
    rng = np.random.default_rng(1)
    n, d = 4, 8
    R = rng.normal(size=(2, 3, n, d)).astype(np.float32)
    fn = rng.normal(size=(n * (n + 2), n * d)).astype(np.float32) * 0.1
    base = rng.normal(size=(n * (n + 2),)).astype(np.float32)
    scale = np.asarray([0.5, 1.5, 2.0], np.float32)
    mix = mhc.hc_mix(jnp.asarray(R), jnp.asarray(fn), jnp.asarray(base), jnp.asarray(scale), iters=20,
                     hc_eps=1e-6, norm_eps=1e-20)
    flat = R.reshape(2, 3, -1)
    m = flat @ fn.T / np.sqrt((flat**2).mean(-1, keepdims=True) + 1e-20)
    z = base + m * np.concatenate([[scale[0]] * n, [scale[1]] * n, [scale[2]] * n * n])
    sig = 1 / (1 + np.exp(-z))
    np.testing.assert_allclose(np.asarray(mix.pre), sig[..., :n] + 1e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(mix.post), 2 * sig[..., n : 2 * n], rtol=1e-5)
    comb = _sinkhorn_np(z[..., 2 * n :].reshape(2, 3, n, n), 20, 1e-6)
    np.testing.assert_allclose(np.asarray(mix.comb), comb, atol=1e-5)
    y = rng.normal(size=(2, 3, d)).astype(np.float32)
    out = np.asarray(mhc.expand(jnp.asarray(y), jnp.asarray(R), mix))
    want = 2 * sig[..., n : 2 * n, None] * y[:, :, None] + np.einsum("btij,btid->btjd", comb, R)  # sum over i
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    col = np.asarray(mhc.collapse(jnp.asarray(R), mix.pre))
    np.testing.assert_allclose(col, np.einsum("bti,btid->btd", sig[..., :n] + 1e-6, R), rtol=1e-5)


# ---------------------------------------------------------------- RoPE / YaRN


def test_rope_frequencies_plain_and_yarn_by_hand():
    f = rope_frequencies(8, 10000.0)
    np.testing.assert_allclose(f, [10000 ** (-k / 4) for k in range(4)], rtol=1e-6)
    sc = RopeScaling(factor=16, beta_fast=32, beta_slow=1, original_max_position_embeddings=65536)
    theta, dim = 160000.0, 64
    y = rope_frequencies(dim, theta, sc)
    low = max(math.floor(dim * math.log(65536 / (32 * 2 * math.pi)) / (2 * math.log(theta))), 0)
    high = min(math.ceil(dim * math.log(65536 / (1 * 2 * math.pi)) / (2 * math.log(theta))), dim - 1)
    base = np.asarray([theta ** (-2 * k / dim) for k in range(dim // 2)])
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    np.testing.assert_allclose(y, base / 16 * ramp + base * (1 - ramp), rtol=2e-6)
    assert y[0] == pytest.approx(base[0], rel=1e-6) and y[-1] == pytest.approx(base[-1] / 16, rel=1e-5)


def test_apply_rope_interleaved_pairs_and_inverse():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(1, 5, 2, 12)).astype(np.float32)  # 4 passthrough + 8 rotary channels
    freqs = rope_frequencies(8, 10000.0)
    ang = rope_angles(jnp.arange(5)[None], freqs)
    y = np.asarray(apply_rope(jnp.asarray(x), ang))
    np.testing.assert_array_equal(y[..., :4], x[..., :4])
    z = x[..., 4:].reshape(1, 5, 2, 4, 2)
    c = z[..., 0] + 1j * z[..., 1]
    rot = c * np.exp(1j * np.arange(5)[None, :, None, None] * freqs)
    np.testing.assert_allclose(y[..., 4::2], rot.real, atol=1e-5)
    np.testing.assert_allclose(y[..., 5::2], rot.imag, atol=1e-5)
    back = np.asarray(apply_rope(jnp.asarray(y), ang, inverse=True))
    np.testing.assert_allclose(back, x, atol=1e-5)


# ---------------------------------------------------------------- indexer selection


def test_select_topk_ascending_ties_lowest_index_and_empty_slots():
    s = jnp.asarray([[[1.0, 3.0, 3.0, -jnp.inf, 3.0, 0.5]]])
    np.testing.assert_array_equal(np.asarray(select_topk(s, 2)), [[[1, 2]]])  # three-way tie: lowest two
    np.testing.assert_array_equal(np.asarray(select_topk(s, 3)), [[[1, 2, 4]]])
    s2 = jnp.asarray([[[2.0, -jnp.inf, -jnp.inf, 1.0]]])
    np.testing.assert_array_equal(np.asarray(select_topk(s2, 3)), [[[0, 3, -1]]])


def test_candidate_pool_forces_newest_block_and_drops_empty():
    # 6 entries, blocks of 2 -> 3 blocks; keep 1 block by score, the newest visible block is forced
    s = jnp.asarray([[[5.0, 0.0, 1.0, 2.0, -jnp.inf, -jnp.inf], [0.0, 0.0, 9.0, 0.0, 1.0, -jnp.inf]]])
    n_visible = jnp.asarray([[4, 5]])
    keep = np.asarray(candidate_pool(s, n_visible, 1, 2))
    # query 0: newest visible entry 3 -> block 1 forced (+inf) wins the single slot
    np.testing.assert_array_equal(keep[0, 0], [0, 0, 1, 1, 0, 0])
    keep2 = np.asarray(candidate_pool(s, n_visible, 2, 2))
    np.testing.assert_array_equal(keep2[0, 0], [1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(keep2[0, 1], [0, 0, 1, 1, 1, 1])  # block 2 forced, block 1 best


# ---------------------------------------------------------------- router and experts


def test_router_sqrt_softplus_selection_bias_and_scaling():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(7, 6)).astype(np.float32)
    bias = np.asarray([0, 0, 0, 0, 0, 10.0], np.float32)  # forces expert 5 into every selection
    w, ids = route(jnp.asarray(logits), jnp.asarray(bias), 2, 1.5, True)
    s = np.sqrt(np.log1p(np.exp(logits)))
    for n in range(7):
        assert 5 in np.asarray(ids[n])
        other = int(np.argsort(-s[n, :5])[0])
        assert set(np.asarray(ids[n]).tolist()) == {5, other}
        chosen = s[n, np.asarray(ids[n])]
        np.testing.assert_allclose(np.asarray(w[n]), chosen / chosen.sum() * 1.5, rtol=1e-5)


def test_swiglu_clamps():
    g = jnp.asarray([20.0, -20.0, 1.0])
    u = jnp.asarray([20.0, -20.0, 1.0])
    got = np.asarray(swiglu(g, u, 10.0))
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    np.testing.assert_allclose(got, [silu(10.0) * 10.0, silu(-20.0) * -10.0, silu(1.0)], rtol=1e-6)


def test_compressor_ratio2_pooling_against_numpy():
    from flax import nnx

    from deepinfer_jax.model.compressor import Compressor

    comp = Compressor(8, 16, 2, 1e-20, rngs=nnx.Rngs(0), std=0.5)
    x = np.random.default_rng(4).normal(size=(1, 7, 8)).astype(np.float32)
    got = np.asarray(comp(jnp.asarray(x)))
    assert got.shape == (1, 3, 16)  # the incomplete trailing token makes no entry
    wkv, wg = np.asarray(comp.wkv.weight[...]), np.asarray(comp.wgate.weight[...])
    v = (x[0, :6] @ wkv.T).reshape(3, 2, 16)
    g = (x[0, :6] @ wg.T).reshape(3, 2, 16)
    p = np.exp(g - g.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    c = (v * p).sum(1)
    want = c / np.sqrt((c**2).mean(-1, keepdims=True) + 1e-20)
    np.testing.assert_allclose(got[0], want, rtol=2e-5, atol=1e-6)


def test_forward_full_is_causal_and_jits_once():
    from deepinfer_jax.model.deepseek_v41 import forward_full, init_params

    cfg = ModelConfig.tiny()
    params = init_params(cfg, 0)
    f = jax.jit(forward_full, static_argnums=1)
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, (1, 24))
    full = np.asarray(f(params, cfg, ids))
    ids2 = ids.copy()
    ids2[0, 16:] = (ids2[0, 16:] + 1) % cfg.vocab_size
    other = np.asarray(f(params, cfg, ids2))
    np.testing.assert_array_equal(full[0, :16], other[0, :16])  # earlier positions never see later tokens
    assert np.abs(full[0, 16:] - other[0, 16:]).max() > 0
    assert full.dtype == np.float32 and full.shape == (1, 24, cfg.vocab_size)
