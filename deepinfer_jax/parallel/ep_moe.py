"""Routed experts over an ``ep`` mesh axis inside ``shard_map`` (engine.md §4; model.md §4.6 for the math).

Every device holds a shard of the tokens (data parallel over ``token_axes``, by default every mesh
axis) and ``slots_per_rank`` physical expert slots (the slot axis of the stacked expert weights is
sharded over ``ep``; other axes replicate them). Per device:

1. the router (fp32 ``sqrt(softplus)``, top-k over *logical* experts, exactly ``model.routing.route``);
2. each (token, expert) pair goes to one replica of the expert: replica ``t mod copies`` for global
   token index ``t`` (deterministic, conserves every pair; the placement tables say where it lives);
3. the pairs travel to the ranks holding their slots, the experts run there (grouped matmuls,
   ``lax.ragged_dot``; the routing weight multiplies the SwiGLU activations before ``w2``, as in the
   dense reference), the results travel back and are summed over the k choices.

Two dispatch implementations (``EPConfig.dispatch``):

* ``"all_to_all"``: fixed-capacity buffers [ep, C, d] exchanged with ``lax.all_to_all``. Pairs past
  a destination's capacity are *not dropped*: further passes send them (as many as the fullest
  buffer needs, agreed across all devices), and the number of pairs that needed them is returned.
* ``"ragged_all_to_all"``: exact-size exchange with ``lax.ragged_all_to_all`` (GPU/TPU; XLA:CPU does
  not implement it, so a CPU mesh raises ``NotImplementedError``). Receive buffers have worst-case
  size (every pair of the group to one rank).

``ep_moe`` returns the routed output only (the shared expert is replicated and added outside) and
``EPStats``: per-slot token counts (summed over the mesh, for ``LoadStats``), passes, overflow.
``ep_moe_local`` is the per-device body, for callers already inside a ``shard_map`` (the engine's DP
step, ``parallel.ep_model.StepEP``); it also skips padding tokens (neither sent nor counted).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from deepinfer_jax.config.eplb import DISPATCHES
from deepinfer_jax.model import qweight
from deepinfer_jax.model.layers import matmul_t
from deepinfer_jax.model.routing import route, swiglu
from deepinfer_jax.ops.quantized_matmul import quantized_grouped_matmul
from deepinfer_jax.parallel.mesh import shard_map

__all__ = ["DISPATCHES", "EPConfig", "EPLayer", "EPStats", "ep_moe", "ep_moe_local", "expert_rows", "linear_index"]

TABLES = ("phys_to_log", "slots_by_expert", "first_slot", "replica_count")


@dataclass(frozen=True)
class EPConfig:
    """Expert-parallel settings: ``dispatch`` (one of ``DISPATCHES``); ``capacity`` rows per (source,
    destination) pair and pass, or ``None`` for ``ceil(capacity_factor * pairs / ep)``; the mesh axis of the
    expert slots and those the tokens are split over (``None``: every mesh axis)."""

    dispatch: str = "all_to_all"
    capacity_factor: float = 2.0
    capacity: int | None = None
    ep_axis: str = "ep"
    token_axes: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"dispatch must be one of {DISPATCHES}, got {self.dispatch!r}")
        cf = self.capacity_factor
        if not isinstance(cf, numbers.Real) or isinstance(cf, bool) or not cf > 0 or not math.isfinite(cf):
            raise ValueError(f"capacity_factor must be a finite number > 0, got {cf!r}")
        cap = self.capacity
        if cap is not None and (not isinstance(cap, numbers.Integral) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"capacity must be None or an integer >= 1, got {cap!r}")
        if self.token_axes is not None:
            object.__setattr__(self, "token_axes", tuple(self.token_axes))


class EPStats(NamedTuple):
    """``slot_counts`` [P] int32 (pairs routed to each physical slot, whole mesh), ``passes`` (exchange rounds
    of the all_to_all path; 1 for ragged), ``overflow`` (pairs that did not fit the first round)."""

    slot_counts: jax.Array
    passes: jax.Array
    overflow: jax.Array


class EPLayer(NamedTuple):
    """What one MoE layer needs to run expert-parallel: the mesh and ``EPConfig`` (static) and the layer's
    ``Placement.tables(layer)`` as int32 arrays (pass them as jit arguments: a rebalance then never retraces)."""

    mesh: Mesh
    config: EPConfig
    tables: dict


def expert_rows(x_Rd: jax.Array, slot_R: jax.Array, weight_R: jax.Array, w1_Sfd: jax.Array, w3_Sfd: jax.Array,
                w2_Sdf: jax.Array, limit: float) -> jax.Array:
    """``weight * SwiGLU`` of each row through its local slot's expert, then ``w2``: [R, d] in x's dtype.

    ``slot_R`` in [0, S) picks the expert, -1 marks an empty row (output 0). Rows are sorted by slot and
    run as grouped matmuls (``lax.ragged_dot``), then put back in order.
    """
    n_slots = w1_Sfd.shape[0]
    group = jnp.where(slot_R >= 0, slot_R, n_slots)
    order = jnp.argsort(group, stable=True)
    sizes = jnp.zeros((n_slots + 1,), jnp.int32).at[group].add(1)[:n_slots]
    xs = x_Rd[order]
    dt = x_Rd.dtype
    if qweight.is_quantized(w1_Sfd):  # quantized-resident experts: decoded inside the grouped matmul
        gmm = lambda x, w: quantized_grouped_matmul(x, w, sizes).astype(dt)
    else:
        gmm = lambda x, w: lax.ragged_dot(x, jnp.swapaxes(w, 1, 2).astype(dt), sizes)
    gate, up = gmm(xs, w1_Sfd), gmm(xs, w3_Sfd)
    valid = (group[order] < n_slots)[:, None]
    h = jnp.where(valid, swiglu(gate, up, limit) * weight_R[order][:, None], 0.0).astype(dt)
    y = gmm(h, w2_Sdf)
    y = jnp.where(valid, y, 0)
    return jnp.zeros_like(y).at[order].set(y)


def linear_index(axes: tuple[str, ...], sizes) -> jax.Array:
    """This device's position along ``axes`` (row-major; ``sizes``: axis name -> size, e.g. ``mesh.shape``),
    inside shard_map."""
    idx = jnp.int32(0)
    for name in axes:
        idx = idx * sizes[name] + lax.axis_index(name)
    return idx


def _ragged_supported(mesh: Mesh) -> bool:
    """Whether ``lax.ragged_all_to_all`` runs on the mesh's platform (not on XLA:CPU)."""
    return mesh.devices.flat[0].platform != "cpu"


