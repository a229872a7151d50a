"""The model's MoE layers running expert-parallel, in two settings read at trace time.

``with expert_parallel(mesh, config): ...`` (a plain jitted function, e.g. ``sharding.sharded_forward_full``):
every routed-expert computation traced inside runs through ``parallel.ep_moe.ep_moe``, its own
``shard_map`` over the mesh, with the model's stacked expert weights ``[E, ...]`` as the physical
slots of the identity placement (slot ``e`` = expert ``e``, ``E / ep`` per rank, no replicas), which
is how ``sharding.shard_params`` lays them out. Tokens are padded to a multiple of the mesh size and
the padding dropped after.

``with step_experts(spec, tables, valid) as ep: ...`` (inside a ``shard_map`` that is already manual over
the mesh, as the engine's DP step is): the model's expert weights are *this device's* slots of an
EPLB placement (``[S, ...]``, physical slots ``r * S ..`` of EP rank r, replicas included) and
``tables`` holds every layer's ``Placement.tables`` stacked ``[L, ...]`` (int32 arrays: a new
placement is new argument values, never a retrace). The MoE layers take the tables in call order
(layer 0 first; the model's layer loop), and each returns its per-slot pair counts into
``ep.counts`` (summed over the mesh, padding tokens excluded; ``ep.slot_counts()`` stacks them
[L, P]). A rank's tokens that are replicated over EP devices (the ``split_axes``, e.g. a DP rank
spanning the ``ep`` devices of its mesh row) are split over them first and gathered back after.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from deepinfer_jax.parallel.ep_moe import TABLES, EPConfig, ep_moe, ep_moe_local, linear_index
from deepinfer_jax.parallel.eplb import identity_placement

__all__ = ["EPConfig", "StepEP", "StepSpec", "current", "expert_parallel", "routed_experts", "step_experts"]


@dataclass(frozen=True)
class _EP:
    mesh: Mesh
    config: EPConfig


@dataclass(frozen=True)
class StepSpec:
    """Where the EP MoE runs inside an enclosing manual ``shard_map`` (static; hashable).

    config: the dispatch settings (``config.ep_axis`` names the EP axis). axis_sizes: ``(name, size)`` of
    every manual mesh axis. split_axes: the manual axes over which a rank's tokens are replicated (split
    over them for the experts, gathered back after); () when every device holds its own tokens.
    """

    config: EPConfig
    axis_sizes: tuple[tuple[str, int], ...]
    split_axes: tuple[str, ...] = ()

    @property
    def sizes(self) -> Mapping[str, int]:
        return dict(self.axis_sizes)

    @property
    def ep(self) -> int:
        return self.sizes[self.config.ep_axis]


@dataclass
class StepEP:
    """The live ``step_experts`` setting: the spec, the stacked tables, the tokens' validity, the counts so far."""

    spec: StepSpec
    tables: dict
    valid: jnp.ndarray | None
    counts: list = field(default_factory=list)

    def slot_counts(self) -> jnp.ndarray:
        """[L, P] int32: pairs routed to each physical slot of every MoE layer traced so far (whole mesh)."""
        if len(self.counts) != self.tables["phys_to_log"].shape[0]:
            raise ValueError(f"{len(self.counts)} MoE layers were traced, the placement has "
                             f"{self.tables['phys_to_log'].shape[0]}")
        return jnp.stack(self.counts)


_STACK: list[_EP | StepEP] = []


@contextlib.contextmanager
def expert_parallel(mesh: Mesh, config: EPConfig | None = None) -> Iterator[None]:
    """Trace the MoE layers inside the block expert-parallel over ``config.ep_axis`` of ``mesh``
    (``config`` None: ``EPConfig()``, the capacity-based all_to_all over ``ep``)."""
    config = EPConfig() if config is None else config
    if config.ep_axis not in mesh.axis_names:
        raise ValueError(f"EPConfig.ep_axis {config.ep_axis!r} is not an axis of the mesh {mesh.axis_names}")
    _STACK.append(_EP(mesh, config))
    try:
        yield
    finally:
        _STACK.pop()


