"""A decode step reads a bounded set: nothing it computes scales with the block pool (issue 19, item 6)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax import ModelConfig, init_params
from deepinfer_jax.config import CacheConfig
from deepinfer_jax.model.kv_cache import init_cache
from deepinfer_jax.model.paged import paged_step
from deepinfer_jax.runner import ChunkSpec
from deepinfer_jax.runner.step_batch import build_inputs

CFG = ModelConfig.tiny()


def _values(jaxpr):
    """Every value an equation of ``jaxpr`` makes, nested jaxprs (jit, scan, custom_jvp ...) included."""
    for eqn in jaxpr.eqns:
        yield from eqn.outvars
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(inner, "eqns"):
                    yield from _values(inner)


def _pool_sized_floats(num_blocks: int) -> list:
    """The float32 values of one traced decode step whose leading axis is the pool's block count."""
    cc = CacheConfig(block_size=16, num_blocks=num_blocks, max_requests=4, max_blocks_per_request=8)
    params = init_params(CFG, seed=0)
    inputs = build_inputs([ChunkSpec(slot=0, block_table=[1, 2], ctx_len=20, token_ids=[3])], 8, 4, 8, 4)
    step = lambda p, c, i: paged_step(p, CFG, cc, c, i)
    jaxpr = jax.make_jaxpr(step)(params, init_cache(CFG, cc), inputs).jaxpr
    return [v for v in _values(jaxpr) if v.aval.shape[:1] == (num_blocks,) and v.aval.dtype == jnp.float32]


def test_a_step_decodes_no_pool_sized_array():
    # quantized storage keeps the pool as codes and scales (uint8 / float8): a float32 value with the
    # pool's block count as its leading axis is the whole pool decoded (37 blocks: no other axis is 37)
    found = _pool_sized_floats(37)
    assert not found, f"the step decodes the whole block pool: {sorted({str(v.aval) for v in found})}"
