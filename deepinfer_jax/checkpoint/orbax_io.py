"""Save / restore a parameter tree with orbax-checkpoint, the config stored next to it.

Layout of a saved directory::

    <path>/config.json   cfg.to_hf_config()  (read back with ModelConfig.from_hf_config)
    <path>/params/       orbax PyTree checkpoint of the tree

Orbax wants string dict keys, so integer keys (layer indices) are written as their decimal
string and every all-digit key is turned back into an int on restore (the tree contract has
no all-digit string keys). Leaves come back as numpy arrays with their saved dtype.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from deepinfer_jax.config import ModelConfig

CONFIG_FILE = "config.json"
PARAMS_DIR = "params"


def _to_str_keys(tree: Any, where: str = "") -> Any:
    if isinstance(tree, Mapping):
        out = {}
        for k, v in tree.items():
            if not isinstance(k, (int, str)) or isinstance(k, bool):
                raise TypeError(f"tree key {k!r} at {where or '<root>'} must be an int or a str")
            if isinstance(k, str) and k.isdigit():
                raise ValueError(f"tree key {k!r} at {where or '<root>'} is an all-digit string; use an int")
            out[str(k)] = _to_str_keys(v, f"{where}.{k}" if where else str(k))
        return out
    return np.asarray(tree)


def _from_str_keys(tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {(int(k) if k.isdigit() else k): _from_str_keys(v) for k, v in tree.items()}
    return np.asarray(tree)


def _map_leaves(tree: Any, fn) -> Any:
    if isinstance(tree, Mapping):
        return {k: _map_leaves(v, fn) for k, v in tree.items()}
    return fn(tree)


def save_tree(path: str | os.PathLike, tree: Mapping, cfg: ModelConfig, *, overwrite: bool = False) -> Path:
    """Write ``tree`` (nested dict of numpy arrays, int or str keys) and ``cfg`` under ``path``."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    params = path / PARAMS_DIR
    if params.exists() and not overwrite:
        raise FileExistsError(f"{params} already exists (pass overwrite=True to replace it)")
    path.mkdir(parents=True, exist_ok=True)
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(params, _to_str_keys(tree), force=overwrite)
    (path / CONFIG_FILE).write_text(json.dumps(cfg.to_hf_config(), indent=2) + "\n", encoding="utf-8")
    return path


def restore_tree(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """Read back ``(cfg, tree)`` written by :func:`save_tree`; leaves are numpy arrays."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    cfg_file, params = path / CONFIG_FILE, path / PARAMS_DIR
    if not cfg_file.is_file() or not params.is_dir():
        raise FileNotFoundError(f"{path}: expected {CONFIG_FILE} and {PARAMS_DIR}/ written by save_tree")
    cfg = ModelConfig.from_hf_config(json.loads(cfg_file.read_text(encoding="utf-8")))
    with ocp.PyTreeCheckpointer() as ckptr:
        meta = ckptr.metadata(params)
        structure = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
        restore_args = _map_leaves(structure, lambda _: ocp.RestoreArgs(restore_type=np.ndarray))
        tree = ckptr.restore(params, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    return cfg, _from_str_keys(tree)
