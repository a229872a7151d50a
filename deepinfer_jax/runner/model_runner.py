"""ModelRunner: turns scheduled request chunks into padded device inputs and runs the jitted step.

One runner for one device and for a device mesh. Without ``mesh`` it owns one KV cache (a single
device is the mesh ``dp=1, ep=1``); with ``mesh`` and a sharding ``preset`` it owns one cache per
attention data-parallel rank, stacked along a leading ``dp`` axis (engine.md §4), the parameters
placed by the preset's rules, and runs every rank's step in one program (``runner.mesh_step``;
with EPLB the EP MoE and its placement, ``set_placement`` / ``slot_counts``). The host side is the
same either way: a step is one chunk list per rank (one device: just the chunk list), each rank
padded to one common bucket shape (an idle rank is all padding, which writes nothing), and its
sampled ids stay on the device, in a ``[slots]`` (one device) or ``[dp, slots]`` buffer, feeding
the next step by rank and slot. The jitted programs themselves are ``runner.step_programs``.

Speculation and context parallelism are step components the runner holds, not other runners
(``runner.spec_step.SpeculativeStep`` as ``speculation``, ``runner.cp_step.ContextParallelStep`` as
``context_parallel``): ``forward`` / ``sample`` / ``precompile`` / ``execute`` hand them their part.

Two entry points share the model step: ``execute`` returns logits (for tests and research),
``launch`` (= ``forward`` then ``sample``, two jitted programs) samples after the step
(``model.sampler``) and returns a ``PendingStep`` without waiting for the device; between
``forward`` and ``sample`` the host may compute structured-output token masks while the device
already runs the step, which is what the engine's asynchronous loop needs (engine.md §2.2): the
sampled ids also stay on the device, in a per-slot buffer, and a later step can take its first
token from there (``ChunkSpec.feed_last``) before the host has seen it.

The only place that converts between host data (lists of ids, block tables) and device arrays.
``execute`` validates the whole batch before anything reaches the device, so a bad chunk raises
``StepInputError`` and leaves the cache (and every other request's state) untouched. The cache is
donated to the step; shapes are bucketed and all buckets compile in ``precompile``; ``traces``
counts compilations so tests can assert that a long mixed run never recompiles.

The prefix cache's copies (``snapshot_swa`` / ``restore_swa``, ``read_blocks`` / ``write_blocks``) take the DP
``rank`` whose slot or blocks they touch: over a mesh they copy into and out of that rank's slice of the stacked
cache (what they read comes back replicated, host payloads and windows are rank-independent), on one device
``rank`` is 0 and the programs are the single-cache ones. The engine roles' whole-slot copies (``snapshot_slot`` /
``restore_slot``) take ``rank`` the same way: over a mesh they read (as a gather: one all-reduce of the slot
state's size, no gather of every rank's cache) or write only that rank's slot, and the state has the one-device
names and shapes, so a slot moves between a one-device engine and a DP one. Decoder bounded replay
(``decoder_replay``) pads every rank's decoder tokens to one bucket. Over a mesh the logits-only ``execute`` is
not supported yet (``ValueError``); several processes
(``jax.distributed``) pass the same host inputs, which become global arrays (``parallel.mesh.put_global``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax import compile_options
from deepinfer_jax.model.host_arrays import filled
from deepinfer_jax.model.kv_cache import init_cache
from deepinfer_jax.model.paged import StepInputs
from deepinfer_jax.model.sampler import SamplingInputs
from deepinfer_jax.runner import step_programs
from deepinfer_jax.runner.buckets import Buckets, BucketUse
from deepinfer_jax.runner.program_store import stored_jit
from deepinfer_jax.runner.step_batch import (
    ChunkSpec,
    SampleSpec,
    StepInputError,
    build_inputs,
    check_chunks,
    check_runner_settings,
    logit_rows,
    pick_shape,
    sampling_batch,
    validate_chunks,
)
from deepinfer_jax.runner.step_output import SampledToken, StepOutput
from deepinfer_jax.runner.step_programs import count_trace, forward_step_flat, logits_step_flat, sample_rows

__all__ = ["ChunkSpec", "Forward", "ModelRunner", "PendingStep", "SampleSpec", "StepInputError"]


def _snapshot(cache, slot, at=()):
    """The slot's SWA ring of every layer (a copy; [L, cap, ...] per storage leaf). ``at``: the leading
    index of a stacked cache (over a mesh: ``(rank,)``, the DP rank's slice; one device: none)."""
    return jax.tree.map(lambda a: a[(*at, slice(None), slot)], cache["swa"])


def _rank_snapshot(cache, slot, at):
    """``_snapshot`` of DP rank ``at[0]``'s slot in a stacked cache, as a gather: GSPMD partitions it locally (each
    device reads its own rank's slice, masked, and one all-reduce of the window's size combines them), where a
    dynamic slice along the sharded rank axis would gather every rank's rings first."""
    return jax.tree.map(lambda a: a[at[0][None], :, slot][0], cache["swa"])


def _restore(cache, slot, rows, engram_pos, engram_ids, at=()):
    """Write a saved ring into ``slot`` and its Engram look-back (``_set_engram``)."""
    cache = {**cache, "swa": jax.tree.map(lambda a, r: a.at[(*at, slice(None), slot)].set(r), cache["swa"], rows)}
    return _set_engram(cache, slot, engram_pos, engram_ids, at)


def _slot_state(cache, slot):
    """Everything ``slot`` holds besides block KV: its SWA rings (every layer), the compressor's
    pending groups and the Engram look-back (a copy; the slot axis removed)."""
    state = {"swa": jax.tree.map(lambda a: a[:, slot], cache["swa"]),
             "comp": jax.tree.map(lambda a: a[slot], cache["comp"])}
    if "engram" in cache:
        state["engram"] = cache["engram"][slot]
    return state


def _rank_slot_state(cache, slot, at):
    """``_slot_state`` of DP rank ``at[0]``'s slot in a stacked cache, as gathers (``_rank_snapshot``'s way: each
    device reads its own rank's slice, masked, and all-reduces combine them): the slot state's layout."""
    rank = at[0][None]
    state = {"swa": jax.tree.map(lambda a: a[rank, :, slot][0], cache["swa"]),
             "comp": jax.tree.map(lambda a: a[rank, slot][0], cache["comp"])}
    if "engram" in cache:
        state["engram"] = cache["engram"][rank, slot][0]
    return state


def _one_rank_slot_state(mesh, dp_axes, cache, slot, at):
    """``_rank_slot_state`` with one collective: per rank (``shard_map`` over the DP axes) the local slot state as
    bytes, zero unless this is rank ``at[0]``, then one all-reduce (``psum``) of the state's bytes over the DP
    axes; the bytes become the leaves again. Nothing of the cache beyond the one slot leaves a device."""
    from jax.sharding import PartitionSpec

    part = {k: cache[k] for k in ("swa", "comp", "engram") if k in cache}
    shapes = jax.eval_shape(lambda c: _slot_state(jax.tree.map(lambda a: a[0], c), 0), part)
    leaves, tree = jax.tree_util.tree_flatten(shapes)

    def local(c, slot, rank):
        state = jax.tree.leaves(_slot_state(jax.tree.map(lambda a: a[0], c), slot))
        raw = jnp.concatenate([jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1) for x in state])
        return jax.lax.psum(jnp.where(jax.lax.axis_index(dp_axes) == rank, raw, 0).astype(jnp.uint8), dp_axes)

    dp, rep = PartitionSpec(dp_axes), PartitionSpec()
    raw = jax.shard_map(local, mesh=mesh, in_specs=(dp, rep, rep), out_specs=rep, axis_names=set(dp_axes),
                        check_vma=False)(part, slot, at[0])
    out, start = [], 0
    for leaf in leaves:
        width = jnp.dtype(leaf.dtype).itemsize
        n = int(np.prod(leaf.shape, dtype=np.int64)) * width
        chunk = raw[start : start + n].reshape(*leaf.shape, width) if width > 1 else raw[start : start + n]
        out.append(jax.lax.bitcast_convert_type(chunk, leaf.dtype).reshape(leaf.shape))
        start += n
    return jax.tree_util.tree_unflatten(tree, out)


