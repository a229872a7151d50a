"""Weights resident in their checkpoint formats (``weights="quantized"``): the device decoders, the
tile-by-tile matmul, the loader, and parity with the float-resident path (presets and the shipped model)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.checkpoint import CheckpointError, WeightsError, load_hf_checkpoint, params_from_state_dict
from deepinfer_jax.checkpoint import quant_formats as Q
from deepinfer_jax.checkpoint.hf_export import tree_to_hf_tensors
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.llm import DEFAULT_CHECKPOINT
from deepinfer_jax.model import qweight as qw
from deepinfer_jax.model.deepseek_v41 import forward_full
from deepinfer_jax.ops import dispatch
from deepinfer_jax.ops.ffi import fp8_block_gemm_reference
from deepinfer_jax.ops.quantized_matmul import cuda as qcuda
from deepinfer_jax.ops.quantized_matmul import pallas as qpallas
from deepinfer_jax.ops.quantized_matmul import reference as qref
from deepinfer_jax.params import init_params, resident_bytes, to_device_weights

RNG = np.random.default_rng(0)


def _device(data, scale, kind, block, shape):
    from deepinfer_jax.checkpoint.residency import StoredTensor

    return to_device_weights(StoredTensor(data, scale, kind, block, shape))


def _fp8(rows, cols, block=(32, 32)):
    w = RNG.standard_normal((rows, cols)).astype(np.float32) * 0.05
    q, s = Q.encode_fp8_blockwise(w, block)
    return _device(q, s.view(np.uint8), "fp8", block, (rows, cols)), Q.decode_weight(q, s)


def _fp4(rows, cols, lead=()):
    ws = RNG.standard_normal(lead + (rows, cols)).astype(np.float32).reshape(-1, rows, cols)
    pairs = [Q.encode_fp4_packed(w) for w in ws]
    data = np.stack([p[0] for p in pairs]).view(np.uint8).reshape(lead + (rows, cols // 2))
    scale = np.stack([p[1] for p in pairs]).view(np.uint8).reshape(lead + (rows, -(-cols // 32)))
    full = np.stack([Q.decode_weight(*p) for p in pairs]).reshape(lead + (rows, cols))
    return _device(data, scale, "fp4", (1, 32), lead + (rows, cols)), full


# ---- element decoders ---------------------------------------------------------------------------


def test_e4m3_decoder_matches_ml_dtypes_on_every_code():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.asarray(qw.e4m3_to_f32(jnp.asarray(codes)))
    ok = ~np.isnan(want)  # 0x7F / 0xFF are NaN in E4M3; checkpoints never hold them
    np.testing.assert_array_equal(got[ok], want[ok])
    assert np.array_equal(np.signbit(got[ok]), np.signbit(want[ok]))


def test_e2m1_and_ue8m0_decoders_on_every_code():
    got = np.asarray(qw.e2m1_to_f32(jnp.arange(16, dtype=jnp.int32)))
    np.testing.assert_array_equal(got, Q.E2M1_VALUES)
    assert np.array_equal(np.signbit(got), np.signbit(Q.E2M1_VALUES))
    b = np.arange(255, dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(qw.ue8m0_to_f32(jnp.asarray(b))), b.view(Q.E8M0).astype(np.float32))


@pytest.mark.parametrize("shape,block", [((64, 96), (32, 32)), ((50, 70), (32, 32)), ((33, 64), (1, 32))])
def test_dequantize_fp8_equals_host_decoder(shape, block):
    w, full = _fp8(*shape, block=block)
    np.testing.assert_array_equal(np.asarray(qw.dequantize(w)), full)


def test_dequantize_fp4_and_take_rows_equal_host_decoder():
    w, full = _fp4(40, 96)
    np.testing.assert_array_equal(np.asarray(qw.dequantize(w)), full)
    ids = jnp.asarray([[3, 0], [39, 3]])
    np.testing.assert_array_equal(np.asarray(qw.take_rows(w, ids)), full[np.asarray(ids)])
    w8, full8 = _fp8(70, 64)  # 32x32 blocks: a row's scale is its block row's
    np.testing.assert_array_equal(np.asarray(qw.take_rows(w8, jnp.asarray([69, 31, 32]))), full8[[69, 31, 32]])


def test_validate_names_the_bad_part():
    w, _ = _fp8(64, 64)
    with pytest.raises(qw.QWeightError, match="scale shape"):
        qw.validate(qw.QWeight(w.data, w.scale[:1], "fp8", (32, 32), (64, 64)))
    with pytest.raises(qw.QWeightError, match="kind must be one of"):
        qw.validate(qw.QWeight(w.data, w.scale, "fp6", (32, 32), (64, 64)))


# ---- the tile-by-tile matmul ----------------------------------------------------------------------


@pytest.mark.parametrize("m", [2, 8, 32])
@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_tiled_matmul_is_bit_identical_to_the_float_matmul(m, kind):
    w, full = _fp8(448, 128) if kind == "fp8" else _fp4(448, 128)
    x = jnp.asarray(RNG.standard_normal((m, 128)).astype(np.float32))
    want = jnp.einsum("ni,oi->no", x, jnp.asarray(full))
    for tile in (qref.TILE_BYTES, 128 * 128 * 4):  # one tile; three 128-row tiles and a 64-row tail
        got = jax.jit(lambda x, w, t=tile: qref.quantized_matmul(x, w, tile_bytes=t))(x, w)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_tiled_matmul_with_an_unaligned_tail_agrees_to_reassociation():
    w, full = _fp8(200, 128)  # 64-row tiles and an 8-row tail: not on the dot kernel's column tiles
    x = jnp.asarray(RNG.standard_normal((8, 128)).astype(np.float32))
    want = np.asarray(jnp.einsum("ni,oi->no", x, jnp.asarray(full)))
    got = np.asarray(jax.jit(lambda x, w: qref.quantized_matmul(x, w, tile_bytes=64 * 128 * 4))(x, w))
    assert np.max(np.abs(got - want)) <= 1e-6 * np.max(np.abs(want))


def test_tiled_matmul_materialises_no_full_size_float_weight():
    """The optimized HLO's temporaries stay below the weight's float32 size (decoding first does not)."""
    w, _ = _fp8(8192, 512)  # 16 MiB of float32: four tiles
    x = jnp.zeros((2, 512), jnp.float32)
    full_f32 = 8192 * 512 * 4
    tiled = jax.jit(qref.quantized_matmul).lower(x, w).compile()
    naive = jax.jit(lambda x, w: jnp.einsum("ni,oi->no", x, qw.dequantize(w))).lower(x, w).compile()
    assert naive.memory_analysis().temp_size_in_bytes >= full_f32  # the check can fail
    assert tiled.memory_analysis().temp_size_in_bytes < full_f32 // 2
    assert "while" in tiled.as_text()


def test_pallas_grouped_fp4_matches_reference():
    w, _ = _fp4(64, 64, lead=(3,))
    x = jnp.asarray(RNG.standard_normal((20, 64)).astype(np.float32))
    sizes = jnp.asarray([7, 0, 11], jnp.int32)
    want = qref.quantized_grouped_matmul(x, w, sizes)
    got = qpallas.quantized_grouped_matmul(x, w, sizes, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[18:] == 0)


def test_dispatch_selects_the_gpu_paths_and_falls_back_to_the_reference():
    with dispatch.use_kernels("reference"):
        assert dispatch.get("quantized_matmul") is qref.quantized_matmul
    with dispatch.use_kernels("cuda_ffi"):
        assert dispatch.get("quantized_matmul") is qcuda.quantized_matmul
    with dispatch.use_kernels("pallas_interpret"):
        assert dispatch.get("quantized_matmul") is qref.quantized_matmul  # no Pallas dense kernel: reference
        assert dispatch.get("quantized_grouped_matmul").func is qpallas.quantized_grouped_matmul


def test_cuda_path_quantizes_activations_then_calls_fp8_block_gemm():
    """Run with the custom call's jnp reference (no GPU here): FP8 activations, so close but not exact."""
    w, full = _fp8(96, 128)
    x = jnp.asarray(RNG.standard_normal((4, 128)).astype(np.float32))
    got = qcuda.quantized_matmul(x, w, gemm=fp8_block_gemm_reference)
    want = np.asarray(x) @ full.T
    np.testing.assert_allclose(np.asarray(got), want, rtol=0.1, atol=0.05 * np.abs(want).max())
    w4, _ = _fp4(64, 64)  # FP4 goes to the XLA formulation
    assert qcuda.quantized_matmul(x[:, :64], w4, gemm=None).shape == (4, 64)


