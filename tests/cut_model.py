"""A 5-layer cut of the test model, for the tests whose point is not the 12-layer schedule.

``ModelConfig.tiny()`` cut to 5 layers that keep every attention layer role (SWA, FULL at ratio 2, REUSE, FULL
at ratio 1 as the candidate source, REINDEX), the encoder/decoder split (the decoder from layer 3), one Engram
layer and the drafter's three target layers. So every kind of per-request state stays: SWA rings, compressor
groups at both ratios, an Engram look-back. It runs 2 Sinkhorn rounds instead of 20. Its step programs compile
in about half the time of ``tiny``'s (docs/benchmarks.md). The sharded checks use a similar cut without Engram
(``tests/sharded/shard_common.py``).
"""

from __future__ import annotations

import numpy as np

from deepinfer_jax import ModelConfig


def tiny_cut() -> ModelConfig:
    return ModelConfig.tiny().replace(
        num_hidden_layers=5, compress_ratios=(0, 2, 2, 1, 1), kv_source_layer_ids=(1, 3),
        index_source_layer_ids=(1, 3, 4), candidate_source_layer_id=3, engram_layer_ids=(1,),
        engram_num_embeddings=(2048,), dspark_target_layer_ids=(2, 3, 4), hc_sinkhorn_iters=2)


def write_tiny_cut(path) -> str:
    """``tiny_cut()`` with random weights (seed 0) written as a float32 checkpoint directory at ``path``, for tests
    that load the model by path (every Ray actor does); its random weights make greedy tokens that depend on
    every layer."""
    from flax import nnx

    from deepinfer_jax.checkpoint.hf_export import save_hf_checkpoint
    from deepinfer_jax.params import init_params

    cfg = tiny_cut()
    tree = nnx.to_pure_dict(init_params(cfg, seed=0))
    tree.pop("engram_token_map")  # the identity map, rebuilt by the loader

    def host(t):
        return {k: host(v) if isinstance(v, dict) else np.asarray(v, np.float32) for k, v in t.items()}

    save_hf_checkpoint(path, cfg, host(tree), quantize=False, plain_dtype=np.float32)
    return str(path)
