"""Moving expert weights to a new placement (EPLB, engine.md §3: weights move inside the parallel group).

The slot axis (axis 0) of each stacked expert array is sharded over ``ep``. ``eplb.move_sources`` decides on
the host where each new slot's weights come from (the same rank when it already holds the expert,
else one of the expert's old copies, spread round-robin); ``apply_placement`` does the move on the
devices inside ``shard_map``: every rank all-gathers the old slots over ``ep`` and keeps the ones its
new slots need. That is one collective per array, simple and exact; its transient memory is the
layer's whole expert stack per rank, fine for small EP. (A wide-EP deployment would send only the
moved slots, e.g. in ``ppermute`` rounds; the host-side ``move_sources`` already names them.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from deepinfer_jax.parallel.eplb import Placement, move_sources
from deepinfer_jax.parallel.mesh import shard_map

__all__ = ["apply_placement", "to_slots"]


def apply_placement(weights, old: Placement, new: Placement, mesh: Mesh, layer: int = 0, ep_axis: str = "ep"):
    """``weights`` (a pytree of [P, ...] arrays laid out as ``old`` for ``layer``) rearranged for ``new``.

    Returns the new pytree, sharded over ``ep`` on axis 0 like the input. Outputs of the EP MoE with the new
    tables and weights equal those with the old ones.
    """
    if ep_axis not in mesh.axis_names:
        raise ValueError(f"ep_axis={ep_axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    ep = mesh.shape[ep_axis]
    if ep != old.n_ranks:
        raise ValueError(f"the placement has {old.n_ranks} ranks, the mesh axis {ep_axis!r} has {ep}")
    leaves, treedef = jax.tree_util.tree_flatten(weights)
    for leaf in leaves:
        if leaf.ndim < 1 or leaf.shape[0] != old.n_slots:
            raise ValueError(f"every weight must have {old.n_slots} slots on axis 0, got shape {leaf.shape}")
    src = jnp.asarray(move_sources(old, new, layer), jnp.int32)
    return jax.tree_util.tree_unflatten(treedef, list(_mover(mesh, ep_axis, len(leaves))(src, *leaves)))


@functools.lru_cache(maxsize=32)
def _mover(mesh: Mesh, ep_axis: str, n_leaves: int):
    """The jitted move for ``n_leaves`` arrays (cached: every layer and rebalance reuses one compile per shape)."""

    def body(src_local, *local):
        return tuple(lax.all_gather(a, ep_axis, tiled=True)[src_local] for a in local)

    spec = P(ep_axis)
    return jax.jit(shard_map(body, mesh, in_specs=(spec,) * (1 + n_leaves), out_specs=(spec,) * n_leaves))


def to_slots(weights_E, placement: Placement, mesh: Mesh, layer: int = 0, ep_axis: str = "ep"):
    """Logical expert weights (a pytree of [E, ...] arrays) laid out in ``placement``'s physical slots [P, ...],
    sharded over ``ep`` on axis 0."""
    idx = jnp.asarray(placement.phys_to_log[layer], jnp.int32)
    sharding = NamedSharding(mesh, P(ep_axis))

    def one(a):
        if a.shape[0] != placement.n_experts:
            raise ValueError(f"every weight must have {placement.n_experts} experts on axis 0, got shape {a.shape}")
        return jax.device_put(jnp.take(jnp.asarray(a), idx, axis=0), sharding)

    return jax.tree_util.tree_map(one, weights_E)
