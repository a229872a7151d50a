"""Parameter tree -> a Hugging Face-layout checkpoint in the released storage formats.

The inverse of :func:`~deepinfer_jax.checkpoint.loader.tensors_to_tree`, for test checkpoints
and the small shipped checkpoint: dense projections become FP8 E4M3 with UE8M0 32x32 block
scales, routed experts packed FP4 E2M1 with per-row/32-column scales, Engram tables FP8 with
per-row/32-column scales, other weights BF16 and the FP32 families FP32 (model.md §7).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np

from deepinfer_jax.checkpoint import names as N
from deepinfer_jax.checkpoint import quant_formats as Q
from deepinfer_jax.checkpoint.safetensors_io import save_sharded
from deepinfer_jax.config import ModelConfig


def _leaf(tree: Mapping, path: tuple, name: str) -> np.ndarray:
    node = tree
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(f"tree has no leaf for {name} (path {path})")
        node = node[part]
    return np.asarray(node)


def tree_to_hf_tensors(
    cfg: ModelConfig,
    tree: Mapping,
    *,
    quantize: bool = True,
    plain_dtype=ml_dtypes.bfloat16,
    block: Sequence[int] = (32, 32),
    group: int = 32,
    drafter: bool = False,
) -> dict[str, np.ndarray]:
    """DeepSeek-native tensors (weights and ``.scale`` partners) for every expected name.

    ``quantize=False`` stores every non-FP32 tensor in ``plain_dtype`` without scales.
    ``drafter``: the DSpark drafter's ``mtp.*`` tensors from its tree (``{"mtp": ...}``) instead.
    """
    out: dict[str, np.ndarray] = {}
    expected = N.expected_drafter_tensors(cfg) if drafter else N.expected_tensors(cfg)
    for name, (shape, kind) in expected.items():
        path, expert = N.native_to_path(name)
        value = _leaf(tree, path, name)
        if expert is not None:
            value = value[expert]
        value = np.asarray(value, dtype=np.float32)
        if value.shape != shape:
            raise ValueError(f"{name}: tree leaf has shape {value.shape}, expected {shape}")
        scale_name = N.scale_partner(name)
        if kind is N.TensorKind.FP32:
            out[name] = value.copy()
        elif not quantize or kind is N.TensorKind.PLAIN:
            out[name] = value.astype(plain_dtype)
        elif kind is N.TensorKind.FP8_BLOCK:
            out[name], out[scale_name] = Q.encode_fp8_blockwise(value, block)
        elif kind is N.TensorKind.FP8_ROW:
            out[name], out[scale_name] = Q.encode_fp8_rowwise(value, group)
        elif kind is N.TensorKind.FP4_EXPERT and value.shape[1] % 2 == 0:
            out[name], out[scale_name] = Q.encode_fp4_packed(value, group)
        else:
            out[name] = value.astype(plain_dtype)
    return out


def save_hf_checkpoint(
    directory: str | os.PathLike,
    cfg: ModelConfig,
    tree: Mapping,
    *,
    quantize: bool = True,
    max_shard_bytes: int = 5 * 1024**3,
    extra_tensors: Mapping[str, np.ndarray] | None = None,
    plain_dtype=ml_dtypes.bfloat16,
) -> list[Path]:
    """Write ``config.json`` (``cfg.to_hf_config()``) and sharded safetensors for ``tree``.

    ``extra_tensors`` (e.g. ``mtp.*``) are written after the backbone tensors.
    Returns the files written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = tree_to_hf_tensors(cfg, tree, quantize=quantize, plain_dtype=plain_dtype)
    if extra_tensors:
        tensors.update(extra_tensors)
    config = cfg.to_hf_config()
    if not quantize:
        config.pop("quantization_config", None)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return [directory / "config.json"] + save_sharded(directory, tensors, max_shard_bytes)