def _set_slot_state(cache, slot, state, at=()):
    """Write a ``_slot_state`` copy into ``slot`` (``at``: the DP rank's slice of a stacked cache, as ``_restore``)."""
    out = {**cache, "swa": jax.tree.map(lambda a, r: a.at[(*at, slice(None), slot)].set(r), cache["swa"], state["swa"]),
           "comp": jax.tree.map(lambda a, r: a.at[(*at, slot)].set(r), cache["comp"], state["comp"])}
    if "engram" in cache:
        out["engram"] = cache["engram"].at[(*at, slot)].set(state["engram"])
    return out


def _read_blocks(cache, block_ids, at=()):
    """Every KV-source layer's stored rows of ``block_ids`` [n] (the block axis first)."""
    return jax.tree.map(lambda a: a[(*at, block_ids)], cache["global"])


def _write_blocks(cache, block_ids, rows, at=()):
    """Write rows into ``block_ids``; out-of-range ids (padding) write nothing."""
    return {**cache, "global": jax.tree.map(lambda a, r: a.at[(*at, block_ids)].set(r, mode="drop"), cache["global"],
                                            rows)}


def _set_engram(cache, slot, engram_pos, engram_ids, at=()):
    """Put token ``engram_ids`` [n-1] at positions ``engram_pos`` [n-1] of ``slot``'s Engram ring (-1 = none)."""
    if "engram" not in cache:
        return cache
    ring = cache["engram"]
    slots, size = ring.shape[len(at)], ring.shape[len(at) + 1]
    where = (*at, jnp.where(engram_pos >= 0, slot, slots), jnp.mod(engram_pos, size))
    return {**cache, "engram": ring.at[where].set(engram_ids, mode="drop")}


def no_mask(cache: dict, rows: int, words: int, make) -> jax.Array:
    """The all-ones token mask of ``rows`` sampling rows (made once per row count by ``make(shape)``, kept in
    ``cache``): a step without a structured-output constraint passes it, so one program serves both."""
    if rows not in cache:
        cache[rows] = make((rows, words))
    return cache[rows]


def quantized_split_ok(preset) -> bool:
    """Whether quantized-resident weights run on ``preset``: every parameter replicated (attention data parallelism
    alone), or the routed experts split over ``ep`` by the engine's EP MoE with everything else replicated."""
    return not preset.context_parallel and (math.prod(preset.shape) == preset.dp_size or preset.engine_expert_parallel)


def _check_quantized_split(params, preset) -> None:
    """``QWeightError`` (field ``weights``) for quantized-resident weights on a preset that splits more than attention
    data parallelism and the engine's EP MoE (``quantized_split_ok``): other splits place float leaves."""
    from deepinfer_jax.model.qweight import QWeight, QWeightError

    if quantized_split_ok(preset):
        return
    if any(isinstance(x, QWeight) for x in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QWeight))):
        raise QWeightError(f"quantized-resident weights run over attention data parallelism and the engine's EP MoE; "
                           f"the preset {preset.name!r} ({dict(zip(preset.axes, preset.shape))}) splits otherwise: "
                           "load float weights", "weights")


