"""The MoE strategy is an explicit, static argument of the model step (issue 22 item 3; ``model.moe_strategy``).

One device: the strategy's checks; ``dense`` / ``grouped`` / ``auto`` on one MoE layer; and an ``"ep"`` strategy
whose ``ExpertParallel`` is a one-device stand-in (the dense routed experts, counts per expert), which shows what
the step hands each layer (its own row of ``moe_tables``, the tokens' validity) and what it returns (the counts,
last). The real implementations (``parallel.ep_model``) run on 8 fake devices in ``test_ep_moe.py``,
``test_sharding.py`` and ``test_dp_engine.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from sharded.shard_common import model_and_inputs

from deepinfer_jax.config import CacheConfig
from deepinfer_jax.model.deepseek_v41 import _graphdef, forward_full
from deepinfer_jax.model.kv_cache import init_cache
from deepinfer_jax.model.layers import matmul_t
from deepinfer_jax.model.moe_strategy import MoEStrategy
from deepinfer_jax.model.paged import paged_step
from deepinfer_jax.model.routing import route
from deepinfer_jax.runner import ChunkSpec
from deepinfer_jax.runner.step_batch import build_inputs


@dataclass(frozen=True)
class OneDeviceEP:
    """An ``ExpertParallel`` on one device: the dense routed experts; counts per expert (padding excluded) plus
    1000 x the layer number the step's table row carries."""

    def __call__(self, moe, x, tables, valid):
        logits = matmul_t(x.astype(jnp.float32), moe.gate.weight[...].astype(jnp.float32))
        w, ids = route(logits, moe.gate.bias[...], moe.top_k, moe.scale, moe.renormalize)
        y = moe._dense_experts(x, w, ids, moe.experts.w1[...], moe.experts.w3[...], moe.experts.w2[...])
        live = jnp.ones(x.shape[0], jnp.int32) if valid is None else valid.astype(jnp.int32)
        counts = jnp.zeros(moe.gate.weight[...].shape[0], jnp.int32).at[ids].add(live[:, None])
        return y, counts + 1000 * tables["layer"]


@pytest.fixture(scope="module")
def model():
    cfg, params, ids = model_and_inputs()
    return cfg, params, ids


def _tables(cfg):
    return {"layer": jnp.broadcast_to(jnp.arange(cfg.num_hidden_layers, dtype=jnp.int32)[:, None],
                                      (cfg.num_hidden_layers, cfg.n_routed_experts))}


def test_the_strategy_is_checked():
    with pytest.raises(ValueError, match="kind"):
        MoEStrategy("sparse")
    with pytest.raises(ValueError, match="ep"):
        MoEStrategy("ep")
    with pytest.raises(ValueError, match="ep"):
        MoEStrategy("dense", ep=OneDeviceEP())
    assert hash(MoEStrategy("ep", OneDeviceEP())) == hash(MoEStrategy("ep", OneDeviceEP()))  # a static argument


def test_tables_go_with_the_ep_strategy_only(model):
    cfg, params, ids = model
    with pytest.raises(ValueError, match="moe_tables are for"):
        forward_full(params, cfg, ids[:1, :4], moe_tables=_tables(cfg))
    with pytest.raises(ValueError, match="needs moe_tables"):
        forward_full(params, cfg, ids[:1, :4], moe=MoEStrategy("ep", OneDeviceEP()))
    with pytest.raises(ValueError, match="layers along axis 0"):
        forward_full(params, cfg, ids[:1, :4], moe=MoEStrategy("ep", OneDeviceEP()),
                     moe_tables={"layer": jnp.zeros((1, cfg.n_routed_experts), jnp.int32)})


def test_dense_grouped_and_auto_on_one_layer(model):
    cfg, params, _ = model
    moe = nnx.merge(_graphdef(cfg), params).layers[1].ffn
    x = jax.random.normal(jax.random.key(0), (2, 8, cfg.hidden_size), jnp.float32)
    auto, counts = moe.run(x)
    dense, _ = moe.run(x, MoEStrategy("dense"))
    grouped, _ = moe.run(x, MoEStrategy("grouped"))
    assert counts is None
    assert np.array_equal(np.asarray(auto), np.asarray(dense))  # auto = the reference on CPU
    assert np.array_equal(np.asarray(moe(x)), np.asarray(auto))
    np.testing.assert_allclose(np.asarray(grouped), np.asarray(dense), rtol=0, atol=1e-5)


def test_forward_full_hands_each_layer_its_table_row_and_returns_the_counts(model):
    cfg, params, ids = model
    fwd = jax.jit(forward_full, static_argnums=(1, 3, 4))
    want = fwd(params, cfg, ids[:2], (), MoEStrategy())
    got, counts = fwd(params, cfg, ids[:2], (), MoEStrategy("ep", OneDeviceEP()), _tables(cfg))
    assert np.array_equal(np.asarray(got), np.asarray(want))
    counts = np.asarray(counts)
    assert counts.shape == (cfg.num_hidden_layers, cfg.n_routed_experts)
    layer = np.arange(cfg.num_hidden_layers)[:, None]
    assert ((counts - 1000 * layer) >= 0).all()
    np.testing.assert_array_equal((counts - 1000 * layer).sum(1), ids[:2].size * cfg.num_experts_per_tok)


def test_paged_step_counts_real_tokens_only(model):
    cfg, params, ids = model
    cc = CacheConfig(block_size=16, num_blocks=8, max_requests=2, max_blocks_per_request=2)
    chunks = [ChunkSpec(slot=0, block_table=[0], ctx_len=0, token_ids=[int(t) for t in ids[0, :5]]),
              ChunkSpec(slot=1, block_table=[1], ctx_len=0, token_ids=[int(t) for t in ids[1, :3]])]
    inp = build_inputs(chunks, 16, 2, 2, cc.max_requests)._replace(logit_rows=np.array([4, 7], np.int32))
    step = jax.jit(paged_step, static_argnums=(1, 2, 5, 6))
    want, _ = step(params, cfg, cc, init_cache(cfg, cc), inp, (), MoEStrategy())
    got, _, counts = step(params, cfg, cc, init_cache(cfg, cc), inp, (), MoEStrategy("ep", OneDeviceEP()),
                          _tables(cfg))
    assert np.array_equal(np.asarray(got), np.asarray(want))
    counts = np.asarray(counts) - 1000 * np.arange(cfg.num_hidden_layers)[:, None]
    np.testing.assert_array_equal(counts.sum(1), 8 * cfg.num_experts_per_tok)  # 8 real tokens of 16
