"""The paged step's tiled indexer selection (``model.index_tiles``) equals the untiled path bit for bit.

A tiny ``TILE_BUDGET`` forces tiles of a few tokens on a short mixed step (two prefill chunks, one after
a cached prefix, and a decode token; tiles straddle requests, the last tile is padded), and the top-k
ids, candidate pools, logits and every cache leaf are compared with the untiled step exactly.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from cut_model import tiny_cut

from deepinfer_jax import compile_options, init_params
from deepinfer_jax.config import CacheConfig
from deepinfer_jax.model import index_tiles, paged
from deepinfer_jax.model.kv_cache import init_cache
from deepinfer_jax.runner.step_batch import ChunkSpec, build_inputs

CFG = tiny_cut()  # every attention role; the point here is the indexer tiles, not the 12-layer schedule
BLOCK, BLOCKS = 16, 8
DEFAULT = index_tiles.TILE_BUDGET

#: compile-bound: level 0 (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("xla_cpu_level0")


def _step(params, cache_cfg, cache, inp, budget, monkeypatch):
    """(logits, cache, [(top-k, candidates) per selecting layer]) of one jitted step under ``budget``."""
    monkeypatch.setattr(index_tiles, "TILE_BUDGET", budget)
    picks = []

    def recording(*a, **k):
        out = index_tiles.select_tokens(*a, **k)
        picks.append(out)
        return out

    monkeypatch.setattr(paged, "select_tokens", recording)

    def run(params, cache, inp):  # a fresh function per call: no jit cache is shared between budgets
        picks.clear()
        logits, new_cache = paged.paged_step(params, CFG, cache_cfg, cache, inp)[:2]
        return logits, new_cache, list(picks)

    return compile_options.jit(run)(params, cache, inp)


def _inputs(rng, cache_cfg):
    """The first step's two prompts, in the second step's shapes (one compiled program serves both untiled steps)."""
    ids = lambda n: rng.integers(0, CFG.vocab_size, n).tolist()  # noqa: E731
    chunks = [ChunkSpec(slot=0, block_table=[0, 1, 2, 3], ctx_len=0, token_ids=ids(40)),
              ChunkSpec(slot=1, block_table=[4, 5, 6, 7], ctx_len=0, token_ids=ids(20))]
    return build_inputs(chunks, 60, 3, BLOCKS, cache_cfg.max_requests)


@pytest.mark.parametrize("storage", ["dequantized", "quantized"])
def test_tiled_selection_equals_untiled_bit_for_bit(storage, monkeypatch):
    params = init_params(CFG, seed=3)
    cache_cfg = CacheConfig(block_size=BLOCK, num_blocks=16, max_requests=3, max_blocks_per_request=BLOCKS,
                            storage=storage)
    rng = np.random.default_rng(0)
    # a first step fills the cache, so the second one reads cached entries (a prefix) besides its own
    first = _inputs(rng, cache_cfg)
    _, cache, _ = _step(params, cache_cfg, init_cache(CFG, cache_cfg), first, DEFAULT, monkeypatch)
    ids = lambda n: rng.integers(0, CFG.vocab_size, n).tolist()  # noqa: E731
    chunks = [ChunkSpec(slot=0, block_table=[0, 1, 2, 3], ctx_len=40, token_ids=ids(13)),
              ChunkSpec(slot=1, block_table=[4, 5, 6, 7], ctx_len=20, token_ids=[5]),
              ChunkSpec(slot=2, block_table=[8, 9, 10], ctx_len=0, token_ids=ids(37))]
    second = build_inputs(chunks, 60, 3, BLOCKS, cache_cfg.max_requests)
    hd = CFG.index_head_dim
    e = BLOCKS * BLOCK  # entries of a ratio-1 layer: tiles of 8 tokens there (of 16 on a ratio-2 layer)
    want = _step(params, cache_cfg, cache, second, DEFAULT, monkeypatch)
    got = _step(params, cache_cfg, cache, second, 8 * e * hd, monkeypatch)
    assert index_tiles.tile_for(e, hd, 8 * e * hd) == 8 < second.token_ids.shape[0]
    assert index_tiles.tile_for(e, hd, DEFAULT) >= second.token_ids.shape[0]  # the default runs untiled here
    assert len(want[2]) == len(got[2]) > 0
    for (tk_w, cand_w), (tk_g, cand_g) in zip(want[2], got[2]):
        assert (np.asarray(tk_w) >= 0).any()
        np.testing.assert_array_equal(np.asarray(tk_g), np.asarray(tk_w))
        assert (cand_w is None) == (cand_g is None)
        if cand_w is not None:
            np.testing.assert_array_equal(np.asarray(cand_g), np.asarray(cand_w))
    assert np.asarray(want[0]).tobytes() == np.asarray(got[0]).tobytes()
    flat_w, flat_g = jax.tree.leaves(want[1]), jax.tree.leaves(got[1])
    assert len(flat_w) == len(flat_g)
    for a, b in zip(flat_w, flat_g):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_short_steps_keep_the_untiled_path():
    assert index_tiles.tile_for(64, 32, DEFAULT) >= 8192  # a 4-block bucket: decode and short prefills never tile
    assert index_tiles.tile_for(8192, 32, DEFAULT) == 256
    assert index_tiles.tile_for(1 << 20, 128, DEFAULT) == index_tiles.MIN_TILE
