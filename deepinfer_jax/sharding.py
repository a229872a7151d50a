"""Arrays on a device mesh: the logical axes of every parameter and cache array, meshes from presets,
placement, the sharded forward, multi-host start.

The presets themselves are configuration (``deepinfer_jax.config.sharding``: ``ShardingPreset``,
``RULES``, ``resolve_preset``; ``config.eplb``: ``EplbSettings``) and are re-exported here.
``make_mesh(preset)`` builds the preset's ``jax.sharding.Mesh`` (Auto axes, so GSPMD propagates).

``PARAM_AXES`` gives every parameter of ``deepinfer_jax.model`` its logical axes (the ``nnx.State``
path with the layer index written ``*``; the DSpark drafter's ``mtp.S`` stages too), ``CACHE_AXES``
every array of ``model.kv_cache.init_cache``; the preset's rules table maps them to mesh axes. An
unknown path is an error, never a silent replication.

Production presets put every device on both parallel axes (DeepInfer's "EP8 DP8" is 8 devices,
each one an attention DP rank and an EP rank): mesh ``dp=1, ep=N`` with ``batch = ["dp", "ep"]``.
The CPU test presets (``cpu-dp2-ep4`` ...) keep ``batch`` on ``dp`` only, so a DP rank spans the
``ep`` devices of its row.

Multi-host: ``init_distributed()`` starts ``jax.distributed`` from arguments or the environment
variables ``DEEPINFER_COORDINATOR`` (``host:port``), ``DEEPINFER_NUM_PROCESSES`` and
``DEEPINFER_PROCESS_ID`` (a no-op when none is set); ``make_mesh`` then spans every process's devices.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from deepinfer_jax.config.eplb import DISPATCHES, EplbSettings
from deepinfer_jax.config.fields import ShardingError, int_field, str_field
from deepinfer_jax.config.sharding import (
    MESH_AXES,
    PRESET_DIR,
    RULES,
    ShardingPreset,
    available_presets,
    resolve_preset,
)
from deepinfer_jax.parallel.mesh import auto_mesh, put_global

__all__ = [
    "CACHE_AXES", "DISPATCHES", "MESH_AXES", "PARAM_AXES", "PRESET_DIR", "RULES", "EplbSettings", "ShardingError",
    "ShardingPreset", "available_presets", "cache_shardings", "gather_to_host", "init_distributed", "logical_spec",
    "make_mesh", "param_shardings", "place", "resolve_preset", "shard_cache", "shard_params", "sharded_forward_full",
]


#: Logical axes of every parameter, by ``nnx.State`` path with the layer index written ``*``.
PARAM_AXES: Mapping[str, tuple[str | None, ...]] = {
    "embed.weight": ("vocab", "embed"),
    "head.weight": ("vocab", "embed"),
    "norm.weight": ("embed",),
    "engram_token_map": ("engram",),
    "layers.*.attn_norm.weight": ("embed",),
    "layers.*.ffn_norm.weight": ("embed",),
    **{f"layers.*.hc_{site}_{leaf}": axes for site in ("attn", "ffn")
       for leaf, axes in (("fn", ("hc", "embed")), ("base", ("hc",)), ("scale", ("hc",)))},
    "layers.*.attn.wq_a.weight": ("q_lora", "embed"),
    "layers.*.attn.q_norm.weight": ("q_lora",),
    "layers.*.attn.wq_b.weight": ("heads", "q_lora"),
    "layers.*.attn.wkv.weight": ("head_dim", "embed"),
    "layers.*.attn.kv_norm.weight": ("head_dim",),
    "layers.*.attn.wo_a.weight": ("o_lora", "heads"),
    "layers.*.attn.wo_b.weight": ("embed", "o_lora"),
    "layers.*.attn.attn_sink": ("heads",),
    "layers.*.attn.compressor.wkv.weight": ("head_dim", "embed"),
    "layers.*.attn.compressor.wgate.weight": ("head_dim", "embed"),
    "layers.*.attn.compressor.norm.weight": ("head_dim",),
    "layers.*.attn.indexer.wq_b.weight": ("index_heads", "q_lora"),
    "layers.*.attn.indexer.wk.weight": ("index_dim", "head_dim"),
    "layers.*.attn.indexer.k_norm.weight": ("index_dim",),
    "layers.*.attn.indexer.weights_proj.weight": ("index_heads", "embed"),
    "layers.*.ffn.gate.weight": ("router", "embed"),
    "layers.*.ffn.gate.bias": ("router",),
    "layers.*.ffn.gate.bias_vl": ("router",),
    "layers.*.ffn.experts.w1": ("experts", "expert_mlp", "embed"),
    "layers.*.ffn.experts.w3": ("experts", "expert_mlp", "embed"),
    "layers.*.ffn.experts.w2": ("experts", "embed", "expert_mlp"),
    "layers.*.ffn.shared_experts.w1.weight": ("mlp", "embed"),
    "layers.*.ffn.shared_experts.w3.weight": ("mlp", "embed"),
    "layers.*.ffn.shared_experts.w2.weight": ("embed", "mlp"),
    "layers.*.engram.embed.weight": ("engram", None),
    "layers.*.engram.k_weight": ("engram", "embed"),
    "layers.*.engram.q_weight": ("engram", "embed"),
    "layers.*.engram.wkv.weight": ("engram", "embed"),
    # the DSpark drafter (model/dspark.py, tree ``mtp.S.*``): its stages reuse the block names above
    "mtp.*.main_proj.weight": ("embed", None),
    "mtp.*.main_norm.weight": ("embed",),
    "mtp.*.norm.weight": ("embed",),
    "mtp.*.markov_head.embed.weight": ("vocab", None),
    "mtp.*.markov_head.head.weight": ("vocab", None),
    "mtp.*.confidence_head.proj.weight": (None, None),
}

#: Logical axes of the cache arrays (``model.kv_cache.init_cache``), by top-level key; the leading axes
#: of every leaf below it (quantized storage's ``q``/``s`` codes and scales share them).
CACHE_AXES: Mapping[str, tuple[str | None, ...]] = {
    "global": ("cache_blocks",),  # global[L].kv / .index: [num_blocks, block_size // ratio, D]
    "comp": ("cache_slots",),  # comp[L].v / .g: [slots, ratio, D]
    "swa": ("layers", "cache_slots"),  # [layers, slots, ring, D]
    "engram": ("cache_slots",),  # [slots, max_ngram - 1]
}



# ---- meshes and layouts --------------------------------------------------------------------------


def make_mesh(preset: str | ShardingPreset, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The preset's ``Mesh`` over the first ``num_devices`` of ``devices`` (default: every process's devices).

    Axes are ``AxisType.Auto`` (GSPMD propagation; ``jax.make_mesh`` would default to Explicit).
    ShardingError ``mesh.shape`` if the mesh needs more devices than there are, or, with several
    processes, fewer (every process must own part of the mesh).
    """
    preset = resolve_preset(preset)
    devices = list(jax.devices() if devices is None else devices)
    n = preset.num_devices
    preset.check_devices(len(devices))
    if n > len(devices):
        raise ShardingError("mesh.shape", f"preset {preset.name!r} needs {n} devices "
                            f"({' x '.join(map(str, preset.shape))}), only {len(devices)} available")
    if jax.process_count() > 1 and n != len(devices):
        raise ShardingError("mesh.shape", f"with {jax.process_count()} processes the mesh must use all "
                            f"{len(devices)} devices, preset {preset.name!r} has {n}")
    return auto_mesh(preset.shape, preset.axes, devices[:n])


