"""Moving expert weights to a new placement (EPLB, engine.md §3: weights move inside the parallel group).

The slot axis (axis 0) of each stacked expert array is sharded over ``ep``. ``eplb.move_sources`` decides on
the host where each new slot's weights come from (the same rank when it already holds the expert,
else one of the expert's old copies, spread round-robin); ``apply_placement`` does the move on the
devices inside ``shard_map``: every rank all-gathers the old slots over ``ep`` and keeps the ones its
new slots need. That is one collective per array, simple and exact; its transient memory is the
layer's whole expert stack per rank, fine for small EP. (A wide-EP deployment would send only the
moved slots, e.g. in ``ppermute`` rounds; the host-side ``move_sources`` already names them.)

For a whole model's parameter state (the engine): ``physical_params`` lays the logical experts
``layers.L.ffn.experts.{w1,w3,w2}`` [E, ...] out in a placement's slots [P, ...] on the host, and
``move_params`` applies a new placement to every layer in one jitted program (``TRACES`` counts its
compilations).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from deepinfer_jax.model import qweight
from deepinfer_jax.parallel.eplb import Placement, move_sources
from deepinfer_jax.parallel.mesh import put_global, shard_map

__all__ = ["TRACES", "apply_placement", "expert_leaves", "move_params", "physical_params", "to_slots"]

#: Compilations of ``move_params``'s program in this process (the engine adds them to its trace count).
TRACES = [0]
_EXPERT_LEAF = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(w1|w3|w2)$")


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


def _dotted(path) -> str:
    keys = [str(k.key) if isinstance(k, jax.tree_util.DictKey) else str(k.idx)
            for k in path if isinstance(k, (jax.tree_util.DictKey, jax.tree_util.SequenceKey))]
    return ".".join(keys)


def expert_leaves(params) -> dict[int, list[int]]:
    """Layer -> positions (in ``jax.tree.leaves`` order) of its routed-expert arrays w1/w3/w2 in a parameter state."""
    out: dict[int, list[int]] = {}
    for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0]):
        match = _EXPERT_LEAF.match(_dotted(path))
        if match:
            out.setdefault(int(match.group(1)), []).append(i)
    return out


def physical_params(params, placement: Placement):
    """The parameter state with every layer's expert arrays [E, ...] taken into ``placement``'s slots [P, ...]
    (host numpy; the other leaves unchanged). ValueError unless the placement covers every MoE layer."""
    layers = expert_leaves(params)
    if sorted(layers) != list(range(placement.n_layers)):
        raise ValueError(f"the placement has {placement.n_layers} layers, the parameters MoE layers {sorted(layers)}")
    leaves, treedef = jax.tree_util.tree_flatten(params)
    for layer, idx in layers.items():
        for i in idx:
            leaf = np.asarray(leaves[i])
            if leaf.shape[0] != placement.n_experts:
                raise ValueError(f"layer {layer}: expert arrays have {leaf.shape[0]} experts, the placement "
                                 f"{placement.n_experts}")
            leaves[i] = np.take(leaf, placement.phys_to_log[layer], axis=0)
    out = jax.tree_util.tree_unflatten(treedef, leaves)
    # a quantized-resident stack (data and scale both [E, ...]) now holds P slots: its declared shape follows
    return jax.tree.map(lambda w: qweight.stacked_as_held(w) if qweight.is_quantized(w) else w, out,
                        is_leaf=qweight.is_quantized)


def logical_params(params, placement: Placement):
    """``physical_params`` undone: every layer's expert arrays [P, ...] (laid out as ``placement``) taken back to one
    per logical expert [E, ...] (host numpy), expert ``e`` from the first slot holding it; the other leaves
    unchanged. What a full-sequence pass in the model's own layout (``forward_full``) needs. Give the expert
    arrays as host (or fully addressable) arrays: they are read to the host."""
    layers = expert_leaves(params)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    for layer, idx in layers.items():
        slots = placement.phys_to_log[layer]
        first = np.array([np.flatnonzero(slots == e)[0] for e in range(placement.n_experts)], np.int32)
        for i in idx:
            leaves[i] = np.take(np.asarray(leaves[i]), first, axis=0)
    out = jax.tree_util.tree_unflatten(treedef, leaves)
    return jax.tree.map(lambda w: qweight.stacked_as_held(w) if qweight.is_quantized(w) else w, out,
                        is_leaf=qweight.is_quantized)


def move_params(params, old: Placement, new: Placement, mesh: Mesh, ep_axis: str = "ep"):
    """``params`` (laid out as ``old``, expert arrays sharded over ``ep_axis`` on axis 0) rearranged for ``new``:
    every layer's slots in one jitted program (one all-gather per array over ``ep_axis``); the other leaves are
    returned as they are. Compiled once per parameter shape."""
    layers = expert_leaves(params)
    if sorted(layers) != list(range(old.n_layers)) or new.n_layers != old.n_layers:
        raise ValueError(f"placements of {old.n_layers}/{new.n_layers} layers for MoE layers {sorted(layers)}")
    src = np.stack([move_sources(old, new, layer) for layer in range(old.n_layers)]).astype(np.int32)
    src = put_global(src, NamedSharding(mesh, P(None, ep_axis)))
    leaves, treedef = jax.tree_util.tree_flatten(params)
    at = [(layer, i) for layer in sorted(layers) for i in layers[layer]]
    moved = _layers_mover(mesh, ep_axis, tuple(layer for layer, _ in at))(src, *(leaves[i] for _, i in at))
    for (_, i), value in zip(at, moved):
        leaves[i] = value
    return jax.tree_util.tree_unflatten(treedef, leaves)


@functools.lru_cache(maxsize=8)
def _layers_mover(mesh: Mesh, ep_axis: str, layer_of_leaf: tuple[int, ...]):
    """One program moving every expert array (leaf i belongs to layer ``layer_of_leaf[i]``) by ``src`` [L, P]."""

    def body(src_local, *local):
        TRACES[0] += 1  # runs only while tracing
        return tuple(lax.all_gather(a, ep_axis, tiled=True)[src_local[layer]] for a, layer in zip(local, layer_of_leaf))

    n = len(layer_of_leaf)
    spec = P(ep_axis)
    return jax.jit(shard_map(body, mesh, in_specs=(P(None, ep_axis),) + (spec,) * n, out_specs=(spec,) * n))
