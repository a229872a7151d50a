"""Context parallelism for long prompts (issue 25; docs/context_parallel.md).

The equality checks run in one subprocess with 8 fake CPU devices (``tests/sharded/cp_check.py``): a CP
prefill against the unsharded paged step (logits, every cache entry, the greedy continuation) for prompts
of odd lengths, pieces shorter than the window, a prompt shorter than the halo, a chunk after a 61-token
prefix, quantized storage over 8 ranks, the CP step's indexer forced into 8-token tiles (``model.index_tiles``)
against the untiled one-device step, and the engine on ``cpu-cp4`` against the one-device engine. The
layout and the settings' errors are checked here, without devices.
"""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_jax.config import ShardingError, ShardingPreset
from deepinfer_jax.parallel.cp_layout import cp_layout
from tests.sharded import run_checks

DEQUANT = ["cp4_301", "cp4_37_pieces_below_window", "cp4_5_below_halo", "cp4_203_after_61_prefix"]
ALL = DEQUANT + ["cp8_389_quantized_no_engram", "cp4_301_tiles8"]
#: XLA:CPU rounds a matmul row differently with another row count (docs/context_parallel.md): the
#: compressor's fp32 partial state (values and gate scores of the last group, not a block) may differ by
#: an ulp in a few rows. Measured: 8 of 64 rows per leaf, 1.2e-7 at most.
COMP_STATE_ULPS = 2e-7


@pytest.fixture(scope="module")
def checks() -> dict[str, dict]:
    return run_checks("cp_check.py", timeout=420)


@pytest.mark.parametrize("case", ALL)
def test_cp_prefill_equals_the_unsharded_step(checks, case):
    row = checks[case]
    assert row["max_logit_diff"] < 1e-5 and row["rel_logit_diff"] < 1e-5, row
    assert row["greedy_cp"] == row["greedy_ref"], row
    for leaf, rows, worst in row["differing_leaves"]:  # blocks, SWA rings and Engram rings: byte for byte
        assert leaf.startswith("['comp']") and worst <= COMP_STATE_ULPS, row
    assert (row["tiled_layers"] > 0) == case.endswith("tiles8"), row  # 8-token indexer tiles in the CP step


def test_the_engine_prefills_long_prompts_by_cp_equal_to_one_device(checks):
    row = checks["engine"]
    assert row["components"] == ["context_parallel"] and row["cp_steps"] == 1, row  # the 300-token prompt alone
    assert row["ids_equal"] and row["max_logprob_diff"] < 1e-4, row
    assert row["cached_cp"] == row["cached_ref"] > 0, row  # blocks the CP prefill wrote are prefix hits


def test_layout_pairs_head_and_tail_pieces_aligned_to_the_ratios():
    lay = cp_layout(5, 1000, 4, align=4, tail_rows=20)
    assert [tuple(p) for p in lay.rank_pieces] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert lay.piece_start[0] == 5 and lay.piece_end[-1] == 1005 and all(lay.piece_start[1:] % 4 == 0)
    assert np.array_equal(lay.piece_start[1:], lay.piece_end[:-1])
    assert sorted(lay.positions[lay.valid].tolist()) == list(range(5, 1005))  # every token exactly once
    pairs = lay.attention_pairs_per_rank()
    assert pairs.max() / pairs.min() < 1.05  # causal load balanced by the zig-zag pairing
    short = cp_layout(0, 3, 4, align=2, tail_rows=20)  # fewer tokens than pieces: empty pieces, one padded slot
    assert short.valid.sum() == 3 and short.tail_rows == short.piece_len
    with pytest.raises(ValueError, match="length"):
        cp_layout(0, 0, 4)


def _preset(**parallel):
    axes = parallel.pop("axes", ["cp"])
    shape = parallel.pop("shape", [4])
    return ShardingPreset.from_dict({"mesh": {"axes": axes, "shape": shape},
                                     "parallel": {"dp_size": 1, "ep_size": 1, **parallel}})


def test_cp_settings_refuse_bad_values_naming_the_field():
    from deepinfer_jax import EngineConfig
    from deepinfer_jax.config import resolve_preset

    assert resolve_preset("cpu-cp4").cp_size == 4 and resolve_preset("prefill-cp8").cp_size == 8
    with pytest.raises(ShardingError, match="cp axis has size 4") as e:
        _preset(cp_size=2)
    assert e.value.field == "parallel.cp_size"
    with pytest.raises(ShardingError, match="cannot share a mesh") as e:  # CP with DP on one mesh
        _preset(axes=["dp", "cp"], shape=[2, 4], cp_size=4, dp_size=2)
    assert e.value.field == "parallel.cp_size"
    with pytest.raises(ShardingError, match=">= 0") as e:
        _preset(cp_size=4, cp_threshold=-1)
    assert e.value.field == "parallel.cp_threshold"
    with pytest.raises(ShardingError, match="does not divide the 6 devices") as e:
        _preset(cp_size=4).check_devices(6)
    assert e.value.field == "parallel.cp_size"
    with pytest.raises(ValueError, match="cp_threshold"):
        EngineConfig(cp_threshold=-5)
    assert EngineConfig(cp_threshold=0).cp_threshold == 0
    from deepinfer_jax import LLM

    with pytest.raises(ValueError, match="speculation='fixed' is not supported with a context-parallel preset"):
        LLM("tiny", sharding="cpu-cp4", speculation="fixed", use_tqdm=False)  # refused before any device is needed


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_scheduler_runs_long_prompts_alone_as_one_cp_chunk(async_scheduling):
    """The scheduler's CP turn against the known fake model of tests/test_scheduler.py: prompts of at least
    ``cp_threshold`` tokens prefill whole, alone in their step; shorter ones chunk as before; outputs unchanged."""
    from deepinfer_jax.engine import EngineCore, SamplingParams, Scheduler
    from tests.test_scheduler import EOS, FakeRunner, reference, run_all

    sched = Scheduler(num_blocks=128, block_size=4, max_blocks_per_request=64, max_num_seqs=4, max_model_len=256,
                      max_num_batched_tokens=16, chunking="tokens", cp_threshold=40)
    runner = FakeRunner(4)
    engine = EngineCore(runner, sched, tokenizer=None, eos_token_id=EOS, async_scheduling=async_scheduling)
    rng = np.random.default_rng(3)
    lengths = [12, 90, 5, 41, 30, 120, 7]
    prompts = [rng.integers(3, 1000, n).tolist() for n in lengths]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True) for _ in prompts]
    outs = run_all(engine, prompts, params)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == reference(p, 6, eos=False)
    cp_steps = [s for s in runner.steps if any(c.context_parallel for c in s)]
    assert all(len(s) == 1 and s[0].ctx_len == 0 for s in cp_steps)
    assert sorted(len(s[0].token_ids) for s in cp_steps) == [41, 90, 120]  # no prefix cache: whole prompts
    assert all(len(c.token_ids) <= 16 for s in runner.steps for c in s if not c.context_parallel)
