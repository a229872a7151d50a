"""EP MoE against the dense ``MoE`` on 8 fake CPU devices; run as a script by tests/test_ep_moe.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharded/ep_moe_check.py

Prints one JSON object per check (``{"check": name, ...numbers}``) and exits non-zero on the first failure.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deepinfer_jax.model.layers import matmul_t
from deepinfer_jax.model.moe import MoE, route
from deepinfer_jax.parallel import ep_moe as ep_moe_module
from deepinfer_jax.parallel.ep_moe import EPConfig, ep_moe
from deepinfer_jax.parallel.eplb import compute_placement, identity_placement, move_sources
from deepinfer_jax.parallel.eplb_policy import expert_counts
from deepinfer_jax.parallel.mesh import auto_mesh
from deepinfer_jax.parallel.weight_moves import apply_placement, to_slots

DEFAULT = EPConfig()
TOL = 2e-5  # relative to the largest output entry (fp32; only summation order differs)
N_EXPERTS, TOP_K, D, INTER, N_TOKENS = 16, 3, 16, 8, 32


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
                               axis_index_groups=None):
    """``lax.ragged_all_to_all`` as its docstring defines it, built from all_gather (XLA:CPU lacks the real one):
    sender s's rows ``operand[input_offsets[r] : + send_sizes[r]]`` land in receiver r's output at
    ``output_offsets[r]`` (offsets as the sender gives them)."""
    del recv_sizes, axis_index_groups
    ops = jax.lax.all_gather(operand, axis_name)  # [ep, rows, ...]
    io, ss, oo = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
    me = jax.lax.axis_index(axis_name)
    j = jnp.arange(output.shape[0])
    start, size = oo[:, me], ss[:, me]
    inside = (j[None] >= start[:, None]) & (j[None] < (start + size)[:, None])  # [ep, out rows]
    src = jnp.argmax(inside, 0)
    row = jnp.clip(io[src, me] + j - start[src], 0, operand.shape[0] - 1)
    hit = inside.any(0).reshape((-1,) + (1,) * (output.ndim - 1))
    return jnp.where(hit, ops[src, row], output)


def report(check: str, **numbers) -> None:
    print(json.dumps({"check": check, **numbers}), flush=True)


def build():
    cfg = SimpleNamespace(initializer_range=0.3, hidden_size=D, moe_intermediate_size=INTER,
                          n_routed_experts=N_EXPERTS, num_experts_per_tok=TOP_K, swiglu_limit=7.0,
                          routed_scaling_factor=1.5, norm_topk_prob=True)
    moe = MoE(cfg, rngs=nnx.Rngs(0))
    moe.gate.bias[...] = jax.random.normal(jax.random.key(1), (N_EXPERTS,)) * 0.3
    x = jax.random.normal(jax.random.key(2), (N_TOKENS, D), jnp.float32)
    return moe, x


def main() -> int:
    assert jax.device_count() == 8, f"needs 8 devices, got {jax.device_count()}"
    moe, x = build()
    ref = np.asarray(moe(x))
    shared = np.asarray(moe.shared_experts(x))
    scale = float(np.abs(ref).max())
    logits = matmul_t(x, moe.gate.weight[...])
    _, ids = route(logits, moe.gate.bias[...], TOP_K, moe.scale, moe.renormalize)
    ref_counts = np.bincount(np.asarray(ids).ravel(), minlength=N_EXPERTS)
    experts_E = {"w1": moe.experts.w1[...], "w3": moe.experts.w3[...], "w2": moe.experts.w2[...]}
    traces, jitted = [], {}

    def run(xx, tables, slots, mesh, config):
        """One jitted EP MoE per (mesh, config): new tables and weights of the same shapes never retrace."""
        if (mesh, config) not in jitted:
            def f(xx, gw, gb, slots, tables):
                traces.append(1)
                return ep_moe(xx, gw, gb, slots, tables, mesh=mesh, top_k=TOP_K, scale=moe.scale,
                              renormalize=moe.renormalize, limit=moe.limit, config=config)

            jitted[mesh, config] = jax.jit(f)
        return jitted[mesh, config](xx, moe.gate.weight[...], moe.gate.bias[...], slots, tables)

    def check(name, placement, mesh, config=DEFAULT):
        slots = to_slots(experts_E, placement, mesh)
        y, stats = run(x, placement.tables(0), slots, mesh, config)
        err = float(np.abs(np.asarray(y) + shared - ref).max()) / scale
        counts = np.asarray(stats.slot_counts)
        per_expert = expert_counts(counts[None], placement)[0]
        report(name, err=err, total=int(counts.sum()), expected_total=N_TOKENS * TOP_K,
               passes=int(stats.passes), overflow=int(stats.overflow),
               counts_match=bool(np.array_equal(per_expert, ref_counts)))
        assert err < TOL, (name, err)
        assert counts.sum() == N_TOKENS * TOP_K and np.array_equal(per_expert, ref_counts), name
        return y, stats, slots

    mesh18, mesh24 = auto_mesh((1, 8), ("dp", "ep")), auto_mesh((2, 4), ("dp", "ep"))
    skew = np.asarray(ref_counts, float)[None] ** 2
    replicated = compute_placement(skew, 4, 2)
    assert replicated.replica_count.max() > 1
    _, stats, _ = check("dp2_ep4_replicas", replicated, mesh24)
    # the replicas of an expert all receive tokens (the split really spreads them)
    hot = int(np.argmax(replicated.replica_count[0]))
    hot_slots = replicated.replicas(0, hot)
    report("replica_split", expert=hot, slot_counts=np.asarray(stats.slot_counts)[hot_slots].tolist())
    assert (np.asarray(stats.slot_counts)[hot_slots] > 0).all()
    _, stats, _ = check("ep8_overflow", compute_placement(skew, 8, 1), mesh18, EPConfig(capacity=1))
    assert int(stats.passes) > 1 and int(stats.overflow) > 0, "capacity 1 must overflow"

    # rebalance in the middle: same jitted function, new tables and moved weights, same outputs
    traces.clear()
    old = identity_placement(1, N_EXPERTS, 8, 1)
    y_old, stats_old, slots_old = check("ep8_rebalance_before", old, mesh18)
    new = compute_placement(expert_counts(np.asarray(stats_old.slot_counts)[None], old), 8, 1)
    assert new != old
    moved = apply_placement(slots_old, old, new, mesh18)
    exact = all(np.array_equal(np.asarray(moved[k]), np.asarray(to_slots(experts_E, new, mesh18)[k])) for k in moved)
    y_new, stats_new = run(x, new.tables(0), moved, mesh18, EPConfig())
    src = move_sources(old, new, 0)
    remote = int((src // old.slots_per_rank != np.arange(old.n_slots) // old.slots_per_rank).sum())
    diff = float(np.abs(np.asarray(y_new) - np.asarray(y_old)).max()) / scale
    report("rebalance_after", err=diff, weights_exact=exact, slots_moved_between_ranks=remote, traces=len(traces),
           total=int(np.asarray(stats_new.slot_counts).sum()))
    assert exact and diff < TOL and len(traces) == 1 and remote > 0

    # the ragged path's offsets, checked against the documented semantics of lax.ragged_all_to_all
    real, jax.lax.ragged_all_to_all = jax.lax.ragged_all_to_all, emulated_ragged_all_to_all
    supported, ep_moe_module._ragged_supported = ep_moe_module._ragged_supported, lambda mesh: True
    try:
        check("dp2_ep4_ragged_emulated", replicated, mesh24, EPConfig(dispatch="ragged_all_to_all"))
    finally:
        jax.lax.ragged_all_to_all, ep_moe_module._ragged_supported = real, supported

    # bad settings are clear errors
    for name, thunk, exc in [
        ("ragged_on_cpu", lambda: run(x, old.tables(0), slots_old, mesh18, EPConfig(dispatch="ragged_all_to_all")),
         NotImplementedError),
        ("tokens_not_divisible", lambda: run(x[:30], old.tables(0), slots_old, mesh18, EPConfig()), ValueError),
        ("bad_dispatch", lambda: EPConfig(dispatch="nccl"), ValueError),
    ]:
        try:
            thunk()
        except exc as e:
            report(name, raised=type(e).__name__, message=str(e)[:120])
        else:
            report(name, raised=None)
            raise AssertionError(f"{name} did not raise {exc.__name__}")
    report("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
