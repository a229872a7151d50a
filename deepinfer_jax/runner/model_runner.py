"""ModelRunner: turns scheduled request chunks into padded device inputs and runs the jitted step.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.model.kv_cache import init_cache
from deepinfer_jax.model.paged import StepInputs, paged_step
from deepinfer_jax.model.sampler import SamplingInputs, sample
from deepinfer_jax.runner.buckets import Buckets, BucketUse
from deepinfer_jax.runner.program_store import stored_jit
from deepinfer_jax.runner.step_batch import (
    ChunkSpec,
    SampleSpec,
    StepInputError,
    build_inputs,
    check_runner_settings,
    logit_rows,
    sampling_batch,
    validate_chunks,
)

__all__ = ["ChunkSpec", "Forward", "ModelRunner", "PendingStep", "SampleSpec", "StepInputError"]


_TRACES = [0]


def _count_trace() -> None:
    """A program loaded from the program store counts as built (as a tracing would)."""
    _TRACES[0] += 1


def _step(params, cfg, cache_cfg, cache, inputs):
    _TRACES[0] += 1  # runs only while tracing
    return paged_step(params, cfg, cache_cfg, cache, inputs)


def _forward_step(params, cfg, cache_cfg, cache, last_ids, feed, inputs):
    """The engine's model step: tokens marked ``feed`` come from ``last_ids`` [slots] (by slot);
    returns the logits of ``inputs.logit_rows`` (one row per request) and the new cache."""
    _TRACES[0] += 1
    slots = cache_cfg.max_requests
    token_slot = jnp.clip(inputs.req_slot[inputs.token_req], 0, slots - 1)
    inputs = inputs._replace(token_ids=jnp.where(feed, last_ids[token_slot], inputs.token_ids))
    return paged_step(params, cfg, cache_cfg, cache, inputs)


def _step_flat(ptree, pleaves, cfg, cache_cfg, cache, inputs):
    """``_step`` with the parameters as (treedef, leaves): jit flattens a list of arrays in C++, where an
    ``nnx.State`` costs a Python traversal of every variable on every call (milliseconds per step)."""
    return _step(jax.tree_util.tree_unflatten(ptree, pleaves), cfg, cache_cfg, cache, inputs)


def _forward_step_flat(ptree, pleaves, cfg, cache_cfg, cache, last_ids, feed, inputs):
    return _forward_step(jax.tree_util.tree_unflatten(ptree, pleaves), cfg, cache_cfg, cache, last_ids, feed, inputs)


def _sample_rows(num_top, logits, mask, has_mask, sampling, last_ids, sample_slot):
    """Sample one token per row of ``logits`` [R, V] under the packed token ``mask`` [R, W] and store
    it in ``last_ids`` at ``sample_slot`` (out of range = none). A separate program from the model
    step so a structured-output mask can arrive while the step already runs on the device."""
    _TRACES[0] += 1
    out = sample(logits, sampling, num_top, mask, has_mask)
    return out, last_ids.at[sample_slot].set(out.token_ids, mode="drop")


def _snapshot(cache, slot):
    """The slot's SWA ring of every layer (a copy; [L, cap, ...] per storage leaf)."""
    return jax.tree.map(lambda a: a[:, slot], cache["swa"])


def _restore(cache, slot, rows, engram_pos, engram_ids):
    """Write a saved ring into ``slot`` and its Engram look-back (``_set_engram``)."""
    cache = {**cache, "swa": jax.tree.map(lambda a, r: a.at[:, slot].set(r), cache["swa"], rows)}
    return _set_engram(cache, slot, engram_pos, engram_ids)


def _slot_state(cache, slot):
    """Everything ``slot`` holds besides block KV: its SWA rings (every layer), the compressor's
    pending groups and the Engram look-back (a copy; the slot axis removed)."""
    state = {"swa": jax.tree.map(lambda a: a[:, slot], cache["swa"]),
             "comp": jax.tree.map(lambda a: a[slot], cache["comp"])}
    if "engram" in cache:
        state["engram"] = cache["engram"][slot]
    return state


def _set_slot_state(cache, slot, state):
    """Write a ``_slot_state`` copy into ``slot``."""
    out = {**cache, "swa": jax.tree.map(lambda a, r: a.at[:, slot].set(r), cache["swa"], state["swa"]),
           "comp": jax.tree.map(lambda a, r: a.at[slot].set(r), cache["comp"], state["comp"])}
    if "engram" in cache:
        out["engram"] = cache["engram"].at[slot].set(state["engram"])
    return out


