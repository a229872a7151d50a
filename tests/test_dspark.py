"""The DSpark drafter (``deepinfer_jax.model.dspark``, model.md §4.9): NeMo parity, loading, config errors,
and the shipped drafter of ``checkpoints/small-trained``.

Parity path, end to end: a 3-layer target (Engram at layer 1, every layer captured) and the 3-stage
drafter are built by NeMo AutoModel (``DeepseekV41ForCausalLM`` / ``DeepseekV41DSparkModel``, seeded
random weights); the target's weights go through our loader, the drafter's through the released storage
formats (FP8 32x32 / packed FP4 / BF16 / FP32) and ``drafter_params_from_state_dict``; NeMo is reloaded
with the decoded values. From token ids, NeMo's captured target features (its own capture modules,
stream mean) feed its drafter; ours come from ``forward_full(..., capture=...)``. fp32, fake-quant on.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax import ModelConfig, forward_full
from deepinfer_jax.checkpoint import (
    CheckpointError,
    drafter_params_from_state_dict,
    load_hf_checkpoint,
    load_hf_drafter,
)
from deepinfer_jax.checkpoint.hf_export import save_hf_checkpoint, tree_to_hf_tensors
from deepinfer_jax.checkpoint.loader import drafter_tensors_to_tree, tensors_to_tree
from deepinfer_jax.checkpoint.safetensors_io import save_file
from deepinfer_jax.model import dspark

REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "checkpoints" / "small-trained"
FIXTURE = REPO / "tests" / "fixtures" / "stdlib_heldout_sample.py.txt"


def _cfg() -> ModelConfig:
    """3 SWA layers, Engram at layer 1, all three captured; window 6, block 4, 4 experts top-2 in the drafter."""
    return ModelConfig.tiny().replace(
        num_hidden_layers=3, compress_ratios=(0,) * 6, kv_source_layer_ids=(), index_source_layer_ids=(),
        candidate_source_layer_id=-1, engram_layer_ids=(1,), engram_num_embeddings=(2048,),
        dspark_target_layer_ids=(0, 1, 2), sliding_window=6, dspark_block_size=4)


def _nemo_drafter(cfg: ModelConfig, seed: int):
    """NeMo's drafter in fp32 with non-trivial norms, sinks, mixers, biases and heads."""
    torch = pytest.importorskip("torch")
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel

    hf = cfg.to_hf_config(vision_config={"num_hidden_layers": 0})
    hf["text_config"]["dtype"] = "float32"
    torch.manual_seed(seed)
    backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch")
    model = DeepseekV41DSparkModel(DeepseekV41Config(**hf).text_config, backend, num_anchors=3,
                                   enable_confidence_head=True).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "_hc.scale")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "sinks_param" in name or name.endswith(".base"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("wo_b.weight") or "down_proj" in name:
                p.mul_(0.03)  # robust to a rounding-level fake-quant flip (environment.md)
            elif "markov_head" in name or "confidence_head" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model


def _nemo_features(target, ids: np.ndarray, layers) -> np.ndarray:
    """NeMo's DSpark target features: its capture modules' inputs, mean over the streams, concatenated."""
    import torch

    got = {}
    hooks = [m.register_forward_pre_hook(lambda _m, inp, i=i: got.__setitem__(i, inp[0].mean(dim=2)))
             for i, m in zip(layers, target.get_dspark_target_feature_modules(list(layers)))]
    with torch.no_grad():
        target(torch.from_numpy(ids.astype(np.int64)))
    for h in hooks:
        h.remove()
    return torch.cat([got[i] for i in layers], dim=-1).float().numpy()


@pytest.mark.oracle
@pytest.mark.slow
def test_drafter_matches_nemo(monkeypatch):
    pytest.importorskip("nemo_automodel", reason="nemo_automodel (the oracle) is not installed; `make test` installs it")
    nemo = pytest.importorskip("nemo_oracle")
    import nemo_automodel.components.models.deepseek_v41.dspark as nemo_dspark
    import torch

    cfg = _cfg()
    k, batch, seq = cfg.dspark_block_size, 2, 20
    target = nemo.build_nemo(cfg.to_hf_config(vision_config={"num_hidden_layers": 0}), seed=0, output_scale=0.03)
    from deepinfer_jax.params import params_from_tree

    params = params_from_tree(cfg, tensors_to_tree(cfg, nemo.native_state_dict(target)))
    model = _nemo_drafter(cfg, seed=3)
    native = {k_: v.detach().float().numpy() for k_, v in model.state_dict_adapter.to_hf(model.state_dict()).items()}
    stored = tree_to_hf_tensors(cfg, drafter_tensors_to_tree(cfg, native), quantize=True, drafter=True)
    assert any(v.dtype.itemsize == 1 for v in stored.values())  # really FP8/FP4 storage
    drafter = drafter_params_from_state_dict(cfg, stored)
    decoded = tree_to_hf_tensors(cfg, drafter_tensors_to_tree(cfg, stored), quantize=False, plain_dtype=np.float32,
                                 drafter=True)
    sd = target.state_dict_adapter.to_hf(target.state_dict())
    decoded.update({n: sd[n].float().numpy() for n in ("embed.weight", "head.weight")})  # shared with the target
    missing, unexpected = model.load_state_dict(model.state_dict_adapter.from_hf(
        {n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in decoded.items()}), strict=False)
    assert not missing and not unexpected, (missing, unexpected)

    rng = np.random.default_rng(5)
    ids = rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    anchors = np.array([[0, 7, 15], [4, 11, 14]])
    monkeypatch.setattr(nemo_dspark, "sample_anchor_positions",
                        lambda **_: (torch.from_numpy(anchors), torch.ones(anchors.shape, dtype=torch.bool)))
    want_feats = _nemo_features(target, ids, cfg.dspark_target_layer_ids)
    with torch.no_grad():
        out = model(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(want_feats), torch.ones(batch, seq))
    want_logits, want_conf = out.draft_logits.numpy(), out.confidence_pred.numpy()

    capture = jax.jit(lambda p, x: forward_full(p, cfg, x, capture=cfg.dspark_target_layer_ids)[1])

    def _teacher_forced(params, drafter, c, feats, anchors):  # the drafter alone, teacher-forced
        offs = anchors[..., None] + jnp.arange(k)
        toks = jnp.take_along_axis(ids[:, None, :], offs.reshape(batch, 1, -1), axis=2).reshape(offs.shape)
        block = jnp.where(jnp.arange(k) == 0, toks, c.dspark_noise_token_id)
        pos = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
        hn = dspark.drafter_states(drafter, params["embed"]["weight"][...], c, feats, pos,
                                   jnp.ones((batch, seq), bool), block, anchors)
        return dspark.teacher_forced_heads(drafter, c, params["head"]["weight"][...], hn, toks)

    teacher_forced = jax.jit(_teacher_forced, static_argnums=2)
    feats = np.asarray(capture(params, jnp.asarray(ids)))
    logits, conf = (np.asarray(v) for v in teacher_forced(params, drafter, cfg, feats, jnp.asarray(anchors)))
    feat_err = np.abs(feats - want_feats).max()
    logit_err, conf_err = np.abs(logits - want_logits).max(), np.abs(conf - want_conf).max()
    print(f"features {feat_err:.2e} / {np.abs(want_feats).max():.2f}, draft logits {logit_err:.2e} / "
          f"{np.abs(want_logits).max():.2f}, confidence {conf_err:.2e} / {np.abs(want_conf).max():.2f}")
    assert feat_err <= 1e-5 * np.abs(want_feats).max()
    assert logit_err <= 1e-4 * np.abs(want_logits).max()
    assert conf_err <= 1e-4 * np.abs(want_conf).max()
    # the context matters (each block sees its window of target features) ...
    shifted = np.asarray(teacher_forced(params, drafter, cfg, capture(params, jnp.asarray(np.roll(ids, 1, axis=1))),
                                        jnp.asarray(anchors))[0])
    assert np.abs(shifted[:, 1:] - want_logits[:, 1:]).max() > 1000 * logit_err
    # ... and the SWA-row FP8 fake-quant is really under test
    off = np.asarray(teacher_forced(params, drafter, cfg.replace(fake_quant=False), feats, jnp.asarray(anchors))[0])
    assert np.abs(off - want_logits).max() > 20 * max(logit_err, 1e-7)

    # inference path: draft_from_features -> draft_block (the Markov head chained on its own greedy drafts)
    # equals NeMo fed those drafts as the block's true tokens (features are causal: a prefix's are a prefix)
    a = 11
    got = jax.jit(dspark.draft_from_features, static_argnums=2)(params, drafter, cfg, feats[:, :a + 1], ids[:, :a + 1])
    fed = ids.copy()
    fed[:, a + 1:a + k] = np.asarray(got.draft_ids)[:, :k - 1]
    one = np.full((batch, 1), a)
    monkeypatch.setattr(nemo_dspark, "sample_anchor_positions",
                        lambda **_: (torch.from_numpy(one), torch.ones(one.shape, dtype=torch.bool)))
    with torch.no_grad():
        ref = model(torch.from_numpy(fed.astype(np.int64)), torch.from_numpy(want_feats), torch.ones(batch, seq))
    ref_logits = ref.draft_logits.numpy()[:, 0]
    assert np.abs(np.asarray(got.logits) - ref_logits).max() <= 1e-4 * np.abs(ref_logits).max()
    np.testing.assert_array_equal(np.asarray(got.draft_ids), ref_logits.argmax(-1))
    np.testing.assert_allclose(np.asarray(got.confidence), 1 / (1 + np.exp(-ref.confidence_pred.numpy()[:, 0])),
                               rtol=1e-4, atol=1e-6)


def _random_tree(abstract_state, seed: int, std: float = 0.02) -> dict:
    """A parameter tree of normal(std) numpy values shaped like ``abstract_state`` (no JAX compiles)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: (rng.normal(0, std, a.shape)).astype(np.float32), nnx_pure(abstract_state))


def _drafter_tensors(cfg, seed=1) -> dict:
    tree = _random_tree(dspark.abstract_drafter_params(cfg), seed)
    return tree_to_hf_tensors(cfg, tree, quantize=True, drafter=True)


def nnx_pure(state):
    from flax import nnx

    return nnx.to_pure_dict(state)


def test_loader_with_and_without_mtp(tmp_path):
    cfg = _cfg().replace(engram_layer_ids=(), engram_num_embeddings=())
    from deepinfer_jax.model.deepseek_v41 import abstract_params

    target_tree = _random_tree(abstract_params(cfg), 0)
    mtp = _drafter_tensors(cfg)
    plain = tmp_path / "plain"
    save_hf_checkpoint(plain, cfg, target_tree)
    assert load_hf_drafter(plain) is None  # no mtp.*: the target loads, the drafter is absent
    _, want = load_hf_checkpoint(plain, progress=False)

    inline = tmp_path / "inline"  # mtp.* inside the checkpoint, as released
    save_hf_checkpoint(inline, cfg, target_tree, extra_tensors=mtp)
    cfg_in, params = load_hf_checkpoint(inline, progress=False)
    assert cfg_in == cfg
    for a, b in zip(jax.tree.leaves(nnx_pure(params)), jax.tree.leaves(nnx_pure(want))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the backbone ignores mtp.*
    got = load_hf_drafter(inline)
    ref = drafter_tensors_to_tree(cfg, mtp)
    got_flat = dict(_flat(nnx_pure(got)))
    ref_flat = dict(_flat(ref))
    assert got_flat.keys() == ref_flat.keys() and len(got_flat) > 50
    for name, v in ref_flat.items():
        np.testing.assert_array_equal(np.asarray(got_flat[name]), v, err_msg=name)
    assert got_flat["mtp.0.ffn.experts.w1"].shape == (cfg.dspark_n_routed_experts, cfg.moe_intermediate_size,
                                                      cfg.hidden_size)

    beside = tmp_path / "beside"  # drafter.safetensors next to the target
    save_hf_checkpoint(beside, cfg, target_tree)
    save_file(beside / "drafter.safetensors", mtp)
    for name, v in _flat(nnx_pure(load_hf_drafter(beside, cfg))):
        np.testing.assert_array_equal(np.asarray(v), ref_flat[name], err_msg=name)

    partial = dict(mtp)
    del partial["mtp.1.attn.wkv.weight"], partial["mtp.1.attn.wkv.scale"]
    with pytest.raises(CheckpointError) as e:
        drafter_params_from_state_dict(cfg, partial)
    assert e.value.missing == ["mtp.1.attn.wkv.weight"] and "mtp.1.attn.wkv.weight" in str(e.value)
    stray = {**mtp, "mtp.3.attn.wkv.weight": mtp["mtp.1.attn.wkv.weight"]}
    with pytest.raises(CheckpointError, match=r"unknown:\n  mtp\.3\.attn\.wkv\.weight"):
        drafter_params_from_state_dict(cfg, stray)


def _flat(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def test_bad_drafter_config_names_the_field():
    tiny = ModelConfig.tiny()
    for change, field in [({"dspark_target_layer_ids": (3, 12)}, "dspark_target_layer_ids"),
                          ({"dspark_target_layer_ids": (4, 3)}, "dspark_target_layer_ids"),
                          ({"dspark_num_experts_per_tok": 5}, "dspark_num_experts_per_tok"),
                          ({"dspark_noise_token_id": 512}, "dspark_noise_token_id"),
                          ({"dspark_markov_rank": 0}, "dspark_markov_rank"),
                          ({"dspark_block_size": 0}, "dspark_block_size")]:
        with pytest.raises(ValueError, match=field):
            tiny.replace(**change)
    raw = tiny.to_hf_config()
    raw["text_config"]["dspark_block_size"] = "5"
    with pytest.raises(ValueError, match="dspark_block_size"):
        ModelConfig.from_hf_config(raw)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        dspark.check_drafter_config(tiny.replace(num_nextn_predict_layers=0))
    prefix = tiny.replace(num_hidden_layers=2, dspark_target_layer_ids=(1,))  # stages would sit on ratio-2 layers
    with pytest.raises(ValueError, match="compress_ratios"):
        dspark.init_drafter_params(prefix)
    for bad in ((12,), (3, 1)):  # the capture hook: backbone layer ids, strictly increasing
        with pytest.raises(ValueError, match="capture"):
            forward_full(None, tiny, np.zeros((1, 4), np.int32), capture=bad)
    # a checkpoint drafter trained for three target layers does not fit a config naming two
    mtp = _drafter_tensors(_cfg())
    with pytest.raises(CheckpointError) as e:
        drafter_params_from_state_dict(_cfg().replace(dspark_target_layer_ids=(1, 2)), mtp)
    assert e.value.misshaped == ["mtp.0.main_proj.weight"] and "main_proj" in str(e.value)


#: The shipped drafter's position-1 greedy match on the fixture's 287 anchors measured 0.561 (held-out
#: teacher-forced over 1536 blocks: 0.588, drafter_metrics.json); the margin absorbs argmax near-ties
#: on other platforms. The same check on a drafter with random weights must fail it (asserted below).
MIN_POSITION1_MATCH = 0.5


@pytest.mark.slow
def test_shipped_drafter_predicts_the_target_next_token():
    from deepinfer_jax.tokenizer import load_tokenizer

    assert (SHIPPED / "drafter.safetensors").is_file(), "the trained drafter ships next to the target"
    assert (SHIPPED / "drafter.safetensors").stat().st_size < 15 * 2**20
    cfg, target = load_hf_checkpoint(SHIPPED, progress=False)
    drafter = load_hf_drafter(SHIPPED, cfg)
    assert drafter is not None
    ids = load_tokenizer().encode(FIXTURE.read_text(), add_special_tokens=False).ids
    ids = np.asarray([cfg.bos_token_id, *ids], np.int32)[None]
    w = cfg.sliding_window
    anchors = np.arange(w, ids.shape[1])  # every anchor of the held-out excerpt with a full context window

    # two jits: one over the target and the drafter together compiles twice as long on XLA:CPU
    logits, feats = jax.jit(lambda t, x: forward_full(t, cfg, x, capture=cfg.dspark_target_layer_ids))(target, ids)
    want = np.asarray(jnp.argmax(logits[0, anchors], -1))

    @jax.jit
    def run(target, drafter, feats, ids):
        pos = jnp.asarray(anchors)[:, None] - w + jnp.arange(w)
        out = dspark.draft_block(drafter, target, cfg, feats[0][pos], pos, pos >= 0, ids[0, anchors],
                                 jnp.asarray(anchors))
        return out.draft_ids, out.confidence

    got, conf = (np.asarray(v) for v in run(target, drafter, feats, jnp.asarray(ids)))
    match = got[:, 0] == want
    rate = match.mean()
    print(f"position-1 greedy match {rate:.3f} over {len(anchors)} held-out anchors; mean confidence "
          f"{conf[:, 0].mean():.3f} (matched) ... {conf[match, 0].mean():.3f} vs {conf[~match, 0].mean():.3f}")
    assert rate >= MIN_POSITION1_MATCH
    untrained = dspark.drafter_params_from_tree(cfg, _random_tree(dspark.abstract_drafter_params(cfg), 0))
    untrained = np.asarray(run(target, untrained, feats, jnp.asarray(ids))[0])
    assert (untrained[:, 0] == want).mean() < MIN_POSITION1_MATCH / 2
    metrics = json.loads((SHIPPED / "drafter_metrics.json").read_text())
    assert len(metrics["heldout"]["teacher_forced"]["alpha_per_position"]) == cfg.dspark_block_size
