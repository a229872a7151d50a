"""Expert-parallel load balancing (EPLB, engine.md §3): where each expert's copies live.

Host code, pure numpy. A *placement* gives every layer ``P = n_ranks * slots_per_rank`` physical
expert slots, laid out rank-major (slot ``s`` lives on rank ``s // slots_per_rank``), each holding
one logical expert; every logical expert has at least one slot, hot ones several (replicas), and the
router splits a logical expert's tokens evenly across its replicas.

``compute_placement`` follows the algorithm of deepseek-ai/EPLB, restated:

1. *Replicate*: starting from one copy per expert, give the next redundant slot to the expert with
   the highest load per copy, until the slots run out (D'Hondt apportionment).
2. *Pack*: place the copies (each weighing ``load / copies``) onto ranks, exactly
   ``slots_per_rank`` each, to keep the heaviest rank light: heaviest copies first, in rounds of
   ``n_ranks`` copies, the heaviest copy of a round to the currently lightest rank; then copies of
   one expert that met on one rank are swapped apart (when possible), and a few swaps of
   single-copy experts between the heaviest and the lightest rank lower the maximum further.
3. *Hierarchical* (``n_nodes > 1``): first pack contiguous expert groups onto nodes (balanced
   group loads, ``n_groups / n_nodes`` groups each), then replicate and pack inside each node, so
   a token's experts and their copies stay on as few nodes as the grouping allows.

Everything is vectorised over layers (and nodes); the loops run over redundant slots and rounds,
not over layers. ``moe_lb = max rank load / mean rank load`` per layer is the balance metric.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "Placement",
    "compute_placement",
    "identity_placement",
    "moe_lb",
    "move_sources",
    "pack_balanced",
    "rank_loads",
    "replicate_experts",
    "slot_rank_loads",
]


def _argsort_keys(keys: np.ndarray, n_keys: int) -> np.ndarray:
    """Stable argsort along the last axis of integer keys in [0, n_keys): 16-bit keys take numpy's radix sort."""
    dtype = np.int16 if n_keys <= np.iinfo(np.int16).max else np.int64
    return np.argsort(keys.astype(dtype, copy=False), axis=-1, kind="stable")