def _preset_for(mesh: Mesh, preset: str | ShardingPreset | None) -> ShardingPreset:
    """The preset whose rules apply on ``mesh`` (default: ``RULES`` on the mesh's own axes)."""
    if preset is not None:
        preset = resolve_preset(preset)
        if dict(zip(preset.axes, preset.shape)) != dict(mesh.shape):
            raise ShardingError("mesh", f"mesh axes {dict(mesh.shape)} do not match preset {preset.name!r} "
                                f"({dict(zip(preset.axes, preset.shape))})")
        return preset
    axes, shape = tuple(mesh.axis_names), tuple(mesh.shape[a] for a in mesh.axis_names)
    sizes = dict(zip(axes, shape))
    size = lambda logical: math.prod(sizes.get(a, 1) for a in RULES[logical])
    return ShardingPreset(name="mesh", axes=axes, shape=shape, dp_size=size("batch"), ep_size=size("experts"))


def logical_spec(logical_axes: Sequence[str | None], shape: Sequence[int], preset: ShardingPreset,
                 name: str = "array") -> PartitionSpec:
    """The ``PartitionSpec`` of an array with these logical axes under the preset's rules.

    ShardingError naming ``name`` if a dimension does not divide by its mesh axes, or if two
    dimensions map to the same mesh axis.
    """
    if len(logical_axes) > len(shape):
        raise ShardingError(name, f"has {len(shape)} dimensions but {len(logical_axes)} logical axes")
    parts, used = [], set()
    for dim, logical in enumerate(logical_axes):
        axes = preset.mesh_axes(logical)
        if used & set(axes):
            raise ShardingError(name, f"maps mesh axes {sorted(used & set(axes))} to two dimensions")
        used |= set(axes)
        size = preset.axis_size(*axes)
        if shape[dim] % size:
            raise ShardingError(name, f"dimension {dim} ({logical!r}, size {shape[dim]}) does not divide by mesh "
                                f"axes {list(axes)} (size {size})")
        parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while parts and parts[-1] is None:
        parts.pop()
    return PartitionSpec(*parts)