def _read_blocks(cache, block_ids):
    """Every KV-source layer's stored rows of ``block_ids`` [n] (the block axis first)."""
    return jax.tree.map(lambda a: a[block_ids], cache["global"])


def _write_blocks(cache, block_ids, rows):
    """Write rows into ``block_ids``; out-of-range ids (padding) write nothing."""
    return {**cache, "global": jax.tree.map(lambda a, r: a.at[block_ids].set(r, mode="drop"), cache["global"], rows)}


def _set_engram(cache, slot, engram_pos, engram_ids):
    """Put token ``engram_ids`` [n-1] at positions ``engram_pos`` [n-1] of ``slot``'s Engram ring (-1 = none)."""
    if "engram" not in cache:
        return cache
    ring = cache["engram"]
    at = (jnp.where(engram_pos >= 0, slot, ring.shape[0]), jnp.mod(engram_pos, ring.shape[1]))
    return {**cache, "engram": ring.at[at].set(engram_ids, mode="drop")}


@dataclass
class Forward:
    """A dispatched model step whose sampling is still to dispatch (``ModelRunner.sample``); row i of
    the step's logits belongs to chunk i, rows past the chunks are padding."""

    logits: jax.Array  # [rows, vocab] f32, on the device
    sampling: SamplingInputs
    sample_slot: np.ndarray
    chunks: list
    rows: int  # the request bucket


class PendingStep:
    """A launched step; ``result()`` waits for the device and returns, per chunk in launch order,
    ``(token_id, logprob, top_ids, top_logprobs)`` or None for chunks that sampled nothing."""

    def __init__(self, sampled, chunks: Sequence[ChunkSpec], rows: Sequence[int] | None = None):
        self._sampled, self._chunks, self._result = sampled, chunks, None
        self._rows = range(len(chunks)) if rows is None else rows  # chunk i's row of the sampled arrays

    def result(self) -> list[tuple[int, float, np.ndarray, np.ndarray] | None]:
        if self._result is None:
            ids, lp, top_ids, top_lp = (np.asarray(a) for a in self._sampled)
            self._result = [(int(ids[i]), float(lp[i]), top_ids[i], top_lp[i]) if c.sample is not None else None
                            for i, c in zip(self._rows, self._chunks)]
            self._sampled = None
        return self._result


