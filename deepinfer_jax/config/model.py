"""Model configuration of DeepSeek-V4.1-Flash (``DeepseekV41ForCausalLM``), model.md §2-§3.

``ModelConfig``: the published config.json as a frozen, hashable, validated dataclass (a static
``jax.jit`` argument), plus the layer-schedule queries and size arithmetic, in plain Python.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
import math
import numbers
import os
import types
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from deepinfer_jax.model.engram_consts import engram_primes

__all__ = ["PUBLISHED_VISION_CONFIG", "LayerRole", "ModelConfig", "RopeScaling"]

NESTED_MODEL_TYPE = "deepseek_v41"
TEXT_MODEL_TYPE = "deepseek_v41_text"

#: The published ``vision_config`` (model.md §2.1); out of scope for the engine, emitted as is.
PUBLISHED_VISION_CONFIG: Mapping[str, Any] = types.MappingProxyType({
    "model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024,
    "num_attention_heads": 16, "intermediate_size": 2816, "patch_size": 14, "rope_theta": 10000.0,
    "downsample_ratio": 3, "max_image_tokens": 1024, "min_pixels": 295936, "max_wh_ratio": None,
})


class LayerRole(str, enum.Enum):
    """CSA2 role of a layer (model.md §3)."""

    SWA = "swa"  # compress ratio 0: own sliding window only
    FULL = "full"  # KV source: owns global KV and index keys (and is an index source)
    REINDEX = "reindex"  # index source that scores its KV source's keys with its own queries
    REUSE = "reuse"  # takes KV and top-k selection from its sources unchanged


# --- checks: ValueError naming the field -----------------------------------------------------


def _bad(name: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"{name} must be {expected}, got {value!r}")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")


def _coerce(name: str, kind: str, value: Any) -> Any:
    """Check ``value`` against the annotation string ``kind``; normalise lists to tuples and
    ints to floats where a float is declared."""
    if kind.endswith(" | None"):
        return None if value is None else _coerce(name, kind.removesuffix(" | None"), value)
    if kind == "RopeScaling":
        if isinstance(value, Mapping):
            return RopeScaling.from_hf(value)
        if not isinstance(value, RopeScaling):
            raise _bad(name, "a mapping or null", value)
        return value
    if kind.startswith("tuple["):
        pair = kind == "tuple[int, int]"
        if not isinstance(value, (list, tuple)) or pair and len(value) != 2:
            raise _bad(name, "a list of two integers" if pair else "a list of integers", value)
        return tuple(_coerce(f"{name}[{i}]", "int", v) for i, v in enumerate(value))
    types_, words, cast = {"int": (numbers.Integral, "an integer", int),
                           "float": (numbers.Real, "a number", float),
                           "bool": (bool, "a boolean", bool), "str": (str, "a string", str)}[kind]
    if not isinstance(value, types_) or kind != "bool" and isinstance(value, bool):
        raise _bad(name, words, value)
    return cast(value)


def _coerce_fields(obj: Any, prefix: str = "") -> None:
    """Type-check and normalise every field of a frozen dataclass in place."""
    for f in dataclasses.fields(obj):
        object.__setattr__(obj, f.name, _coerce(prefix + f.name, f.type, getattr(obj, f.name)))


def _at_least(obj: Any, low: int, *names: str) -> None:
    for name in names:
        _check(getattr(obj, name) >= low, name, f"must be >= {low}, got {getattr(obj, name)!r}")


def _finite(obj: Any, low: float, *names: str, strict: bool = True) -> None:
    for name in names:
        value = getattr(obj, name)
        ok = math.isfinite(value) and (value > low if strict else value >= low)
        _check(ok, name, f"must be finite and {'>' if strict else '>='} {low}, got {value!r}")


def _rules(obj: Any, rules: tuple[tuple[str, bool, str], ...]) -> None:
    """Check ``(field, ok, rule)`` triples: ValueError "field must be rule, got value"."""
    for name, ok, rule in rules:
        _check(ok, name, f"must be {rule}, got {getattr(obj, name)!r}")


def _increasing_ids(name: str, ids: tuple[int, ...], end: int) -> None:
    _check(all(a < b for a, b in itertools.pairwise(ids)), name, f"must be strictly increasing, got {ids}")
    _check(all(0 <= i < end for i in ids), name, f"must lie in [0, {end}), got {ids}")


# --- Engram hash primes (model.md §4.3) ------------------------------------------------------


# --- the configuration -----------------------------------------------------------------------


@dataclass(frozen=True)
class RopeScaling:
    """The published ``rope_scaling`` dict: frequency-only YaRN of compressed layers (§4.5)."""

    rope_type: str = "yarn"
    factor: float = 16.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 65536

    def __post_init__(self) -> None:
        _coerce_fields(self, "rope_scaling.")
        fast, slow = self.beta_fast, self.beta_slow
        for name, ok, rule in (
            ("rope_type", self.rope_type == "yarn", "'yarn'"),
            ("factor", math.isfinite(self.factor) and self.factor >= 1, "finite and >= 1"),
            ("beta_slow", math.isfinite(slow) and slow > 0, "finite and > 0"),
            ("beta_fast", math.isfinite(fast) and fast > slow, "finite and > beta_slow"),
            ("original_max_position_embeddings", self.original_max_position_embeddings >= 1, ">= 1"),
        ):
            _check(ok, f"rope_scaling.{name}", f"must be {rule}, got {getattr(self, name)!r}")

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any]) -> RopeScaling:
        """From an HF ``rope_scaling`` dict (legacy key ``type`` accepted, extra keys ignored)."""
        kwargs = {f.name: raw[f.name] for f in dataclasses.fields(cls) if f.name in raw}
        if "rope_type" not in kwargs and "type" in raw:
            kwargs["rope_type"] = raw["type"]
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        """The HF ``rope_scaling`` dict."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek-V4.1-Flash geometry; defaults are the published V4.1-Flash values (model.md §2.1).

    List-valued fields are tuples so the config is hashable. Layer ids index the schedule
    ``compress_ratios``, which also covers the DSpark stages (entries past its end are ratio 0).
    Source and Engram ids may point past ``num_hidden_layers`` (a truncated pretrained prefix
    keeps the full schedule and hash identities); DSpark targets must be backbone layers.
    """

    # dimensions
    vocab_size: int = 129280
    hidden_size: int = 5120
    moe_intermediate_size: int = 2304
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_lora_rank: int = 1024
    o_groups: int = 8
    hidden_act: str = "silu"
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    attention_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    use_cache: bool = True
    tie_word_embeddings: bool = False
    # positions
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = RopeScaling()
    # MoE
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    # CSA2 attention schedule
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    compress_rope_theta: float = 160000.0
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # DSpark drafter (mtp.*)
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # root level of the nested config
    dtype: str = "bfloat16"
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int | None = 2
    image_token_id: int = 129264
    # quantization_config (None when absent: an unquantised checkpoint)
    weight_block_size: tuple[int, int] | None = (32, 32)
    expert_dtype: str | None = "fp4"
    # ours: QAT fake-quant boundaries of model.md §4.8 on/off
    fake_quant: bool = True

    # ---- validation ----

    def __post_init__(self) -> None:
        _coerce_fields(self)
        _at_least(self, 1, "vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_lora_rank",
                  "o_groups", "max_position_embeddings", "n_routed_experts", "num_experts_per_tok",
                  "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
                  "hc_sinkhorn_iters")
        _at_least(self, 0, "bos_token_id", "eos_token_id", "image_token_id", "num_nextn_predict_layers",
                  "dspark_block_size")
        _finite(self, 0, "rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta",
                "routed_scaling_factor")
        _finite(self, 0, "swiglu_limit", "attention_dropout", "initializer_range", strict=False)
        heads, rope, block = self.num_attention_heads, self.qk_rope_head_dim, self.weight_block_size
        _rules(self, (
            ("num_key_value_heads", self.num_key_value_heads == 1, "1 (one shared latent, K = V)"),
            ("n_shared_experts", self.n_shared_experts == 1, "1"),
            ("hidden_act", self.hidden_act == "silu", "'silu'"),
            ("scoring_func", self.scoring_func == "sqrtsoftplus", "'sqrtsoftplus'"),
            ("topk_method", self.topk_method == "noaux_tc", "'noaux_tc'"),
            ("head_dim", self.head_dim % 32 == 0, "a multiple of 32 (quantisation groups)"),
            ("index_head_dim", self.index_head_dim % 32 == 0, "a multiple of 32 (quantisation groups)"),
            ("o_groups", heads % self.o_groups == 0, f"a divisor of num_attention_heads={heads}"),
            ("qk_rope_head_dim", rope % 2 == 0 and rope <= min(self.head_dim, self.index_head_dim),
             "even and <= head_dim and index_head_dim"),
            ("num_experts_per_tok", self.num_experts_per_tok <= self.n_routed_experts, "<= n_routed_experts"),
            ("attention_dropout", self.attention_dropout < 1, "< 1"),
            ("pad_token_id", self.pad_token_id is None or self.pad_token_id >= 0, ">= 0 or None"),
            ("dtype", self.dtype in ("bfloat16", "float32", "float16"), "'bfloat16', 'float32' or 'float16'"),
            ("weight_block_size", block is None or min(block) >= 1, "two positive integers or None"),
            ("expert_dtype", self.expert_dtype in (None, "fp4", "fp8"), "'fp4', 'fp8' or None"),
        ))
        self._validate_schedule()
        self._validate_engram()
        if self.num_nextn_predict_layers > 0:  # DSpark on
            experts = self.dspark_n_routed_experts
            _increasing_ids("dspark_target_layer_ids", self.dspark_target_layer_ids, self.num_hidden_layers)
            _at_least(self, 1, "dspark_block_size", "dspark_markov_rank", "dspark_n_routed_experts",
                      "dspark_num_experts_per_tok")
            _rules(self, (
                ("dspark_target_layer_ids", len(self.dspark_target_layer_ids) > 0, "non-empty"),
                ("dspark_num_experts_per_tok", self.dspark_num_experts_per_tok <= experts,
                 "<= dspark_n_routed_experts"),
                ("dspark_noise_token_id", 0 <= self.dspark_noise_token_id < self.vocab_size, "< vocab_size"),
            ))

    def _validate_schedule(self) -> None:
        ratios, kv, index = self.compress_ratios, self.kv_source_layer_ids, self.index_source_layer_ids
        n = len(ratios)
        for name in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
            _increasing_ids(name, getattr(self, name), n)
        _rules(self, (
            ("compress_ratios", n >= self.num_hidden_layers, "at least num_hidden_layers long"),
            ("compress_ratios", min(ratios, default=0) >= 0, "non-negative"),
            ("index_source_layer_ids", set(kv) <= set(index), "a superset of kv_source_layer_ids"),
            ("kv_source_layer_ids", all(ratios[i] for i in kv), "free of compress-ratio-0 (SWA-only) layers"),
            ("index_source_layer_ids", all(ratios[i] for i in index), "free of compress-ratio-0 layers"),
        ))
        owner = None
        for layer, ratio in enumerate(ratios):
            owner = layer if layer in kv else owner
            if ratio and (owner is None or ratios[owner] != ratio):
                got = "none" if owner is None else f"layer {owner} of ratio {ratios[owner]}"
                raise ValueError(f"kv_source_layer_ids: compressed layer {layer} (compress ratio {ratio}) "
                                 f"needs a preceding KV source with the same compress ratio, got {got}")
        cand = self.candidate_source_layer_id
        _rules(self, (
            ("candidate_source_layer_id", cand == -1 or cand in kv, "-1 or one of kv_source_layer_ids"),
            ("candidate_source_layer_id",
             all(ratios[i] == ratios[cand] for i in index if cand >= 0 and i > cand),
             "a layer with the compress ratio of every later index source"),
        ))
        _at_least(self, 1 if cand >= 0 else 0, "candidate_topk_blocks", "candidate_block_size")

    def _validate_engram(self) -> None:
        ids, rows = self.engram_layer_ids, self.engram_num_embeddings
        _rules(self, (("engram_num_embeddings", len(rows) == len(ids), "one row count per engram layer"),))
        if not ids:
            return
        _at_least(self, 2, "engram_max_ngram_size", "engram_vocab_size")
        _at_least(self, 1, "engram_n_heads", "engram_head_dim", "engram_compressed_vocab_size")
        vocab, heads = self.vocab_size, self.num_engram_hash_heads
        _rules(self, (
            ("engram_compressed_vocab_size", self.engram_compressed_vocab_size <= vocab, "<= vocab_size"),
            ("engram_pad_token_id", 0 <= self.engram_pad_token_id < vocab, "< vocab_size"),
            ("engram_n_heads", heads * len(ids) <= 1 << 16, "small enough for <= 65536 hash primes in all"),
            ("engram_num_embeddings", min(rows) >= heads * self.engram_vocab_size,  # cheap bound first
             ">= (engram_max_ngram_size - 1) * engram_n_heads * engram_vocab_size"),
        ))
        need = tuple(sum(p) for p in self.engram_primes())
        _rules(self, (("engram_num_embeddings", all(r >= m for r, m in zip(rows, need)),
                       f">= the sums of each layer's hash primes {need}"),))

    # ---- Hugging Face config.json ----

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> ModelConfig:
        """Build from a published config: the nested ``deepseek_v41`` layout or a flat
        ``deepseek_v41_text`` one, as a dict or a path to ``config.json`` or its directory.

        Unknown keys are ignored, known keys of the wrong type raise ``ValueError``, missing
        fields take the V4.1 defaults; a missing ``quantization_config`` means an unquantised
        checkpoint (``weight_block_size`` and ``expert_dtype`` None). A flat ``rope_parameters``
        (transformers 5) stands in for a missing ``rope_scaling``.
        """
        raw = config if isinstance(config, Mapping) else _read_json(config)
        model_type = raw.get("model_type")
        if model_type == NESTED_MODEL_TYPE:
            text = {} if raw.get("text_config") is None else raw["text_config"]
            if not isinstance(text, Mapping):
                raise _bad("text_config", "a mapping", text)
            if text.get("model_type", TEXT_MODEL_TYPE) != TEXT_MODEL_TYPE:
                raise _bad("text_config.model_type", repr(TEXT_MODEL_TYPE), text.get("model_type"))
        elif model_type == TEXT_MODEL_TYPE:
            text = raw
        else:
            raise _bad("model_type", f"{NESTED_MODEL_TYPE!r} or {TEXT_MODEL_TYPE!r}", model_type)
        kwargs: dict[str, Any] = {name: text[name] for name in _TEXT_FIELDS + ("fake_quant",) if name in text}
        if "engram_num_embeddings" not in text and text.get("engram_layer_ids") in ([], ()):
            kwargs["engram_num_embeddings"] = ()  # Engram off: no tables
        params = text.get("rope_parameters")  # how transformers 5 re-saves rope_scaling
        if "rope_scaling" not in text and isinstance(params, Mapping) and "rope_type" in params:
            kwargs["rope_scaling"] = None if params["rope_type"] == "default" else params
        for name in _ROOT_FIELDS:  # the root wins over text_config; "torch_dtype" is the old "dtype"
            keys = (name, "torch_dtype") if name == "dtype" else (name,)
            found = [source[key] for source in (raw, text) for key in keys if key in source]
            if found:
                kwargs[name] = found[0]
        quant = raw.get("quantization_config", text.get("quantization_config"))
        if quant is not None and not isinstance(quant, Mapping):
            raise _bad("quantization_config", "a mapping or null", quant)
        kwargs["weight_block_size"] = None if quant is None else quant.get("weight_block_size")
        kwargs["expert_dtype"] = None if quant is None else quant.get("expert_dtype")
        return cls(**kwargs)

    def to_hf_config(
        self, *, vision_config: Mapping[str, Any] | None = PUBLISHED_VISION_CONFIG
    ) -> dict[str, Any]:
        """The nested published layout; ``from_hf_config(self.to_hf_config()) == self``.

        ``fake_quant`` is written into ``text_config`` only when off, so the V4.1 defaults
        reproduce the published file; ``vision_config=None`` leaves the vision tower out.
        """
        text: dict[str, Any] = {"model_type": TEXT_MODEL_TYPE}
        for name in _TEXT_FIELDS:
            value = getattr(self, name)
            text[name] = value.to_hf() if isinstance(value, RopeScaling) else _jsonable(value)
        if not self.fake_quant:
            text["fake_quant"] = False
        out: dict[str, Any] = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": NESTED_MODEL_TYPE,
                               "dtype": self.dtype, "transformers_version": "5.6.0"}
        out.update({name: getattr(self, name) for name in _ROOT_FIELDS if name != "dtype"})
        if self.weight_block_size is not None or self.expert_dtype is not None:
            quant = {"quant_method": "fp8", "activation_scheme": "dynamic",
                     "weight_block_size": _jsonable(self.weight_block_size), "scale_fmt": "ue8m0",
                     "expert_dtype": self.expert_dtype}
            out["quantization_config"] = {k: v for k, v in quant.items() if v is not None}
        out["text_config"] = text
        if vision_config is not None:
            out["vision_config"] = dict(vision_config)
        return out

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes`` applied, validated again."""
        return dataclasses.replace(self, **changes)

    # ---- presets (model.md §9): 12 layers, encoder 0-5, decoder 6-11, every role, Engram at 1 and 4 ----

    @classmethod
    def tiny(cls) -> ModelConfig:
        """The test model: identity Engram map (compressed vocab = vocab), fp32."""
        return cls(
            vocab_size=512, hidden_size=64, moe_intermediate_size=32, head_dim=32, qk_rope_head_dim=8,
            q_lora_rank=32, o_lora_rank=16, max_position_embeddings=4096,
            rope_scaling=RopeScaling(original_max_position_embeddings=256), sliding_window=8, index_topk=8,
            candidate_block_size=2, engram_num_embeddings=(2048, 2048), engram_vocab_size=101,
            engram_head_dim=16, engram_compressed_vocab_size=512, dspark_noise_token_id=511,
            dtype="float32", image_token_id=510, **_PRESET_SCHEDULE,
        )

    @classmethod
    def small(cls) -> ModelConfig:
        """The demo model: the real V4 vocabulary (129280) and tokenizer-derived Engram map (99092)."""
        return cls(
            hidden_size=128, moe_intermediate_size=128, head_dim=64, qk_rope_head_dim=16, q_lora_rank=64,
            o_lora_rank=32, max_position_embeddings=65536,
            rope_scaling=RopeScaling(original_max_position_embeddings=4096), sliding_window=16, index_topk=16,
            candidate_block_size=4, engram_num_embeddings=(4062, 4152), engram_vocab_size=1009,
            engram_head_dim=32, **_PRESET_SCHEDULE,
        )

    # ---- layer schedule (model.md §3) ----

    def compress_ratio(self, layer: int) -> int:
        """``compress_ratios[layer]``; 0 past the end of the schedule."""
        _check(layer >= 0, "layer", f"must be >= 0, got {layer}")
        return self.compress_ratios[layer] if layer < len(self.compress_ratios) else 0

    def layer_role(self, layer: int) -> LayerRole:
        """SWA (ratio 0), FULL (KV source), REINDEX (other index source) or REUSE."""
        if self.compress_ratio(layer) == 0:
            return LayerRole.SWA
        if layer in self.kv_source_layer_ids:
            return LayerRole.FULL
        return LayerRole.REINDEX if layer in self.index_source_layer_ids else LayerRole.REUSE

    def kv_source(self, layer: int) -> int | None:
        """The layer whose global KV this layer attends to (same ratio); None for SWA-only layers."""
        return _latest(self.kv_source_layer_ids, layer) if self.compress_ratio(layer) else None

    def index_source(self, layer: int) -> int | None:
        """The layer whose top-k selection this layer uses (same ratio); None for SWA-only layers."""
        return _latest(self.index_source_layer_ids, layer) if self.compress_ratio(layer) else None

    def is_candidate_source(self, layer: int) -> bool:
        """True for the layer that publishes the candidate-block pool."""
        return layer == self.candidate_source_layer_id

    def uses_candidates(self, layer: int) -> bool:
        """True for index-source layers after the candidate source (they score within its pool)."""
        return layer in self.index_source_layer_ids and 0 <= self.candidate_source_layer_id < layer

    def rope_theta_for(self, layer: int) -> float:
        """RoPE base: ``compress_rope_theta`` for compressed layers, else ``rope_theta``."""
        return self.compress_rope_theta if self.compress_ratio(layer) else self.rope_theta

    def rope_scaling_for(self, layer: int) -> RopeScaling | None:
        """YaRN settings: ``rope_scaling`` for compressed layers, None for SWA-only ones."""
        return self.rope_scaling if self.compress_ratio(layer) else None

    @property
    def decoder_start(self) -> int:
        """First decoder layer of the CED / YOCO split (model.md §6; §9, open point 4): the candidate source,
        else the first ratio-1 KV source, else none (``num_hidden_layers``); capped at the latter."""
        start = self.candidate_source_layer_id
        if start < 0:
            ones = [s for s in self.kv_source_layer_ids if self.compress_ratios[s] == 1]
            start = ones[0] if ones else self.num_hidden_layers
        return min(start, self.num_hidden_layers)

    @property
    def encoder_layers(self) -> range:
        """Layers that run on every prompt token."""
        return range(self.decoder_start)

    @property
    def decoder_layers(self) -> range:
        """Layers whose global KV is projected from the encoder's output."""
        return range(self.decoder_start, self.num_hidden_layers)

    def engram_index(self, layer: int) -> int | None:
        """Position of ``layer`` in ``engram_layer_ids`` (its table), or None."""
        return self.engram_layer_ids.index(layer) if layer in self.engram_layer_ids else None

    @property
    def num_engram_hash_heads(self) -> int:
        """Hash columns per token and Engram layer: one per (n-gram order >= 2, head)."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def engram_primes(self) -> tuple[tuple[int, ...], ...]:
        """Hash-bucket primes per Engram layer (``engram_layer_ids`` order), each ordered by
        (n-gram order, head): consecutive primes >= ``engram_vocab_size``, never reused."""
        return engram_primes(self.engram_vocab_size, len(self.engram_layer_ids), self.num_engram_hash_heads)

    # ---- sizes ----

    def num_parameters(self, include_engram: bool = False) -> int:
        """Backbone parameter count: embedding, head, final norm, layers (no mtp, no vision).

        Counts logical weights, not quantisation scales; Engram tables and projections only
        with ``include_engram``.
        """
        d, n, heads, latent, idx = (self.hidden_size, self.hc_mult, self.num_attention_heads,
                                    self.head_dim, self.index_head_dim)
        mix, o_rank = n * (n + 2), self.o_groups * self.o_lora_rank  # mix: pre n, post n, comb n x n
        expert = 3 * d * self.moe_intermediate_size
        engram_width = self.num_engram_hash_heads * self.engram_head_dim
        total = self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d  # embed, head, norm
        for layer in range(self.num_hidden_layers):
            total += 2 * d + 2 * (mix * n * d + mix + 3)  # attn/ffn norms, hc_{attn,ffn}_{fn,base,scale}
            total += self.q_lora_rank * (d + 1 + heads * latent)  # wq_a, q_norm, wq_b
            total += latent * (d + 1) + o_rank * heads * latent // self.o_groups  # wkv, kv_norm, wo_a
            total += d * o_rank + heads  # wo_b, attn_sink
            if layer in self.kv_source_layer_ids:  # compressor wkv (+ wgate), norm; indexer wk, k_norm
                gates = 2 if self.compress_ratios[layer] > 1 else 1
                total += gates * latent * d + latent + idx * (latent + 1)
            if layer in self.index_source_layer_ids:  # indexer wq_b, weights_proj
                total += self.index_n_heads * (idx * self.q_lora_rank + d)
            total += self.n_routed_experts * (d + 2 + expert) + expert  # gate (+ bias, bias_vl), experts
            table = self.engram_index(layer)
            if include_engram and table is not None:  # embed, wkv, q_weight, k_weight
                total += self.engram_num_embeddings[table] * self.engram_head_dim
                total += (n + 1) * d * engram_width + 2 * n * d
        return total

    @property
    def global_cache_bytes_per_token(self) -> float:
        """Global cache bytes per token (model.md §4.8): per active KV source, an NVFP4 main entry
        plus an MXFP4 index key, divided by its compress ratio (890 for V4.1)."""
        entry = Fraction(self.head_dim * 9, 16) + Fraction(self.index_head_dim * 17, 32)
        active = [s for s in self.kv_source_layer_ids if s < self.num_hidden_layers]
        return float(sum((entry / self.compress_ratios[s] for s in active), Fraction(0)))

    @property
    def swa_row_bytes(self) -> int:
        """Bytes of one FP8 SWA KV row with its UE8M0 scale per 32 channels (528 for V4.1)."""
        return self.head_dim + self.head_dim // 32


# The layer schedule and head counts shared by ModelConfig.tiny() and ModelConfig.small().
_PRESET_SCHEDULE: dict[str, Any] = {
    "num_hidden_layers": 12, "compress_ratios": (0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0),
    "kv_source_layer_ids": (2, 4, 6), "index_source_layer_ids": (2, 4, 6, 8, 10), "candidate_source_layer_id": 6,
    "candidate_topk_blocks": 4, "num_attention_heads": 4, "o_groups": 2, "index_n_heads": 2, "index_head_dim": 32,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "engram_layer_ids": (1, 4), "engram_max_ngram_size": 3,
    "engram_n_heads": 2, "dspark_target_layer_ids": (9, 10, 11), "dspark_markov_rank": 16, "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
}
_ROOT_FIELDS = ("dtype", "bos_token_id", "eos_token_id", "pad_token_id", "image_token_id")
_OWN_FIELDS = ("weight_block_size", "expert_dtype", "fake_quant")
_TEXT_FIELDS = tuple(
    f.name for f in dataclasses.fields(ModelConfig) if f.name not in _ROOT_FIELDS + _OWN_FIELDS
)


def _latest(ids: tuple[int, ...], layer: int) -> int:
    return max(i for i in ids if i <= layer)


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _read_json(path: str | os.PathLike[str]) -> Mapping[str, Any]:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"config must be a mapping or a path, got {type(path).__name__}")
    file = Path(path)
    file = file / "config.json" if file.is_dir() else file
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    return raw