def _key_name(entry) -> str | None:
    if isinstance(entry, jax.tree_util.DictKey):
        return str(entry.key)
    if isinstance(entry, jax.tree_util.SequenceKey):
        return str(entry.idx)
    return None  # attribute keys of Variable wrappers (``.value``) are not part of the name


def _dotted(path) -> str:
    return ".".join(k for k in map(_key_name, path) if k is not None)


def param_logical_axes(path: str) -> tuple[str | None, ...]:
    """Logical axes of the parameter at dotted ``path`` (``layers.3.ffn.experts.w1``, ``mtp.0.main_proj.weight``).

    A DSpark stage (``mtp.S``) falls back to the block entries (``layers.*``); ShardingError if unknown.
    """
    key = re.sub(r"^(layers|mtp)\.\d+\.", r"\1.*.", path)
    if key not in PARAM_AXES and key.startswith("mtp.*."):
        key = "layers.*." + key.removeprefix("mtp.*.")
    if key not in PARAM_AXES:
        raise ShardingError(path, "has no entry in sharding.PARAM_AXES (add its logical axes there)")
    return PARAM_AXES[key]


def param_shardings(params, mesh: Mesh, preset: str | ShardingPreset | None = None):
    """``NamedSharding`` for every leaf of a parameter state (arrays or ``ShapeDtypeStruct``), same structure."""
    preset = _preset_for(mesh, preset)

    def one(path, leaf):
        name = _dotted(path)
        return NamedSharding(mesh, logical_spec(param_logical_axes(name), np.shape(leaf), preset, name))

    return jax.tree_util.tree_map_with_path(one, params)


def cache_shardings(cache, mesh: Mesh, preset: str | ShardingPreset | None = None):
    """``NamedSharding`` for every array of a cache pytree (``init_cache``'s dict), same structure."""
    preset = _preset_for(mesh, preset)

    def one(path, leaf):
        name = "cache." + _dotted(path)
        top = _key_name(path[0])
        if top not in CACHE_AXES:
            raise ShardingError(name, "has no entry in sharding.CACHE_AXES")
        return NamedSharding(mesh, logical_spec(CACHE_AXES[top], np.shape(leaf), preset, name))

    return jax.tree_util.tree_map_with_path(one, cache)


