"""Checkpoint tensors -> the nested parameter tree of the backbone (host code, numpy only).

``tensors_to_tree`` takes any ``Mapping[name, np.ndarray]`` of DeepSeek-native tensors (an
in-memory dict or the lazy :class:`~deepinfer_jax.checkpoint.safetensors_io.CheckpointReader`),
checks it against :func:`~deepinfer_jax.checkpoint.names.expected_tensors` from shapes alone,
raises ONE :class:`CheckpointError` listing every problem, then decodes tensor by tensor:
quantised weights are paired with their ``.scale`` partner and decoded
(:func:`~deepinfer_jax.checkpoint.quant_formats.decode_weight`), routed experts are stacked
into ``[E, out, in]`` leaves. The tree is a nested dict keyed by name parts (ints for layer
indices) with numpy leaves in ``[out, in]`` layout.

Skipped (never loaded, never an error): ``vision.*``, ``aligner.*``, ``mtp.*``,
``image_{start,end,newline,pad}`` and layers at or past ``num_hidden_layers`` (a truncated
prefix of a deeper checkpoint).

The DSpark drafter (``mtp.*``, model.md §4.9) is read separately with ``drafter=True`` (every
other name skipped) by :func:`drafter_tensors_to_tree` / :func:`load_hf_drafter_tree`: from
``drafter.safetensors`` next to the backbone when present, else from the checkpoint's own ``mtp.*``
tensors; a checkpoint without them has no drafter (``None``), never an error.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from tqdm import tqdm

from deepinfer_jax.checkpoint import names as N
from deepinfer_jax.checkpoint import quant_formats as Q
from deepinfer_jax.checkpoint.residency import BF16_RESIDENT, StoredTensor, WeightsError
from deepinfer_jax.checkpoint.safetensors_io import open_checkpoint
from deepinfer_jax.config import ModelConfig

Tree = dict[Any, Any]

_LAYER_RE = re.compile(r"^layers\.(\d+)\.")
_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


class CheckpointError(ValueError):
    """The checkpoint does not match the config.

    ``missing``: expected names absent; ``misshaped``: names present with a wrong (decoded)
    shape, dtype or scale (``reasons[name]`` says what); ``unknown``: names that are neither
    expected, nor a scale partner, nor skipped. The message lists them all.
    """

    def __init__(
        self,
        missing: list[str] | None = None,
        misshaped: list[str] | None = None,
        unknown: list[str] | None = None,
        reasons: Mapping[str, str] | None = None,
        source: str | None = None,
    ):
        self.missing = list(missing or [])
        self.misshaped = list(misshaped or [])
        self.unknown = list(unknown or [])
        self.reasons = dict(reasons or {})
        self.source = source
        lines = [f"checkpoint{f' {source}' if source else ''} does not match the config:"]
        if self.missing:
            lines.append(f"{len(self.missing)} missing:")
            lines += [f"  {n}" for n in self.missing]
        if self.misshaped:
            lines.append(f"{len(self.misshaped)} misshaped:")
            lines += [f"  {n}: {self.reasons.get(n, 'wrong shape')}" for n in self.misshaped]
        if self.unknown:
            lines.append(f"{len(self.unknown)} unknown:")
            lines += [f"  {n}" for n in self.unknown]
        super().__init__("\n".join(lines))


@dataclass
class CheckpointPlan:
    """How each name of a checkpoint is used, from shapes and dtypes only (no data read).

    ``load``: expected name -> its scale partner name (or None); ``skipped``, ``scales``: names
    not loaded as leaves; ``missing`` / ``misshaped`` / ``unknown`` / ``reasons``: problems.
    """

    expected: dict[str, tuple[tuple[int, ...], N.TensorKind]]
    load: dict[str, str | None] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    scales: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    misshaped: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.misshaped or self.unknown)

    def error(self, source: str | None = None) -> CheckpointError:
        return CheckpointError(self.missing, self.misshaped, self.unknown, self.reasons, source)


def resolve_dtype(dtype) -> np.dtype:
    """``np.float32`` / ``"bfloat16"`` / ``ml_dtypes.bfloat16`` ... -> a floating numpy dtype."""
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        return _DTYPES[dtype]
    dt = np.dtype(dtype)
    if dt not in _DTYPES.values():
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dt}")
    return dt


def _meta(tensors: Mapping[str, np.ndarray], name: str) -> tuple[np.dtype, tuple[int, ...]]:
    info = getattr(tensors, "info", None)
    if callable(info):
        i = info(name)
        return np.dtype(i.dtype), tuple(i.shape)
    arr = np.asarray(tensors[name])
    return arr.dtype, tuple(arr.shape)


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or dtype == np.dtype(ml_dtypes.bfloat16)


def _beyond_backbone(name: str, cfg: ModelConfig) -> bool:
    m = _LAYER_RE.match(name)
    return m is not None and int(m.group(1)) >= cfg.num_hidden_layers


def plan_checkpoint(cfg: ModelConfig, tensors: Mapping[str, np.ndarray], *, drafter: bool = False) -> CheckpointPlan:
    """Classify every name of ``tensors`` and validate shapes, dtypes and scale pairs.

    ``drafter``: plan the DSpark drafter's ``mtp.*`` tensors instead of the backbone (others skipped).
    """
    expected = N.expected_drafter_tensors(cfg) if drafter else N.expected_tensors(cfg)
    plan = CheckpointPlan(expected)
    present = set(tensors.keys())

    def bad(name: str, reason: str) -> None:
        plan.misshaped.append(name)
        plan.reasons[name] = reason

    for name in tensors.keys():
        if name in expected:
            continue
        if (not N.is_drafter(name)) if drafter else (N.is_skipped(name) or _beyond_backbone(name, cfg)):
            plan.skipped.append(name)
        elif N.weight_of_scale(name) in expected:
            weight = N.weight_of_scale(name)
            if weight in present:
                plan.scales.append(name)
        else:
            plan.unknown.append(name)

    for name, (shape, _kind) in expected.items():
        if name not in present:
            plan.missing.append(name)
            continue
        dtype, stored = _meta(tensors, name)
        partner = N.scale_partner(name)
        if partner is not None and partner in present:
            sdtype, sshape = _meta(tensors, partner)
            if not (_is_float(sdtype) or sdtype == np.dtype(np.uint8) or sdtype == Q.E8M0):
                bad(name, f"scale {partner} has dtype {sdtype} (expected float8_e8m0fnu)")
                continue
            try:
                got = Q.decoded_shape(stored, dtype, sshape)
            except Q.QuantFormatError as e:
                bad(name, f"{e} (stored {dtype} {stored}, scale {partner} {sshape})")
                continue
            if got != shape:
                bad(name, f"expected {shape}, got {got} after decoding stored {dtype} {stored} "
                          f"with scale {sshape}")
            plan.load[name] = partner
            continue
        if Q.is_quantized_dtype(dtype):
            bad(name, f"stored as {dtype} but its scale partner {partner or '(none)'} is absent")
        elif not _is_float(dtype):
            bad(name, f"non-floating dtype {dtype}")
        elif stored != shape:
            bad(name, f"expected {shape}, got {stored}")
        else:
            plan.load[name] = None
    return plan


def _set(tree: Tree, path: tuple, value: Any) -> None:
    node = tree
    for part in path[:-1]:
        node = node.setdefault(part, {})
    node[path[-1]] = value


def _get(tree: Tree, path: tuple) -> Any:
    node = tree
    for part in path:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return None
    return node


def tensors_to_tree(
    cfg: ModelConfig,
    tensors: Mapping[str, np.ndarray],
    dtype=np.float32,
    *,
    progress: bool = False,
    source: str | None = None,
    drafter: bool = False,
    quantized: bool = False,
) -> Tree:
    """Decode checkpoint ``tensors`` into the backbone parameter tree (``drafter``: the ``mtp.*`` tree).

    Leaves are ``dtype`` (float32 / bfloat16 / float16) except mHC mixers, attention sinks and
    router biases (:attr:`TensorKind.FP32`), which stay float32. Every leaf is a fresh array
    (no view into ``tensors``). Raises :class:`CheckpointError` (all problems at once) before
    any data is decoded when the names, shapes or scale pairs do not match ``cfg``.

    ``quantized`` (``weights="quantized"``, ``checkpoint.residency``): every tensor with a UE8M0 scale
    partner stays in its storage format as a :class:`~deepinfer_jax.checkpoint.residency.StoredTensor`
    (routed experts stacked to ``[E, out, in]`` storage), and BF16 ``embed``/``head`` stay BF16; the
    other leaves are float32.
    """
    out_dtype = np.dtype(np.float32) if quantized else resolve_dtype(dtype)
    plan = plan_checkpoint(cfg, tensors, drafter=drafter)
    if not plan.ok:
        raise plan.error(source)
    tree: Tree = {}
    E = cfg.dspark_n_routed_experts if drafter else cfg.n_routed_experts
    items = list(plan.load.items())
    for name, partner in tqdm(items, desc="loading tensors", unit="tensor", disable=not progress):
        shape, kind = plan.expected[name]
        leaf_dtype = np.dtype(np.float32) if kind is N.TensorKind.FP32 else out_dtype
        value = stored_tensor(name, tensors, partner, shape) if quantized else None
        if value is not None:
            pass
        elif partner is None:
            value = np.array(tensors[name], dtype=leaf_dtype, copy=True)
        else:
            value = Q.decode_weight(tensors[name], tensors[partner], dtype=leaf_dtype, field=name)
        path, expert = N.native_to_path(name)
        if expert is None:
            _set(tree, path, value)
            continue
        stacked = _get(tree, path)
        if stacked is None:
            stacked = _empty_stack(value, E, shape, leaf_dtype)
            _set(tree, path, stacked)
        if isinstance(stacked, StoredTensor) != isinstance(value, StoredTensor):
            raise WeightsError(f"{name}: the experts of one projection mix quantized and plain storage; "
                               f"load this checkpoint with weights='float32'")
        if isinstance(stacked, StoredTensor):
            stacked.data[expert], stacked.scale[expert] = value.data, value.scale
        else:
            stacked[expert] = value
    return tree


def _empty_stack(value, n: int, shape: tuple[int, ...], dtype) -> Any:
    if not isinstance(value, StoredTensor):
        return np.zeros((n,) + shape, dtype=dtype)
    return StoredTensor(np.zeros((n,) + value.data.shape, value.data.dtype),
                        np.zeros((n,) + value.scale.shape, np.uint8), value.kind, value.block, (n,) + shape)


def stored_tensor(name: str, tensors: Mapping[str, np.ndarray], partner: str | None,
                  shape: tuple[int, ...]) -> StoredTensor | None:
    """``name`` as a :class:`StoredTensor` for quantized residency, or ``None`` when it is decoded to float
    (no scale partner and not a BF16 embed/head; a floating scale, which has no UE8M0 bytes)."""
    if partner is None:
        if name in BF16_RESIDENT and np.dtype(tensors[name].dtype) == np.dtype(ml_dtypes.bfloat16):
            return StoredTensor(np.array(tensors[name], copy=True), None, "bf16", (1, 1), shape)
        return None
    scale = np.asarray(tensors[partner])
    if scale.dtype == Q.E8M0:
        scale = scale.view(np.uint8)
    elif scale.dtype != np.uint8:
        return None
    data = np.array(tensors[name], copy=True)
    kind = "fp8" if data.dtype == Q.E4M3 else "fp4"
    if kind == "fp4":
        data = data.view(np.uint8)
    block = Q.infer_block(shape, scale.shape, field=name)
    return StoredTensor(data, np.array(scale, copy=True), kind, block, tuple(shape))


def read_hf_config(path: str | os.PathLike) -> ModelConfig:
    """``ModelConfig`` from ``<path>/config.json``."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: checkpoint directory has no config.json")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: config.json is not valid JSON: {e}") from None
    return ModelConfig.from_hf_config(raw)


