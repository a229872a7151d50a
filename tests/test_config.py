"""Tests of deepinfer_jax.config: the V4.1-Flash ModelConfig, its HF round trip, validation,
layer schedule and size arithmetic (model.md §2, §3, §4.8, §9). CPU only, no JAX."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_jax.config import LayerRole, ModelConfig, RopeScaling

FIXTURE = Path(__file__).parent / "fixtures" / "deepseek_v41_flash_config.json"


@pytest.fixture(scope="module")
def published() -> dict:
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def v41() -> ModelConfig:
    return ModelConfig.from_hf_config(FIXTURE)


# ---- the published config (model.md §2.1) ----------------------------------------------------

# Transcribed from the model.md §2.1 tables, independently of the fixture and of the defaults.
TABLE_2_1 = {
    "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280,
    "o_lora_rank": 1024, "o_groups": 8, "hidden_act": "silu", "swiglu_limit": 10.0, "rms_norm_eps": 1e-20,
    "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
    "tie_word_embeddings": False, "max_position_embeddings": 1048576, "rope_theta": 10000.0,
    "rope_scaling": RopeScaling("yarn", 16.0, 32.0, 1.0, 65536), "compress_rope_theta": 160000.0,
    "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2304,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "sliding_window": 128,
    "compress_ratios": tuple([0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]),
    "kv_source_layer_ids": (2, 8, 14, 20), "index_source_layer_ids": (2, 8, 14, 20, 24, 28, 32, 36),
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "engram_layer_ids": (1, 14), "engram_num_embeddings": (384006168, 384016682),
    "engram_max_ngram_size": 4, "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256,
    "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3,
    "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": (37, 38, 39),
    "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
    # root level and quantization_config
    "dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "image_token_id": 129264,
    "weight_block_size": (32, 32), "expert_dtype": "fp4",
}


def test_fixture_reproduces_every_table_value(v41: ModelConfig) -> None:
    for name, expected in TABLE_2_1.items():
        assert getattr(v41, name) == expected, name
    assert len(v41.compress_ratios) == 43
    assert v41.fake_quant is True


def test_defaults_are_the_published_config(v41: ModelConfig) -> None:
    assert ModelConfig() == v41


def test_fixture_round_trip(published: dict, v41: ModelConfig) -> None:
    assert v41.to_hf_config() == published
    assert ModelConfig.from_hf_config(v41.to_hf_config()) == v41
    assert ModelConfig.from_hf_config(json.loads(json.dumps(v41.to_hf_config()))) == v41


def test_flat_text_config_accepted(published: dict, v41: ModelConfig) -> None:
    flat = dict(published["text_config"])
    assert ModelConfig.from_hf_config(flat) == v41.replace(weight_block_size=None, expert_dtype=None)
    flat["quantization_config"] = published["quantization_config"]
    flat.update(dtype="float32", eos_token_id=7)
    assert ModelConfig.from_hf_config(flat) == v41.replace(dtype="float32", eos_token_id=7)


def test_path_to_file_and_directory(tmp_path: Path, v41: ModelConfig) -> None:
    (tmp_path / "config.json").write_text(FIXTURE.read_text())
    assert ModelConfig.from_hf_config(tmp_path) == v41
    assert ModelConfig.from_hf_config(str(tmp_path)) == v41
    assert ModelConfig.from_hf_config(tmp_path / "config.json") == v41
    with pytest.raises(FileNotFoundError):
        ModelConfig.from_hf_config(tmp_path / "missing.json")
    with pytest.raises(TypeError):
        ModelConfig.from_hf_config(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("model_type", ["deepseek_v4", "deepseek_v3", "", None])
def test_unknown_model_type_rejected(published: dict, model_type: str | None) -> None:
    raw = dict(published, model_type=model_type)
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf_config(raw)
    text = dict(published["text_config"], model_type=model_type)
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf_config(text)


def test_nested_text_config_model_type_checked(published: dict) -> None:
    raw = copy.deepcopy(published)
    raw["text_config"]["model_type"] = "deepseek_v4"
    with pytest.raises(ValueError, match="text_config.model_type"):
        ModelConfig.from_hf_config(raw)
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_hf_config(dict(published, text_config=[1, 2]))


def test_missing_fields_take_defaults_and_extras_are_ignored(published: dict) -> None:
    assert ModelConfig.from_hf_config({"model_type": "deepseek_v41"}) == ModelConfig(
        weight_block_size=None, expert_dtype=None)
    raw = copy.deepcopy(published)
    raw["text_config"].update(hidden_size=4096, some_future_key=[1, 2], rope_parameters={"x": 1})
    raw.update(auto_map={"AutoConfig": "x"}, torch_dtype="float16")
    assert ModelConfig.from_hf_config(raw) == ModelConfig(hidden_size=4096)  # root "dtype" wins
    del raw["dtype"]
    assert ModelConfig.from_hf_config(raw).dtype == "float16"  # legacy "torch_dtype"


def test_transformers5_rope_parameters_stand_in_for_rope_scaling(published: dict) -> None:
    raw = copy.deepcopy(published)
    rope = raw["text_config"].pop("rope_scaling")
    raw["text_config"]["rope_parameters"] = dict(rope, original_max_position_embeddings=4096, rope_theta=1e4)
    assert ModelConfig.from_hf_config(raw).rope_scaling == RopeScaling(original_max_position_embeddings=4096)
    raw["text_config"]["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
    assert ModelConfig.from_hf_config(raw).rope_scaling is None


@pytest.mark.parametrize(("key", "value", "field"), [
    ("hidden_size", "5120", "hidden_size"),
    ("hidden_size", 5120.0, "hidden_size"),
    ("num_hidden_layers", True, "num_hidden_layers"),
    ("compress_ratios", [0, "2"], "compress_ratios[1]"),
    ("kv_source_layer_ids", 2, "kv_source_layer_ids"),
    ("rope_scaling", "yarn", "rope_scaling"),
    ("rope_scaling", {"factor": "16"}, "rope_scaling.factor"),
    ("rope_theta", "1e4", "rope_theta"),
    ("attention_bias", 0, "attention_bias"),
    ("hidden_act", 1, "hidden_act"),
    ("pad_token_id", 2.0, "pad_token_id"),
])
def test_wrong_types_rejected(published: dict, key: str, value: object, field: str) -> None:
    raw = copy.deepcopy(published)
    (raw if key == "pad_token_id" else raw["text_config"])[key] = value
    with pytest.raises(ValueError, match=re.escape(field)):
        ModelConfig.from_hf_config(raw)


def test_quantization_config(published: dict) -> None:
    with pytest.raises(ValueError, match="quantization_config"):
        ModelConfig.from_hf_config(dict(published, quantization_config=[32, 32]))
    with pytest.raises(ValueError, match="weight_block_size"):
        ModelConfig.from_hf_config(dict(published, quantization_config={"weight_block_size": [32]}))
    cfg = ModelConfig.from_hf_config(dict(published, quantization_config={"weight_block_size": [128, 128]}))
    assert (cfg.weight_block_size, cfg.expert_dtype) == ((128, 128), None)
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


def test_numbers_and_lists_are_normalised() -> None:
    cfg = ModelConfig.tiny().replace(rope_theta=10000, kv_source_layer_ids=[2, 4, 6], rope_scaling={
        "type": "yarn", "factor": 16, "original_max_position_embeddings": 256, "mscale": 1.0})
    assert cfg == ModelConfig.tiny()
    assert isinstance(cfg.rope_theta, float) and isinstance(cfg.kv_source_layer_ids, tuple)
    assert isinstance(cfg.rope_scaling, RopeScaling)


def test_to_hf_config_options() -> None:
    cfg = ModelConfig.tiny().replace(fake_quant=False, weight_block_size=None, expert_dtype=None,
                                     pad_token_id=None, rope_scaling=None)
    raw = cfg.to_hf_config(vision_config=None)
    assert "vision_config" not in raw and "quantization_config" not in raw
    assert raw["text_config"]["fake_quant"] is False
    assert ModelConfig.from_hf_config(json.loads(json.dumps(raw))) == cfg
    assert "fake_quant" not in ModelConfig.tiny().to_hf_config()["text_config"]


# ---- validation -------------------------------------------------------------------------------

INVALID = [  # (changes applied to tiny(), the field the error must name)
    # KV-source ids whose compress ratios disagree: layer 6 (ratio 1) would read layer 2 (ratio 2)
    (dict(kv_source_layer_ids=(2,), index_source_layer_ids=(2, 8, 10), candidate_source_layer_id=-1),
     "kv_source_layer_ids"),
    (dict(compress_ratios=(0, 0, 2, 2, 1, 2, 1, 1, 1, 1, 1, 1)), "kv_source_layer_ids"),
    (dict(compress_ratios=(0, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1)), "kv_source_layer_ids"),
    (dict(index_topk=0), "index_topk"),
    (dict(hc_mult=0), "hc_mult"),
    (dict(candidate_source_layer_id=8), "candidate_source_layer_id"),
    (dict(candidate_source_layer_id=-2), "candidate_source_layer_id"),
    (dict(candidate_source_layer_id=4), "candidate_source_layer_id"),  # later index sources have ratio 1
    (dict(candidate_topk_blocks=0), "candidate_topk_blocks"),
    (dict(num_key_value_heads=2), "num_key_value_heads"),
    (dict(n_shared_experts=2), "n_shared_experts"),
    (dict(o_groups=3), "o_groups"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    (dict(qk_rope_head_dim=0), "qk_rope_head_dim"),
    (dict(qk_rope_head_dim=64), "qk_rope_head_dim"),
    (dict(head_dim=48), "head_dim"),
    (dict(index_head_dim=16), "index_head_dim"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(hidden_size=-64), "hidden_size"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(hc_eps=math.nan), "hc_eps"),
    (dict(rope_theta=-1.0), "rope_theta"),
    (dict(compress_rope_theta=math.inf), "compress_rope_theta"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(attention_dropout=1.0), "attention_dropout"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(scoring_func="sigmoid"), "scoring_func"),
    (dict(compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1)), "compress_ratios"),
    (dict(compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, -1)), "compress_ratios"),
    (dict(kv_source_layer_ids=(4, 2, 6)), "kv_source_layer_ids"),
    (dict(kv_source_layer_ids=(2, 2, 4, 6)), "kv_source_layer_ids"),
    (dict(index_source_layer_ids=(2, 4, 6, 8, 15)), "index_source_layer_ids"),
    (dict(index_source_layer_ids=(2, 4, 8, 10)), "index_source_layer_ids"),  # KV source 6 missing
    (dict(kv_source_layer_ids=(0, 2, 4, 6), index_source_layer_ids=(0, 2, 4, 6, 8, 10)),
     "kv_source_layer_ids"),  # ratio-0 KV source
    (dict(index_source_layer_ids=(1, 2, 4, 6, 8, 10)), "index_source_layer_ids"),  # ratio-0 index source
    (dict(engram_num_embeddings=(2048,)), "engram_num_embeddings"),
    (dict(engram_num_embeddings=(2048, 507)), "engram_num_embeddings"),  # layer 4 needs 508 rows
    (dict(engram_layer_ids=(4, 1)), "engram_layer_ids"),
    (dict(engram_pad_token_id=512), "engram_pad_token_id"),
    (dict(engram_max_ngram_size=1), "engram_max_ngram_size"),
    (dict(engram_compressed_vocab_size=513), "engram_compressed_vocab_size"),
    (dict(dspark_target_layer_ids=(10, 11, 12)), "dspark_target_layer_ids"),
    (dict(dspark_target_layer_ids=(9, 11, 10)), "dspark_target_layer_ids"),
    (dict(dspark_target_layer_ids=()), "dspark_target_layer_ids"),
    (dict(dspark_num_experts_per_tok=5), "dspark_num_experts_per_tok"),
    (dict(dspark_noise_token_id=512), "dspark_noise_token_id"),
    (dict(dspark_block_size=0), "dspark_block_size"),
    (dict(num_nextn_predict_layers=-1), "num_nextn_predict_layers"),
    (dict(rope_scaling=RopeScaling(factor=16.0).__dict__ | {"factor": 0.5}), "rope_scaling.factor"),
    (dict(rope_scaling={"beta_fast": 1.0, "beta_slow": 32.0}), "rope_scaling.beta_fast"),
    (dict(rope_scaling={"rope_type": "linear"}), "rope_scaling.rope_type"),
    (dict(dtype="int8"), "dtype"),
    (dict(expert_dtype="int4"), "expert_dtype"),
    (dict(weight_block_size=(0, 32)), "weight_block_size"),
    (dict(pad_token_id=-1), "pad_token_id"),
]


@pytest.mark.parametrize(("changes", "field"), INVALID, ids=[f for _, f in INVALID])
def test_inconsistent_fields_rejected(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        ModelConfig.tiny().replace(**changes)
    raw = ModelConfig.tiny().to_hf_config()
    for key, value in changes.items():
        value = list(value) if isinstance(value, tuple) else value
        if key in ("dtype", "pad_token_id"):
            raw[key] = value
        elif key in ("weight_block_size", "expert_dtype"):
            raw["quantization_config"][key] = value
        else:
            raw["text_config"][key] = value
    with pytest.raises(ValueError, match=re.escape(field)):
        ModelConfig.from_hf_config(raw)


def test_valid_edge_cases_accepted() -> None:
    tiny = ModelConfig.tiny()
    no_engram = tiny.replace(engram_layer_ids=(), engram_num_embeddings=(), engram_pad_token_id=10**6)
    assert no_engram.engram_index(1) is None and no_engram.engram_primes() == ()
    raw = tiny.to_hf_config()
    raw["text_config"]["engram_layer_ids"] = []
    del raw["text_config"]["engram_num_embeddings"]  # Engram off: no row counts needed
    assert ModelConfig.from_hf_config(raw) == no_engram.replace(engram_pad_token_id=2)
    no_cand = tiny.replace(candidate_source_layer_id=-1, candidate_topk_blocks=0, candidate_block_size=0)
    assert not any(no_cand.uses_candidates(i) for i in range(12))
    no_dspark = tiny.replace(num_nextn_predict_layers=0, dspark_target_layer_ids=(), dspark_block_size=0)
    assert no_dspark.num_nextn_predict_layers == 0
    # a truncated pretrained prefix keeps the full schedule and hash identities
    prefix = ModelConfig(num_hidden_layers=4, num_nextn_predict_layers=0)
    assert prefix.decoder_start == 4 and list(prefix.decoder_layers) == []
    assert prefix.global_cache_bytes_per_token == pytest.approx(178.0)  # only layer 2 is active


def test_frozen_and_hashable() -> None:
    tiny = ModelConfig.tiny()
    table = {tiny: "tiny", ModelConfig.small(): "small", ModelConfig(): "v41"}
    assert table[ModelConfig.tiny()] == "tiny" and table[ModelConfig.from_hf_config(FIXTURE)] == "v41"
    assert hash(tiny) == hash(ModelConfig.from_hf_config(tiny.to_hf_config()))
    assert len({tiny, tiny.replace(), tiny.replace(index_topk=9)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny.hidden_size = 3  # type: ignore[misc]


# ---- layer schedule (model.md §3) -------------------------------------------------------------


def test_v41_layer_map(v41: ModelConfig) -> None:
    full, reindex = {2, 8, 14, 20}, {24, 28, 32, 36}
    for layer in range(43):
        if layer in (0, 1) or layer >= 40:
            role = LayerRole.SWA
        else:
            role = LayerRole.FULL if layer in full else LayerRole.REUSE
            role = LayerRole.REINDEX if layer in reindex else role
        assert v41.layer_role(layer) is role, layer
        expected_kv = None if role is LayerRole.SWA else max(s for s in full if s <= layer)
        expected_index = None if role is LayerRole.SWA else max(s for s in full | reindex if s <= layer)
        assert (v41.kv_source(layer), v41.index_source(layer)) == (expected_kv, expected_index), layer
    assert v41.kv_source(5) == 2 and v41.index_source(27) == 24 and v41.kv_source(27) == 20
    assert v41.uses_candidates(24) and not v41.uses_candidates(20) and not v41.uses_candidates(25)
    assert [i for i in range(40) if v41.uses_candidates(i)] == [24, 28, 32, 36]
    assert v41.is_candidate_source(20) and not v41.is_candidate_source(24)
    assert v41.layer_role(1000) is LayerRole.SWA and v41.compress_ratio(1000) == 0
    with pytest.raises(ValueError, match="layer"):
        v41.compress_ratio(-1)


def test_v41_ced_split(v41: ModelConfig) -> None:
    assert v41.decoder_start == 20
    assert v41.encoder_layers == range(0, 20) and v41.decoder_layers == range(20, 40)
    # without a candidate source the split falls back to the first ratio-1 KV source
    no_cand = v41.replace(candidate_source_layer_id=-1)
    assert no_cand.decoder_start == 20
    tiny = ModelConfig.tiny().replace(candidate_source_layer_id=-1,
                                      compress_ratios=(0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2))
    assert tiny.decoder_start == 12 and list(tiny.decoder_layers) == []


def test_v41_rope_per_layer(v41: ModelConfig) -> None:
    for layer in range(43):
        compressed = 2 <= layer < 40
        assert v41.rope_theta_for(layer) == (160000.0 if compressed else 10000.0), layer
        assert v41.rope_scaling_for(layer) == (RopeScaling() if compressed else None), layer


def test_v41_engram(v41: ModelConfig) -> None:
    assert v41.num_engram_hash_heads == 24
    assert (v41.engram_index(1), v41.engram_index(14), v41.engram_index(2)) == (0, 1, None)
    # the published row counts are exactly the sums of each layer's 24 consecutive hash primes
    primes = v41.engram_primes()
    assert tuple(sum(p) for p in primes) == v41.engram_num_embeddings
    assert primes[0][0] == 16000057 and primes[0][-1] < primes[1][0]
    assert ModelConfig.tiny().engram_primes() == ((101, 103, 107, 109), (113, 127, 131, 137))


# ---- sizes ------------------------------------------------------------------------------------


def test_v41_sizes(v41: ModelConfig) -> None:
    params, with_engram = v41.num_parameters(), v41.num_parameters(include_engram=True)
    assert abs(params - 552e9) / 552e9 < 0.01
    assert abs((with_engram - params) - 196.6e9) / 196.6e9 < 0.01  # model.md §2.3
    assert v41.global_cache_bytes_per_token == 890
    assert v41.swa_row_bytes == 528
    tied = v41.replace(tie_word_embeddings=True)
    assert params - tied.num_parameters() == 129280 * 5120


# ---- presets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", [ModelConfig.tiny, ModelConfig.small])
def test_presets_cover_every_role(preset) -> None:
    cfg = preset()
    roles = [cfg.layer_role(i) for i in range(cfg.num_hidden_layers)]
    assert set(roles) == set(LayerRole)
    assert roles == [LayerRole.SWA] * 2 + [LayerRole.FULL, LayerRole.REUSE] * 3 + [LayerRole.REINDEX,
                                                                                   LayerRole.REUSE] * 2
    assert cfg.decoder_start == 6 and cfg.encoder_layers == range(6) and cfg.decoder_layers == range(6, 12)
    assert all(layer in cfg.encoder_layers for layer in cfg.engram_layer_ids)
    assert cfg.engram_layer_ids == (1, 4) and cfg.dspark_target_layer_ids == (9, 10, 11)
    assert [cfg.uses_candidates(i) for i in range(12)].count(True) == 2  # layers 8 and 10
    stages = range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers)
    assert all(cfg.layer_role(stage) is LayerRole.SWA for stage in stages)  # DSpark stages: SWA only
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    assert cfg.weight_block_size == (32, 32)
    assert cfg.hidden_size % 32 == 0 and cfg.moe_intermediate_size % 32 == 0 and cfg.q_lora_rank % 32 == 0


def test_small_uses_the_real_tokenizer_sizes() -> None:
    small = ModelConfig.small()
    assert (small.vocab_size, small.engram_compressed_vocab_size, small.dspark_noise_token_id) == (
        129280, 99092, 128799)
    assert small.engram_num_embeddings == tuple(sum(p) for p in small.engram_primes())
    tiny = ModelConfig.tiny()
    assert tiny.engram_compressed_vocab_size == tiny.vocab_size == 512  # identity map
    assert tiny.dspark_noise_token_id == 511


@pytest.mark.parametrize("preset", [ModelConfig.tiny, ModelConfig.small, ModelConfig])
def test_yarn_bends_some_but_not_all_frequencies(preset) -> None:
    """model.md §4.5's ramp, evaluated for the preset: both regimes must be exercised."""
    cfg = preset()
    dims, theta, scaling = cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling
    orig = scaling.original_max_position_embeddings

    def bound(beta: float) -> float:
        return dims * math.log(orig / (beta * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(bound(scaling.beta_fast)), 0)
    high = min(math.ceil(bound(scaling.beta_slow)), dims - 1)
    ramps = [min(max((k - low) / max(high - low, 1e-3), 0.0), 1.0) for k in range(dims // 2)]
    assert min(ramps) == 0.0 and max(ramps) > 0.0
    assert cfg.max_position_embeddings == orig * scaling.factor


# ---- property-based: random valid schedules --------------------------------------------------


@st.composite
def schedules(draw) -> dict:
    """A random valid CSA2 schedule: SWA prefix, then segments each opened by a KV source."""
    ratios: list[int] = [0] * draw(st.integers(0, 3))
    kv: list[int] = []
    index: list[int] = []
    for _ in range(draw(st.integers(0, 4))):
        ratio = draw(st.sampled_from([1, 2, 4]))
        kv.append(len(ratios))
        index.append(len(ratios))
        ratios.append(ratio)
        for _ in range(draw(st.integers(0, 4))):
            if draw(st.booleans()):
                ratios.append(0)
            else:
                if draw(st.booleans()):
                    index.append(len(ratios))
                ratios.append(ratio)
    ratios = ratios or [0]
    layers = draw(st.integers(1, len(ratios)))
    tail = draw(st.integers(0, 3))
    cand = kv[-1] if kv and draw(st.booleans()) else -1
    engram = sorted(draw(st.sets(st.integers(0, len(ratios) - 1), max_size=3)))
    nextn = draw(st.integers(0, 3))
    targets = sorted(draw(st.sets(st.integers(0, layers - 1), min_size=1, max_size=3))) if nextn else []
    return dict(num_hidden_layers=layers, compress_ratios=ratios + [0] * tail, kv_source_layer_ids=kv,
                index_source_layer_ids=index, candidate_source_layer_id=cand, engram_layer_ids=engram,
                engram_num_embeddings=[4096] * len(engram), num_nextn_predict_layers=nextn,
                dspark_target_layer_ids=targets, fake_quant=draw(st.booleans()),
                weight_block_size=draw(st.sampled_from([None, (32, 32), (128, 128)])))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules())
def test_random_schedules_round_trip_and_stay_consistent(changes: dict) -> None:
    cfg = ModelConfig.tiny().replace(**changes)
    assert ModelConfig.from_hf_config(json.loads(json.dumps(cfg.to_hf_config()))) == cfg
    assert hash(ModelConfig.from_hf_config(cfg.to_hf_config())) == hash(cfg)
    for layer in range(len(cfg.compress_ratios) + 2):
        ratio, role = cfg.compress_ratio(layer), cfg.layer_role(layer)
        kv, index = cfg.kv_source(layer), cfg.index_source(layer)
        if ratio == 0:
            assert role is LayerRole.SWA and kv is None and index is None
            assert cfg.rope_scaling_for(layer) is None and cfg.rope_theta_for(layer) == cfg.rope_theta
            continue
        assert cfg.compress_ratio(kv) == ratio and cfg.compress_ratio(index) == ratio
        assert kv <= index <= layer and cfg.kv_source(index) == kv
        assert (role is LayerRole.FULL) == (kv == layer)
        assert (role in (LayerRole.FULL, LayerRole.REINDEX)) == (index == layer)
        assert not cfg.uses_candidates(layer) or role is not LayerRole.REUSE
    assert list(cfg.encoder_layers) + list(cfg.decoder_layers) == list(range(cfg.num_hidden_layers))
    assert cfg.num_parameters(include_engram=True) >= cfg.num_parameters() > 0


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10**6) | st.floats(allow_nan=True) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([f.name for f in dataclasses.fields(ModelConfig)]), JSON_VALUES)
def test_junk_values_give_value_errors_only(field: str, value: object) -> None:
    raw = ModelConfig.tiny().to_hf_config()
    if field in ("dtype", "bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"):
        raw[field] = value
    elif field in ("weight_block_size", "expert_dtype"):
        raw["quantization_config"][field] = value
    else:
        raw["text_config"][field] = value
    try:
        cfg = ModelConfig.from_hf_config(raw)
    except ValueError:
        return
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