# ---- loader, settings and parity --------------------------------------------------------------------


def _tensors(cfg, seed=0):
    from flax import nnx

    tree = nnx.to_pure_dict(init_params(cfg, seed))
    tree.pop("engram_token_map", None)
    tree = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), tree)
    tensors = tree_to_hf_tensors(cfg, tree)
    tensors["embed.weight"], tensors["embed.scale"] = Q.encode_fp8_blockwise(tree["embed"]["weight"], (32, 32))
    return tensors


def test_bad_weights_setting_and_missing_scale_are_typed_errors():
    cfg = ModelConfig.tiny()
    tensors = _tensors(cfg)
    with pytest.raises(WeightsError, match="weights: must be one of"):
        params_from_state_dict(cfg, tensors, weights="fp8")
    del tensors["layers.0.attn.wq_a.scale"]
    with pytest.raises(CheckpointError, match="layers.0.attn.wq_a.weight.*scale partner"):
        params_from_state_dict(cfg, tensors, weights="quantized")


#: one token shape for every forward_full comparison here
_IDS_SHAPE = (2, 45)
#: the engine shape of tests/test_chat.py and test_serve.py (the quantized engine's programs are shared through
#: the compilation cache)
_CHAT_TEST_ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=64, token_buckets=(64,), block_size=32,
                         max_model_len=512, chunking="tokens", use_tqdm=False)