@contextlib.contextmanager
def step_experts(spec: StepSpec, tables: Mapping[str, jnp.ndarray], valid: jnp.ndarray | None = None
                 ) -> Iterator[StepEP]:
    """Trace the MoE layers inside the block through ``ep_moe_local`` with the per-layer ``tables``
    (``TABLES`` keys, each [L, ...] int32) and token validity ``valid`` [N] (None: all real); see the module
    docstring. Only inside a ``shard_map`` manual over ``spec.axis_sizes``."""
    if spec.config.ep_axis not in spec.sizes:
        raise ValueError(f"EPConfig.ep_axis {spec.config.ep_axis!r} is not a manual axis {list(spec.sizes)}")
    missing = [k for k in TABLES if k not in tables]
    if missing:
        raise ValueError(f"tables lack {missing}")
    state = StepEP(spec, dict(tables), valid)
    _STACK.append(state)
    try:
        yield state
    finally:
        _STACK.pop()


def current() -> _EP | StepEP | None:
    """The innermost expert-parallel setting, or None (single-device experts)."""
    return _STACK[-1] if _STACK else None


def routed_experts(moe, x_Nd: jnp.ndarray) -> jnp.ndarray:
    """The routed-expert output [N, d] (fp32) of ``moe`` (a ``model.moe.MoE``) for ``x_Nd``, expert-parallel."""
    ep = current()
    if isinstance(ep, StepEP):
        return _in_step(ep, moe, x_Nd)
    n_experts = moe.gate.weight[...].shape[0]
    n_ranks = ep.mesh.shape[ep.config.ep_axis]
    if n_experts % n_ranks:
        raise ValueError(f"{n_experts} experts do not divide over ep={n_ranks} ranks")
    tables = identity_placement(1, n_experts, n_ranks).tables(0)
    shards = math.prod(ep.mesh.shape[a] for a in (ep.config.token_axes or ep.mesh.axis_names))
    n = x_Nd.shape[0]
    pad = -n % shards
    x = jnp.pad(x_Nd, ((0, pad), (0, 0))) if pad else x_Nd
    experts = {"w1": moe.experts.w1[...], "w3": moe.experts.w3[...], "w2": moe.experts.w2[...]}
    y, _ = ep_moe(x, moe.gate.weight[...], moe.gate.bias[...], experts, tables, mesh=ep.mesh, top_k=moe.top_k,
                  scale=moe.scale, renormalize=moe.renormalize, limit=moe.limit, config=ep.config)
    return y[:n]


def _in_step(ep: StepEP, moe, x_Nd: jnp.ndarray) -> jnp.ndarray:
    spec, layer = ep.spec, len(ep.counts)
    n_layers = ep.tables["phys_to_log"].shape[0]
    if layer >= n_layers:
        raise ValueError(f"more MoE layers traced than the placement's {n_layers}")
    tables = {k: ep.tables[k][layer] for k in TABLES}
    n_slots, n_experts = tables["phys_to_log"].shape[0], tables["first_slot"].shape[0]
    w1, w3, w2 = moe.experts.w1[...], moe.experts.w3[...], moe.experts.w2[...]
    if moe.gate.weight[...].shape[0] != n_experts or w1.shape[0] * spec.ep != n_slots:
        raise ValueError(f"MoE layer {layer}: {moe.gate.weight[...].shape[0]} experts and {w1.shape[0]} local slots "
                         f"do not match the placement's {n_experts} experts and {n_slots} slots over ep={spec.ep}")
    n = x_Nd.shape[0]
    valid = jnp.ones((n,), bool) if ep.valid is None else ep.valid
    if valid.shape != (n,):
        raise ValueError(f"step_experts: valid has shape {valid.shape}, the layer sees {n} tokens")
    split = math.prod(spec.sizes[a] for a in spec.split_axes)
    pad = -n % split
    x, valid = (jnp.pad(x_Nd, ((0, pad), (0, 0))), jnp.pad(valid, (0, pad))) if pad else (x_Nd, valid)
    part = x.shape[0] // split
    me = linear_index(spec.split_axes, spec.sizes)
    if split > 1:  # this device's share of the rank's tokens
        x, valid = lax.dynamic_slice_in_dim(x, me * part, part), lax.dynamic_slice_in_dim(valid, me * part, part)
    manual = tuple(spec.sizes)
    y, counts, _, _ = ep_moe_local(x, moe.gate.weight[...], moe.gate.bias[...], w1, w3, w2, tables,
                                   ep_axis=spec.config.ep_axis, ep=spec.ep, sync_axes=manual,
                                   token_offset=me * part, top_k=moe.top_k, scale=moe.scale,
                                   renormalize=moe.renormalize, limit=moe.limit, config=spec.config, valid=valid)
    if split > 1:
        y = lax.all_gather(y, spec.split_axes, tiled=True)
    ep.counts.append(lax.psum(counts, manual))
    return y[:n]