def _int_at_least(name: str, value, lo: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Placement:
    """Physical slots of every layer: ``phys_to_log`` [L, P] int, slot ``s`` on rank ``s // slots_per_rank``.

    Derived (read-only numpy arrays): ``replica_count`` [L, E] (copies of each logical expert),
    ``slots_by_expert`` [L, P] (slot ids sorted by logical expert, stable) and ``first_slot`` [L, E]
    (where each expert's run starts in it): replica ``r`` of expert ``e`` is
    ``slots_by_expert[l, first_slot[l, e] + r]``.
    """

    phys_to_log: np.ndarray
    n_ranks: int
    n_experts: int
    replica_count: np.ndarray = field(init=False, repr=False)
    slots_by_expert: np.ndarray = field(init=False, repr=False)
    first_slot: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        n_ranks = _int_at_least("n_ranks", self.n_ranks, 1)
        n_experts = _int_at_least("n_experts", self.n_experts, 1)
        p2l = np.asarray(self.phys_to_log)
        if p2l.ndim != 2 or not np.issubdtype(p2l.dtype, np.integer):
            raise ValueError(f"phys_to_log must be an integer array [layers, slots], got {p2l.dtype} {p2l.shape}")
        n_slots = p2l.shape[1]
        if n_slots % n_ranks:
            raise ValueError(f"phys_to_log has {n_slots} slots per layer, not divisible by n_ranks={n_ranks}")
        if p2l.size and (p2l.min() < 0 or p2l.max() >= n_experts):
            raise ValueError(f"phys_to_log holds expert ids outside [0, n_experts={n_experts})")
        count = np.zeros((p2l.shape[0], n_experts), np.int64)
        np.add.at(count, (np.arange(p2l.shape[0])[:, None], p2l), 1)
        if (count == 0).any():
            layer, expert = np.argwhere(count == 0)[0]
            raise ValueError(f"phys_to_log: logical expert {expert} of layer {layer} has no slot")
        p2l = p2l.astype(np.int64)
        by_expert = _argsort_keys(p2l, n_experts)
        first = np.cumsum(count, axis=1) - count
        for name, arr in (("phys_to_log", p2l), ("replica_count", count), ("slots_by_expert", by_expert),
                          ("first_slot", first)):
            arr.setflags(write=False)
            object.__setattr__(self, name, arr)
        object.__setattr__(self, "n_ranks", n_ranks)
        object.__setattr__(self, "n_experts", n_experts)

    @property
    def n_layers(self) -> int:
        return self.phys_to_log.shape[0]

    @property
    def n_slots(self) -> int:
        return self.phys_to_log.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.n_slots // self.n_ranks

    @property
    def rank_of_slot(self) -> np.ndarray:
        """[P] rank holding each slot (the same for every layer)."""
        return np.arange(self.n_slots) // self.slots_per_rank

    def replicas(self, layer: int, expert: int) -> np.ndarray:
        """The slot ids holding ``expert`` in ``layer``."""
        start = self.first_slot[layer, expert]
        return self.slots_by_expert[layer, start:start + self.replica_count[layer, expert]]

    def tables(self, layer: int) -> dict[str, np.ndarray]:
        """int32 routing tables of one layer for the device: ``phys_to_log`` [P], ``slots_by_expert`` [P],
        ``first_slot`` [E], ``replica_count`` [E] (fixed shapes: a new placement never retraces)."""
        return {name: getattr(self, name)[layer].astype(np.int32)
                for name in ("phys_to_log", "slots_by_expert", "first_slot", "replica_count")}

    def __eq__(self, other) -> bool:
        return (isinstance(other, Placement) and self.n_ranks == other.n_ranks
                and self.n_experts == other.n_experts and np.array_equal(self.phys_to_log, other.phys_to_log))

    __hash__ = None


def _check_geometry(n_experts: int, n_ranks, redundant_per_rank, n_nodes=1) -> tuple[int, int, int]:
    n_ranks = _int_at_least("n_ranks", n_ranks, 1)
    redundant = _int_at_least("redundant_per_rank", redundant_per_rank, 0)
    n_nodes = _int_at_least("n_nodes", n_nodes, 1)
    if n_experts % n_ranks:
        raise ValueError(f"n_experts={n_experts} is not divisible by n_ranks={n_ranks}")
    if n_ranks % n_nodes:
        raise ValueError(f"n_ranks={n_ranks} is not divisible by n_nodes={n_nodes}")
    slots_per_rank = n_experts // n_ranks + redundant
    if slots_per_rank > n_experts // n_nodes:
        raise ValueError(f"redundant_per_rank={redundant} is too large: {slots_per_rank} slots per rank exceed the "
                         f"{n_experts // n_nodes} experts a node can hold, so a rank would need two copies of one "
                         f"expert (at most {n_experts // n_nodes - n_experts // n_ranks})")
    return n_ranks, redundant, n_nodes


def _check_load(load_LE) -> np.ndarray:
    load = np.asarray(load_LE)
    if load.ndim == 1:
        load = load[None]
    if load.ndim != 2 or load.shape[1] == 0 or not (np.issubdtype(load.dtype, np.number) and load.dtype != bool):
        raise ValueError(f"load_LE must be a numeric array [layers, experts], got {load.dtype} {load.shape}")
    load = load.astype(np.float64)
    if not np.isfinite(load).all():
        raise ValueError("load_LE must be finite (found NaN or inf)")
    if (load < 0).any():
        raise ValueError(f"load_LE must be >= 0 (found {load.min()})")
    return load


def identity_placement(n_layers: int, n_experts: int, n_ranks: int, redundant_per_rank: int = 0) -> Placement:
    """The load-blind start: slot ``s`` holds expert ``s mod n_experts`` (contiguous experts per rank, the
    redundant slots filled with the first experts again), the same for every layer."""
    n_layers = _int_at_least("n_layers", n_layers, 1)
    n_experts = _int_at_least("n_experts", n_experts, 1)
    n_ranks, redundant, _ = _check_geometry(n_experts, n_ranks, redundant_per_rank)
    n_slots = n_experts + n_ranks * redundant
    return Placement(np.tile(np.arange(n_slots) % n_experts, (n_layers, 1)), n_ranks, n_experts)


def replicate_experts(load_BE: np.ndarray, n_slots: int) -> np.ndarray:
    """Copies per expert [B, E] (each >= 1, summing to ``n_slots``): each extra copy to the highest load per copy.

    A tiny uniform load is added so that idle experts share the spare copies instead of the first one
    taking them all; ties go to the lowest expert id.
    """
    load = np.asarray(load_BE, np.float64)
    n_rows, n_experts = load.shape
    load = load + (load.sum(1, keepdims=True) + 1.0) * (1e-9 / n_experts)
    count = np.ones((n_rows, n_experts), np.int64)
    per_copy = load.copy()
    rows = np.arange(n_rows)
    for _ in range(n_slots - n_experts):
        best = per_copy.argmax(1)
        count[rows, best] += 1
        per_copy[rows, best] = load[rows, best] / count[rows, best]
    return count


def _fix_duplicates(pack_BI, key_BI, weight_BI, n_keys: int) -> None:
    """Swap copies of one key (expert) that share a pack with a similar-weight item elsewhere, in place."""
    n_rows, n_items = pack_BI.shape
    n_packs = int(pack_BI.max()) + 1
    flat = pack_BI * n_keys + key_BI
    order = _argsort_keys(flat, n_packs * n_keys)
    srt = np.take_along_axis(flat, order, 1)
    repeat = np.zeros((n_rows, n_items), bool)
    repeat[:, 1:] = srt[:, 1:] == srt[:, :-1]  # a later copy of a (pack, key) pair already seen
    for b in np.flatnonzero(repeat.any(1)):
        held = np.zeros((n_packs, n_keys), np.int64)  # copies of each key on each pack
        np.add.at(held, (pack_BI[b], key_BI[b]), 1)
        for i in order[b, repeat[b]]:
            p, k = pack_BI[b, i], key_BI[b, i]
            if held[p, k] < 2:
                continue  # an earlier trade already took a copy away
            # a second copy of key k on pack p: trade it for an item j elsewhere such that neither pack ends up
            # with a duplicate, the closest in weight
            other_p, other_k = pack_BI[b], key_BI[b]
            ok = (other_p != p) & (held[other_p, k] == 0) & (held[p, other_k] == 0)
            if not ok.any():
                continue  # unavoidable (more copies than packs that lack the key)
            cand = np.flatnonzero(ok)
            j = cand[np.argmin(np.abs(weight_BI[b, cand] - weight_BI[b, i]))]
            q, kj = pack_BI[b, j], key_BI[b, j]
            held[p, k] -= 1
            held[q, k] += 1
            held[q, kj] -= 1
            held[p, kj] += 1
            pack_BI[b, i], pack_BI[b, j] = q, p


def _refine(pack_BI, weight_BI, movable_BI, n_packs: int, iters: int) -> None:
    """Up to ``iters`` rounds of the best single swap between each row's heaviest and lightest packs, in place.

    Only ``movable`` items (single-copy experts: moving one can never put two copies on a pack) swap. A row
    drops out once its heaviest pack is within 0.1% of the mean or no swap helps.
    """
    n_rows, n_items = pack_BI.shape
    per = n_items // n_packs
    members = _argsort_keys(pack_BI, n_packs).reshape(n_rows, n_packs, per)  # item ids per pack
    w = np.where(movable_BI, weight_BI, np.nan)
    load = np.zeros((n_rows, n_packs))
    np.add.at(load, (np.arange(n_rows)[:, None], pack_BI), weight_BI)
    act = np.arange(n_rows)
    for _ in range(iters):
        act = act[load[act].max(1) > load[act].mean(1) * (1 + 1e-3)]
        if not act.size:
            break
        top, low = load[act].argmax(1), load[act].argmin(1)
        a_items, b_items = members[act, top], members[act, low]  # [B', per] each
        wa = np.take_along_axis(w[act], a_items, 1)[:, :, None]
        wb = np.take_along_axis(w[act], b_items, 1)[:, None, :]
        load_top, load_low = load[act, top][:, None, None], load[act, low][:, None, None]
        # the pair's new maximum after trading a (heaviest pack) for b (lightest); gain > 0 lowers the top
        gain = load_top - np.fmax(load_top - wa + wb, load_low + wa - wb)
        gain = np.where(np.isnan(gain), -np.inf, gain).reshape(act.size, -1)
        best = gain.argmax(1)
        improve = gain[np.arange(act.size), best] > 1e-12 * (load[act, top] + 1.0)
        act, top, low, best = act[improve], top[improve], low[improve], best[improve]
        if not act.size:
            break
        ai, bi = np.divmod(best, per)
        a, b = a_items[improve, ai], b_items[improve, bi]
        delta = weight_BI[act, a] - weight_BI[act, b]
        load[act, top] -= delta
        load[act, low] += delta
        members[act, top, ai], members[act, low, bi] = b, a
        pack_BI[act, a], pack_BI[act, b] = low, top


def pack_balanced(weight_BI: np.ndarray, n_packs: int, key_BI: np.ndarray | None = None, n_keys: int = 0,
                  refine_iters: int = 16) -> np.ndarray:
    """Pack index [B, I] of each item, exactly ``I / n_packs`` items per pack, keeping the heaviest pack light.

    Heaviest items first in rounds of ``n_packs``, the k-th heaviest of a round to the k-th lightest pack;
    with ``key_BI`` (the expert of each item) no two items of one key share a pack when avoidable, and
    items whose key occurs once per row are then swapped to lower the maximum.
    """
    weight = np.asarray(weight_BI, np.float64)
    n_rows, n_items = weight.shape
    per = n_items // n_packs
    order = np.argsort(-weight, axis=1, kind="stable")
    w_sorted = np.take_along_axis(weight, order, 1)
    rows = np.arange(n_rows)[:, None]
    load = np.zeros((n_rows, n_packs))
    pack_sorted = np.empty((n_rows, n_items), np.int64)
    for t in range(per):
        lightest = np.argsort(load, axis=1, kind="stable")
        chunk = slice(t * n_packs, (t + 1) * n_packs)
        pack_sorted[:, chunk] = lightest
        load[rows, lightest] += w_sorted[:, chunk]
    pack = np.empty_like(pack_sorted)
    np.put_along_axis(pack, order, pack_sorted, 1)
    if key_BI is None:
        movable = np.ones_like(pack, bool)
    else:
        key = np.asarray(key_BI, np.int64)
        _fix_duplicates(pack, key, weight, n_keys)
        copies = np.zeros((n_rows, n_keys), np.int64)
        np.add.at(copies, (np.broadcast_to(rows, key.shape), key), 1)
        movable = np.take_along_axis(copies, key, 1) == 1
    if refine_iters and n_packs > 1:
        _refine(pack, weight, movable, n_packs, refine_iters)
    return pack


def compute_placement(load_LE, n_ranks: int, redundant_per_rank: int, n_nodes: int = 1,
                      n_groups: int | None = None, refine_iters: int = 16) -> Placement:
    """A balanced placement for per-layer logical expert loads ``load_LE`` [L, E] (token counts, >= 0).

    ``n_ranks`` EP ranks each get ``E / n_ranks + redundant_per_rank`` slots. With ``n_nodes > 1`` the
    experts are first grouped (``n_groups`` contiguous groups, default one per expert; divisible by
    ``n_nodes``) and the groups packed onto nodes, then each node replicates and packs its own experts.
    """
    load = _check_load(load_LE)
    n_layers, n_experts = load.shape
    n_ranks, redundant, n_nodes = _check_geometry(n_experts, n_ranks, redundant_per_rank, n_nodes)
    n_groups = n_experts if n_groups is None else _int_at_least("n_groups", n_groups, 1)
    if n_experts % n_groups:
        raise ValueError(f"n_groups={n_groups} does not divide n_experts={n_experts}")
    if n_groups % n_nodes:
        raise ValueError(f"n_groups={n_groups} is not divisible by n_nodes={n_nodes}")
    slots_per_rank = n_experts // n_ranks + redundant
    ranks_per_node, experts_per_node = n_ranks // n_nodes, n_experts // n_nodes
    slots_per_node = ranks_per_node * slots_per_rank

    # 1. groups -> nodes; node_experts [L, N, E/N]: the logical experts of each node
    if n_nodes > 1:
        group_size = n_experts // n_groups
        group_load = load.reshape(n_layers, n_groups, group_size).sum(-1)
        node_of_group = pack_balanced(group_load, n_nodes, refine_iters=0)  # many items per node: rounds suffice
        node_of_expert = np.repeat(node_of_group, group_size, axis=1)
        node_experts = _argsort_keys(node_of_expert * n_experts + np.arange(n_experts), n_nodes * n_experts)
    else:
        node_experts = np.broadcast_to(np.arange(n_experts), (n_layers, n_experts))
    node_experts = node_experts.reshape(n_layers * n_nodes, experts_per_node)
    node_load = np.take_along_axis(load.repeat(n_nodes, 0), node_experts, 1)

    # 2. replicate inside each node; items = copies (local expert ids), weight = load per copy
    count = replicate_experts(node_load, slots_per_node)
    n_rows = n_layers * n_nodes
    item_local = np.repeat(np.tile(np.arange(experts_per_node), n_rows), count.ravel()).reshape(n_rows, -1)
    item_weight = np.take_along_axis(node_load / count, item_local, 1)

    # 3. copies -> ranks of the node; slots ordered by (rank, expert)
    rank_local = pack_balanced(item_weight, ranks_per_node, item_local, experts_per_node, refine_iters)
    item_expert = np.take_along_axis(node_experts, item_local, 1)
    slot_order = _argsort_keys(rank_local * n_experts + item_expert, ranks_per_node * n_experts)
    phys_to_log = np.take_along_axis(item_expert, slot_order, 1).reshape(n_layers, n_nodes * slots_per_node)
    return Placement(phys_to_log, n_ranks, n_experts)


def rank_loads(load_LE, placement: Placement) -> np.ndarray:
    """[L, R] expected load of each rank: every expert's load split evenly over its copies."""
    load = _check_load(load_LE)
    if load.shape != (placement.n_layers, placement.n_experts):
        raise ValueError(f"load_LE has shape {load.shape}, the placement needs "
                         f"({placement.n_layers}, {placement.n_experts})")
    per_copy = load / placement.replica_count
    slot_load = np.take_along_axis(per_copy, placement.phys_to_log, 1)
    return slot_load.reshape(placement.n_layers, placement.n_ranks, -1).sum(-1)


def slot_rank_loads(slot_counts_LP, n_ranks: int) -> np.ndarray:
    """[L, R] measured load of each rank from per-slot token counts [L, P] (as the EP MoE returns them)."""
    counts = np.asarray(slot_counts_LP, np.float64)
    if counts.ndim == 1:
        counts = counts[None]
    return counts.reshape(counts.shape[0], n_ranks, -1).sum(-1)


def moe_lb(load_LE, placement: Placement) -> np.ndarray:
    """[L] ``max rank load / mean rank load`` (1.0 is perfect; a layer with no load counts as 1.0)."""
    return _max_over_mean(rank_loads(load_LE, placement))


def _max_over_mean(rank_load_LR: np.ndarray) -> np.ndarray:
    mean = rank_load_LR.mean(-1)
    return np.where(mean > 0, rank_load_LR.max(-1) / np.where(mean > 0, mean, 1.0), 1.0)


def _check_pair(old: Placement, new: Placement, layer: int) -> None:
    if (old.n_slots, old.n_ranks, old.n_experts) != (new.n_slots, new.n_ranks, new.n_experts):
        raise ValueError(f"placements differ in geometry: old has {old.n_slots} slots / {old.n_ranks} ranks / "
                         f"{old.n_experts} experts, new {new.n_slots} / {new.n_ranks} / {new.n_experts}")
    if not 0 <= layer < min(old.n_layers, new.n_layers):
        raise ValueError(f"layer={layer} is outside the placements' {min(old.n_layers, new.n_layers)} layers")


def move_sources(old: Placement, new: Placement, layer: int) -> np.ndarray:
    """[P] old slot whose weights each new slot of ``layer`` takes (same slot, else same rank, else another rank)."""
    _check_pair(old, new, layer)
    spr = old.slots_per_rank
    old_l, new_l = old.phys_to_log[layer], new.phys_to_log[layer]
    src = np.empty(new.n_slots, np.int64)
    used = np.zeros(old.n_experts, np.int64)  # round-robin over an expert's old copies for remote sources
    for s, e in enumerate(new_l):
        if old_l[s] == e:
            src[s] = s
            continue
        rank = s // spr
        local = np.flatnonzero(old_l[rank * spr:(rank + 1) * spr] == e)
        if local.size:
            src[s] = rank * spr + local[0]
        else:
            copies = old.replicas(layer, e)
            src[s] = copies[used[e] % copies.size]
            used[e] += 1
    return src