def _check_weights_present(path: str | os.PathLike) -> None:
    """A directory without a backbone weights file is a ``FileNotFoundError`` saying so (rather than a
    ``CheckpointError`` listing every tensor as missing); ``drafter.safetensors`` alone does not count."""
    d = Path(path)
    if not d.is_dir() or (d / "model.safetensors.index.json").is_file():
        return
    weights = [f.name for f in d.glob("*.safetensors") if f.name != DRAFTER_FILE]
    if not weights:
        found = ", ".join(sorted(f.name for f in d.iterdir())[:8]) or "nothing"
        raise FileNotFoundError(f"{d}: no weights file (model.safetensors, model.safetensors.index.json or "
                                f"*.safetensors shards) in the checkpoint directory; found {found}")


def load_hf_checkpoint_tree(
    path: str | os.PathLike, dtype=np.float32, progress: bool = True, quantized: bool = False
) -> tuple[ModelConfig, Tree]:
    """Read ``config.json`` and the safetensors of a Hugging Face checkpoint directory.

    Tensors are memory-mapped and decoded one at a time (peak host memory ~ the tree plus
    one decoded tensor); ``progress`` shows a tqdm bar over tensors. ``quantized``: keep the
    storage formats (see :func:`tensors_to_tree`).
    """
    cfg = read_hf_config(path)
    _check_weights_present(path)
    with open_checkpoint(path) as reader:
        tree = tensors_to_tree(cfg, reader, dtype, progress=progress, source=str(path), quantized=quantized)
    return cfg, tree


