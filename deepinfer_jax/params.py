"""Parameter states for a config: the bridge between checkpoint data and the model's state.

The model's state carries one derived, non-checkpoint array: the Engram compressed-id map, which
for the real vocabulary comes from the tokenizer (host data). These wrappers attach it, so that
``init_params`` and the loaders always return a state ready for ``forward_full``.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from deepinfer_jax.checkpoint.residency import StoredTensor
from deepinfer_jax.engram_vocab import default_token_map
from deepinfer_jax.model import deepseek_v41 as _model
from deepinfer_jax.model.host_arrays import to_device
from deepinfer_jax.model.qweight import QWeight, validate


def engram_token_map(cfg, token_map: np.ndarray | None = None) -> np.ndarray | None:
    """``token_map`` if given, else the config's default (identity or the DeepSeek tokenizer's map)."""
    if not cfg.engram_layer_ids:
        return None
    if token_map is None:
        return default_token_map(cfg)
    token_map = np.asarray(token_map)
    bad_range = token_map.min() < 0 or token_map.max() >= cfg.engram_compressed_vocab_size
    if token_map.shape != (cfg.vocab_size,) or bad_range:
        raise ValueError(f"token_map must have shape ({cfg.vocab_size},) with ids in "
                         f"[0, {cfg.engram_compressed_vocab_size}) (engram_compressed_vocab_size)")
    return token_map


def init_params(cfg, seed: int = 0, token_map: np.ndarray | None = None):
    """Seeded random parameters for ``cfg`` (an ``nnx.State``), with the Engram map attached."""
    return _model.init_params(cfg, seed, token_map=engram_token_map(cfg, token_map))


def params_from_tree(cfg, tree: Mapping, token_map: np.ndarray | None = None, dtype=None):
    """The parameter state from a nested dict laid out like the checkpoint names (experts stacked).

    ``StoredTensor`` leaves (``weights="quantized"``) become device ``QWeight`` leaves, resident in their
    storage format."""
    kwargs = {} if dtype is None else {"dtype": dtype}
    return _model.params_from_tree(cfg, to_device_weights(tree), token_map=engram_token_map(cfg, token_map), **kwargs)


def to_device_weights(tree):
    """``tree`` with every host ``StoredTensor`` replaced by a validated device ``QWeight``."""
    if isinstance(tree, StoredTensor):
        # FP8 bytes travel as uint8: XLA:CPU would otherwise convert the whole f8 array to f16 ahead of any loop
        data = tree.data.view(np.uint8) if tree.kind != "bf16" else tree.data
        return validate(QWeight(to_device(data), None if tree.scale is None else to_device(tree.scale),
                                tree.kind, tree.block, tree.shape))
    if isinstance(tree, Mapping):
        return {k: to_device_weights(v) for k, v in tree.items()}
    return tree


def resident_bytes(params) -> int:
    """Bytes the parameter state holds (storage bytes for quantized leaves), Engram token map excluded."""
    import jax

    state = dict(params) if isinstance(params, Mapping) else params
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if "engram_token_map" in jax.tree_util.keystr(path):
            continue
        total += int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
    return total