def _check(x_Nd, gate_weight_Ed, experts, tables, mesh: Mesh, config: EPConfig) -> tuple[tuple[str, ...], int]:
    if config.ep_axis not in mesh.axis_names:
        raise ValueError(f"ep_axis={config.ep_axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    token_axes = tuple(mesh.axis_names) if config.token_axes is None else config.token_axes
    for name in token_axes:
        if name not in mesh.axis_names:
            raise ValueError(f"token_axes names {name!r}, not an axis of the mesh {tuple(mesh.axis_names)}")
    shards = math.prod(mesh.shape[a] for a in token_axes)
    if x_Nd.ndim != 2 or x_Nd.shape[0] % shards:
        raise ValueError(f"x_Nd must be [tokens, d] with tokens divisible by the {shards} token shards "
                         f"({token_axes}), got {x_Nd.shape}")
    missing = [k for k in ("w1", "w3", "w2") if k not in experts] + [k for k in TABLES if k not in tables]
    if missing:
        raise ValueError(f"experts/tables lack {missing}")
    n_slots, ep = experts["w1"].shape[0], mesh.shape[config.ep_axis]
    if n_slots % ep:
        raise ValueError(f"experts hold {n_slots} slots, not divisible by ep={ep}")
    if tables["phys_to_log"].shape != (n_slots,) or tables["first_slot"].shape != (gate_weight_Ed.shape[0],):
        raise ValueError(f"tables do not match {n_slots} slots and {gate_weight_Ed.shape[0]} logical experts")
    if config.dispatch == "ragged_all_to_all" and not _ragged_supported(mesh):
        raise NotImplementedError("dispatch='ragged_all_to_all' needs GPU/TPU: lax.ragged_all_to_all is not "
                                  "implemented on XLA:CPU; use dispatch='all_to_all' on CPU meshes")
    return token_axes, n_slots


def ep_moe_local(x: jax.Array, gate_w: jax.Array, gate_b: jax.Array, w1: jax.Array, w3: jax.Array, w2: jax.Array,
                 tables: dict, *, ep_axis: str, ep: int, sync_axes: tuple[str, ...], token_offset, top_k: int,
                 scale: float, renormalize: bool, limit: float, config: EPConfig = EPConfig(),
                 valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The EP MoE of one device, called *inside* ``shard_map`` (``ep_axis`` and ``sync_axes`` manual).

    ``x`` [n, d]: this device's tokens; ``w1``/``w3`` [S, f, d], ``w2`` [S, d, f]: its ``S`` local slots (slot
    ``s`` of rank ``r`` is physical slot ``r * S + s``); ``tables``: ``Placement.tables(layer)`` (int32,
    replicated). ``token_offset`` + row index is the token's number for the choice of replica. ``valid`` [n]
    (default all) marks real tokens: padding tokens are neither sent nor counted (their output is 0).
    ``sync_axes``: every manual axis (the devices agree on the number of all_to_all passes over them).
    Returns (routed output [n, d] fp32, this device's pairs per physical slot [P] int32, passes, pairs of
    this device that missed the first pass); sum the last two over the token axes yourself.
    """
    n, d = x.shape
    n_slots = tables["phys_to_log"].shape[0]
    spr = n_slots // ep
    n_pairs = n * top_k
    capacity = config.capacity or max(1, math.ceil(config.capacity_factor * n_pairs / ep))
    capacity = min(capacity, n_pairs)
    logits = matmul_t(x.astype(jnp.float32), gate_w.astype(jnp.float32))
    weight_nk, ids_nk = route(logits, gate_b, top_k, scale, renormalize)
    token = token_offset + jnp.arange(n, dtype=jnp.int32)
    replica = token[:, None] % tables["replica_count"][ids_nk]
    slot = tables["slots_by_expert"][tables["first_slot"][ids_nk] + replica].reshape(-1)  # [A] slot of each pair
    live = jnp.ones((n_pairs,), bool) if valid is None else jnp.repeat(valid.astype(bool), top_k)
    counts = jnp.zeros((n_slots,), jnp.int32).at[slot].add(live.astype(jnp.int32))
    dest, local_slot = slot // spr, slot % spr
    x_pairs, w_pairs = x[jnp.arange(n_pairs) // top_k], weight_nk.reshape(-1)
    weights = (w1, w3, w2)
    if config.dispatch == "all_to_all":
        out, passes, overflow = _dispatch_all_to_all(x_pairs, w_pairs, dest, local_slot, live, weights, ep_axis, ep,
                                                     capacity, sync_axes, limit)
    else:
        out = _dispatch_ragged(x_pairs, w_pairs, dest, local_slot, live, weights, ep_axis, ep, limit)
        passes, overflow = jnp.int32(1), jnp.int32(0)
    return out.reshape(n, top_k, d).sum(1), counts, passes, overflow


def _dispatch_all_to_all(x_pairs, w_pairs, dest, local_slot, live, weights, ep_axis, ep, capacity, sync_axes, limit):
    d = x_pairs.shape[1]
    onehot = (dest[:, None] == jnp.arange(ep)[None]) & live[:, None]
    pos = jnp.take_along_axis(jnp.cumsum(onehot, 0, dtype=jnp.int32), dest[:, None], 1)[:, 0] - 1
    fullest = lax.pmax(jnp.max(onehot.sum(0, dtype=jnp.int32)), sync_axes)
    passes = (fullest + capacity - 1) // capacity  # 0 when nothing is sent anywhere
    overflow = jnp.sum(live & (pos >= capacity), dtype=jnp.int32)

    def one_pass(state):
        p, out = state
        sel = live & (pos >= p * capacity) & (pos < (p + 1) * capacity)
        row = jnp.where(sel, pos - p * capacity, capacity)  # out of range: dropped by the scatter
        send_x = jnp.zeros((ep, capacity, d), x_pairs.dtype).at[dest, row].set(x_pairs, mode="drop")
        send_s = jnp.full((ep, capacity), -1, jnp.int32).at[dest, row].set(local_slot, mode="drop")
        send_w = jnp.zeros((ep, capacity), jnp.float32).at[dest, row].set(w_pairs, mode="drop")
        recv_x, recv_s, recv_w = (lax.all_to_all(a, ep_axis, 0, 0) for a in (send_x, send_s, send_w))
        y = expert_rows(recv_x.reshape(ep * capacity, d), recv_s.reshape(-1), recv_w.reshape(-1), *weights,
                        limit).reshape(ep, capacity, d)
        back = lax.all_to_all(y, ep_axis, 0, 0)
        got = back[dest, jnp.minimum(row, capacity - 1)].astype(jnp.float32)
        return p + 1, out + jnp.where(sel[:, None], got, 0.0)

    out0 = jnp.zeros((x_pairs.shape[0], d), jnp.float32)
    _, out = lax.while_loop(lambda s: s[0] < passes, one_pass, (jnp.int32(0), out0))
    return out, passes, overflow


def _dispatch_ragged(x_pairs, w_pairs, dest, local_slot, live, weights, ep_axis, ep, limit):
    n_pairs, d = x_pairs.shape
    order = jnp.argsort(jnp.where(live, dest, ep), stable=True)  # padding pairs last, never sent
    send_sizes = jnp.zeros((ep,), jnp.int32).at[dest].add(live.astype(jnp.int32))
    in_offsets = jnp.cumsum(send_sizes) - send_sizes
    sizes_sd = lax.all_gather(send_sizes, ep_axis)  # [ep source, ep destination]
    me = lax.axis_index(ep_axis)
    out_offsets = (jnp.cumsum(sizes_sd, 0) - sizes_sd)[me]  # where my rows start in each receiver
    recv_sizes = sizes_sd[:, me]
    recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
    buf = ep * n_pairs  # worst case: every pair of the group to this rank

    def exchange(a, fill):
        out = jnp.full((buf,) + a.shape[1:], fill, a.dtype)
        return lax.ragged_all_to_all(a[order], out, in_offsets, send_sizes, out_offsets, recv_sizes,
                                     axis_name=ep_axis)

    rx, rs, rw = exchange(x_pairs, 0), exchange(local_slot, -1), exchange(w_pairs, 0)
    y = expert_rows(rx, rs, rw, *weights, limit)
    back_offsets = lax.all_gather(in_offsets, ep_axis)[:, me]  # where each source's rows for me started
    yb = lax.ragged_all_to_all(y, jnp.zeros((n_pairs, d), y.dtype), recv_offsets, recv_sizes, back_offsets,
                               send_sizes, axis_name=ep_axis)
    return jnp.zeros((n_pairs, d), jnp.float32).at[order].set(yb.astype(jnp.float32))


def ep_moe(x_Nd: jax.Array, gate_weight_Ed: jax.Array, gate_bias_E: jax.Array, experts: dict, tables: dict, *,
           mesh: Mesh, top_k: int, scale: float, renormalize: bool, limit: float,
           config: EPConfig = EPConfig()) -> tuple[jax.Array, EPStats]:
    """Routed-expert output [N, d] in fp32 (add the shared expert, then cast, as ``MoE`` does) and ``EPStats``
    for tokens ``x_Nd`` split over the token axes.

    ``experts``: ``w1``/``w3`` [P, f, d], ``w2`` [P, d, f] stacked over physical slots (sharded over
    ``ep``); ``tables``: ``Placement.tables(layer)`` (int32, replicated). ``top_k``/``scale``/
    ``renormalize``/``limit`` are the ``MoE`` module's routing and SwiGLU settings. One ``shard_map`` over
    the whole mesh around ``ep_moe_local``.
    """
    token_axes, _ = _check(x_Nd, gate_weight_Ed, experts, tables, mesh, config)
    ep_axis, ep = config.ep_axis, mesh.shape[config.ep_axis]
    all_axes = tuple(mesh.axis_names)

    def body(x, gate_w, gate_b, w1, w3, w2, *table_arrays):
        offset = linear_index(token_axes, mesh.shape) * x.shape[0]
        w1, w3, w2 = (qweight.stacked_as_held(w) if qweight.is_quantized(w) else w for w in (w1, w3, w2))
        y, counts, passes, overflow = ep_moe_local(
            x, gate_w, gate_b, w1, w3, w2, dict(zip(TABLES, table_arrays)), ep_axis=ep_axis, ep=ep,
            sync_axes=all_axes, token_offset=offset, top_k=top_k, scale=scale, renormalize=renormalize, limit=limit,
            config=config)
        return y, lax.psum(counts, token_axes), passes, lax.psum(overflow, token_axes)

    tok = P(token_axes)
    fn = shard_map(body, mesh,
                   in_specs=(tok, P(), P(), P(ep_axis), P(ep_axis), P(ep_axis), P(), P(), P(), P()),
                   out_specs=(tok, P(), P(), P()))
    y, counts, passes, overflow = fn(x_Nd, gate_weight_Ed, gate_bias_E, experts["w1"], experts["w3"], experts["w2"],
                                     *(jnp.asarray(tables[k], jnp.int32) for k in TABLES))
    return y, EPStats(counts, passes, overflow)
