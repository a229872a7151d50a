"""Frozen, validated configuration dataclasses, one module per concern."""

from deepinfer_jax.config.cache import CacheConfig
from deepinfer_jax.config.engine import EngineConfig, yoco_keep_tokens
from deepinfer_jax.config.model import NESTED_MODEL_TYPE, TEXT_MODEL_TYPE, LayerRole, ModelConfig, RopeScaling

__all__ = ["NESTED_MODEL_TYPE", "TEXT_MODEL_TYPE", "CacheConfig", "EngineConfig", "LayerRole", "ModelConfig", "RopeScaling", "yoco_keep_tokens"]