@dataclass
class Forward:
    """A dispatched model step whose sampling is still to dispatch (``ModelRunner.sample``). The logits rows
    are rank-major (rank d's request row k is row ``d * rows_per_rank + k``; one device: rank 0 alone),
    ``chunk_rows[i]`` is chunk i's row, rows past the chunks are padding."""

    logits: jax.Array  # [rows, vocab] (one device) or [dp, rows_per_rank, vocab] f32, on the device(s)
    sampling: SamplingInputs  # [rows]
    sample_slot: np.ndarray  # [rows] where each row's token is stored (rank * slots + slot; out of range = none)
    chunks: list  # every rank's chunks, rank by rank
    rows: int  # the sampling program's rows: dp * the request bucket (the mask's rows)
    chunk_rows: list[int] | None = None  # None: chunk i is row i
    slot_counts: jax.Array | None = None  # EP step: [L, P] int32 pairs per physical slot (``ModelRunner.slot_counts``)
    placement: object = None  # EP step: the ``parallel.eplb.Placement`` the step ran with


class PendingStep:
    """A launched step; ``result()`` waits for the device and returns, per chunk in launch order, a
    ``SampledToken`` ``(token, logprob, top_ids, top_logprobs)`` or None for chunks that sampled nothing;
    ``output()`` is the same as a ``StepOutput``."""

    def __init__(self, sampled, chunks: Sequence[ChunkSpec], rows: Sequence[int] | None = None):
        self._sampled, self._chunks, self._result = sampled, chunks, None
        self._rows = range(len(chunks)) if rows is None else rows  # chunk i's row of the sampled arrays

    def result(self) -> list[SampledToken | None]:
        if self._result is None:
            ids, lp, top_ids, top_lp = (np.asarray(a) for a in self._sampled)
            self._result = [SampledToken(int(ids[i]), float(lp[i]), top_ids[i], top_lp[i]) if c.sample is not None
                            else None for i, c in zip(self._rows, self._chunks)]
            self._sampled = None
        return self._result

    def output(self) -> StepOutput:
        """``result()`` as the engine core's typed ``StepOutput`` (one token per sampling chunk)."""
        return StepOutput.plain(self.result())