def place(tree, shardings):
    """Put every leaf of ``tree`` on its sharding; works across processes (each holds the full host value)."""
    return put_global(tree, shardings)


def shard_params(params, mesh: Mesh, preset: str | ShardingPreset | None = None):
    """The parameter state placed on ``mesh`` by the rules (every process passes the same values)."""
    return place(params, param_shardings(params, mesh, preset))


def shard_cache(cache, mesh: Mesh, preset: str | ShardingPreset | None = None):
    """The cache pytree placed on ``mesh`` (slots and blocks split over the DP axes)."""
    return place(cache, cache_shardings(cache, mesh, preset))


def gather_to_host(x: jax.Array) -> np.ndarray:
    """A (possibly multi-process) global array as one numpy array, on every process (a replicated one is read
    locally, anything else is gathered with a collective: every process must call this)."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# ---- the sharded forward -------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _sharded_forward(cfg, mesh: Mesh, preset: ShardingPreset, expert_parallel: bool = False):
    from deepinfer_jax.model.deepseek_v41 import abstract_params, forward_full

    params_sh = param_shardings(abstract_params(cfg), mesh, preset)
    ids_sh = NamedSharding(mesh, PartitionSpec(preset.dp_axes or None))
    logits_sh = NamedSharding(mesh, PartitionSpec(preset.dp_axes or None, None, preset.mesh_axes("vocab") or None))
    if not expert_parallel:
        return jax.jit(lambda params, ids: forward_full(params, cfg, ids), in_shardings=(params_sh, ids_sh),
                       out_shardings=logits_sh)
    from deepinfer_jax.model.moe_strategy import MoEStrategy
    from deepinfer_jax.parallel.ep_model import EPConfig, MeshEP

    # the MoE layers run through shard_map (a static strategy); the identity tables are an argument
    moe = MoEStrategy("ep", MeshEP(mesh, EPConfig(dispatch=preset.eplb.dispatch, ep_axis=preset.ep_axes[0])))
    body = lambda params, ids, tables: forward_full(params, cfg, ids, moe=moe, moe_tables=tables)[0]
    return jax.jit(body, in_shardings=(params_sh, ids_sh, NamedSharding(mesh, PartitionSpec())),
                   out_shardings=logits_sh)


def _identity_tables(cfg, ep_size: int) -> dict[str, np.ndarray]:
    """Every layer's routing tables [L, ...] (int32) of the identity placement: slot ``e`` holds expert ``e``."""
    from deepinfer_jax.parallel.ep_moe import TABLES
    from deepinfer_jax.parallel.eplb import identity_placement

    placement = identity_placement(cfg.num_hidden_layers, cfg.n_routed_experts, ep_size)
    return {k: np.ascontiguousarray(getattr(placement, k), np.int32) for k in TABLES}