def is_quantized_checkpoint(tensors: Mapping[str, np.ndarray]) -> bool:
    """True when any tensor has a ``.scale`` partner (the checkpoint stores FP8/FP4 weights)."""
    return any(name.endswith(N.SCALE_SUFFIX) for name in tensors)


def checkpoint_is_quantized(path: str | os.PathLike) -> bool:
    """:func:`is_quantized_checkpoint` of a checkpoint directory (headers only)."""
    with open_checkpoint(path) as reader:
        return is_quantized_checkpoint(reader)


DRAFTER_FILE = "drafter.safetensors"


def has_drafter(tensors: Mapping[str, np.ndarray]) -> bool:
    """True when ``tensors`` holds any ``mtp.*`` (DSpark drafter) tensor."""
    return any(N.is_drafter(name) for name in tensors)


def drafter_tensors_to_tree(
    cfg: ModelConfig, tensors: Mapping[str, np.ndarray], dtype=np.float32, *, source: str | None = None
) -> Tree | None:
    """The DSpark drafter's parameter tree (``{"mtp": {0: ..., 1: ...}}``) from the ``mtp.*`` names of
    ``tensors``, or ``None`` when there are none. A partial or misshaped set raises ``CheckpointError``;
    a config without DSpark stages (``num_nextn_predict_layers`` 0) with ``mtp.*`` tensors too.
    """
    if not has_drafter(tensors):
        return None
    return tensors_to_tree(cfg, tensors, dtype, source=source, drafter=True)


def load_hf_drafter_tree(path: str | os.PathLike, cfg: ModelConfig | None = None, dtype=np.float32) -> Tree | None:
    """The drafter tree of a checkpoint directory: ``drafter.safetensors`` if present, else the
    checkpoint's own ``mtp.*`` tensors; ``None`` when it has neither."""
    cfg = cfg if cfg is not None else read_hf_config(path)
    file = Path(path) / DRAFTER_FILE
    with open_checkpoint(file if file.is_file() else path) as reader:
        return drafter_tensors_to_tree(cfg, reader, dtype, source=str(file if file.is_file() else path))
