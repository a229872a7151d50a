"""A decode step reads a bounded set: nothing it computes scales with the block pool, and its block
table is as wide as the batch's longest request needs (issue 19, item 6)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cut_model import tiny_cut

from deepinfer_jax import LLM, init_params
from deepinfer_jax.cache import BlockPool, RequestBlocks
from deepinfer_jax.config import CacheConfig
from deepinfer_jax.model.kv_cache import init_cache
from deepinfer_jax.model.paged import paged_step
from deepinfer_jax.runner import Buckets, ChunkSpec, ModelRunner
from deepinfer_jax.runner.buckets import block_buckets
from deepinfer_jax.runner.step_batch import build_inputs, pick_shape

CFG = tiny_cut()  # every attention role; the point here is what a step reads, not the 12-layer schedule

#: compile-bound: level 0 (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("xla_cpu_level0")


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


def test_the_engine_buckets_block_tables_by_the_longest_request():
    assert block_buckets(32, 64) == (8, 32)  # 2,048 tokens of block 64: 512 and 2,048 tokens
    assert block_buckets(257, 64) == (8, 17, 65, 257)
    assert block_buckets(4, 16) == (4,)  # a table of at most 512 tokens keeps one width
    llm = LLM("tiny", max_model_len=2048, block_size=64, max_num_seqs=2, max_num_batched_tokens=32,
              token_buckets=(8, 32), use_tqdm=False, speculation="none", chunking="tokens")
    mbpr = llm.cache_config.max_blocks_per_request
    assert llm.buckets.blocks == (8, mbpr)
    short = [ChunkSpec(slot=0, block_table=[0, 1, 2], ctx_len=150, token_ids=[1])]
    long = short + [ChunkSpec(slot=1, block_table=list(range(3, 3 + 20)), ctx_len=1200, token_ids=[1])]
    assert pick_shape(llm.buckets, [short])[2] == 8  # a short batch pays a 512-token scan, not 2,048
    assert pick_shape(llm.buckets, [long])[2] == mbpr  # the batch's longest table sets the width
    with pytest.raises(ValueError, match="block_buckets"):
        LLM("tiny", max_model_len=2048, block_size=64, block_buckets=(8, 16), use_tqdm=False, speculation="none")


@pytest.mark.parametrize("storage", ["quantized"])
def test_logits_do_not_depend_on_the_block_bucket(storage):
    """The same schedule run with narrow block buckets and with one full-width bucket: bit for bit."""
    params = init_params(CFG, seed=3)
    cc = CacheConfig(block_size=16, num_blocks=24, max_requests=2, max_blocks_per_request=8, storage=storage)
    runs = []
    for blocks in ((2, 8), (8,)):
        runner = ModelRunner(CFG, params, cc, Buckets(tokens=(2, 48), requests=(2,), blocks=blocks))
        pool = BlockPool(cc.num_blocks)
        reqs = [RequestBlocks(pool, 8, 16) for _ in range(2)]
        ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 48))
        out, widths = [], []
        for pos in [0, *range(24, 48)]:  # a 24-token prompt each, then decode past 2 blocks (32 tokens)
            k = 24 if pos == 0 else 1
            chunks = []
            for i, r in enumerate(reqs):
                r.ensure_capacity(pos + k)
                chunks.append(ChunkSpec(slot=i, block_table=r.block_ids, ctx_len=pos,
                                        token_ids=ids[i, pos : pos + k].tolist()))
            widths.append(runner._validate(chunks)[2])
            out.append(np.stack([x[-1] for x in runner.execute(chunks)]))
        runs.append((np.stack(out), widths))
    (narrow, w_narrow), (wide, w_wide) = runs
    assert set(w_narrow) == {2, 8} and set(w_wide) == {8}  # both widths were run
    assert np.array_equal(narrow, wide)
