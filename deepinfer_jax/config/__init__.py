"""Frozen, validated configuration dataclasses, one module per concern (plain Python, no JAX).

``model`` (``ModelConfig`` from HF ``config.json``), ``cache`` (``CacheConfig``: the device cache geometry),
``engine`` (``EngineConfig``) composed of ``sections`` (``SchedulerConfig``, ``CacheSettings``,
``SpeculationConfig``, ``ParallelConfig``), ``sharding`` (``ShardingPreset``, the rules table, the shipped
presets), ``eplb`` (``EplbSettings``), ``shipped`` (where the shipped data lives), ``fields``
(``ShardingError``).
"""

from deepinfer_jax.config.cache import CacheConfig
from deepinfer_jax.config.engine import EngineConfig, yoco_keep_tokens
from deepinfer_jax.config.eplb import EplbSettings
from deepinfer_jax.config.fields import ShardingError
from deepinfer_jax.config.model import NESTED_MODEL_TYPE, TEXT_MODEL_TYPE, LayerRole, ModelConfig, RopeScaling
from deepinfer_jax.config.sections import CacheSettings, ParallelConfig, SchedulerConfig, SpeculationConfig
from deepinfer_jax.config.sharding import ShardingPreset, resolve_preset

__all__ = ["NESTED_MODEL_TYPE", "TEXT_MODEL_TYPE", "CacheConfig", "CacheSettings", "EngineConfig", "EplbSettings",
           "LayerRole", "ModelConfig", "ParallelConfig", "RopeScaling", "SchedulerConfig", "ShardingError",
           "ShardingPreset", "SpeculationConfig", "resolve_preset", "yoco_keep_tokens"]
