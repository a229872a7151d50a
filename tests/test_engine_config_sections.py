"""EngineConfig is composed of sections (scheduler / cache / speculation / parallel) and still takes and
reads back every setting flat, as ``LLM(**settings)`` and the batch CLI use it."""

from __future__ import annotations

import pickle

import pytest

from deepinfer_jax.config import (
    CacheSettings,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    ShardingPreset,
    SpeculationConfig,
    resolve_preset,
)
from deepinfer_jax.config.engine import SECTIONS

# every setting LLM() accepted before the split, in no particular order
FLAT = {"max_num_seqs", "max_model_len", "block_size", "num_blocks", "max_blocks_per_request", "kv_storage",
        "chunking", "max_num_batched_tokens", "step_budget_ns", "profile_steps", "cost_model_dir",
        "async_scheduling", "structured_output_overlap", "seed", "max_logprobs", "token_buckets", "request_buckets", "block_buckets",
        "enable_prefix_caching", "cache_salt", "swa_snapshot_entries", "encoder_replay", "replay_tokens",
        "decoder_replay", "yoco_keep_tokens", "host_store_bytes", "block_store", "block_store_fallback",
        "default_thinking_mode", "sharding", "speculation", "num_speculative_tokens", "draft_vocab_size",
        "precompile", "compilation_cache", "cp_threshold", "dp_match_floor_ns"}


def test_every_flat_setting_belongs_to_one_place():
    assert set(EngineConfig.fields()) == FLAT and len(EngineConfig.fields()) == len(FLAT)
    assert [f.name for f in EngineConfig.flat_fields()] == list(EngineConfig.fields())
    assert set(SECTIONS) == {"scheduler", "cache", "spec", "parallel"}


def test_flat_settings_land_in_their_sections_and_read_back_flat():
    ec = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=32, enable_prefix_caching=False,
                      speculation="none", num_speculative_tokens=2, seed=7, precompile="all")
    assert ec.scheduler == SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    assert ec.cache == CacheSettings(block_size=32, enable_prefix_caching=False)
    assert ec.spec == SpeculationConfig(speculation="none", num_speculative_tokens=2)
    assert ec.parallel == ParallelConfig()
    assert (ec.max_num_seqs, ec.block_size, ec.speculation, ec.num_speculative_tokens, ec.seed, ec.precompile) == (
        4, 32, "none", 2, 7, "all")
    assert ec.settings()["max_num_batched_tokens"] == 64 and set(ec.settings()) == FLAT
    assert EngineConfig(**ec.settings()) == ec and hash(EngineConfig(**ec.settings())) == hash(ec)
    assert pickle.loads(pickle.dumps(ec)) == ec


def test_sections_given_whole_and_overridden_flat():
    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32)
    ec = EngineConfig(scheduler=sched, chunking="tokens", spec=SpeculationConfig(speculation="fixed"))
    assert ec.scheduler == SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, chunking="tokens")
    assert ec.speculation == "fixed" and ec.block_size == 64
    assert ec.replace(max_num_seqs=1).scheduler.max_num_seqs == 1 and ec.replace(max_num_seqs=1).chunking == "tokens"
    assert ec.replace(cache=CacheSettings(block_size=16)).block_size == 16
    with pytest.raises(ValueError, match="scheduler must be a SchedulerConfig"):
        EngineConfig(scheduler={"max_num_seqs": 2})


@pytest.mark.parametrize("section, field, value", [
    (SchedulerConfig, "max_num_seqs", 0), (SchedulerConfig, "chunking", "fast"),
    (CacheSettings, "kv_storage", "fp16"), (CacheSettings, "swa_snapshot_entries", -1),
    (SpeculationConfig, "speculation", "medusa"), (ParallelConfig, "sharding", 3),
])
def test_each_section_validates_its_fields(section, field, value):
    with pytest.raises(ValueError, match=f"^{field} must"):
        section(**{field: value})
    with pytest.raises(ValueError, match=f"^{field} must"):
        EngineConfig(**{field: value})


def test_cross_section_rules_and_unknown_names():
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= max_num_seqs"):
        EngineConfig(max_num_seqs=16, max_num_batched_tokens=8)
    # speculation runs with DP (issue 22); a bad speculation setting still names its field when sharded
    assert EngineConfig(sharding="cpu-dp2-ep4", speculation="dspark").spec.speculation == "dspark"
    with pytest.raises(ValueError, match="^num_speculative_tokens must"):
        EngineConfig(sharding="cpu-dp2-ep4", speculation="fixed", num_speculative_tokens=-1)
    preset = resolve_preset("cpu-dp2-ep4")
    assert isinstance(preset, ShardingPreset)
    sharded = EngineConfig(sharding=preset, decoder_replay=True)  # prefix caching and decoder replay run with DP
    assert sharded.parallel.sharded and sharded.enable_prefix_caching and sharded.decoder_replay
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_seqs'"):
        EngineConfig(max_seqs=4)
