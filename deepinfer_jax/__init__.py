"""deepinfer-jax: DeepSeek's DeepInfer engine for the DeepSeek-V4.1-Flash architecture, in JAX."""

from deepinfer_jax import recipe
from deepinfer_jax.checkpoint import CheckpointError, load_hf_checkpoint, load_hf_drafter, params_from_state_dict
from deepinfer_jax.config import CacheConfig, EngineConfig, ModelConfig
from deepinfer_jax.engine import CompletionOutput, RequestError, RequestOutput, SamplingParams
from deepinfer_jax.llm import LLM
from deepinfer_jax.model.deepseek_v41 import forward_full
from deepinfer_jax.model.generate import generate, generate_ragged, pad_prompts
from deepinfer_jax.params import init_params

__all__ = [
    "LLM",
    "CacheConfig",
    "CheckpointError",
    "CompletionOutput",
    "EngineConfig",
    "ModelConfig",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "forward_full",
    "generate",
    "generate_ragged",
    "init_params",
    "load_hf_checkpoint",
    "load_hf_drafter",
    "pad_prompts",
    "params_from_state_dict",
    "recipe",
]
__version__ = "0.1.0"