def sharded_forward_full(params, cfg, token_ids, mesh: Mesh, preset: str | ShardingPreset | None = None,
                         expert_parallel: bool = False) -> jax.Array:
    """``forward_full`` on ``mesh``: token_ids [B, T] -> logits [B, T, V] fp32, batch split over the DP axes.

    The same function as ``deepinfer_jax.forward_full``, jitted with the rules' in/out shardings
    (GSPMD propagates the rest; the routed experts' weights stay split over the EP axes). With
    ``expert_parallel`` the MoE layers instead run through ``shard_map`` (the ``"ep"`` MoE strategy with
    ``parallel.ep_model.MeshEP``, the identity placement's routing tables a jit argument): tokens travel
    to the ranks holding their experts with the preset's dispatch and come back.
    The batch is padded with copies of row 0 to a multiple of the DP size and the padding dropped
    again. Parameters not already on their shardings are placed first (``shard_params``). Every
    process of a multi-host run calls this with the same inputs; the result is a global array
    (``gather_to_host`` reads it).
    """
    from deepinfer_jax.model.deepseek_v41 import check_token_ids

    preset = _preset_for(mesh, preset)
    preset.validate_for(cfg)
    ids = np.asarray(token_ids)
    check_token_ids(ids, cfg.vocab_size)
    batch = ids.shape[0]
    pad = -batch % preset.dp_size
    if pad:
        ids = np.concatenate([ids, np.repeat(ids[:1], pad, axis=0)])
    if expert_parallel and not preset.ep_axes:
        raise ShardingError("expert_parallel", f"preset {preset.name!r} has no ep axis")
    fn = _sharded_forward(cfg, mesh, preset, bool(expert_parallel))
    params = shard_params(params, mesh, preset)
    ids = place(ids.astype(np.int32), NamedSharding(mesh, PartitionSpec(preset.dp_axes or None)))
    if expert_parallel:
        tables = _identity_tables(cfg, mesh.shape[preset.ep_axes[0]])
        logits = fn(params, ids, place(tables, {k: NamedSharding(mesh, PartitionSpec()) for k in tables}))
    else:
        logits = fn(params, ids)
    return logits[:batch] if pad else logits


# ---- multi-host ------------------------------------------------------------------------------------

#: Environment variables read by ``init_distributed`` (the only place they are read).
ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = ("DEEPINFER_COORDINATOR", "DEEPINFER_NUM_PROCESSES",
                                                      "DEEPINFER_PROCESS_ID")


def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, *, timeout_s: int = 300,
                     environ: Mapping[str, str] | None = None) -> bool:
    """Start ``jax.distributed`` for a multi-host run; returns True if it did, False for a single process.

    Each setting comes from its argument, else from ``DEEPINFER_COORDINATOR`` (``host:port`` of
    process 0's coordinator service), ``DEEPINFER_NUM_PROCESSES`` and ``DEEPINFER_PROCESS_ID``.
    With none of them set this is a no-op; a partial or malformed set is a ShardingError naming the
    setting. Call it before any other JAX call; afterwards ``jax.devices()`` (and ``make_mesh``)
    spans every process's devices. CPU processes talk through gloo collectives.
    """
    env = os.environ if environ is None else environ
    values = {"coordinator_address": (coordinator_address, ENV_COORDINATOR),
              "num_processes": (num_processes, ENV_NUM_PROCESSES), "process_id": (process_id, ENV_PROCESS_ID)}
    got = {k: (v if v is not None else env.get(var) or None) for k, (v, var) in values.items()}
    if all(v is None for v in got.values()):
        return False
    for key, value in got.items():
        if value is None:
            raise ShardingError(f"{key} ({values[key][1]})", "is required once any multi-host setting is given")
    coord = str_field(f"coordinator_address ({ENV_COORDINATOR})", got["coordinator_address"])
    host, _, port = coord.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ShardingError(f"coordinator_address ({ENV_COORDINATOR})", f"must be host:port, got {coord!r}")
    n = int_field(f"num_processes ({ENV_NUM_PROCESSES})", _as_int(got["num_processes"]), 1)
    pid = int_field(f"process_id ({ENV_PROCESS_ID})", _as_int(got["process_id"]), 0)
    if pid >= n:
        raise ShardingError(f"process_id ({ENV_PROCESS_ID})", f"must be < num_processes {n}, got {pid}")
    is_initialized = getattr(jax.distributed, "is_initialized", None)
    if is_initialized is not None and is_initialized():
        return True
    if getattr(jax.config, "jax_cpu_collectives_implementation", "gloo") in (None, "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes need real collectives
    try:
        jax.distributed.initialize(coordinator_address=coord, num_processes=n, process_id=pid,
                                   initialization_timeout=int(timeout_s))
    except RuntimeError as e:  # e.g. JAX already ran something in this process
        raise ShardingError(f"coordinator_address ({ENV_COORDINATOR})", f"jax.distributed did not start ({e}); call "
                            "sharding.init_distributed() before any other JAX call") from e
    return True


def _as_int(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return value