def test_quantized_logits_equal_float_resident():
    """Quantized at load from a float checkpoint (the tiny preset); the small preset's config is the shipped
    model's, whose quantized residency the next test checks from its FP8/FP4 checkpoint."""
    cfg = ModelConfig.tiny()
    tensors = _tensors(cfg, seed=1)
    pf = params_from_state_dict(cfg, tensors, weights="float32")
    pq = params_from_state_dict(cfg, tensors, weights="quantized")
    kinds = {leaf.kind for leaf in jax.tree_util.tree_leaves(pq, is_leaf=qw.is_quantized) if qw.is_quantized(leaf)}
    assert kinds == {"fp8", "fp4", "bf16"}  # embed FP8 32x32, head kept BF16
    ids = RNG.integers(3, cfg.vocab_size, _IDS_SHAPE)
    f = jax.jit(forward_full, static_argnums=1)
    lf, lq = np.asarray(f(pf, cfg, ids)), np.asarray(f(pq, cfg, ids))
    assert np.max(np.abs(lq - lf)) <= 1e-5 * np.max(np.abs(lf))
    assert np.array_equal(lq.argmax(-1), lf.argmax(-1))


def test_shipped_model_quantized_residency():
    cfg, pf = load_hf_checkpoint(DEFAULT_CHECKPOINT, progress=False, weights="float32")
    _, pq = load_hf_checkpoint(DEFAULT_CHECKPOINT, progress=False, weights="auto")
    ckpt_bytes = (DEFAULT_CHECKPOINT / "model.safetensors").stat().st_size
    assert abs(resident_bytes(pq) - ckpt_bytes) <= 0.10 * ckpt_bytes  # float32 residency is ~4x
    assert resident_bytes(pf) > 3 * ckpt_bytes
    kinds = {leaf.kind for leaf in jax.tree_util.tree_leaves(pq, is_leaf=qw.is_quantized) if qw.is_quantized(leaf)}
    assert kinds == {"fp8", "fp4"}, kinds  # the checkpoint's FP8 dense weights (head included) and FP4 experts
    ids = RNG.integers(3, 5000, _IDS_SHAPE)
    f = jax.jit(forward_full, static_argnums=1)
    lf, lq = np.asarray(f(pf, cfg, ids)), np.asarray(f(pq, cfg, ids))
    assert np.max(np.abs(lq - lf)) <= 1e-5 * np.max(np.abs(lf))
    assert np.array_equal(lq.argmax(-1), lf.argmax(-1))