class ModelRunner:
    """Owns the device cache(s) and the compiled step for one model and cache layout, on one device or over
    a mesh.

    ``mesh`` / ``preset`` (a ``sharding.ShardingPreset`` or its name): the attention data-parallel ranks
    (``dp_size``), one cache each; ``cache_cfg`` is one rank's cache. Without them: one device, ``dp_size`` 1.
    A preset with a ``cp`` axis keeps one cache on the mesh's first device (``mesh`` stays None) and adds the
    context-parallel step component (``runner.cp_step``; ``cp_pad_to``: its piece padding).

    ``drafter`` (the DSpark drafter's state) adds the speculative step component (``runner.spec_step``;
    ``draft_vocab``: the ids it may propose, None = all): the engine's step is then the speculative one. The
    components share the runner's cache, slots, buckets and mesh; the runner's entry points hand them their part.
    """

    def __init__(self, cfg, params, cache_cfg, buckets: Buckets | None = None, num_top_logprobs: int = 5,
                 decoder_replay: bool = False, *, mesh=None, preset=None, drafter=None, draft_vocab=None,
                 cp_pad_to: int = 64, program_log=None):
        cache_cfg.validate_for(cfg)
        self.cfg, self.cache_cfg = cfg, cache_cfg
        #: The ``program_store.ProgramLog`` the stored step programs record their files in (``LLM`` gives one).
        self.program_log = program_log
        self.buckets = buckets or Buckets()
        check_runner_settings(self.buckets, cache_cfg, num_top_logprobs)
        self.num_top_logprobs = num_top_logprobs
        if decoder_replay and cfg.decoder_start >= cfg.num_hidden_layers - 1:
            raise ValueError("decoder_replay needs a model with decoder layers (a CED split)")
        if (mesh is None) != (preset is None):
            raise ValueError("mesh and preset: give both (a device mesh) or neither (one device)")
        if preset is not None:
            from deepinfer_jax import sharding as sh

            preset = sh.resolve_preset(preset)
            _check_quantized_split(params, preset)
        cp = preset is not None and preset.context_parallel
        if cp and drafter is not None:
            raise ValueError(f"speculation with context parallelism ({preset.name!r}) is not supported yet: "
                             "give no drafter (docs/context_parallel.md)")
        self.decoder_replay = decoder_replay
        self.mesh, self.preset, self.dp_size = (None if cp else mesh), None, 1
        #: The EPLB placement of the experts' physical slots (None: no EP MoE).
        self.placement = None
        self.ep_spec = None
        self._move_traces = None  # over a mesh: the weight-move programs' trace counter
        self._logical = None  # (placement, parameters in the model's layout) for ``logical_params``
        # the lazy engine sets .lazy (LLM(precompile="lazy"))
        self.bucket_use = BucketUse(self.buckets.tokens, blocks=self.buckets.blocks)
        self.mask_words = (cfg.vocab_size + 31) // 32
        self._no_mask: dict[int, jax.Array] = {}  # rows -> an all-ones mask on the device(s)
        #: The step components (None when off): ``runner.spec_step.SpeculativeStep`` (built from ``drafter``) and
        #: ``runner.cp_step.ContextParallelStep`` (a preset with a ``cp`` axis).
        self.speculation = self.context_parallel = None
        if cp:  # one cache on the mesh's first device; long prompts' chunks over the cp ranks
            from deepinfer_jax.runner.cp_step import ContextParallelStep, check_cp_mesh

            check_cp_mesh(mesh, preset)
            with jax.default_device(mesh.devices.flat[0]):
                self._one_device_programs(params)
            self.context_parallel = ContextParallelStep(self, params, mesh, preset, cp_pad_to)
        elif mesh is None:
            self._one_device_programs(params)
        else:
            self._mesh_programs(params, mesh, preset)
        if drafter is not None:
            from deepinfer_jax.runner.spec_step import SpeculativeStep

            self.speculation = SpeculativeStep(self, params, drafter, draft_vocab)

    def _one_device_programs(self, params) -> None:
        cfg, cache_cfg = self.cfg, self.cache_cfg
        self.params = params
        self.cache = init_cache(cfg, cache_cfg)
        self.last_ids = filled((cache_cfg.max_requests,), jnp.int32)
        self._pleaves, self._ptree = jax.tree_util.tree_flatten(params)
        # the step programs: traced once per machine and kept on disk (runner.program_store)
        log = self.program_log
        self._fn = stored_jit(logits_step_flat, "step", (0, 2, 3), (4,), on_build=count_trace, log=log)
        self._forward_fn = stored_jit(forward_step_flat, "forward", (0, 2, 3), (4,), on_build=count_trace, log=log)
        self._sample_fn = stored_jit(sample_rows, "sample", (0,), on_build=count_trace, log=log)
        self._snapshot_fn = stored_jit(_snapshot, "snapshot", log=log)  # in every step that saves a window
        self._restore_fn = compile_options.jit(_restore, donate_argnums=(0,))
        self._set_engram_fn = compile_options.jit(_set_engram, donate_argnums=(0,))
        self._read_blocks_fn = compile_options.jit(_read_blocks)
        self._slot_state_fn = compile_options.jit(_slot_state)
        self._set_slot_state_fn = compile_options.jit(_set_slot_state, donate_argnums=(0,))
        self._write_blocks_fn = compile_options.jit(_write_blocks, donate_argnums=(0,))
        flat, self._global_def = jax.tree_util.tree_flatten_with_path(self.cache["global"])
        self._global_names = [jax.tree_util.keystr(path) for path, _ in flat]

    def _mesh_programs(self, params, mesh, preset) -> None:
        """Over a mesh (``runner.mesh_step``): the stacked caches, the placed parameters, the DP programs."""
        from jax.sharding import NamedSharding, PartitionSpec

        from deepinfer_jax import sharding as sh
        from deepinfer_jax.parallel import weight_moves
        from deepinfer_jax.parallel.eplb import identity_placement
        from deepinfer_jax.runner import mesh_step

        cfg, cache_cfg = self.cfg, self.cache_cfg
        preset = sh.resolve_preset(preset)
        preset.validate_for(cfg)
        self.preset, self.dp_size, self._move_traces = preset, preset.dp_size, weight_moves.TRACES
        self._dp = dp = NamedSharding(mesh, PartitionSpec(preset.dp_axes or None))
        self._multi = jax.process_count() > 1  # host inputs become global arrays (every process passes the same)
        if preset.engine_expert_parallel:
            preset.validate_engine()
            self.ep_spec = mesh_step.ep_spec(preset, mesh)
            self.placement = identity_placement(cfg.num_hidden_layers, cfg.n_routed_experts, preset.ep_size,
                                                preset.eplb.redundant_slots_per_rank)
            params = weight_moves.physical_params(params, self.placement)
        param_sh = sh.param_shardings(params, mesh, preset)
        self.params = sh.shard_params(params, mesh, preset)
        self.cache = compile_options.jit(functools.partial(mesh_step.stacked_cache, cfg, cache_cfg, self.dp_size),
                                         out_shardings=dp)()
        self.last_ids = compile_options.jit(lambda: jnp.zeros((self.dp_size, cache_cfg.max_requests), jnp.int32),
                                            out_shardings=dp)()
        self._replicated = NamedSharding(mesh, PartitionSpec())
        if self.placement is None:
            self.manual_axes = mesh_step.manual_axes(preset, param_sh)
        else:
            self.manual_axes = tuple(mesh.axis_names)
            self.tables = self._device_tables(self.placement)
        # the prefix cache's copies into and out of one rank's slice of the stacked cache (``at=(rank,)``):
        # what they read comes back replicated (every process reads it), the cache keeps its layout
        self._snapshot_fn = compile_options.jit(_rank_snapshot, out_shardings=self._replicated)
        self._read_blocks_fn = compile_options.jit(_read_blocks, out_shardings=self._replicated)
        self._restore_fn = compile_options.jit(_restore, donate_argnums=(0,), out_shardings=dp)
        self._set_engram_fn = compile_options.jit(_set_engram, donate_argnums=(0,), out_shardings=dp)
        self._write_blocks_fn = compile_options.jit(_write_blocks, donate_argnums=(0,), out_shardings=dp)
        self._slot_state_fn = compile_options.jit(functools.partial(_one_rank_slot_state, mesh, tuple(preset.dp_axes)),
                                                  out_shardings=self._replicated)
        self._set_slot_state_fn = compile_options.jit(_set_slot_state, donate_argnums=(0,), out_shardings=dp)
        one_rank = jax.eval_shape(lambda c: jax.tree.map(lambda a: a[0], c["global"]), self.cache)
        flat, self._global_def = jax.tree_util.tree_flatten_with_path(one_rank)
        self._global_names = [jax.tree_util.keystr(path) for path, _ in flat]
        flat, treedef = jax.tree_util.tree_flatten(param_sh)
        self._forward_fn, self._sample_fn = mesh_step.programs(cfg, cache_cfg, mesh, preset.dp_axes, self.manual_axes,
                                                               self.ep_spec, tuple(x.spec for x in flat), treedef)

    @property
    def traces(self) -> int:
        """How many times a step, sampling or weight-move program has been traced (compiled) in this process."""
        return step_programs.TRACES[0] + (self._move_traces[0] if self._move_traces is not None else 0)

    def _one_device(self, what: str) -> None:
        if self.mesh is not None:
            raise ValueError(f"{what}: not supported over a device mesh yet (one device only)")

    # -- EPLB (over a mesh with the EP MoE) ------------------------------------------------------
    def _device_tables(self, placement) -> dict:
        """Every layer's routing tables [L, ...] int32, replicated on the mesh (the EP step's argument)."""
        from deepinfer_jax import sharding as sh
        from deepinfer_jax.parallel.ep_moe import TABLES

        host = {k: np.ascontiguousarray(getattr(placement, k), np.int32) for k in TABLES}
        return sh.place(host, {k: self._replicated for k in host})

    def set_placement(self, new) -> None:
        """Move the experts' weights to ``new`` (between steps; the steps already dispatched keep the old ones) and
        route by its tables from the next step on. ValueError for a placement of another geometry."""
        from deepinfer_jax.parallel import weight_moves

        old = self.placement
        if old is None:
            raise ValueError("set_placement: this runner has no EP MoE (one device, ep_size 1 or eplb.enabled = false)")
        if (new.n_layers, new.n_slots, new.n_ranks, new.n_experts) != (old.n_layers, old.n_slots, old.n_ranks,
                                                                       old.n_experts):
            raise ValueError(f"set_placement: {new.n_layers} layers x {new.n_slots} slots over {new.n_ranks} ranks, "
                             f"the runner has {old.n_layers} x {old.n_slots} over {old.n_ranks}")
        self.params = weight_moves.move_params(self.params, old, new, self.mesh, self.ep_spec.config.ep_axis)
        self.tables, self.placement = self._device_tables(new), new

    def logical_params(self):
        """The parameters in the model's own layout (``forward_full``'s, e.g. for prompt logprobs): ``params``, or with
        the EP MoE the expert stacks taken back from the current placement's slots (``weight_moves.logical_params``:
        a host copy of the experts, remade after each rebalance; the pass then places them replicated)."""
        if self.placement is None:
            return self.params
        if self._logical is None or self._logical[0] is not self.placement:
            from deepinfer_jax import sharding as sh
            from deepinfer_jax.parallel.weight_moves import expert_leaves, logical_params

            leaves, treedef = jax.tree_util.tree_flatten(self.params)
            experts = {i for idx in expert_leaves(self.params).values() for i in idx}
            leaves = [sh.gather_to_host(x) if i in experts else x for i, x in enumerate(leaves)]  # read, no program
            self._logical = (self.placement, logical_params(jax.tree_util.tree_unflatten(treedef, leaves),
                                                            self.placement))
        return self._logical[1]

    def slot_counts(self, fwd: Forward) -> np.ndarray | None:
        """[L, P] int64 pairs per physical slot of a dispatched EP step (waits for it), None without EP."""
        if fwd.slot_counts is None:
            return None
        from deepinfer_jax import sharding as sh

        return np.asarray(sh.gather_to_host(fwd.slot_counts), np.int64)

    def every_rank(self):
        """This runner as the cost-model profiling sees a runner (``engine.profiling``): one chunk list, run by every
        DP rank at once (rank-local slots and blocks), since a DP step lasts as long as its slowest rank."""
        return self if self.mesh is None else _EveryRank(self)

    def precompile(self, sampling: bool = False, progress=None) -> None:
        """Compile every bucket with all-padding inputs (they write nothing): the logits step, or
        with ``sampling`` the engine's sampling step (over a mesh always the engine's step, and the
        weight move of a rebalance). ``progress(i, total)`` is called per bucket. With speculation the engine's
        step is the speculative one (``SpeculativeStep.precompile``)."""
        if self.speculation is not None and (sampling or self.mesh is not None):
            return self.speculation.precompile(progress)
        shapes = self.buckets.shapes()
        if self.mesh is not None:
            if self.placement is not None:  # the weight move of a rebalance (here: onto the same placement)
                self.set_placement(self.placement)
            sampling = True
        if sampling:  # the prefix cache's window copy and restore (slot 0 holds nothing yet; over a mesh rank 0's)
            self.restore_swa(0, self.snapshot_swa(0), [], 0)
            self.restore_swa(0, None, [], 0)
            self.block_payloads(self.read_blocks([0]))
            self.write_blocks([0], self.block_payloads(self.read_blocks([0])))
        if sampling and self.decoder_replay:  # every decoder-token bucket that fits each token bucket
            shapes = [(n, r, b, d) for n, r, b in shapes for d in self.buckets.tokens if d <= n]
        if progress is not None:
            progress(0, len(shapes))
        for i, (n, r, b, *d) in enumerate(shapes):
            self.bucket_use.compiled.add((n, r, b))
            if sampling:
                self._launch([[]] * self.dp_size, n, r, b, *d).result()
            else:
                self._run(self._inputs([], n, r, b))
            if progress is not None:
                progress(i + 1, len(shapes))

    def _at(self, rank: int) -> tuple:
        """The copy programs' trailing arguments for DP rank ``rank``'s slice of the cache: none on one device
        (its programs are the ones without ``at``), ``((rank,),)`` over a mesh. ValueError for a rank out of range."""
        if not (isinstance(rank, (int, np.integer)) and 0 <= rank < self.dp_size):
            raise ValueError(f"rank must lie in [0, {self.dp_size}), got {rank!r}")
        return () if self.mesh is None else ((np.int32(rank),),)

    def _host_args(self, *host):
        """Host arguments of a copy program (global arrays when several processes run the mesh)."""
        return host if self.mesh is None else self._global(host, self._replicated)

    def snapshot_swa(self, slot: int, rank: int = 0):
        """Dispatch a copy of ``slot``'s SWA rings (all layers) as they are after the launched steps;
        returns device arrays at once (``to_host`` fetches them). ``rank``: the DP rank whose slot it is."""
        at = self._at(rank)
        return self._snapshot_fn(self.cache, *self._host_args(np.int32(slot), *at))

    @staticmethod
    def to_host(snapshot):
        return jax.tree.map(np.asarray, snapshot)

    def _engram_ids(self, engram_ids: Sequence[int], position: int) -> tuple[np.ndarray, np.ndarray]:
        """(positions, ids) [n-1] of the look-back before ``position``: the last n-1 of ``engram_ids``,
        missing ones at position -1 (written nowhere)."""
        n = max(1, self.cfg.engram_max_ngram_size - 1) if self.cfg.engram_layer_ids else 1
        ids, pos = np.full(n, -1, np.int32), np.full(n, -1, np.int32)
        tail = list(engram_ids)[-n:] if self.cfg.engram_layer_ids else []
        if tail:
            ids[n - len(tail):] = tail
            pos[n - len(tail):] = np.arange(position - len(tail), position)
        return pos, ids

    def restore_swa(self, slot: int, snapshot, engram_ids: Sequence[int], position: int, rank: int = 0) -> None:
        """Put a saved ring (from ``snapshot_swa``, on device or host) into ``slot`` before its next step,
        with the Engram look-back (the token ids just before ``position``, the restored length);
        ``snapshot=None`` sets only the look-back (a bounded replay rebuilds the window). ``rank``: the DP
        rank whose slot it is (a window saved on any rank restores on any other)."""
        at = self._at(rank)
        pos, ids = self._engram_ids(engram_ids, position)
        if snapshot is None:
            self.cache = self._set_engram_fn(self.cache, *self._host_args(np.int32(slot), pos, ids, *at))
        else:
            self.cache = self._restore_fn(self.cache, *self._host_args(np.int32(slot), snapshot, pos, ids, *at))

    def snapshot_slot(self, slot: int, rank: int = 0) -> dict[str, np.ndarray]:
        """Dispatch a copy of ``slot``'s whole per-request state (SWA rings, compressor groups, Engram
        look-back) after the launched steps: with the block KV it is the exact state at any position,
        not only at a block boundary (a handoff between engines, ``cluster.handoff``). Returns a
        ``name -> device array`` dict (``to_host`` fetches it). ``rank``: the DP rank whose slot it is (over a
        mesh the copy reads that rank's slice only and comes back replicated, with the one-device names and shapes)."""
        at = self._at(rank)
        flat, _ = jax.tree_util.tree_flatten_with_path(
            self._slot_state_fn(self.cache, *self._host_args(np.int32(slot), *at)))
        return {jax.tree_util.keystr(path): leaf for path, leaf in flat}

    def _slot_shapes(self):
        """The abstract ``snapshot_slot`` result (one rank's, over a mesh)."""
        if self.mesh is None:
            return jax.eval_shape(_slot_state, self.cache, np.int32(0))
        return jax.eval_shape(_rank_slot_state, self.cache, np.int32(0), (np.int32(0),))

    def slot_state_names(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``name -> (shape, dtype)`` of a ``snapshot_slot`` result (what a handoff must carry); the same on one
        device and over a mesh with the same per-rank cache, so a slot moves between the two."""
        flat, _ = jax.tree_util.tree_flatten_with_path(self._slot_shapes())
        return {jax.tree_util.keystr(path): (tuple(leaf.shape), str(leaf.dtype)) for path, leaf in flat}

    def restore_slot(self, slot: int, state: dict[str, np.ndarray], rank: int = 0) -> None:
        """Put a ``snapshot_slot`` copy (host or device arrays, by name) into ``slot`` before its next step.
        ``rank``: the DP rank whose slot it is (over a mesh only that rank's slice is written)."""
        at = self._at(rank)
        flat, tree = jax.tree_util.tree_flatten_with_path(self._slot_shapes())
        leaves = [state[jax.tree_util.keystr(path)] for path, _ in flat]
        rows = jax.tree_util.tree_unflatten(tree, leaves)
        self.cache = self._set_slot_state_fn(self.cache, *self._host_args(np.int32(slot), rows, *at))

    def _io_ids(self, block_ids: Sequence[int], pad: int) -> list[np.ndarray]:
        """Block ids in fixed-size groups (one compiled shape), padded with ``pad``."""
        k = self.cache_cfg.max_blocks_per_request
        ids = list(block_ids)
        return [np.asarray(ids[i : i + k] + [pad] * (k - len(ids[i : i + k])), np.int32) for i in range(0, len(ids), k)]

    def read_blocks(self, block_ids: Sequence[int], rank: int = 0):
        """Dispatch a copy of the blocks' stored rows (after the launched steps): device arrays,
        to pass to ``block_payloads`` later. ``rank``: the DP rank whose blocks they are."""
        at = self._at(rank)
        return len(block_ids), [self._read_blocks_fn(self.cache, *self._host_args(ids, *at))
                                for ids in self._io_ids(block_ids, 0)]

    def block_payloads(self, read) -> list[dict[str, np.ndarray]]:
        """Host payloads (name -> array, one block each) of a ``read_blocks`` result."""
        n, groups = read
        out = []
        for rows in groups:
            leaves = [np.asarray(a) for a in jax.tree.leaves(rows)]
            out += [{name: leaf[i] for name, leaf in zip(self._global_names, leaves)} for i in range(len(leaves[0]))]
        return out[:n]

    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[dict[str, np.ndarray]], rank: int = 0) -> None:
        """Put stored rows (payloads from a block store) into device blocks before the next step. ``rank``: the DP
        rank whose blocks they are (the payloads are rank-independent: a block read on one rank fills another's)."""
        at = self._at(rank)
        k = self.cache_cfg.max_blocks_per_request
        for g, ids in enumerate(self._io_ids(block_ids, self.cache_cfg.num_blocks)):
            part = list(payloads[g * k : (g + 1) * k])
            part += [part[0]] * (k - len(part))
            rows = jax.tree_util.tree_unflatten(self._global_def,
                                                [np.stack([p[name] for p in part]) for name in self._global_names])
            ids, rows, *at_ = self._host_args(ids, rows, *at)
            self.cache = self._write_blocks_fn(self.cache, ids, rows, *at_)

    def launch(self, chunks, budget=0, draft=True, logprobs: bool = True):
        """Validate, then dispatch one sampling step without waiting for it (see ``PendingStep``; with speculation a
        ``SpecPending``); ``result()`` lists the chunks rank by rank. The keywords as in ``forward``."""
        return self.sample(self.forward(chunks, budget, draft, logprobs))

    def forward(self, chunks, budget=0, draft=True, logprobs: bool = True):
        """Validate and dispatch the model step alone; ``sample`` then dispatches its sampling. Between
        the two the device runs the step while the host computes token masks (structured output).
        ``chunks``: one device: the step's chunk list; over a mesh: one list per DP rank (empty = the rank
        idles). ``StepInputError`` names the rank and chunk that cannot run.

        With the speculation component (``self.speculation``) the step is speculative (``runner.spec_step``):
        ``budget`` drafts to verify, ``draft`` whether to draft the next blocks, ``logprobs`` whether to compute
        them (each one value, or one per DP rank); it returns a ``SpecForward``. Without it they must keep their
        defaults. A context-parallel chunk (``self.context_parallel``) runs alone over the ``cp`` ranks."""
        if self.context_parallel is not None:
            cp = self.context_parallel.chunk(chunks)
            if cp is not None:
                logits, inp = self.context_parallel.run(cp)
                _, sampling, sample_slot = sampling_batch([cp], inp, inp.token_ids.shape[0], 1,
                                                          self.cache_cfg.max_requests)
                return Forward(logits, sampling, sample_slot, [cp], 1, [0])
        by_rank = self._by_rank(chunks)
        if self.speculation is not None:
            return self.speculation.forward(by_rank, budget, draft, logprobs)
        if not (isinstance(budget, int) and budget == 0) or draft is not True:
            raise StepInputError("budget / draft: this runner has no drafter (build it with drafter= to speculate)")
        if self.mesh is None:
            n, r, b = self._validate(by_rank[0])
            n, b = self.bucket_use.choose(n, r, b)
        else:
            n, r, b = pick_shape(self.buckets, by_rank)
            for d, cs in enumerate(by_rank):
                try:
                    check_chunks(cs, self.cfg, self.cache_cfg)
                except StepInputError as e:
                    raise StepInputError(f"rank {d}: {e}") from None
        return self._forward(by_rank, n, r, b)

    def sample_rows(self, chunks) -> tuple[int, list[int]]:
        """(rows of the step's sampling program, each chunk's row in it, rank by rank) before ``forward``: the
        shape of a structured-output mask for these chunks."""
        by_rank = self._by_rank(chunks)
        _, r, _ = pick_shape(self.buckets, by_rank)
        return self.dp_size * r, [d * r + k for d, cs in enumerate(by_rank) for k in range(len(cs))]

    def sample(self, fwd, mask: np.ndarray | None = None):
        """Dispatch the sampling of a ``forward`` step: ``mask`` [fwd.rows, mask_words] (i32, packed; row
        ``fwd.chunk_rows[i]`` is chunk i's, see ``Forward``) limits each row's tokens; None = no limit. A
        speculative step's acceptance and drafting (``SpeculativeStep.sample``) return a ``SpecPending``."""
        if self.speculation is not None:
            return self.speculation.sample(fwd, mask)
        if mask is None:
            mask, has = no_mask(self._no_mask, fwd.rows, self.mask_words, self._all_ones), np.False_
        else:
            self.check_mask(mask, fwd.rows)
            has = np.True_
            if self.mesh is not None:  # laid out as the all-ones mask: no retrace
                mask = self._global(mask, self._replicated, always=True)
        sampling, sample_slot = fwd.sampling, fwd.sample_slot
        if self.mesh is not None:
            has, sampling, sample_slot = self._global((has, sampling, sample_slot), self._replicated)
        out, self.last_ids = self._sample_fn(self.num_top_logprobs, fwd.logits, mask, has, sampling,
                                             self.last_ids, sample_slot)
        return PendingStep(out, fwd.chunks, fwd.chunk_rows)

    def check_mask(self, mask: np.ndarray, rows: int) -> None:
        """``StepInputError`` unless ``mask`` is a packed token mask (int32) for ``rows`` sampling rows."""
        if mask.shape != (rows, self.mask_words) or mask.dtype != np.int32:
            raise StepInputError(f"mask must be int32 of shape {(rows, self.mask_words)}, got {mask.dtype} "
                                 f"{mask.shape}")

    def execute(self, chunks: Sequence[ChunkSpec]) -> list[np.ndarray]:
        """Run one step; returns, per chunk, its wanted logits [len(offsets), vocab] (fp32); a context-parallel
        chunk returns its last token's logits [1, vocab]."""
        if self.context_parallel is not None:
            cp = self.context_parallel.chunk(chunks)
            if cp is not None:
                if cp.offsets != (len(cp.token_ids) - 1,):
                    raise StepInputError("a context-parallel chunk returns the logits of its last token only")
                return [np.asarray(self.context_parallel.run(cp)[0])]
        self._one_device("execute")
        n, r, b = self._validate(chunks)
        inputs = self._inputs(chunks, n, r, b)
        if self.decoder_replay:  # wanted rows must lie in each chunk's decoder tail
            inputs, rows = self._decoder_rows(chunks, inputs, inputs.logit_rows, None)
            inputs = inputs._replace(logit_rows=rows)
        logits = self._run(inputs)
        out, at = [], 0
        for c in chunks:
            out.append(logits[at : at + len(c.offsets)])
            at += len(c.offsets)
        return out

    # -- internals ---------------------------------------------------------------------------
    def _by_rank(self, chunks) -> list[list[ChunkSpec]]:
        """The step's chunks as one list per rank (one device: the list itself is rank 0's)."""
        if self.mesh is None:
            return [list(chunks)]
        if len(chunks) != self.dp_size or any(isinstance(c, ChunkSpec) for c in chunks):
            raise StepInputError(f"chunks_by_rank: one chunk list per DP rank ({self.dp_size}), got {len(chunks)}")
        if not any(chunks):
            raise StepInputError("a step needs at least one chunk")
        return [list(cs) for cs in chunks]

    def _all_ones(self, shape) -> jax.Array:
        if self.mesh is None:
            return filled(shape, jnp.int32, -1)
        return compile_options.jit(lambda: jnp.full(shape, -1, jnp.int32), out_shardings=self._replicated)()

    def _global(self, host, sharding, always: bool = False):
        """Host inputs as global arrays when several processes run the mesh (each passes the same)."""
        if not (always or self._multi):
            return host
        from deepinfer_jax.parallel.mesh import put_global

        return put_global(host, sharding)

    def _launch(self, chunks_by_rank, n: int, r: int, b: int, d: int | None = None) -> PendingStep:
        return self.sample(self._forward(chunks_by_rank, n, r, b, d))

    def _forward(self, chunks_by_rank, n: int, r: int, b: int, d: int | None = None) -> Forward:
        """Every rank's inputs padded to one shape; one device runs its rank's directly, a mesh stacks them."""
        slots, dp = self.cache_cfg.max_requests, self.dp_size
        if self.decoder_replay and d is None and self.mesh is not None:  # one decoder-token bucket for every rank
            most = max(sum(max(0, len(c.token_ids) - max(0, c.decoder_from - c.ctx_len)) for c in cs)
                       for cs in chunks_by_rank)
            d = Buckets.pick(self.buckets.tokens, max(1, most), "decoder tokens in the step")
        inputs, feeds, samplings, sample_slots = [], [], [], []
        for rank, chunks in enumerate(chunks_by_rank):
            inp = build_inputs(chunks, n, r, b, slots)
            rows = logit_rows(chunks, inp, r)  # one logit row per request row: its chunk's last token
            if self.decoder_replay:
                inp, rows = self._decoder_rows(chunks, inp, rows, d)
            feed, sampling, sample_slot = sampling_batch(chunks, inp, n, r, slots)
            inputs.append(inp._replace(logit_rows=rows))
            feeds.append(feed)
            samplings.append(sampling)
            sample_slots.append(np.where(sample_slot < slots, sample_slot + rank * slots, dp * slots))
        chunks = [c for cs in chunks_by_rank for c in cs]
        chunk_rows = [rank * r + k for rank, cs in enumerate(chunks_by_rank) for k in range(len(cs))]
        sampling = samplings[0] if dp == 1 else jax.tree.map(lambda *a: np.concatenate(a), *samplings)
        sample_slot = np.concatenate(sample_slots).astype(np.int32)
        counts = None
        if self.mesh is None:
            logits, self.cache = self._forward_fn(self._ptree, self._pleaves, self.cfg, self.cache_cfg, self.cache,
                                                  self.last_ids, feeds[0], inputs[0])
        else:
            stacked, feed = self._global((jax.tree.map(lambda *a: np.stack(a), *inputs), np.stack(feeds)), self._dp)
            if self.placement is None:
                logits, self.cache = self._forward_fn(self.params, self.cache, self.last_ids, feed, stacked)
            else:
                logits, self.cache, counts = self._forward_fn(self.params, self.tables, self.cache, self.last_ids,
                                                              feed, stacked)
        return Forward(logits, sampling, sample_slot, chunks, dp * r, chunk_rows, counts, self.placement)

    def _decoder_rows(self, chunks, inputs: StepInputs, rows: np.ndarray, d: int | None):
        """The tokens that run the decoder (each chunk's tail from ``decoder_from``), padded to a bucket,
        and the logit rows re-indexed into them (a chunk without decoder tokens samples nothing)."""
        flat, floor, remap = [], np.zeros(len(inputs.req_slot), np.int32), {}
        for i, c in enumerate(chunks):
            first = max(0, c.decoder_from - c.ctx_len)
            for k in range(first, len(c.token_ids)):
                remap[int(inputs.req_start[i]) + k] = len(flat)
                flat.append(int(inputs.req_start[i]) + k)
            floor[i] = c.decoder_floor
        d = d or Buckets.pick(self.buckets.tokens, max(1, len(flat)), "decoder tokens in the step")
        dec = np.zeros(d, np.int32)
        dec[: len(flat)] = flat
        valid = np.zeros(d, bool)
        valid[: len(flat)] = True
        rows = np.array([remap.get(int(x), 0) for x in rows], np.int32)
        return inputs._replace(decoder_rows=dec, decoder_valid=valid, decoder_floor=floor), rows

    def _run(self, inputs: StepInputs) -> np.ndarray:
        logits, self.cache = self._fn(self._ptree, self._pleaves, self.cfg, self.cache_cfg, self.cache, inputs)
        return np.asarray(logits)

    def _validate(self, chunks: Sequence[ChunkSpec]) -> tuple[int, int, int]:
        return validate_chunks(chunks, self.cfg, self.cache_cfg, self.buckets)

    def _inputs(self, chunks: Sequence[ChunkSpec], n: int, r: int, b: int) -> StepInputs:
        return build_inputs(chunks, n, r, b, self.cache_cfg.max_requests)


class _EveryRank:
    """``cache_cfg``, ``buckets`` and ``launch(chunks)`` of a runner over a mesh, the chunks given to every rank."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.cache_cfg, self.buckets = runner, runner.cache_cfg, runner.buckets

    def launch(self, chunks: Sequence[ChunkSpec], **step) -> PendingStep:
        return self.runner.launch([list(chunks)] * self.runner.dp_size, **step)  # ``step``: speculation's options
