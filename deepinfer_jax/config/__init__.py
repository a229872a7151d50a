"""Frozen, validated configuration dataclasses, one module per concern (plain Python, no JAX).

``model`` (``ModelConfig`` from HF ``config.json``), ``cache`` (``CacheConfig``), ``engine`` (``EngineConfig``
and its sections), ``sharding`` (``ShardingPreset``, the rules table, the shipped presets), ``eplb``
(``EplbSettings``), ``shipped`` (where the shipped data lives), ``fields`` (``ShardingError``).
"""

from deepinfer_jax.config.cache import CacheConfig
from deepinfer_jax.config.engine import EngineConfig, yoco_keep_tokens
from deepinfer_jax.config.eplb import EplbSettings
from deepinfer_jax.config.fields import ShardingError
from deepinfer_jax.config.model import NESTED_MODEL_TYPE, TEXT_MODEL_TYPE, LayerRole, ModelConfig, RopeScaling
from deepinfer_jax.config.sharding import ShardingPreset, resolve_preset

__all__ = ["NESTED_MODEL_TYPE", "TEXT_MODEL_TYPE", "CacheConfig", "EngineConfig", "EplbSettings", "LayerRole",
           "ModelConfig", "RopeScaling", "ShardingError", "ShardingPreset", "resolve_preset", "yoco_keep_tokens"]