class ModelRunner:
    """Owns the device cache and the compiled step for one model and cache layout."""

    def __init__(self, cfg, params, cache_cfg, buckets: Buckets | None = None, num_top_logprobs: int = 5,
                 decoder_replay: bool = False):
        cache_cfg.validate_for(cfg)
        self.cfg, self.params, self.cache_cfg = cfg, params, cache_cfg
        self.buckets = buckets or Buckets()
        check_runner_settings(self.buckets, cache_cfg, num_top_logprobs)
        self.num_top_logprobs = num_top_logprobs
        if decoder_replay and cfg.decoder_start >= cfg.num_hidden_layers - 1:
            raise ValueError("decoder_replay needs a model with decoder layers (a CED split)")
        self.decoder_replay = decoder_replay
        # the lazy engine sets .lazy (LLM(precompile="lazy"))
        self.bucket_use = BucketUse(self.buckets.tokens, blocks=self.buckets.blocks)
        self.cache = init_cache(cfg, cache_cfg)
        self.last_ids = jnp.zeros(cache_cfg.max_requests, jnp.int32)
        self._pleaves, self._ptree = jax.tree_util.tree_flatten(params)
        # the step programs: traced once per machine and kept on disk (runner.program_store)
        self._fn = stored_jit(_step_flat, "step", (0, 2, 3), (4,), on_build=_count_trace)
        self._forward_fn = stored_jit(_forward_step_flat, "forward", (0, 2, 3), (4,), on_build=_count_trace)
        self._sample_fn = stored_jit(_sample_rows, "sample", (0,), on_build=_count_trace)
        self.mask_words = (cfg.vocab_size + 31) // 32
        self._no_mask: dict[int, jax.Array] = {}  # rows -> an all-ones mask on the device
        self._snapshot_fn = jax.jit(_snapshot)
        self._restore_fn = jax.jit(_restore, donate_argnums=(0,))
        self._set_engram_fn = jax.jit(_set_engram, donate_argnums=(0,))
        self._read_blocks_fn = jax.jit(_read_blocks)
        self._slot_state_fn = jax.jit(_slot_state)
        self._set_slot_state_fn = jax.jit(_set_slot_state, donate_argnums=(0,))
        self._write_blocks_fn = jax.jit(_write_blocks, donate_argnums=(0,))
        flat, self._global_def = jax.tree_util.tree_flatten_with_path(self.cache["global"])
        self._global_names = [jax.tree_util.keystr(path) for path, _ in flat]

    @property
    def traces(self) -> int:
        """How many times the step has been traced (compiled) in this process."""
        return _TRACES[0]

    def precompile(self, sampling: bool = False, progress=None) -> None:
        """Compile every bucket with all-padding inputs (they write nothing): the logits step, or
        with ``sampling`` the engine's sampling step. ``progress(i, total)`` is called per bucket."""
        shapes = self.buckets.shapes()
        if sampling:  # the prefix cache's window copy and restore (slot 0 holds nothing yet)
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
                self._launch([], n, r, b, *d).result()
            else:
                self._run(self._inputs([], n, r, b))
            if progress is not None:
                progress(i + 1, len(shapes))

    def snapshot_swa(self, slot: int):
        """Dispatch a copy of ``slot``'s SWA rings (all layers) as they are after the launched steps;
        returns device arrays at once (``to_host`` fetches them)."""
        return self._snapshot_fn(self.cache, np.int32(slot))

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

    def restore_swa(self, slot: int, snapshot, engram_ids: Sequence[int], position: int) -> None:
        """Put a saved ring (from ``snapshot_swa``, on device or host) into ``slot`` before its next step,
        with the Engram look-back (the token ids just before ``position``, the restored length);
        ``snapshot=None`` sets only the look-back (a bounded replay rebuilds the window)."""
        pos, ids = self._engram_ids(engram_ids, position)
        if snapshot is None:
            self.cache = self._set_engram_fn(self.cache, np.int32(slot), pos, ids)
        else:
            self.cache = self._restore_fn(self.cache, np.int32(slot), snapshot, pos, ids)

    def snapshot_slot(self, slot: int) -> dict[str, np.ndarray]:
        """Dispatch a copy of ``slot``'s whole per-request state (SWA rings, compressor groups, Engram
        look-back) after the launched steps: with the block KV it is the exact state at any position,
        not only at a block boundary (a handoff between engines, ``cluster.handoff``). Returns a
        ``name -> device array`` dict (``to_host`` fetches it)."""
        flat, _ = jax.tree_util.tree_flatten_with_path(self._slot_state_fn(self.cache, np.int32(slot)))
        return {jax.tree_util.keystr(path): leaf for path, leaf in flat}

    def slot_state_names(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``name -> (shape, dtype)`` of a ``snapshot_slot`` result (what a handoff must carry)."""
        shapes = jax.eval_shape(_slot_state, self.cache, np.int32(0))
        flat, _ = jax.tree_util.tree_flatten_with_path(shapes)
        return {jax.tree_util.keystr(path): (tuple(leaf.shape), str(leaf.dtype)) for path, leaf in flat}

    def restore_slot(self, slot: int, state: dict[str, np.ndarray]) -> None:
        """Put a ``snapshot_slot`` copy (host or device arrays, by name) into ``slot`` before its next step."""
        shapes = jax.eval_shape(_slot_state, self.cache, np.int32(0))
        flat, tree = jax.tree_util.tree_flatten_with_path(shapes)
        leaves = [state[jax.tree_util.keystr(path)] for path, _ in flat]
        self.cache = self._set_slot_state_fn(self.cache, np.int32(slot), jax.tree_util.tree_unflatten(tree, leaves))

    def _io_ids(self, block_ids: Sequence[int], pad: int) -> list[np.ndarray]:
        """Block ids in fixed-size groups (one compiled shape), padded with ``pad``."""
        k = self.cache_cfg.max_blocks_per_request
        ids = list(block_ids)
        return [np.asarray(ids[i : i + k] + [pad] * (k - len(ids[i : i + k])), np.int32) for i in range(0, len(ids), k)]

    def read_blocks(self, block_ids: Sequence[int]):
        """Dispatch a copy of the blocks' stored rows (after the launched steps): device arrays,
        to pass to ``block_payloads`` later."""
        return len(block_ids), [self._read_blocks_fn(self.cache, ids) for ids in self._io_ids(block_ids, 0)]

    def block_payloads(self, read) -> list[dict[str, np.ndarray]]:
        """Host payloads (name -> array, one block each) of a ``read_blocks`` result."""
        n, groups = read
        out = []
        for rows in groups:
            leaves = [np.asarray(a) for a in jax.tree.leaves(rows)]
            out += [{name: leaf[i] for name, leaf in zip(self._global_names, leaves)} for i in range(len(leaves[0]))]
        return out[:n]

    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[dict[str, np.ndarray]]) -> None:
        """Put stored rows (payloads from a block store) into device blocks before the next step."""
        k = self.cache_cfg.max_blocks_per_request
        for g, ids in enumerate(self._io_ids(block_ids, self.cache_cfg.num_blocks)):
            part = list(payloads[g * k : (g + 1) * k])
            part += [part[0]] * (k - len(part))
            rows = [np.stack([p[name] for p in part]) for name in self._global_names]
            self.cache = self._write_blocks_fn(self.cache, ids, jax.tree_util.tree_unflatten(self._global_def, rows))

    def launch(self, chunks: Sequence[ChunkSpec]) -> PendingStep:
        """Validate, then dispatch one sampling step without waiting for it (see ``PendingStep``)."""
        n, r, b = self._validate(chunks)
        n, b = self.bucket_use.choose(n, r, b)
        return self._launch(chunks, n, r, b)

    def forward(self, chunks: Sequence[ChunkSpec]) -> Forward:
        """Validate and dispatch the model step alone; ``sample`` then dispatches its sampling. Between
        the two the device runs the step while the host computes token masks (structured output)."""
        n, r, b = self._validate(chunks)
        n, b = self.bucket_use.choose(n, r, b)
        return self._forward(chunks, n, r, b)

    def sample(self, fwd: Forward, mask: np.ndarray | None = None) -> PendingStep:
        """Dispatch the sampling of a ``forward`` step: ``mask`` [rows, mask_words] (i32, packed, rows =
        the step's request bucket, see ``Forward.rows``) limits each row's tokens; None = no limit."""
        if mask is None:
            if fwd.rows not in self._no_mask:
                self._no_mask[fwd.rows] = jnp.full((fwd.rows, self.mask_words), -1, jnp.int32)
            mask, has = self._no_mask[fwd.rows], np.False_
        else:
            if mask.shape != (fwd.rows, self.mask_words) or mask.dtype != np.int32:
                raise StepInputError(f"mask must be int32 of shape {(fwd.rows, self.mask_words)}, got "
                                     f"{mask.dtype} {mask.shape}")
            has = np.True_
        out, self.last_ids = self._sample_fn(self.num_top_logprobs, fwd.logits, mask, has, fwd.sampling,
                                             self.last_ids, fwd.sample_slot)
        return PendingStep(out, fwd.chunks)

    def execute(self, chunks: Sequence[ChunkSpec]) -> list[np.ndarray]:
        """Run one step; returns, per chunk, its wanted logits [len(offsets), vocab] (fp32)."""
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
    def _launch(self, chunks: Sequence[ChunkSpec], n: int, r: int, b: int, d: int | None = None) -> PendingStep:
        return self.sample(self._forward(chunks, n, r, b, d))

    def _forward(self, chunks: Sequence[ChunkSpec], n: int, r: int, b: int, d: int | None = None) -> Forward:
        inputs = self._inputs(chunks, n, r, b)
        rows = logit_rows(chunks, inputs, r)  # one logit row per request row: its chunk's last token
        if self.decoder_replay:
            inputs, rows = self._decoder_rows(chunks, inputs, rows, d)
        feed, sampling, sample_slot = sampling_batch(chunks, inputs, n, r, self.cache_cfg.max_requests)
        logits, self.cache = self._forward_fn(self._ptree, self._pleaves, self.cfg, self.cache_cfg, self.cache,
                                              self.last_ids, feed,
                                              inputs._replace(logit_rows=rows))
        return Forward(logits, sampling, sample_slot, list(chunks), r)

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
