"""Shared inputs of the sharding subprocess scripts: the tiny model, rounding-robust weights, token ids."""

from __future__ import annotations

import numpy as np

BATCH, SEQ = 8, 16


def tiny_config():
    """ModelConfig.tiny() cut to 5 layers that keep every attention layer role (SWA, FULL ratio 2, REUSE,
    FULL ratio 1 as the candidate source, REINDEX), without Engram (replicated by the rules; its hash
    graph alone costs as much compile time as the rest) and with 2 Sinkhorn iterations (unrolled, 20
    in tiny): the forward compiles ~6x faster, and compile time dominates these tests."""
    from deepinfer_jax import ModelConfig

    return ModelConfig.tiny().replace(
        num_hidden_layers=5, compress_ratios=(0, 2, 2, 1, 1), kv_source_layer_ids=(1, 3),
        index_source_layer_ids=(1, 3, 4), candidate_source_layer_id=3, engram_layer_ids=(),
        engram_num_embeddings=(), dspark_target_layer_ids=(2, 3, 4), hc_sinkhorn_iters=2)


def model_and_inputs():
    """(cfg, params, token ids [BATCH, SEQ]) for ``tiny_config()``, identical in every process.

    The weights are drawn with numpy like the model's initialiser (normal(initializer_range)
    matrices, unit norms and mHC scales, zero biases and sinks): eager ``init_params`` compiles one
    small program per op and shape, which costs more than the forward. Sublayer output projections
    are scaled by 0.1 (environment.md, fragility pitfall): a one-ulp difference from a changed
    reduction order then cannot move the logits past the tolerance through a flipped fake-quant
    bin, while attention and the experts still shape the logits.
    """
    from flax import nnx

    from deepinfer_jax.model.deepseek_v41 import abstract_params
    from deepinfer_jax.params import params_from_tree

    cfg = tiny_config()
    rng = np.random.default_rng(7)

    def draw(path: str, shape) -> np.ndarray:
        leaf = path.rsplit(".", 1)[-1]
        if path.endswith("norm.weight") or leaf.endswith("_scale"):
            return np.ones(shape, np.float32)
        if leaf in ("bias", "bias_vl", "attn_sink") or leaf.endswith("_base"):
            return np.zeros(shape, np.float32)
        scale = 0.1 if path.endswith(("attn.wo_b.weight", "experts.w2", "shared_experts.w2.weight")) else 1.0
        return (rng.standard_normal(shape) * cfg.initializer_range * scale).astype(np.float32)

    def fill(tree, prefix=""):
        return {k: fill(v, f"{prefix}{k}.") if isinstance(v, dict) else draw(f"{prefix}{k}", v.shape)
                for k, v in tree.items()}

    params = params_from_tree(cfg, fill(nnx.to_pure_dict(abstract_params(cfg))))
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (BATCH, SEQ))
    return cfg, params, ids
