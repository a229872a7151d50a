"""Decoder bounded replay (YOCO prefill) in the paged step: the decoder runs on the last K tokens only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_step import CFG, robust_params

from deepinfer_jax import compile_options
from deepinfer_jax.config import CacheConfig
from deepinfer_jax.model.kv_cache import init_cache
from deepinfer_jax.model.paged import StepInputs, paged_step

L, BS = 64, 16
CC = CacheConfig(block_size=BS, num_blocks=L // BS, max_requests=1, max_blocks_per_request=L // BS,
                 storage="dequantized")

#: compile-bound: level 0 (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("xla_cpu_level0")


def prefill(keep: int | None):
    """One request's whole prompt in one step; ``keep`` = tokens that run the decoder (None = all)."""
    ids = jnp.asarray(np.random.default_rng(0).integers(3, CFG.vocab_size, L), jnp.int32)
    one = jnp.zeros(1, jnp.int32)
    inp = StepInputs(token_ids=ids, positions=jnp.arange(L, dtype=jnp.int32), token_req=jnp.zeros(L, jnp.int32),
                     token_valid=jnp.ones(L, bool), block_tables=jnp.arange(L // BS, dtype=jnp.int32)[None],
                     req_slot=one, req_start=one, ctx_len=one, new_len=one + L,
                     logit_rows=jnp.array([L - 1], jnp.int32), window_floor=one, global_write_from=one)
    if keep is not None:
        inp = inp._replace(decoder_rows=jnp.arange(L - keep, L, dtype=jnp.int32), decoder_valid=jnp.ones(keep, bool),
                           decoder_floor=one + L - keep, logit_rows=jnp.array([keep - 1], jnp.int32))
    return inp


def run(params, inp):
    step = compile_options.jit(paged_step, static_argnums=(1, 2))
    compiled = step.lower(params, CFG, CC, init_cache(CFG, CC), inp).compile()
    logits, cache = compiled(params, init_cache(CFG, CC), inp)
    cost = compiled.cost_analysis()
    flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
    return np.asarray(logits), jax.tree.map(np.asarray, cache), flops


def test_decoder_replay_keeps_block_kv_exact_and_cuts_decoder_compute():
    params = robust_params()
    full, cache_full, f_full = run(params, prefill(None))
    every, cache_every, _ = run(params, prefill(L))  # all tokens run the decoder: the same computation
    assert np.array_equal(every, full)
    kept, cache_kept, f_kept = run(params, prefill(16))
    # the block KV (every KV source, the decoder's included) is written from the encoder for all tokens
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(cache_full["global"]),
                                                     jax.tree.leaves(cache_kept["global"])))
    diff = np.abs(kept - full).max() / np.abs(full).max()
    assert 0 < diff < 0.5, diff  # approximate (truncated decoder windows), but close
    layers, dec = CFG.num_hidden_layers, CFG.num_hidden_layers - CFG.decoder_start - 1
    assert f_kept < f_full * (1 - 0.5 * dec / layers), (f_kept, f_full)  # the decoder ran on a quarter


def test_engine_decoder_replay_setting():
    from deepinfer_jax import LLM, SamplingParams

    params = robust_params()
    kw = dict(config=CFG, params=params, max_num_seqs=2, max_num_batched_tokens=32, token_buckets=(32,),
              block_size=16, max_model_len=128, chunking="tokens", use_tqdm=False)
    yoco = LLM(**kw, decoder_replay=True, yoco_keep_tokens=16)
    rng = np.random.default_rng(1)
    short, long = rng.integers(3, CFG.vocab_size, 12).tolist(), rng.integers(3, CFG.vocab_size, 70).tolist()
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    got = yoco.generate([{"prompt_token_ids": short}, {"prompt_token_ids": long}], sp, use_tqdm=False)
    ref = LLM(**kw, enable_prefix_caching=False).generate([{"prompt_token_ids": short}, {"prompt_token_ids": long}],
                                                          sp, use_tqdm=False)
    a, b = got[0].outputs[0], ref[0].outputs[0]
    assert a.token_ids == b.token_ids  # a prompt within the kept tokens is exact
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    assert len(got[1].outputs[0].token_ids) == 6
    assert len(yoco.engine.scheduler.prefix.snapshots) == 1  # only the exact request saved a window
