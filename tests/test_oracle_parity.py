"""Oracle parity: ``forward_full`` against NeMo AutoModel's DeepSeek-V4.1 port on tiny configs.

Path under test, end to end: NeMo model (seeded random init) -> DeepSeek-native state dict ->
an HF-style directory in the released storage formats (FP8 32x32 dense, packed FP4 experts, FP8
row-scaled Engram tables; config.json + sharded safetensors + index) -> ``load_hf_checkpoint`` ->
jitted ``forward_full``. NeMo is loaded with the same decoded weights, so both sides compute from
identical values. fp32, fake-quant on in both. Target: max |delta logit| <= 1e-4 * max |logit|.

Sublayer output projections are scaled down (``output_scale``) because with fake-quant on a single
rounding-level difference can flip an FP4/FP8 bin and cascade (environment.md, fragility pitfall).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from deepinfer_jax import ModelConfig, compile_options, forward_full, load_hf_checkpoint
from deepinfer_jax.checkpoint.hf_export import save_hf_checkpoint, tree_to_hf_tensors
from deepinfer_jax.checkpoint.loader import load_hf_checkpoint_tree, tensors_to_tree

nemo = pytest.importorskip("nemo_oracle")

pytestmark = [pytest.mark.oracle, pytest.mark.slow, pytest.mark.usefixtures("xla_cpu_level0")]  # level 0: conftest


def _engram_cfg() -> ModelConfig:
    """tiny(): Engram at 1 and 4, every layer role; top-k and candidate pool never truncate."""
    return ModelConfig.tiny().replace(index_topk=64, candidate_topk_blocks=64)


def _split_cfg() -> ModelConfig:
    """No Engram; encoder 0-3 (ratio 2) / decoder 4-7 (ratio 1) with REINDEX layers, 2 streams."""
    return ModelConfig.tiny().replace(
        num_hidden_layers=8, compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(1, 4),
        index_source_layer_ids=(1, 4, 5, 7), candidate_source_layer_id=4, candidate_topk_blocks=64,
        index_topk=64, sliding_window=4, hc_mult=2, num_attention_heads=2, head_dim=64, qk_rope_head_dim=16,
        engram_layer_ids=(), engram_num_embeddings=(), dspark_target_layer_ids=(5, 6, 7), o_groups=2,
        num_experts_per_tok=3)


def _checkpoint(tmp_path, cfg: ModelConfig, seed: int):
    hf = cfg.to_hf_config(vision_config={"num_hidden_layers": 0})
    model = nemo.build_nemo(hf, seed=seed, output_scale=0.03)
    tree = tensors_to_tree(cfg, nemo.native_state_dict(model))
    save_hf_checkpoint(tmp_path, cfg, tree, quantize=True, max_shard_bytes=200_000)
    _, decoded = load_hf_checkpoint_tree(tmp_path, progress=False)
    nemo.load_native_state_dict(model, tree_to_hf_tensors(cfg, decoded, quantize=False, plain_dtype=np.float32))
    return model


@pytest.mark.parametrize("make_cfg", [_engram_cfg, _split_cfg], ids=["engram", "ced-split"])
def test_forward_full_matches_nemo(tmp_path, make_cfg):
    cfg = make_cfg()
    model = _checkpoint(tmp_path, cfg, seed=0)
    assert len(list(tmp_path.glob("*.safetensors"))) >= 2 and (tmp_path / "model.safetensors.index.json").exists()
    loaded_cfg, params = load_hf_checkpoint(tmp_path, progress=False)
    assert loaded_cfg == cfg
    fwd = compile_options.jit(forward_full, static_argnums=1)
    rng = np.random.default_rng(1)
    for length in (9, 40, 57):  # across the window, several compression groups, a trailing partial group
        ids = rng.integers(0, cfg.vocab_size, (2, length))
        want = nemo.logits(model, ids)
        got = np.asarray(fwd(params, cfg, ids))
        err = np.abs(got - want).max()
        assert err <= 1e-4 * np.abs(want).max(), (length, err, np.abs(want).max())
    # the quantisation boundaries are really under test: turning them off moves the logits far more
    off = np.asarray(fwd(params, cfg.replace(fake_quant=False), ids))
    assert np.abs(off - want).max() > 50 * max(err, 1e-7)
