"""The model step over a device mesh: one program for every attention data-parallel rank (engine.md §4).

Used by ``ModelRunner`` when it is given a mesh and a sharding preset (a single device is the
runner without one). Each DP rank is its own scheduling domain with its own KV cache: ``cache_cfg``
describes one rank's cache and the runner keeps ``dp`` of them stacked along a leading axis placed
on the mesh's DP axes (``stacked_cache``). A step stacks the ranks' ``StepInputs`` along ``dp`` and
runs ``jax.vmap`` of the engine's model step (``step_programs.forward_step``) over that axis in one
jit split over the DP axes (``programs``). Along the DP mesh axes that no parameter is split over
(``manual_axes``) the step runs as one program per rank (``shard_map``), so a rank's attention stays
on its devices; the other axes (``ep``) are left to GSPMD. (Measured: with GSPMD alone along ``dp``
too, it gathers the batched ``top_k`` inputs of every rank to every device.)

With EPLB (``ep_size > 1`` and the preset's ``eplb.enabled``) the step runs as one program per device
(``dp_forward_ep``, ``shard_map`` manual over every mesh axis) with the ``"ep"`` MoE strategy
(``model.moe_strategy``; its ``parallel.ep_model.StepEP`` from ``ep_spec``) as a static argument and every
layer's routing tables as a jit argument, and returns every layer's pair count per physical slot.
Sampling is one program over the ``dp x rows`` logits (``dp_sample``).

Speculative decoding (``runner.spec_step.SpeculativeStep`` over a mesh, ``spec_programs``): the same layout for the
speculative pair of ``step_programs``. The model step (``dp_spec_forward``, or ``dp_spec_forward_ep`` with the EP
MoE) builds each rank's verify rows from that rank's slice of the stacked speculative state and runs every rank
in one program split over the DP axes, as the plain step does; acceptance and drafting (``dp_spec_sample``) is
one program over every rank's rows (``jax.vmap`` along dp). Each rank has its own verification budget and its own
drafting switch (``SpecRows.budget`` and ``draft`` carry the dp axis).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from deepinfer_jax import compile_options
from deepinfer_jax import sharding as sh
from deepinfer_jax.model.kv_cache import init_cache
from deepinfer_jax.model.moe_strategy import MoEStrategy
from deepinfer_jax.parallel import ep_model
from deepinfer_jax.runner.step_programs import forward_step, sample_rows, spec_forward_step, spec_sample_step

__all__ = ["dp_forward", "dp_forward_ep", "dp_sample", "dp_spec_forward", "dp_spec_forward_ep", "dp_spec_sample",
           "ep_spec", "manual_axes", "per_rank", "programs", "spec_programs", "stacked_cache"]


def dp_forward(cfg, cache_cfg, params, cache, last_ids, feed, inputs):
    """The engine's model step on every rank: cache leaves [dp, ...], last_ids [dp, slots], feed [dp, N],
    inputs leaves [dp, ...] -> (logits [dp, R, V] f32, the new cache)."""
    step = lambda c, last, f, inp: forward_step(params, cfg, cache_cfg, c, last, f, inp)
    return jax.vmap(step)(cache, last_ids, feed, inputs)


def dp_sample(num_top, logits, mask, has_mask, sampling, last_ids, sample_slot):
    """Sample every rank's rows at once: logits [dp, R, V] -> rows [dp * R]; ``sample_slot`` [dp * R] indexes
    the flattened ``last_ids`` [dp, slots] (rank * slots + slot; dp * slots = none)."""
    dp, rows, vocab = logits.shape
    out, flat = sample_rows(num_top, logits.reshape(dp * rows, vocab), mask, has_mask, sampling,
                             last_ids.reshape(-1), sample_slot)
    return out, flat.reshape(last_ids.shape)


def dp_forward_ep(cfg, cache_cfg, moe, params, tables, cache, last_ids, feed, inputs):
    """One device's share of the EP step (inside ``shard_map`` manual over the whole mesh) under the ``"ep"``
    strategy ``moe``: the leading dp axis of cache / last_ids / feed / inputs has size 1 (this device's DP rank);
    ``params`` holds this device's expert slots, ``tables`` every layer's routing tables [L, ...]. -> (logits
    [1, R, V], the new cache, slot counts [L, P] of the whole mesh)."""
    first = lambda tree: jax.tree.map(lambda a: a[0], tree)
    inp = first(inputs)
    logits, cache, counts = forward_step(params, cfg, cache_cfg, first(cache), last_ids[0], feed[0], inp, moe, tables)
    return logits[None], jax.tree.map(lambda a: a[None], cache), counts


def ep_spec(preset, mesh: Mesh) -> ep_model.StepEP:
    """The EP step's static layout and MoE implementation (the preset passed ``validate_engine``); ShardingError
    ``eplb.dispatch`` for ragged_all_to_all on CPU devices (XLA:CPU lacks it)."""
    if preset.eplb.dispatch == "ragged_all_to_all" and mesh.devices.flat[0].platform == "cpu":
        raise sh.ShardingError("eplb.dispatch", "ragged_all_to_all needs GPU/TPU devices (XLA:CPU lacks it); use "
                               "dispatch = \"all_to_all\" on CPU")
    sizes = tuple((a, int(mesh.shape[a])) for a in mesh.axis_names)
    split = tuple(a for a, n in sizes if a not in preset.dp_axes and n > 1)  # a rank's tokens are replicated there
    config = ep_model.EPConfig(dispatch=preset.eplb.dispatch, ep_axis=preset.ep_axes[0])
    return ep_model.StepEP(config=config, axis_sizes=sizes, split_axes=split)


def manual_axes(preset, param_sh) -> tuple[str, ...]:
    """The DP mesh axes that no parameter is split over: the step runs as one program per rank along them."""
    used = set()
    for s in jax.tree.leaves(param_sh, is_leaf=lambda x: isinstance(x, NamedSharding)):
        for part in s.spec:
            used |= set(part) if isinstance(part, tuple) else {part} if part is not None else set()
    return tuple(a for a in preset.dp_axes if a not in used)


def per_rank(fn, mesh: Mesh, manual: tuple[str, ...]):
    """``fn`` (params, then four arrays with a leading dp axis) as one program per rank along the ``manual`` mesh
    axes (``shard_map``; the other axes, e.g. ``ep``, stay with GSPMD). Without it GSPMD cannot split some
    batched ops (``top_k``) along dp and gathers their inputs to every device."""
    if not manual or not hasattr(jax, "shard_map"):  # GSPMD alone (still correct)
        return fn
    dp = PartitionSpec(manual)
    return jax.shard_map(fn, mesh=mesh, in_specs=(PartitionSpec(), dp, dp, dp, dp), out_specs=(dp, dp),
                         axis_names=set(manual), check_vma=False)


@functools.lru_cache(maxsize=8)
def programs(cfg, cache_cfg, mesh: Mesh, dp_axes: tuple[str, ...], manual: tuple[str, ...], ep_spec,
             param_specs: tuple, param_treedef):
    """The jitted (model step, sampling program) of one model, cache layout, mesh, EP layout (``ep_spec``: None, or
    the ``StepEP`` of the ``"ep"`` MoE strategy, a static argument of the step) and parameter layout. Cached:
    a second runner over the same layout (another engine, a preset differing only in EPLB timing) reuses the
    compiled programs instead of tracing and compiling them again."""
    dp = NamedSharding(mesh, PartitionSpec(dp_axes or None))
    param_sh = jax.tree_util.tree_unflatten(param_treedef, [NamedSharding(mesh, s) for s in param_specs])
    if ep_spec is None:
        step = per_rank(functools.partial(dp_forward, cfg, cache_cfg), mesh, manual)
        forward = compile_options.jit(step, donate_argnums=(1,), in_shardings=(param_sh, dp, dp, dp, dp),
                                      out_shardings=(dp, dp))
    else:
        dps, repl = PartitionSpec(dp_axes or None), PartitionSpec()
        moe = MoEStrategy("ep", ep_spec)
        step = jax.shard_map(functools.partial(dp_forward_ep, cfg, cache_cfg, moe), mesh=mesh,
                             in_specs=(jax.tree_util.tree_unflatten(param_treedef, param_specs), repl, dps, dps, dps,
                                       dps),
                             out_specs=(dps, dps, repl), axis_names=set(manual), check_vma=False)
        replicated = NamedSharding(mesh, repl)
        forward = compile_options.jit(step, donate_argnums=(2,), in_shardings=(param_sh, replicated, dp, dp, dp, dp),
                                      out_shardings=(dp, dp, replicated))
    sample = compile_options.jit(dp_sample, static_argnums=(0,),
                                 out_shardings=(NamedSharding(mesh, PartitionSpec()), dp))
    return forward, sample  # the sampled tokens come back replicated: every process reads them locally


def stacked_cache(cfg, cache_cfg, dp: int):
    """``init_cache`` repeated ``dp`` times along a new leading axis."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a[None], (dp, *a.shape)), init_cache(cfg, cache_cfg))


def dp_spec_forward(cfg, cache_cfg, params, drafter, cache, spec, last_ids, inputs, rows):
    """The speculative model step on every rank: cache, spec, last_ids, inputs and rows with a leading dp axis ->
    (logits [dp, M, V], cache, spec, layout, the rows' slots [dp, R])."""
    step = lambda c, s, last, inp, r: spec_forward_step(params, drafter, cfg, cache_cfg, c, s, last, inp, r)
    return jax.vmap(step)(cache, spec, last_ids, inputs, rows)


def dp_spec_forward_ep(cfg, cache_cfg, moe, params, tables, drafter, cache, spec, last_ids, inputs, rows):
    """One device's share of the speculative EP step (``shard_map`` manual over the whole mesh; the leading dp axis
    has size 1), as ``dp_forward_ep``: the outputs of ``dp_spec_forward`` plus the slot counts [L, P]."""
    first = lambda tree: jax.tree.map(lambda a: a[0], tree)
    logits, cache, spec, layout, slot, counts = spec_forward_step(
        params, drafter, cfg, cache_cfg, first(cache), first(spec), last_ids[0], first(inputs), first(rows), moe,
        tables)
    lead = lambda tree: jax.tree.map(lambda a: a[None], tree)
    return logits[None], lead(cache), lead(spec), lead(layout), slot[None], counts


def dp_spec_sample(num_top, cfg, params, drafter, heads, logits, mask, has_mask, sampling, layout, rows, spec, last_ids,
                   slot, draft, want_logprobs):
    """Acceptance and drafting on every rank: everything but the states, ``has_mask`` and ``want_logprobs`` has a
    leading dp axis (``mask`` [dp, R, W], ``draft`` [dp])."""
    step = lambda lg, m, smp, lay, r, s, last, sl, d: spec_sample_step(
        num_top, cfg, params, drafter, heads, lg, m, has_mask, smp, lay, r, s, last, sl, d, want_logprobs)
    return jax.vmap(step)(logits, mask, sampling, layout, rows, spec, last_ids, slot, draft)


@functools.lru_cache(maxsize=8)
def spec_programs(cfg, cache_cfg, mesh: Mesh, dp_axes: tuple[str, ...], manual: tuple[str, ...], ep_spec,
                  param_specs: tuple, param_treedef):
    """The jitted (speculative model step, acceptance program) of one layout (``programs``' arguments). The
    drafter and its heads are replicated; the step donates the cache and the speculative state."""
    dp = NamedSharding(mesh, PartitionSpec(dp_axes or None))
    repl = NamedSharding(mesh, PartitionSpec())
    param_sh = jax.tree_util.tree_unflatten(param_treedef, [NamedSharding(mesh, s) for s in param_specs])
    dps = PartitionSpec(dp_axes or None)
    if ep_spec is None:
        step = functools.partial(dp_spec_forward, cfg, cache_cfg)
        if manual and hasattr(jax, "shard_map"):  # one program per rank along the manual axes (``per_rank``)
            mp = PartitionSpec(manual)
            step = jax.shard_map(step, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec(), mp, mp, mp, mp, mp),
                                 out_specs=(mp,) * 5, axis_names=set(manual), check_vma=False)
        forward = compile_options.jit(step, donate_argnums=(2, 3), in_shardings=(param_sh, repl, dp, dp, dp, dp, dp),
                                      out_shardings=(dp,) * 5)
    else:
        moe = MoEStrategy("ep", ep_spec)
        step = jax.shard_map(functools.partial(dp_spec_forward_ep, cfg, cache_cfg, moe), mesh=mesh,
                             in_specs=(jax.tree_util.tree_unflatten(param_treedef, param_specs), PartitionSpec(),
                                       PartitionSpec(), dps, dps, dps, dps, dps),
                             out_specs=(dps,) * 5 + (PartitionSpec(),), axis_names=set(manual), check_vma=False)
        forward = compile_options.jit(step, donate_argnums=(3, 4),
                                      in_shardings=(param_sh, repl, repl, dp, dp, dp, dp, dp),
                                      out_shardings=(dp,) * 5 + (repl,))
    sample = compile_options.jit(dp_spec_sample, static_argnums=(0, 1), donate_argnums=(11, 12),
                                 out_shardings=(repl, repl, repl, repl, dp, dp))
    return forward, sample
