"""Checkpoints: DeepSeek-native Hugging Face directories in, the model's parameter state out.

``params_from_state_dict`` and ``load_hf_checkpoint`` return the ``nnx.State`` that
``forward_full`` takes; the tree-level functions they build on (``tensors_to_tree``,
``load_hf_checkpoint_tree``) work on plain nested dicts of numpy arrays and never import the model,
so the CLI (``python -m deepinfer_jax.checkpoint``) stays light.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from deepinfer_jax.checkpoint.loader import (
    CheckpointError,
    checkpoint_is_quantized,
    drafter_tensors_to_tree,
    is_quantized_checkpoint,
    load_hf_checkpoint_tree,
    load_hf_drafter_tree,
    tensors_to_tree,
)
from deepinfer_jax.checkpoint.residency import WeightsError, resolve_weights

__all__ = ["CheckpointError", "WeightsError", "drafter_params_from_state_dict", "load_hf_checkpoint", "load_hf_drafter",
           "load_params", "params_from_state_dict", "save_params"]


def _residency(weights, dtype, quantized_checkpoint) -> tuple[bool, str]:
    """(keep storage formats?, float dtype) for a ``weights`` setting (None: decode to ``dtype``)."""
    if weights is None:
        return False, dtype
    mode = resolve_weights(weights, quantized_checkpoint)
    return mode == "quantized", "float32" if mode == "quantized" else mode


def params_from_state_dict(cfg, tensors: Mapping[str, np.ndarray], dtype="float32", token_map=None, weights=None):
    """The model's parameter state from DeepSeek-native tensors (FP8/FP4 decoded, experts stacked).

    ``weights`` (``checkpoint.residency``): ``"quantized"`` keeps the storage formats resident,
    ``"float32"`` / ``"bfloat16"`` decode, ``"auto"`` = quantized when the tensors have scales; None
    decodes to ``dtype``. Missing, misshaped or unknown tensors raise one ``CheckpointError`` listing them all.
    """
    from deepinfer_jax.params import params_from_tree

    quantized, dtype = _residency(weights, dtype, is_quantized_checkpoint(tensors))
    tree = tensors_to_tree(cfg, tensors, dtype=np.float32, quantized=quantized)
    return params_from_tree(cfg, tree, token_map=token_map, dtype=_jnp_dtype(dtype))


def load_hf_checkpoint(path: str | Path, dtype="float32", progress: bool = True, token_map=None, weights=None):
    """``(ModelConfig, params)`` from a Hugging Face-format directory (config.json + safetensors).

    Tensors are read lazily, one at a time, with a progress bar. ``weights`` as in
    :func:`params_from_state_dict` (``LLM`` passes ``"auto"``: quantized residency for FP8/FP4 checkpoints).
    """
    from deepinfer_jax.params import params_from_tree

    quantized, dtype = _residency(weights, dtype, weights is not None and checkpoint_is_quantized(path))
    cfg, tree = load_hf_checkpoint_tree(path, dtype=np.float32, progress=progress, quantized=quantized)
    return cfg, params_from_tree(cfg, tree, token_map=token_map, dtype=_jnp_dtype(dtype))


def drafter_params_from_state_dict(cfg, tensors: Mapping[str, np.ndarray], dtype="float32"):
    """The DSpark drafter's state (``deepinfer_jax.model.dspark``) from the ``mtp.*`` tensors, or ``None``
    when there are none. A partial or misshaped set raises ``CheckpointError``."""
    tree = drafter_tensors_to_tree(cfg, tensors)
    return None if tree is None else _drafter_state(cfg, tree, dtype)


def load_hf_drafter(path: str | Path, cfg=None, dtype="float32"):
    """The DSpark drafter of a checkpoint directory (``drafter.safetensors``, else its ``mtp.*`` tensors)
    as a state for ``deepinfer_jax.model.dspark``, or ``None`` when it has no drafter."""
    tree = load_hf_drafter_tree(path, cfg)
    if tree is None:
        return None
    from deepinfer_jax.checkpoint.loader import read_hf_config

    return _drafter_state(cfg if cfg is not None else read_hf_config(path), tree, dtype)


def _drafter_state(cfg, tree, dtype):
    from deepinfer_jax.model.dspark import drafter_params_from_tree

    return drafter_params_from_tree(cfg, tree, dtype=_jnp_dtype(dtype))


def save_params(path: str | Path, cfg, params) -> None:
    """Save converted parameters with orbax (plus config.json) for fast restores."""
    from flax import nnx

    from deepinfer_jax.checkpoint.orbax_io import save_tree

    tree = nnx.to_pure_dict(params)
    tree.pop("engram_token_map", None)
    save_tree(path, _to_numpy(tree), cfg)


def load_params(path: str | Path, dtype="float32", token_map=None):
    """``(ModelConfig, params)`` restored from a directory written by ``save_params`` or the CLI."""
    from deepinfer_jax.checkpoint.orbax_io import restore_tree
    from deepinfer_jax.params import params_from_tree

    cfg, tree = restore_tree(path)
    return cfg, params_from_tree(cfg, tree, token_map=token_map, dtype=_jnp_dtype(dtype))


def _to_numpy(tree):
    return {k: _to_numpy(v) if isinstance(v, Mapping) else np.asarray(v) for k, v in tree.items()}


def _jnp_dtype(dtype):
    import jax.numpy as jnp

    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}.get(dtype, dtype) if isinstance(dtype, str) else dtype
