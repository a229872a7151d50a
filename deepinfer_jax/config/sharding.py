"""Sharding presets: deployment layouts as configuration (docs/sharding.md, docs/engine.md §3-§4).

A **preset** (``sharding/<name>.toml`` at the top of the repository, shipped inside the wheel; see
``config.shipped``) names the mesh axes and their sizes, the attention data-parallel and expert-parallel
degrees, optional overrides of the rules table, and the EPLB settings (``config.eplb``).
``resolve_preset(name_or_path)`` loads one; ``deepinfer_jax.sharding.make_mesh(preset)`` builds its mesh.

**One rules table**, ``RULES``, maps logical axis names to mesh axes: ``batch`` -> ``dp`` (attention
DP), ``experts`` -> ``ep`` (routed experts), ``vocab``/``heads``/``mlp``/``expert_mlp`` -> ``tp``,
the cache's ``cache_slots``/``cache_blocks`` -> wherever ``batch`` goes (each DP rank's requests and
blocks live on its devices), everything else replicated. A mesh axis the mesh lacks (``tp`` in a
2-D preset) resolves to "replicated".

Plain Python (host side, no JAX): a preset is frozen, hashable data (a static jit argument). The
arrays' logical axes and the placement on a mesh live in ``deepinfer_jax.sharding``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepinfer_jax.config.eplb import EplbSettings
from deepinfer_jax.config.fields import ShardingError, int_field, no_extra, str_field, table_field
from deepinfer_jax.config.shipped import shipped

__all__ = ["MESH_AXES", "PRESET_DIR", "RULES", "ShardingError", "ShardingPreset", "available_presets",
           "resolve_preset"]

#: Where the shipped presets live: ``sharding/`` (the wheel's copy, else the checkout's).
PRESET_DIR = shipped("sharding")
#: The mesh axis names a preset may use: attention data parallel, expert parallel, tensor parallel, context
#: parallel (a long prompt's chunk split by position over ``cp``; docs/context_parallel.md).
MESH_AXES = ("dp", "ep", "tp", "cp")

#: The rules table: logical axis -> mesh axes (an empty tuple = replicated). Presets may override entries.
RULES: Mapping[str, tuple[str, ...]] = {
    "batch": ("dp",),  # sequences / request rows: attention data parallel
    "experts": ("ep",),  # routed experts (and their EPLB slots)
    "vocab": ("tp",),
    "heads": ("tp",),  # attention heads (q heads x head_dim, sinks, the O-LoRA input)
    "mlp": ("tp",),  # shared-expert intermediate
    "expert_mlp": ("tp",),  # routed-expert intermediate
    "embed": (),
    "seq": (),
    "layers": (),
    "q_lora": (),
    "o_lora": (),
    "head_dim": (),
    "index_heads": (),
    "index_dim": (),
    "router": (),  # the router's expert axis: every token scores every expert
    "hc": (),  # mHC mixing coefficients
    "engram": (),  # Engram tables, hash heads and the token map
    "cache_slots": ("dp",),  # per-request cache slots (SWA rings, compressor state, Engram look-back)
    "cache_blocks": ("dp",),  # the paged block pool
}
_FOLLOW_BATCH = ("cache_slots", "cache_blocks")  # follow ``batch`` unless a preset overrides them



@dataclass(frozen=True, kw_only=True)
class ShardingPreset:
    """A deployment layout; frozen and hashable.

    name: the preset's name. axes: mesh axis names (a subset of ``MESH_AXES``, each once).
    shape: the mesh size along each axis. dp_size / ep_size: the attention data-parallel and
    expert-parallel degrees, checked against the product of the mesh axes that ``batch`` and
    ``experts`` map to. rules: the full rules table (``RULES`` with the preset's overrides) as
    sorted ``(logical, mesh axes)`` pairs. eplb: ``EplbSettings``. description: free text.
    cp_size: context-parallel ranks (the ``cp`` mesh axis; ``[parallel] cp_size``, default 1); a CP preset
    runs nothing else in parallel (dp, ep and tp sizes 1). cp_threshold: prompts of at least this many
    tokens (still to compute) prefill as one CP chunk (``[parallel] cp_threshold``; 0 = the engine setting
    ``cp_threshold`` decides, whose default is then 2 * max_num_batched_tokens).
    """

    name: str
    axes: tuple[str, ...]
    shape: tuple[int, ...]
    dp_size: int
    ep_size: int
    rules: tuple[tuple[str, tuple[str, ...]], ...] = tuple(sorted(RULES.items()))
    eplb: EplbSettings = EplbSettings()
    description: str = ""
    cp_size: int = 1
    cp_threshold: int = 0

    def __post_init__(self) -> None:
        str_field("name", self.name)
        if not isinstance(self.axes, (list, tuple)) or not self.axes:
            raise ShardingError("mesh.axes", f"must be a non-empty list of axis names, got {self.axes!r}")
        axes = tuple(str_field(f"mesh.axes[{i}]", a) for i, a in enumerate(self.axes))
        for i, a in enumerate(axes):
            if a not in MESH_AXES:
                raise ShardingError(f"mesh.axes[{i}]", f"unknown mesh axis {a!r} (known: {', '.join(MESH_AXES)})")
        if len(set(axes)) != len(axes):
            raise ShardingError("mesh.axes", f"names an axis twice: {list(axes)}")
        if not isinstance(self.shape, (list, tuple)) or len(self.shape) != len(axes):
            raise ShardingError("mesh.shape", f"must be a list of {len(axes)} sizes (one per axis), got {self.shape!r}")
        shape = tuple(int_field(f"mesh.shape[{i}]", s, 1) for i, s in enumerate(self.shape))
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "rules", _check_rules(self.rules, axes))
        if not isinstance(self.eplb, EplbSettings):
            raise ShardingError("eplb", f"must be EplbSettings, got {self.eplb!r}")
        str_field("description", self.description)
        for field, logical in (("dp_size", "batch"), ("ep_size", "experts")):
            value = int_field(f"parallel.{field}", getattr(self, field), 1)
            object.__setattr__(self, field, value)
            implied = self.axis_size(*self.mesh_axes(logical))
            if value != implied:
                raise ShardingError(f"parallel.{field}", f"is {value} but the rules map {logical!r} to mesh axes "
                                    f"{list(self.mesh_axes(logical))} of total size {implied}")
        self._check_cp()

    def _check_cp(self) -> None:
        """``cp_size`` equals the ``cp`` axis; CP is not combined with another split on one mesh (yet)."""
        cp = int_field("parallel.cp_size", self.cp_size, 1)
        object.__setattr__(self, "cp_size", cp)
        object.__setattr__(self, "cp_threshold", int_field("parallel.cp_threshold", self.cp_threshold, 0))
        axis = self.axis_size("cp") if "cp" in self.axes else 1
        if cp != axis:
            raise ShardingError("parallel.cp_size", f"is {cp} but the mesh's cp axis has size {axis}")
        if cp > 1:
            others = {a: n for a, n in zip(self.axes, self.shape) if a != "cp" and n > 1}
            if others:
                raise ShardingError("parallel.cp_size", f"context parallelism ({cp}) cannot share a mesh with other "
                                    f"parallel axes yet, got {others}; use a preset with only the cp axis")

    # ---- queries ----

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    @property
    def dp_axes(self) -> tuple[str, ...]:
        """Mesh axes of attention data parallelism (the request batch and the cache)."""
        return self.mesh_axes("batch")

    @property
    def ep_axes(self) -> tuple[str, ...]:
        """Mesh axes of expert parallelism (the routed experts; the EP MoE's ``shard_map`` axes)."""
        return self.mesh_axes("experts")

    def axis_size(self, *axes: str) -> int:
        """Product of the sizes of the given mesh axes (1 for none)."""
        sizes = dict(zip(self.axes, self.shape))
        return math.prod(sizes[a] for a in axes)

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        """The mesh axes (present in this mesh) that a logical axis maps to; () = replicated."""
        if logical is None:
            return ()
        table = dict(self.rules)
        if logical not in table:
            raise ShardingError("rules", f"unknown logical axis {logical!r} (known: {', '.join(sorted(table))})")
        return tuple(a for a in table[logical] if a in self.axes)

    def experts_per_rank(self, cfg) -> int:
        """Physical expert slots per EP rank: logical experts / EP + the redundant slots."""
        self.validate_for(cfg)
        return cfg.n_routed_experts // self.ep_size + self.eplb.redundant_slots_per_rank

    @property
    def context_parallel(self) -> bool:
        """Whether long prompts prefill over the ``cp`` axis (``cp_size > 1``)."""
        return self.cp_size > 1

    def check_devices(self, available: int) -> None:
        """ShardingError ``parallel.cp_size`` unless the cp ranks divide the devices there are."""
        if self.cp_size > 1 and available % self.cp_size:
            raise ShardingError("parallel.cp_size", f"{self.cp_size} does not divide the {available} devices")

    @property
    def engine_expert_parallel(self) -> bool:
        """Whether the engine's step runs the shard_map EP MoE with EPLB (``ep_size > 1`` and ``eplb.enabled``)."""
        return self.ep_size > 1 and self.eplb.enabled

    def validate_engine(self) -> None:
        """ShardingError ``eplb.enabled`` if the engine cannot run its EP MoE on this layout: it runs one program
        per device, so the experts must lie on one mesh axis and no other parameter axis may be split (no tensor
        parallel; set ``eplb.enabled = false`` to leave such layouts to GSPMD)."""
        if not self.engine_expert_parallel:
            return
        if len(self.ep_axes) != 1:
            raise ShardingError("eplb.enabled", f"the engine's EP MoE needs the experts on one mesh axis, the rules "
                                f"map them to {list(self.ep_axes)}")
        params = [k for k in RULES if k not in ("batch", "experts", *_FOLLOW_BATCH)]
        split = sorted({a for k in params for a in self.mesh_axes(k)
                        if a not in self.ep_axes and self.axis_size(a) > 1})
        if split:
            raise ShardingError("eplb.enabled", f"the engine's EP MoE needs no parameter split over {split} (tensor "
                                f"parallel); set eplb.enabled = false for this preset")

    def validate_for(self, cfg) -> None:
        """ShardingError unless the model's routed experts divide evenly over the EP ranks (and, with the engine's
        EP MoE, a rank's slots do not outnumber the experts)."""
        if cfg.n_routed_experts % self.ep_size:
            raise ShardingError("parallel.ep_size", f"{self.ep_size} does not divide the model's "
                                f"n_routed_experts {cfg.n_routed_experts}")
        slots = cfg.n_routed_experts // self.ep_size + self.eplb.redundant_slots_per_rank
        if self.engine_expert_parallel and slots > cfg.n_routed_experts:
            raise ShardingError("eplb.redundant_slots_per_rank", f"{self.eplb.redundant_slots_per_rank} makes {slots} "
                                f"slots per EP rank, more than the model's {cfg.n_routed_experts} experts (a rank "
                                "would hold one expert twice)")

    def replace(self, **changes: Any) -> ShardingPreset:
        return dataclasses.replace(self, **changes)

    # ---- construction ----

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], name: str | None = None) -> ShardingPreset:
        """A preset from a parsed TOML document (see ``sharding/*.toml`` for the layout)."""
        raw = table_field("preset", raw)
        no_extra("", raw, ("name", "description", "mesh", "parallel", "rules", "eplb"))
        mesh = table_field("mesh", raw.get("mesh"))
        no_extra("mesh", mesh, ("axes", "shape"))
        for key in ("axes", "shape"):
            if key not in mesh:
                raise ShardingError(f"mesh.{key}", "is required")
        par = table_field("parallel", raw.get("parallel", {}))
        no_extra("parallel", par, ("dp_size", "ep_size", "cp_size", "cp_threshold"))
        for key in ("dp_size", "ep_size"):
            if key not in par:
                raise ShardingError(f"parallel.{key}", "is required")
        eplb = table_field("eplb", raw.get("eplb", {}))
        no_extra("eplb", eplb, [f.name for f in dataclasses.fields(EplbSettings)])
        overrides = table_field("rules", raw.get("rules", {}))
        rules = dict(RULES)
        for logical, value in overrides.items():
            if logical not in RULES:
                raise ShardingError(f"rules.{logical}", f"unknown logical axis (known: {', '.join(RULES)})")
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, (list, tuple)):
                raise ShardingError(f"rules.{logical}", f"must be a mesh axis name or a list of them, got {value!r}")
            rules[logical] = tuple(str_field(f"rules.{logical}[{i}]", v) for i, v in enumerate(value))
        for logical in _FOLLOW_BATCH:
            if logical not in overrides:
                rules[logical] = rules["batch"]
        return cls(name=str_field("name", raw.get("name", name or "custom")), axes=tuple(mesh["axes"]),
                   shape=tuple(mesh["shape"]) if isinstance(mesh["shape"], (list, tuple)) else mesh["shape"],
                   dp_size=par["dp_size"], ep_size=par["ep_size"], rules=tuple(sorted(rules.items())),
                   eplb=EplbSettings(**eplb), description=str_field("description", raw.get("description", "")),
                   cp_size=par.get("cp_size", 1), cp_threshold=par.get("cp_threshold", 0))

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> ShardingPreset:
        path = Path(path)
        try:
            raw = tomllib.loads(path.read_text())
        except OSError as e:
            raise ShardingError("preset", f"cannot read {path}: {e}") from e
        except tomllib.TOMLDecodeError as e:
            raise ShardingError("preset", f"{path} is not valid TOML: {e}") from e
        return cls.from_dict(raw, name=path.stem)


