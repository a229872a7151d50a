"""SpecRunner: the ``ModelRunner`` with DSpark speculative decoding (engine.md §2.3).

Two jitted programs per step, as in ``ModelRunner``:

- ``forward(chunks, budget)``: the model step. Host chunks (prefill pieces, ``ChunkSpec`` as usual)
  come first; then every *verify row* (``ChunkSpec(verify=True)``: a decoding request, named by its
  slot) whose tokens the device builds from its slot's speculative state: the anchor and the drafts
  the confidence-ranked top-``budget`` selection gives it (``model.speculative``). The host fixes only
  the total (rows + budget), so the bucket shape is known without knowing any row's position; each
  token's DSpark target features go into the slot's feature ring.
- ``sample(fwd, mask)``: lossless acceptance of each row's drafts, the bonus or corrected token,
  the new anchor, and the drafter's next block for every row that produced a token (optionally
  skipped: ``draft=False``). Between the two the host may compute structured-output masks.

Results come back per chunk as a list of ``(token_id, logprob, top_ids, top_logprobs)`` (empty for a
verify row that was past its limit, None for a chunk that samples nothing), plus per chunk the
number of drafts it verified, its anchor position and the confidences of its next drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.model import dspark
from deepinfer_jax.model import speculative as spec_ops
from deepinfer_jax.model.host_arrays import filled
from deepinfer_jax.model.paged import paged_step
from deepinfer_jax.model.sampler import SamplingInputs
from deepinfer_jax.runner.buckets import Buckets
from deepinfer_jax.runner.model_runner import ModelRunner
from deepinfer_jax.runner.program_store import stored_jit
from deepinfer_jax.runner.step_batch import ChunkSpec, StepInputError, build_inputs, check_chunks, sampling_batch
from deepinfer_jax.runner.step_programs import TRACES, count_trace

__all__ = ["SpecForward", "SpecPending", "SpecRunner"]


def _spec_forward(ptree, pleaves, dtree, dleaves, cfg, cache_cfg, cache, spec, last_ids, inputs, rows):
    """Build the verify rows on the device, run the step with the DSpark capture, keep the features.
    The target's and the drafter's states come as (treedef, leaves) (see ``step_programs.logits_step_flat``)."""
    TRACES[0] += 1
    params, drafter = jax.tree_util.tree_unflatten(ptree, pleaves), jax.tree_util.tree_unflatten(dtree, dleaves)
    full, layout = spec_ops.verify_inputs(inputs, rows, spec, last_ids)
    logits, cache, captured = paged_step(params, cfg, cache_cfg, cache, full,
                                         capture=tuple(cfg.dspark_target_layer_ids))
    spec = spec_ops.write_features(spec, drafter, cfg, captured)
    return logits, cache, spec, layout._replace(counts=jnp.where(rows.is_verify, layout.counts, 0)), full.req_slot


def _spec_sample(num_top, cfg, ptree, pleaves, dtree, dleaves, heads, logits, mask, has_mask, sampling, layout, rows,
                 spec, last_ids, slot_R, draft, want_logprobs):
    """Accept, take the tokens into the slots, draft the next blocks."""
    TRACES[0] += 1
    params, drafter = jax.tree_util.tree_unflatten(ptree, pleaves), jax.tree_util.tree_unflatten(dtree, dleaves)
    out = spec_ops.accept(logits, layout, rows, sampling, spec, slot_R, num_top, heads.ids, mask, has_mask,
                          want_logprobs)
    spec, last_ids = spec_ops.draft_next(spec, last_ids, drafter, params, cfg, heads, out, layout, rows, sampling,
                                         slot_R, draft)
    conf = spec.conf[jnp.clip(slot_R, 0, spec.conf.shape[0] - 1)]
    return out, layout.counts, layout.anchor, conf, spec, last_ids


@dataclass
class SpecForward:
    """A dispatched speculative model step whose acceptance is still to dispatch."""

    logits: jax.Array
    layout: spec_ops.SpecLayout
    spec_rows: spec_ops.SpecRows
    slot: jax.Array  # [R] the rows' slots on the device (out of range: writes nothing)
    sampling: SamplingInputs
    chunks: list  # in the caller's order
    order: list[int]  # chunk i's request row
    rows: int  # the request bucket (the mask's rows)
    draft: bool
    logprobs: bool = True
    tokens: int = 0  # the token bucket the step ran in


class SpecPending:
    """A launched speculative step; ``result()`` waits for the device (see the module docstring)."""

    def __init__(self, outputs, chunks: Sequence[ChunkSpec], order: Sequence[int]):
        self._out, self._chunks, self._order, self._result = outputs, chunks, order, None
        self.verified: list[int] = []  # drafts verified per chunk (after result())
        self.anchors: list[int] = []  # verify rows: the anchor position they ran at
        self.confidence: list[np.ndarray] = []  # per chunk: the confidences of its next drafts [K]

    def result(self) -> list[list[tuple[int, float, np.ndarray, np.ndarray]] | None]:
        if self._result is None:
            acc, counts, anchors, conf = self._out[:4]
            tokens, n_new, lp, top_ids, top_lp = (np.asarray(a) for a in acc)
            counts, anchors, conf = np.asarray(counts), np.asarray(anchors), np.asarray(conf)
            res = []
            for c, i in zip(self._chunks, self._order):
                if c.sample is None:
                    res.append(None)
                else:
                    res.append([(int(tokens[i, j]), float(lp[i, j]), top_ids[i, j], top_lp[i, j])
                                for j in range(int(n_new[i]))])
                self.verified.append(int(counts[i]))
                self.anchors.append(int(anchors[i]))
                self.confidence.append(conf[i])
            self._result, self._out = res, None
        return self._result


class SpecRunner(ModelRunner):
    """A ``ModelRunner`` that also owns the drafter, the per-slot speculative state and its programs.

    ``drafter``: the DSpark drafter's state (``model.dspark``). ``draft_vocab``: the token ids the drafter
    may propose (a frequency-ranked subset makes drafting cheaper: its head scores only those rows; the
    verification stays lossless), None = the whole vocabulary. ``num_top_logprobs`` as in ModelRunner.
    """

    def __init__(self, cfg, params, drafter, cache_cfg, buckets: Buckets | None = None, num_top_logprobs: int = 5,
                 decoder_replay: bool = False, draft_vocab=None):
        super().__init__(cfg, params, cache_cfg, buckets, num_top_logprobs, decoder_replay)
        k = cfg.dspark_block_size
        if cache_cfg.spec_slack < k:
            raise ValueError(f"spec_slack must be >= dspark_block_size ({k}) to absorb the rollback of "
                             f"rejected drafts, got {cache_cfg.spec_slack}")
        if draft_vocab is not None:
            ids = np.asarray(draft_vocab)
            if ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= cfg.vocab_size or len(set(ids.tolist())) != len(ids):
                raise ValueError(f"draft_vocab must be distinct token ids in [0, {cfg.vocab_size})")
        self.drafter, self.k = drafter, k
        self.heads = dspark.draft_heads(drafter, params, cfg, draft_vocab)
        self.spec = spec_ops.init_spec_state(cfg, cache_cfg.max_requests, cfg.sliding_window + cache_cfg.spec_slack,
                                             int(self.heads.ids.shape[0]))
        self._dleaves, self._dtree = jax.tree_util.tree_flatten(drafter)
        self._spec_forward_fn = stored_jit(_spec_forward, "spec_forward", (0, 2, 4, 5), (6, 7), on_build=count_trace)
        self._spec_sample_fn = stored_jit(_spec_sample, "spec_sample", (0, 1, 2, 4), (13, 14), on_build=count_trace)

    def logit_rows(self, n: int, r: int) -> int:
        """Logit rows of a (tokens n, requests r) step: at most K + 1 per request row."""
        return min(n, r * (self.k + 1))

    def precompile(self, sampling: bool = False, progress=None) -> None:
        """Compile the plain logits step (``sampling=False``) or the speculative engine step of every
        bucket with all-padding inputs, plus the prefix cache's copies."""
        if not sampling:
            return super().precompile(False, progress)
        self.restore_swa(0, self.snapshot_swa(0), [], 0)
        self.restore_swa(0, None, [], 0)
        self.block_payloads(self.read_blocks([0]))
        self.write_blocks([0], self.block_payloads(self.read_blocks([0])))
        shapes = self.buckets.shapes()
        if self.decoder_replay:
            shapes = [(n, r, b, d) for n, r, b in shapes for d in self.buckets.tokens if d <= n]
        if progress is not None:
            progress(0, len(shapes))
        for i, (n, r, b, *d) in enumerate(shapes):
            self.bucket_use.compiled.add((n, r, b))
            self.sample(self._dispatch([], 0, True, n, r, b, *d)).result()
            if progress is not None:
                progress(i + 1, len(shapes))

    # -- the engine's step -------------------------------------------------------------------
    def launch(self, chunks: Sequence[ChunkSpec], budget: int = 0, draft: bool = True,
               logprobs: bool = True) -> SpecPending:
        return self.sample(self.forward(chunks, budget, draft, logprobs))

    def forward(self, chunks: Sequence[ChunkSpec], budget: int = 0, draft: bool = True,
                logprobs: bool = True) -> SpecForward:
        """Validate and dispatch the model step; ``budget``: drafts to verify over the non-forced verify
        rows (the forced ones add their caps); ``draft``: whether the acceptance program drafts again;
        ``logprobs``: whether it computes logprobs (else they come back as zeros)."""
        if not chunks:
            raise StepInputError("a step needs at least one chunk")
        check_chunks(chunks, self.cfg, self.cache_cfg)
        if not isinstance(budget, (int, np.integer)) or budget < 0:
            raise StepInputError(f"budget must be an integer >= 0, got {budget!r}")
        host = [c for c in chunks if not c.verify]
        ver = [c for c in chunks if c.verify]
        budget = min(int(budget), sum(c.max_drafts for c in ver if not c.forced))
        forced = sum(c.max_drafts for c in ver if c.forced)
        try:
            n = Buckets.pick(self.buckets.tokens, sum(len(c.token_ids) for c in host) + len(ver) + forced + budget,
                             "tokens in the step")
            r = Buckets.pick(self.buckets.requests, len(chunks), "requests in the step")
            b = Buckets.pick(self.buckets.blocks, max(len(c.block_table) for c in chunks), "block_table length")
        except ValueError as e:
            raise StepInputError(str(e)) from None
        n, b = self.bucket_use.choose(n, r, b)
        fwd = self._dispatch(chunks, budget, draft, n, r, b)
        fwd.logprobs, fwd.tokens = logprobs, n
        return fwd

    def sample(self, fwd: SpecForward, mask: np.ndarray | None = None) -> SpecPending:
        """Dispatch acceptance + drafting; ``mask`` [rows bucket, mask_words] as in ``ModelRunner.sample``
        (row i = chunk i in the caller's order)."""
        if mask is None:
            if fwd.rows not in self._no_mask:
                self._no_mask[fwd.rows] = filled((fwd.rows, self.mask_words), jnp.int32, -1)
            dev_mask, has = self._no_mask[fwd.rows], np.False_
        else:
            if mask.shape != (fwd.rows, self.mask_words) or mask.dtype != np.int32:
                raise StepInputError(f"mask must be int32 of shape {(fwd.rows, self.mask_words)}, got "
                                     f"{mask.dtype} {mask.shape}")
            dev_mask = np.full_like(mask, -1)
            for i, row in enumerate(fwd.order):
                dev_mask[row] = mask[i]
            has = np.True_
        outs = self._spec_sample_fn(self.num_top_logprobs, self.cfg, self._ptree, self._pleaves, self._dtree,
                                    self._dleaves, self.heads, fwd.logits, dev_mask, has, fwd.sampling, fwd.layout,
                                    fwd.spec_rows, self.spec, self.last_ids, fwd.slot, np.bool_(fwd.draft),
                                    np.bool_(fwd.logprobs))
        *result, self.spec, self.last_ids = outs
        return SpecPending(result, fwd.chunks, fwd.order)

    # -- internals ---------------------------------------------------------------------------
    def _dispatch(self, chunks: Sequence[ChunkSpec], budget: int, draft: bool, n: int, r: int, b: int,
                      d: int | None = None) -> SpecForward:
        slots = self.cache_cfg.max_requests
        host = [c for c in chunks if not c.verify]
        ver = [c for c in chunks if c.verify]
        ordered = host + ver
        order = [ordered.index(c) for c in chunks] if len(set(map(id, chunks))) == len(chunks) else None
        if order is None:
            raise StepInputError("a chunk appears twice in one step")
        m = self.logit_rows(n, r)
        inp = build_inputs(host, n, r, b, slots)
        p = sum(len(c.token_ids) for c in host)
        host_logit = np.full(r, -1, np.int32)
        logit_rows = np.zeros(m, np.int32)
        mp = 0
        for i, c in enumerate(host):
            if c.sample is not None:
                host_logit[i] = mp
                logit_rows[mp] = inp.req_start[i] + len(c.token_ids) - 1
                mp += 1
        arr = lambda f, dtype: np.array([f(c) for c in ordered] + [0] * (r - len(ordered)), dtype)
        is_verify = arr(lambda c: c.verify, bool)
        for i, c in enumerate(ver):
            row = len(host) + i
            inp.block_tables[row, : len(c.block_table)] = c.block_table
            inp.req_slot[row] = c.slot
            inp.window_floor[row], inp.global_write_from[row] = c.window_floor, c.global_write_from
        rows = spec_ops.SpecRows(
            is_verify=is_verify, cap=arr(lambda c: c.max_drafts if c.verify else 0, np.int32),
            forced=arr(lambda c: c.forced, bool), limit=arr(lambda c: c.limit if c.verify else 0, np.int32),
            prompt_len=arr(lambda c: c.prompt_len, np.int32), host_logit=host_logit,
            ctx_from=arr(lambda c: c.ctx_from, np.int32), budget=np.int32(budget), prefill_tokens=np.int32(p),
            prefill_logits=np.int32(mp), logit_base=np.int32(p))
        _, sampling, sample_slot = sampling_batch(ordered, inp, n, r, slots)
        inp = inp._replace(logit_rows=logit_rows)
        if self.decoder_replay:
            inp, rows = self._spec_decoder_rows(host, ordered, inp, rows, n - p, d)
        logits, self.cache, self.spec, layout, slot = self._spec_forward_fn(
            self._ptree, self._pleaves, self._dtree, self._dleaves, self.cfg, self.cache_cfg, self.cache, self.spec,
            self.last_ids, inp, rows)
        del sample_slot  # every producing row stores its anchor in its slot (``speculative.draft_next``)
        return SpecForward(logits, layout, rows, slot, sampling, list(chunks), order, r, draft)

    def _spec_decoder_rows(self, host, ordered, inp, rows, room: int, d: int | None):
        """Decoder bounded replay: the host chunks' tails from ``decoder_from`` run the decoder, then every
        token the verify rows may use (``room`` = the bucket's tokens after the host chunks); the host
        chunks' logit rows re-indexed into the decoder rows, the verify ones start after theirs."""
        flat, remap = [], {}
        for i, c in enumerate(host):
            first = max(0, c.decoder_from - c.ctx_len)
            for k in range(first, len(c.token_ids)):
                remap[int(inp.req_start[i]) + k] = len(flat)
                flat.append(int(inp.req_start[i]) + k)
        base = len(flat)
        verify_room = room if np.any(np.asarray(rows.is_verify)) else 0
        p = int(rows.prefill_tokens)
        flat += list(range(p, p + verify_room))
        d = d or Buckets.pick(self.buckets.tokens, max(1, len(flat)), "decoder tokens in the step")
        dec = np.zeros(d, np.int32)
        dec[: len(flat)] = flat[:d]
        valid = np.zeros(d, bool)
        valid[: len(flat)] = True
        mp = int(rows.prefill_logits)
        logit_rows = np.asarray(inp.logit_rows).copy()
        logit_rows[:mp] = [remap.get(int(x), 0) for x in logit_rows[:mp]]
        floors = np.array([c.decoder_floor for c in ordered] + [0] * (len(inp.req_slot) - len(ordered)), np.int32)
        return (inp._replace(decoder_rows=dec, decoder_valid=valid, decoder_floor=floors, logit_rows=logit_rows),
                rows._replace(logit_base=np.int32(base)))
