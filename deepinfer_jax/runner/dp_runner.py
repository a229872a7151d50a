"""DPRunner: one jitted model step for every attention data-parallel rank of a device mesh (engine.md §4).

Each DP rank is its own scheduling domain with its own KV cache: ``cache_cfg`` describes one rank's
cache (its slots and block pool), and the runner keeps ``dp`` of them stacked along a leading axis
placed on the mesh's DP axes, so rank d's cache lives on the devices of mesh row d (replicated over
that row's EP devices). A step takes one chunk list per rank (``ChunkSpec``s with rank-local slots
and block ids), pads every rank to one common bucket shape (an idle rank is all padding, which
writes nothing), stacks the ranks' ``StepInputs`` along ``dp`` and runs ``jax.vmap`` of the engine's
model step (``model_runner._forward_step``) over that axis in one jit whose inputs and outputs are
split over the DP axes. The parameters are placed by the sharding rules (``sharding.shard_params``:
routed experts over ``ep``, the rest replicated). Along the DP mesh axes that no parameter is split
over, the step runs as one program per rank (``shard_map`` with those axes manual), so a rank's
attention stays on its devices with no collective; the other axes (``ep``) are left to GSPMD, which
splits the experts' matmuls and sums them with an all-reduce. (Measured: with GSPMD alone along
``dp`` too, it gathers the batched ``top_k`` inputs of every rank to every device.) All ranks step
together, as the EP collectives require.

Sampling is one program over the ``dp x rows`` logits (``model_runner._sample_rows``); the sampled
ids stay on the device in a ``[dp, slots]`` buffer and feed the next step by rank and slot
(``ChunkSpec.feed_last``), as in ``ModelRunner``.

**Expert parallelism with EPLB** (``ep_size > 1`` and the preset's ``eplb.enabled``): the step instead runs
as one program per device (``shard_map`` manual over every mesh axis). Each MoE layer goes through the
EP MoE (``parallel.ep_model.step_experts`` -> ``parallel.ep_moe.ep_moe_local``): a rank's tokens are
split over the EP devices that replicate them, each (token, expert) pair travels to a replica of its
expert by the preset's dispatch and comes back. The experts' weights are held in the physical slots of
an EPLB placement (``placement``: logical experts + ``redundant_slots_per_rank`` per EP rank, identity
at the start) and every layer's routing tables are a jit argument (``tables``), so ``set_placement``
(weights moved between ranks by ``weight_moves.move_params``, new tables) never recompiles. The step also
returns every layer's pair count per physical slot (padding excluded), fetched by ``slot_counts``.
Needs a single EP mesh axis and no parameter split over another axis (no ``tp``), else ``ShardingError``
naming ``eplb.enabled``; with ``eplb.enabled = false`` or ``ep_size == 1`` the step is the GSPMD one above.

Not supported here (yet): the logits-only ``execute``, prefix-cache block and window copies, decoder bounded
replay. Several processes (``jax.distributed``): every process passes the same host inputs, which become global
arrays (``parallel.mesh.put_global``); the sampled tokens and the slot counts come back replicated.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from deepinfer_jax import sharding as sh
from deepinfer_jax.model.kv_cache import init_cache
from deepinfer_jax.model.sampler import SamplingInputs
from deepinfer_jax.parallel import ep_model, weight_moves
from deepinfer_jax.parallel.ep_moe import TABLES
from deepinfer_jax.parallel.eplb import Placement, identity_placement
from deepinfer_jax.parallel.mesh import put_global
from deepinfer_jax.runner.buckets import Buckets
from deepinfer_jax.runner.model_runner import _TRACES, PendingStep, _forward_step, _sample_rows
from deepinfer_jax.runner.step_batch import (
    ChunkSpec,
    StepInputError,
    build_inputs,
    check_chunks,
    check_runner_settings,
    logit_rows,
    pick_shape,
    sampling_batch,
)

__all__ = ["DPForward", "DPRunner"]


def _dp_forward(cfg, cache_cfg, params, cache, last_ids, feed, inputs):
    """The engine's model step on every rank: cache leaves [dp, ...], last_ids [dp, slots], feed [dp, N],
    inputs leaves [dp, ...] -> (logits [dp, R, V] f32, the new cache)."""
    step = lambda c, last, f, inp: _forward_step(params, cfg, cache_cfg, c, last, f, inp)
    return jax.vmap(step)(cache, last_ids, feed, inputs)


def _dp_sample(num_top, logits, mask, has_mask, sampling, last_ids, sample_slot):
    """Sample every rank's rows at once: logits [dp, R, V] -> rows [dp * R]; ``sample_slot`` [dp * R] indexes
    the flattened ``last_ids`` [dp, slots] (rank * slots + slot; dp * slots = none)."""
    dp, rows, vocab = logits.shape
    out, flat = _sample_rows(num_top, logits.reshape(dp * rows, vocab), mask, has_mask, sampling,
                             last_ids.reshape(-1), sample_slot)
    return out, flat.reshape(last_ids.shape)


def _dp_forward_ep(cfg, cache_cfg, spec, params, tables, cache, last_ids, feed, inputs):
    """One device's share of the EP step (inside ``shard_map`` manual over the whole mesh): the leading dp axis of
    cache / last_ids / feed / inputs has size 1 (this device's DP rank); ``params`` holds this device's expert
    slots. -> (logits [1, R, V], the new cache, slot counts [L, P] of the whole mesh)."""
    first = lambda tree: jax.tree.map(lambda a: a[0], tree)
    inp = first(inputs)
    with ep_model.step_experts(spec, tables, inp.token_valid) as ep:
        logits, cache = _forward_step(params, cfg, cache_cfg, first(cache), last_ids[0], feed[0], inp)
        counts = ep.slot_counts()
    return logits[None], jax.tree.map(lambda a: a[None], cache), counts


def _ep_spec(preset, mesh: Mesh) -> ep_model.StepSpec:
    """The EP step's static layout (the preset passed ``validate_engine``); ShardingError ``eplb.dispatch`` for
    ragged_all_to_all on CPU devices (XLA:CPU lacks it)."""
    if preset.eplb.dispatch == "ragged_all_to_all" and mesh.devices.flat[0].platform == "cpu":
        raise sh.ShardingError("eplb.dispatch", "ragged_all_to_all needs GPU/TPU devices (XLA:CPU lacks it); use "
                               "dispatch = \"all_to_all\" on CPU")
    sizes = tuple((a, int(mesh.shape[a])) for a in mesh.axis_names)
    split = tuple(a for a, n in sizes if a not in preset.dp_axes and n > 1)  # a rank's tokens are replicated there
    config = ep_model.EPConfig(dispatch=preset.eplb.dispatch, ep_axis=preset.ep_axes[0])
    return ep_model.StepSpec(config=config, axis_sizes=sizes, split_axes=split)


def _manual_axes(preset, param_sh) -> tuple[str, ...]:
    """The DP mesh axes that no parameter is split over: the step runs as one program per rank along them."""
    used = set()
    for s in jax.tree.leaves(param_sh, is_leaf=lambda x: isinstance(x, NamedSharding)):
        for part in s.spec:
            used |= set(part) if isinstance(part, tuple) else {part} if part is not None else set()
    return tuple(a for a in preset.dp_axes if a not in used)


def _per_rank(fn, mesh: Mesh, manual: tuple[str, ...]):
    """``fn`` (params, then four arrays with a leading dp axis) as one program per rank along the ``manual`` mesh
    axes (``shard_map``; the other axes, e.g. ``ep``, stay with GSPMD). Without it GSPMD cannot split some
    batched ops (``top_k``) along dp and gathers their inputs to every device."""
    if not manual or not hasattr(jax, "shard_map"):  # GSPMD alone (still correct)
        return fn
    dp = PartitionSpec(manual)
    return jax.shard_map(fn, mesh=mesh, in_specs=(PartitionSpec(), dp, dp, dp, dp), out_specs=(dp, dp),
                         axis_names=set(manual), check_vma=False)


@functools.lru_cache(maxsize=8)
def _programs(cfg, cache_cfg, mesh: Mesh, dp_axes: tuple[str, ...], manual: tuple[str, ...], ep_spec,
              param_specs: tuple, param_treedef):
    """The jitted (model step, sampling program) of one model, cache layout, mesh and parameter layout. Cached:
    a second runner over the same layout (another engine, a preset differing only in EPLB timing) reuses the
    compiled programs instead of tracing and compiling them again."""
    dp = NamedSharding(mesh, PartitionSpec(dp_axes or None))
    param_sh = jax.tree_util.tree_unflatten(param_treedef, [NamedSharding(mesh, s) for s in param_specs])
    if ep_spec is None:
        step = _per_rank(functools.partial(_dp_forward, cfg, cache_cfg), mesh, manual)
        forward = jax.jit(step, donate_argnums=(1,), in_shardings=(param_sh, dp, dp, dp, dp), out_shardings=(dp, dp))
    else:
        dps, repl = PartitionSpec(dp_axes or None), PartitionSpec()
        step = jax.shard_map(functools.partial(_dp_forward_ep, cfg, cache_cfg, ep_spec), mesh=mesh,
                             in_specs=(jax.tree_util.tree_unflatten(param_treedef, param_specs), repl, dps, dps, dps,
                                       dps),
                             out_specs=(dps, dps, repl), axis_names=set(manual), check_vma=False)
        replicated = NamedSharding(mesh, repl)
        forward = jax.jit(step, donate_argnums=(2,), in_shardings=(param_sh, replicated, dp, dp, dp, dp),
                          out_shardings=(dp, dp, replicated))
    sample = jax.jit(_dp_sample, static_argnums=(0,), out_shardings=(NamedSharding(mesh, PartitionSpec()), dp))
    return forward, sample  # the sampled tokens come back replicated: every process reads them locally


def _stacked_cache(cfg, cache_cfg, dp: int):
    """``init_cache`` repeated ``dp`` times along a new leading axis."""
    return jax.tree.map(lambda a: jnp.broadcast_to(a[None], (dp, *a.shape)), init_cache(cfg, cache_cfg))


@dataclass
class DPForward:
    """A dispatched DP model step whose sampling is still to dispatch; the logits rows are rank-major
    (rank d's request row k is row ``d * rows_per_rank + k``), ``chunk_rows[i]`` is chunk i's row."""

    logits: jax.Array  # [dp, rows_per_rank, vocab] f32, on the devices
    sampling: SamplingInputs  # [dp * rows_per_rank]
    sample_slot: np.ndarray  # [dp * rows_per_rank] flat slot (rank * slots + slot)
    chunks: list  # every rank's chunks, rank by rank
    chunk_rows: list[int]
    rows: int  # dp * the request bucket (the sampling program's rows)
    slot_counts: jax.Array | None = None  # EP step: [L, P] int32 pairs per physical slot (``DPRunner.slot_counts``)
    placement: Placement | None = None  # EP step: the placement the step ran with


class DPRunner:
    """Owns the stacked per-rank caches and the compiled DP step for one model, mesh and cache layout."""

    def __init__(self, cfg, params, cache_cfg, mesh: Mesh, preset: str | sh.ShardingPreset,
                 buckets: Buckets | None = None, num_top_logprobs: int = 5):
        cache_cfg.validate_for(cfg)
        preset = sh.resolve_preset(preset)
        preset.validate_for(cfg)
        self.cfg, self.cache_cfg, self.mesh, self.preset = cfg, cache_cfg, mesh, preset
        self.dp_size = preset.dp_size
        self.buckets = buckets or Buckets()
        check_runner_settings(self.buckets, cache_cfg, num_top_logprobs)
        self.num_top_logprobs = num_top_logprobs
        self.mask_words = (cfg.vocab_size + 31) // 32
        self._dp = dp = NamedSharding(mesh, PartitionSpec(preset.dp_axes or None))
        self._multi = jax.process_count() > 1  # host inputs become global arrays (every process passes the same)
        #: The EPLB placement of the experts' physical slots (None: the GSPMD step, no EP MoE).
        self.placement: Placement | None = None
        self.ep_spec = None
        if preset.engine_expert_parallel:
            preset.validate_engine()
            self.ep_spec = _ep_spec(preset, mesh)
            self.placement = identity_placement(cfg.num_hidden_layers, cfg.n_routed_experts, preset.ep_size,
                                                preset.eplb.redundant_slots_per_rank)
            params = weight_moves.physical_params(params, self.placement)
        param_sh = sh.param_shardings(params, mesh, preset)
        self.params = sh.shard_params(params, mesh, preset)
        self.cache = jax.jit(functools.partial(_stacked_cache, cfg, cache_cfg, self.dp_size), out_shardings=dp)()
        self.last_ids = jax.jit(lambda: jnp.zeros((self.dp_size, cache_cfg.max_requests), jnp.int32),
                                out_shardings=dp)()
        self._replicated = NamedSharding(mesh, PartitionSpec())
        if self.placement is None:
            self.manual_axes = _manual_axes(preset, param_sh)
        else:
            self.manual_axes = tuple(mesh.axis_names)
            self.tables = self._device_tables(self.placement)
        flat, treedef = jax.tree_util.tree_flatten(param_sh)
        self._forward_fn, self._sample_fn = _programs(cfg, cache_cfg, mesh, preset.dp_axes, self.manual_axes,
                                                      self.ep_spec, tuple(x.spec for x in flat), treedef)
        self._no_mask: dict[int, jax.Array] = {}

    @property
    def traces(self) -> int:
        """How many times a step, sampling or weight-move program has been traced (compiled) in this process."""
        return _TRACES[0] + weight_moves.TRACES[0]

    # -- EPLB ----------------------------------------------------------------------------------
    def _device_tables(self, placement: Placement) -> dict:
        """Every layer's routing tables [L, ...] int32, replicated on the mesh (the EP step's argument)."""
        host = {k: np.ascontiguousarray(getattr(placement, k), np.int32) for k in TABLES}
        return sh.place(host, {k: self._replicated for k in host})

    def set_placement(self, new: Placement) -> None:
        """Move the experts' weights to ``new`` (between steps; the steps already dispatched keep the old ones) and
        route by its tables from the next step on. ValueError for a placement of another geometry."""
        old = self.placement
        if old is None:
            raise ValueError("set_placement: this runner has no EP MoE (ep_size 1 or eplb.enabled = false)")
        if (new.n_layers, new.n_slots, new.n_ranks, new.n_experts) != (old.n_layers, old.n_slots, old.n_ranks,
                                                                       old.n_experts):
            raise ValueError(f"set_placement: {new.n_layers} layers x {new.n_slots} slots over {new.n_ranks} ranks, "
                             f"the runner has {old.n_layers} x {old.n_slots} over {old.n_ranks}")
        self.params = weight_moves.move_params(self.params, old, new, self.mesh, self.ep_spec.config.ep_axis)
        self.tables, self.placement = self._device_tables(new), new

    def slot_counts(self, fwd: DPForward) -> np.ndarray | None:
        """[L, P] int64 pairs per physical slot of a dispatched EP step (waits for it), None without EP."""
        if fwd.slot_counts is None:
            return None
        return np.asarray(sh.gather_to_host(fwd.slot_counts), np.int64)

    def precompile(self, sampling: bool = True, progress=None) -> None:
        """Compile the engine step (model step + sampling) of every bucket with all-padding inputs (they
        write nothing). ``sampling`` is accepted for ``ModelRunner`` compatibility: this runner has only
        the engine step. ``progress(i, total)`` is called per bucket."""
        shapes = self.buckets.shapes()
        if self.placement is not None:  # the weight move of a rebalance (here: onto the same placement)
            self.set_placement(self.placement)
        if progress is not None:
            progress(0, len(shapes))
        for i, shape in enumerate(shapes):
            self.sample(self._forward([[]] * self.dp_size, *shape)).result()
            if progress is not None:
                progress(i + 1, len(shapes))

    def every_rank(self) -> _EveryRank:
        """This runner as the cost-model profiling sees a runner (``engine.profiling``): one chunk list, run by every
        DP rank at once (rank-local slots and blocks), since a DP step lasts as long as its slowest rank."""
        return _EveryRank(self)

    def launch(self, chunks_by_rank: Sequence[Sequence[ChunkSpec]]) -> PendingStep:
        """Validate, then dispatch one step of every rank without waiting; ``result()`` lists the chunks
        rank by rank."""
        return self.sample(self.forward(chunks_by_rank))

    def forward(self, chunks_by_rank: Sequence[Sequence[ChunkSpec]]) -> DPForward:
        """Validate (``StepInputError`` naming the rank and chunk) and dispatch the model step of every rank;
        ``chunks_by_rank`` has one list per DP rank (empty = the rank idles)."""
        if len(chunks_by_rank) != self.dp_size:
            raise StepInputError(f"chunks_by_rank: one chunk list per DP rank ({self.dp_size}), got {len(chunks_by_rank)}")
        if not any(chunks_by_rank):
            raise StepInputError("a step needs at least one chunk")
        shape = pick_shape(self.buckets, chunks_by_rank)
        for d, chunks in enumerate(chunks_by_rank):
            try:
                check_chunks(chunks, self.cfg, self.cache_cfg)
            except StepInputError as e:
                raise StepInputError(f"rank {d}: {e}") from None
        return self._forward(chunks_by_rank, *shape)

    def sample_rows(self, chunks_by_rank: Sequence[Sequence[ChunkSpec]]) -> tuple[int, list[int]]:
        """(rows of the step's sampling program, each chunk's row in it, rank by rank) before ``forward``: the
        shape of a structured-output mask for these chunks."""
        _, r, _ = pick_shape(self.buckets, chunks_by_rank)
        return self.dp_size * r, [d * r + k for d, cs in enumerate(chunks_by_rank) for k in range(len(cs))]

    def sample(self, fwd: DPForward, mask: np.ndarray | None = None) -> PendingStep:
        """Dispatch the sampling of a ``forward`` step: ``mask`` [fwd.rows, mask_words] (int32, packed; row
        ``fwd.chunk_rows[i]`` is chunk i's) limits each row's tokens; None = no limit."""
        if mask is None:
            if fwd.rows not in self._no_mask:
                shape = (fwd.rows, self.mask_words)
                self._no_mask[fwd.rows] = jax.jit(lambda: jnp.full(shape, -1, jnp.int32),
                                                  out_shardings=self._replicated)()
            mask, has_mask = self._no_mask[fwd.rows], np.False_
        else:
            if mask.shape != (fwd.rows, self.mask_words) or mask.dtype != np.int32:
                raise StepInputError(f"mask must be int32 of shape {(fwd.rows, self.mask_words)}, got "
                                     f"{mask.dtype} {mask.shape}")
            mask, has_mask = put_global(mask, self._replicated), np.True_  # laid out as the all-ones mask: no retrace
        host = (has_mask, fwd.sampling, fwd.sample_slot)
        has_mask, sampling, sample_slot = put_global(host, self._replicated) if self._multi else host
        out, self.last_ids = self._sample_fn(self.num_top_logprobs, fwd.logits, mask, has_mask, sampling,
                                             self.last_ids, sample_slot)
        return PendingStep(out, fwd.chunks, fwd.chunk_rows)

    # -- internals ---------------------------------------------------------------------------
    def _forward(self, chunks_by_rank: Sequence[Sequence[ChunkSpec]], n: int, r: int, b: int) -> DPForward:
        slots = self.cache_cfg.max_requests
        inputs, feeds, samplings, sample_slots = [], [], [], []
        for d, chunks in enumerate(chunks_by_rank):
            inp = build_inputs(chunks, n, r, b, slots)
            feed, sampling, sample_slot = sampling_batch(chunks, inp, n, r, slots)
            inputs.append(inp._replace(logit_rows=logit_rows(chunks, inp, r)))
            feeds.append(feed)
            samplings.append(sampling)
            sample_slots.append(np.where(sample_slot < slots, sample_slot + d * slots, self.dp_size * slots))
        stacked, feed = jax.tree.map(lambda *a: np.stack(a), *inputs), np.stack(feeds)
        if self._multi:
            stacked, feed = put_global((stacked, feed), self._dp)
        counts = None
        if self.placement is None:
            logits, self.cache = self._forward_fn(self.params, self.cache, self.last_ids, feed, stacked)
        else:
            logits, self.cache, counts = self._forward_fn(self.params, self.tables, self.cache, self.last_ids, feed,
                                                          stacked)
        chunks = [c for cs in chunks_by_rank for c in cs]
        chunk_rows = [d * r + k for d, cs in enumerate(chunks_by_rank) for k in range(len(cs))]
        sampling = jax.tree.map(lambda *a: np.concatenate(a), *samplings)
        return DPForward(logits, sampling, np.concatenate(sample_slots).astype(np.int32), chunks, chunk_rows,
                         self.dp_size * r, counts, self.placement)


class _EveryRank:
    """``cache_cfg`` and ``launch(chunks)`` of a ``DPRunner``, the chunks given to every rank."""

    def __init__(self, runner: DPRunner):
        self.runner, self.cache_cfg = runner, runner.cache_cfg

    def launch(self, chunks: Sequence[ChunkSpec]) -> PendingStep:
        return self.runner.launch([list(chunks)] * self.runner.dp_size)