# ---- the NeMo AutoModel V4.1 port as an external oracle (model.md §8.2) ----------------------


@pytest.mark.oracle
@pytest.mark.slow
def test_nemo_port_agrees_on_config_and_parameter_count() -> None:
    pytest.importorskip("torch")
    nemo = pytest.importorskip("nemo_automodel.components.models.deepseek_v41.model")
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    for cfg in (ModelConfig(), ModelConfig.small()):  # NeMo's validator accepts ours; its dict reads back
        raw = cfg.to_hf_config(vision_config={"num_hidden_layers": 0})
        theirs = DeepseekV41Config(**{k: v for k, v in raw.items() if k != "model_type"})
        assert ModelConfig.from_hf_config(theirs.to_dict()) == cfg

    tiny = ModelConfig.tiny()
    vocab = {f"t{i}": i for i in range(tiny.vocab_size)}  # distinct tokens: identity Engram map
    word_level = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    raw = tiny.to_hf_config(vision_config={"num_hidden_layers": 0})
    del raw["quantization_config"]
    model = nemo.DeepseekV41ForCausalLM(
        DeepseekV41Config(**{k: v for k, v in raw.items() if k != "model_type"}),
        backend=BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch",
                              dispatcher="torch"),
        tokenizer=PreTrainedTokenizerFast(tokenizer_object=word_level),
    )
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    counted = {name: t.numel() for name, t in tensors.items() if "engram_hash" not in name}
    assert sum(counted.values()) == tiny.num_parameters(include_engram=True)
    assert sum(n for name, n in counted.items() if ".engram." not in name) == tiny.num_parameters()
    assert tuple(map(tuple, model.model.engram_hash.primes.tolist())) == tiny.engram_primes()


def test_absurd_engram_sizes_fail_fast() -> None:
    with pytest.raises(ValueError, match="engram_n_heads"):
        ModelConfig.tiny().replace(engram_n_heads=10**6, engram_num_embeddings=(10**12, 10**12))
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        ModelConfig.tiny().replace(engram_n_heads=10**4)
