"""The model's MoE layers running expert-parallel: ``with expert_parallel(mesh, config): ...``.

Whatever is traced inside the block runs every routed-expert computation through
``parallel.ep_moe.ep_moe`` (tokens to the ranks holding their experts inside ``shard_map``,
results back) instead of the single-device path; the router and the shared expert stay as they
are. The model's stacked expert weights ``[E, ...]`` are the physical slots of the identity
placement (slot ``e`` = expert ``e``, ``E / ep`` per rank, no replicas), which is how
``sharding.shard_params`` already lays them out, so no weight moves are needed. Replicated
(rebalanced) placements work at the layer level (``ep_moe`` with ``Placement.tables``,
``weight_moves.apply_placement``); the model does not carry physical-slot weights yet.

Tokens are padded to a multiple of the mesh size (every device takes a share) and the padding
dropped after. The choice is read at trace time: jit the function inside the block.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import NamedTuple

import jax.numpy as jnp
from jax.sharding import Mesh

from deepinfer_jax.parallel.ep_moe import EPConfig, ep_moe
from deepinfer_jax.parallel.eplb import identity_placement

__all__ = ["EPConfig", "current", "expert_parallel", "routed_experts"]


class _EP(NamedTuple):
    mesh: Mesh
    config: EPConfig


_STACK: list[_EP] = []


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


def current() -> _EP | None:
    """The innermost ``expert_parallel`` setting, or None (single-device experts)."""
    return _STACK[-1] if _STACK else None


def routed_experts(moe, x_Nd: jnp.ndarray) -> jnp.ndarray:
    """The routed-expert output [N, d] (fp32) of ``moe`` (a ``model.moe.MoE``) for ``x_Nd``, expert-parallel."""
    ep = current()
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
