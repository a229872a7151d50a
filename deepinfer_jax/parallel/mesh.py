"""``shard_map`` across jax versions and meshes with Auto axes (environment.md: ``jax.make_mesh`` defaults to
Explicit axes, whose inputs ``shard_map`` rejects unless already laid out as its ``in_specs``), and host values
put on a mesh that may span several processes (``put_global``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

__all__ = ["auto_mesh", "put_global", "shard_map"]


def shard_map(f: Callable, mesh: Mesh, in_specs, out_specs) -> Callable:
    """``jax.shard_map`` (jax >= 0.6) or ``jax.experimental.shard_map.shard_map``, replication checks off
    (the collectives here make outputs replicated by construction)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy  # pragma: no cover - old jax

    return legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)  # pragma: no cover


def auto_mesh(shape: Sequence[int], names: Sequence[str], devices=None) -> Mesh:
    """A mesh of ``shape`` over the first ``prod(shape)`` devices with every axis ``AxisType.Auto``."""
    n = 1
    for size in shape:
        n *= size
    devices = list(jax.devices() if devices is None else devices)
    if n > len(devices):
        raise ValueError(f"mesh shape {tuple(shape)} needs {n} devices, only {len(devices)} exist")
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is None:  # pragma: no cover - old jax: every axis is Auto
        return jax.make_mesh(tuple(shape), tuple(names), devices=devices[:n])
    return jax.make_mesh(tuple(shape), tuple(names), axis_types=(axis_type.Auto,) * len(shape), devices=devices[:n])


def put_global(tree, shardings):
    """Every leaf of ``tree`` (host values, the same in every process) on its sharding (one ``Sharding`` or a tree
    of them). One process: ``jax.device_put``. Several: each process fills its own devices' shards
    (``jax.make_array_from_callback``; no cross-process check, unlike ``device_put`` of a numpy array)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)

    def one(leaf, sharding):
        if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
            return leaf
        host = np.asarray(leaf)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)