def test_engine_default_is_quantized_with_identical_greedy_tokens():
    from deepinfer_jax import LLM, SamplingParams

    prompts = ["def fib(n):", "import os\n", "class Foo:"]
    sp = SamplingParams(temperature=0, max_tokens=16)
    runs = {}
    for weights in (None, "float32"):
        llm = LLM(weights=weights, **_CHAT_TEST_ENGINE)
        runs[llm.weights_resident] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        del llm
    assert set(runs) == {"quantized", "float32"}
    assert runs["quantized"] == runs["float32"]


def test_quantized_with_a_split_beyond_data_parallelism_is_refused_naming_weights():
    from deepinfer_jax.llm import _resolve_weights
    from deepinfer_jax.sharding import resolve_preset

    for name in ("cpu-dp2-ep2-tp2", "cpu-cp4"):  # tensors (and experts without EPLB) or the context split
        with pytest.raises(WeightsError, match=f"weights: quantized residency runs on one device.*'{name}'"):
            _resolve_weights("quantized", "float32", resolve_preset(name))
    for name in ("cpu-dp8-ep1", "cpu-dp2-ep4"):  # DP alone, DP with the EP MoE: quantized runs (test_dp_engine.py)
        assert _resolve_weights("quantized", "float32", resolve_preset(name)) == "quantized"
        assert _resolve_weights(None, "float32", resolve_preset(name)) == "float32"  # "auto" stays float sharded
    assert _resolve_weights(None, "bfloat16") == "bfloat16"
    assert _resolve_weights(None, "float32") == "auto"


# ---- the memory plan --------------------------------------------------------------------------------


def _tree_bytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(tree))


@pytest.mark.parametrize("weights", ["quantized", "float32"])
def test_memory_plan_matches_the_small_models_resident_bytes(weights):
    from deepinfer_jax.checkpoint import memory_plan as M
    from deepinfer_jax.config import CacheConfig
    from deepinfer_jax.model.kv_cache import init_cache

    cfg, params = load_hf_checkpoint(DEFAULT_CHECKPOINT, progress=False, weights=weights)
    storage = M.checkpoint_storage(DEFAULT_CHECKPOINT)
    cache_cfg = CacheConfig(block_size=64, num_blocks=40, max_requests=4, max_blocks_per_request=10)
    plan = M.plan_memory(cfg, M.Layout.from_preset("single"), weights=weights, kv_tokens=40 * 64, context=640,
                         max_requests=4, block_size=64, storage=storage)
    real_weights = resident_bytes(params)
    assert abs(plan.weight_bytes - real_weights) <= 0.05 * real_weights, (plan.weights, real_weights)
    real_cache = _tree_bytes(init_cache(cfg, cache_cfg))
    assert abs(plan.cache_bytes - real_cache) <= 0.05 * real_cache, (plan.cache_bytes, real_cache)


def test_memory_plan_v41_fits_every_design_preset_quantized_not_float32():
    import json
    from pathlib import Path

    from deepinfer_jax.checkpoint import memory_plan as M

    raw = json.loads((Path(__file__).parent / "fixtures" / "deepseek_v41_flash_config.json").read_text())
    cfg = ModelConfig.from_hf_config(raw)
    for name in M.DESIGN_PRESETS:
        plan = M.plan_memory(cfg, M.Layout.from_preset(name), kv_tokens=65536)
        assert plan.fits and plan.free > 0, M.format_plan(plan, cfg)
    assert not M.plan_memory(cfg, M.Layout.from_preset(M.OFFLINE_8), weights="float32").fits
    with pytest.raises(M.PlanError, match="sharding: no preset"):
        M.Layout.from_preset("ep3")
