"""The model's MoE layers running expert-parallel: the ``ExpertParallel`` implementations of ``model.moe_strategy``.

Each is a frozen, hashable object that a step builder puts into ``MoEStrategy("ep", ep=...)``, the
model step's static argument; the model calls it per MoE layer with that layer's routing tables (a
row of the step's ``moe_tables`` argument, ``Placement.tables`` stacked ``[L, ...]``, int32) and gets
back the routed output and the layer's per-slot pair counts (summed over the mesh). Nothing is read
from module state while tracing.

``MeshEP(mesh, config)`` (a plain jitted function, e.g. ``sharding.sharded_forward_full``): every
MoE layer runs through ``parallel.ep_moe.ep_moe``, its own ``shard_map`` over the mesh, with the
model's stacked expert weights ``[P, ...]`` as the physical slots of the tables' placement (the
identity placement, slot ``e`` = expert ``e``, is how ``sharding.shard_params`` lays them out).
Tokens are padded to a multiple of the token shards and the padding dropped after.

``StepEP(config, axis_sizes, split_axes)`` (inside a ``shard_map`` that is already manual over the
mesh, as the engine's DP step is, ``runner.mesh_step``): the model's expert weights are *this
device's* slots of an EPLB placement (``[S, ...]``, physical slots ``r * S ..`` of EP rank r,
replicas included), and the MoE runs ``ep_moe_local``; padding tokens (``valid`` False) are neither
sent nor counted. A rank's tokens that are replicated over EP devices (the ``split_axes``, e.g. a DP
rank spanning the ``ep`` devices of its mesh row) are split over them first and gathered back after.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from deepinfer_jax.model import qweight
from deepinfer_jax.parallel.ep_moe import TABLES, EPConfig, ep_moe, ep_moe_local, linear_index

__all__ = ["EPConfig", "MeshEP", "StepEP"]


def _experts(moe) -> tuple:
    """The layer's w1, w3, w2 as held here (inside ``shard_map``: this device's slots; a quantized-resident stack's
    declared leading size follows its data)."""
    held = lambda w: qweight.stacked_as_held(w) if qweight.is_quantized(w) else w
    return held(moe.experts.w1[...]), held(moe.experts.w3[...]), held(moe.experts.w2[...])


@dataclass(frozen=True)
class MeshEP:
    """The MoE layers expert-parallel over ``config.ep_axis`` of ``mesh``, each its own ``shard_map``
    (``config``: the dispatch settings; default ``EPConfig()``, the capacity-based all_to_all over ``ep``)."""

    mesh: Mesh
    config: EPConfig = EPConfig()

    def __post_init__(self):
        if self.config.ep_axis not in self.mesh.axis_names:
            raise ValueError(f"EPConfig.ep_axis {self.config.ep_axis!r} is not an axis of the mesh "
                             f"{self.mesh.axis_names}")

    def __call__(self, moe, x_Nd: jnp.ndarray, tables: Mapping[str, jnp.ndarray], valid=None):
        """(routed output [N, d] fp32, pairs per physical slot [P] int32) of ``moe`` (a ``model.moe.MoE``)."""
        if valid is not None:
            raise NotImplementedError("MeshEP counts every token; padding tokens need StepEP (the engine's step)")
        n_slots, n_ranks = moe.experts.w1[...].shape[0], self.mesh.shape[self.config.ep_axis]
        if n_slots % n_ranks:
            raise ValueError(f"{n_slots} expert slots do not divide over ep={n_ranks} ranks")
        shards = math.prod(self.mesh.shape[a] for a in (self.config.token_axes or self.mesh.axis_names))
        n = x_Nd.shape[0]
        pad = -n % shards
        x = jnp.pad(x_Nd, ((0, pad), (0, 0))) if pad else x_Nd
        w1, w3, w2 = _experts(moe)
        y, stats = ep_moe(x, moe.gate.weight[...], moe.gate.bias[...], {"w1": w1, "w3": w3, "w2": w2}, tables,
                          mesh=self.mesh, top_k=moe.top_k, scale=moe.scale, renormalize=moe.renormalize,
                          limit=moe.limit, config=self.config)
        return y[:n], stats.slot_counts


@dataclass(frozen=True)
class StepEP:
    """Where the EP MoE runs inside an enclosing manual ``shard_map`` (see the module docstring).

    config: the dispatch settings (``config.ep_axis`` names the EP axis). axis_sizes: ``(name, size)`` of
    every manual mesh axis. split_axes: the manual axes over which a rank's tokens are replicated (split
    over them for the experts, gathered back after); () when every device holds its own tokens.
    """

    config: EPConfig
    axis_sizes: tuple[tuple[str, int], ...]
    split_axes: tuple[str, ...] = ()

    def __post_init__(self):
        if self.config.ep_axis not in self.sizes:
            raise ValueError(f"EPConfig.ep_axis {self.config.ep_axis!r} is not a manual axis {list(self.sizes)}")

    @property
    def sizes(self) -> Mapping[str, int]:
        return dict(self.axis_sizes)

    @property
    def ep(self) -> int:
        return self.sizes[self.config.ep_axis]

    def __call__(self, moe, x_Nd: jnp.ndarray, tables: Mapping[str, jnp.ndarray], valid: jnp.ndarray | None = None):
        """(routed output [N, d] fp32, pairs per physical slot [P] int32, whole mesh, padding excluded) of ``moe``
        for this device's tokens ``x_Nd`` with validity ``valid`` [N] (None: all real)."""
        missing = [k for k in TABLES if k not in tables]
        if missing:
            raise ValueError(f"tables lack {missing}")
        n_slots, n_experts = tables["phys_to_log"].shape[0], tables["first_slot"].shape[0]
        w1, w3, w2 = _experts(moe)
        if moe.gate.weight[...].shape[0] != n_experts or w1.shape[0] * self.ep != n_slots:
            raise ValueError(f"MoE layer: {moe.gate.weight[...].shape[0]} experts and {w1.shape[0]} local slots do "
                             f"not match the placement's {n_experts} experts and {n_slots} slots over ep={self.ep}")
        n = x_Nd.shape[0]
        valid = jnp.ones((n,), bool) if valid is None else valid
        if valid.shape != (n,):
            raise ValueError(f"StepEP: valid has shape {valid.shape}, the layer sees {n} tokens")
        sizes = self.sizes
        split = math.prod(sizes[a] for a in self.split_axes)
        pad = -n % split
        x, valid = (jnp.pad(x_Nd, ((0, pad), (0, 0))), jnp.pad(valid, (0, pad))) if pad else (x_Nd, valid)
        part = x.shape[0] // split
        me = linear_index(self.split_axes, sizes)
        if split > 1:  # this device's share of the rank's tokens
            x, valid = lax.dynamic_slice_in_dim(x, me * part, part), lax.dynamic_slice_in_dim(valid, me * part, part)
        manual = tuple(sizes)
        y, counts, _, _ = ep_moe_local(x, moe.gate.weight[...], moe.gate.bias[...], w1, w3, w2, tables,
                                       ep_axis=self.config.ep_axis, ep=self.ep, sync_axes=manual,
                                       token_offset=me * part, top_k=moe.top_k, scale=moe.scale,
                                       renormalize=moe.renormalize, limit=moe.limit, config=self.config, valid=valid)
        if split > 1:
            y = lax.all_gather(y, self.split_axes, tiled=True)
        return y[:n], lax.psum(counts, manual)