def _check_rules(rules: Any, axes: tuple[str, ...]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    table = dict(rules)
    missing = sorted(set(RULES) - set(table))
    if missing:
        raise ShardingError(f"rules.{missing[0]}", "is missing from the rules table")
    for logical, mesh_axes in table.items():
        if logical not in RULES:
            raise ShardingError(f"rules.{logical}", f"unknown logical axis (known: {', '.join(RULES)})")
        for a in mesh_axes:
            if a not in MESH_AXES:
                raise ShardingError(f"rules.{logical}", f"unknown mesh axis {a!r} (known: {', '.join(MESH_AXES)})")
        if len(set(mesh_axes)) != len(mesh_axes):
            raise ShardingError(f"rules.{logical}", f"names a mesh axis twice: {list(mesh_axes)}")
    return tuple(sorted((k, tuple(v)) for k, v in table.items()))


def available_presets() -> tuple[str, ...]:
    """Names of the shipped presets."""
    return tuple(sorted(p.stem for p in PRESET_DIR.glob("*.toml")))


def resolve_preset(preset: str | os.PathLike[str] | ShardingPreset) -> ShardingPreset:
    """A ``ShardingPreset`` from a shipped preset name, a path to a ``.toml`` file, or a preset (returned as is)."""
    if isinstance(preset, ShardingPreset):
        return preset
    if not isinstance(preset, (str, os.PathLike)):
        raise ShardingError("sharding", f"must be a preset name, a .toml path or a ShardingPreset, got {preset!r}")
    text = os.fspath(preset)
    if text.endswith(".toml") or os.sep in text:
        return ShardingPreset.from_toml(text)
    path = PRESET_DIR / f"{text}.toml"
    if not path.is_file():
        raise ShardingError("sharding", f"unknown preset {text!r} (shipped: {', '.join(available_presets())})")
    return ShardingPreset.from_toml(path)
