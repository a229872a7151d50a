"""A 5-layer cut of the test model, for the tests whose point is not the 12-layer schedule.

``ModelConfig.tiny()`` cut to 5 layers that keep every attention layer role (SWA, FULL at ratio 2, REUSE, FULL
at ratio 1 as the candidate source, REINDEX), the encoder/decoder split (the decoder from layer 3), one Engram
layer and the drafter's three target layers. So every kind of per-request state stays: SWA rings, compressor
groups at both ratios, an Engram look-back. It runs 2 Sinkhorn rounds instead of 20. Its step programs compile
in about half the time of ``tiny``'s (docs/benchmarks.md). The sharded checks use a similar cut without Engram
(``tests/sharded/shard_common.py``).
"""

from __future__ import annotations

from deepinfer_jax import ModelConfig


def tiny_cut() -> ModelConfig:
    return ModelConfig.tiny().replace(
        num_hidden_layers=5, compress_ratios=(0, 2, 2, 1, 1), kv_source_layer_ids=(1, 3),
        index_source_layer_ids=(1, 3, 4), candidate_source_layer_id=3, engram_layer_ids=(1,),
        engram_num_embeddings=(2048,), dspark_target_layer_ids=(2, 3, 4), hc_sinkhorn_iters=2)
