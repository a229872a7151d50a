"""The speculative step: the ``ModelRunner`` component for DSpark speculative decoding (docs/speculative.md).

A runner built with a drafter (``ModelRunner(..., drafter=...)``) holds one ``SpeculativeStep`` as
``runner.speculation``: the drafter, its heads, the per-slot speculative state and the two jitted programs
that take the place of the plain step's pair. The runner's ``forward`` / ``sample`` / ``launch`` /
``precompile`` hand their work to it; the cache, the per-slot last ids, the buckets and the mesh stay the
runner's.

- ``forward(chunks, budget)``: the model step. Host chunks (prefill pieces, ``ChunkSpec`` as usual)
  come first; then every *verify row* (``ChunkSpec(verify=True)``: a decoding request, named by its
  slot) whose tokens the device builds from its slot's speculative state: the anchor and the drafts
  the confidence-ranked top-``budget`` selection gives it (``model.speculative``). The host fixes only
  the total (rows + budget), so the bucket shape is known without knowing any row's position; each
  token's DSpark target features go into the slot's feature ring.
- ``sample(fwd, mask)``: lossless acceptance of each row's drafts, the bonus or corrected token,
  the new anchor, and the drafter's next block for every row that produced a token (optionally
  skipped: ``draft=False``). Between the two the host may compute structured-output masks.

Results come back per chunk as a list of ``SampledToken`` (empty for a verify row that was past its limit,
None for a chunk that samples nothing), plus per chunk the number of drafts it verified, its anchor
position and the confidences of its next drafts (``SpecPending.output()``, a ``StepOutput``).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax import compile_options
from deepinfer_jax.model import dspark
from deepinfer_jax.model import speculative as spec_ops
from deepinfer_jax.model.host_arrays import filled
from deepinfer_jax.model.paged import paged_step
from deepinfer_jax.model.sampler import SamplingInputs
from deepinfer_jax.runner.buckets import Buckets
from deepinfer_jax.runner.model_runner import no_mask
from deepinfer_jax.runner.program_store import stored_jit
from deepinfer_jax.runner.step_batch import ChunkSpec, StepInputError, build_inputs, check_chunks, sampling_batch
from deepinfer_jax.runner.step_output import SampledToken, StepOutput
from deepinfer_jax.runner.step_programs import count_trace, spec_forward_step, spec_sample_step

__all__ = ["SpecForward", "SpecPending", "SpeculativeStep"]


def _spec_forward(ptree, pleaves, dtree, dleaves, cfg, cache_cfg, cache, spec, last_ids, inputs, rows):
    """``step_programs.spec_forward_step`` with the target's and the drafter's states as (treedef, leaves) (see
    ``step_programs.logits_step_flat``)."""
    params, drafter = jax.tree_util.tree_unflatten(ptree, pleaves), jax.tree_util.tree_unflatten(dtree, dleaves)
    return spec_forward_step(params, drafter, cfg, cache_cfg, cache, spec, last_ids, inputs, rows)


def _spec_sample(num_top, cfg, ptree, pleaves, dtree, dleaves, heads, logits, mask, has_mask, sampling, layout, rows,
                 spec, last_ids, slot_R, draft, want_logprobs):
    """``step_programs.spec_sample_step`` with the states as (treedef, leaves): accept, take the tokens into the
    slots, draft the next blocks."""
    params, drafter = jax.tree_util.tree_unflatten(ptree, pleaves), jax.tree_util.tree_unflatten(dtree, dleaves)
    return spec_sample_step(num_top, cfg, params, drafter, heads, logits, mask, has_mask, sampling, layout, rows, spec,
                            last_ids, slot_R, draft, want_logprobs)


def _spec_accept(num_top, cfg, ptree, pleaves, dtree, dleaves, heads, logits, mask, has_mask, sampling, layout, rows,
                 spec, last_ids, slot_R, draft, want_logprobs):
    """``_spec_sample`` without the drafter and without draft verification (``spec_sample_step(drafting=False)``):
    sample each row's first position and take the tokens into the slots; ``draft`` is ignored. The program a step
    runs while drafting is deferred (``SpeculativeStep.defer_drafting``), when no row has drafts to verify."""
    params, drafter = jax.tree_util.tree_unflatten(ptree, pleaves), jax.tree_util.tree_unflatten(dtree, dleaves)
    return spec_sample_step(num_top, cfg, params, drafter, heads, logits, mask, has_mask, sampling, layout, rows, spec,
                            last_ids, slot_R, draft, want_logprobs, drafting=False)


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
    chunk_rows: list[int] | None = None  # over a mesh: chunk i's row of the mask (rank d's k-th: d * rows + k)
    slot_counts: jax.Array | None = None  # EP step: [L, P] pairs per physical slot (``ModelRunner.slot_counts``)
    placement: object = None  # EP step: the placement the step ran with


class SpecPending:
    """A launched speculative step; ``result()`` waits for the device (see the module docstring)."""

    def __init__(self, outputs, chunks: Sequence[ChunkSpec], order: Sequence[int], ranked: bool = False):
        self._out, self._chunks, self._order, self._result = outputs, chunks, order, None
        self._ranked = ranked  # over a mesh: the arrays are [dp, R, ...], ``order`` indexes them flattened
        self.verified: list[int] = []  # drafts verified per chunk (after result())
        self.anchors: list[int] = []  # verify rows: the anchor position they ran at
        self.confidence: list[np.ndarray] = []  # per chunk: the confidences of its next drafts [K]

    def output(self) -> StepOutput:
        """The step's tokens per chunk with the drafts each row verified, its anchor and next confidences."""
        return StepOutput(self.result(), self.verified, self.anchors, self.confidence)

    def result(self) -> list[list[SampledToken] | None]:
        if self._result is None:
            acc, counts, anchors, conf = self._out[:4]
            flat = (lambda a: a.reshape(-1, *a.shape[2:])) if self._ranked else (lambda a: a)
            tokens, n_new, lp, top_ids, top_lp = (flat(np.asarray(a)) for a in acc)
            counts, anchors, conf = flat(np.asarray(counts)), flat(np.asarray(anchors)), flat(np.asarray(conf))
            res = []
            for c, i in zip(self._chunks, self._order):
                if c.sample is None:
                    res.append(None)
                else:
                    res.append([SampledToken(int(tokens[i, j]), float(lp[i, j]), top_ids[i, j], top_lp[i, j])
                                for j in range(int(n_new[i]))])
                self.verified.append(int(counts[i]))
                self.anchors.append(int(anchors[i]))
                self.confidence.append(conf[i])
            self._result, self._out = res, None
        return self._result


class SpeculativeStep:
    """The drafter, the per-slot speculative state and their programs, as a component of ``runner``.

    ``drafter``: the DSpark drafter's state (``model.dspark``); ``params``: the target's parameters as loaded
    (the drafter's heads read its embedding). ``draft_vocab``: the token ids the drafter may propose (a
    frequency-ranked subset makes drafting cheaper: its head scores only those rows; the verification stays
    lossless), None = the whole vocabulary.

    Over a device mesh (attention data parallel, ``runner.mesh``) the speculative state is stacked per DP rank
    like the cache, the drafter and its heads are replicated, and a step takes one chunk list per rank with one
    verification budget and one drafting switch per rank (``runner.mesh_step.spec_programs``: every rank's draft /
    verify rows in one program over the mesh).
    """

    def __init__(self, runner, params, drafter, draft_vocab=None):
        cfg, cache_cfg = runner.cfg, runner.cache_cfg
        k = cfg.dspark_block_size
        if cache_cfg.spec_slack < k:
            raise ValueError(f"spec_slack must be >= dspark_block_size ({k}) to absorb the rollback of "
                             f"rejected drafts, got {cache_cfg.spec_slack}")
        if draft_vocab is not None:
            ids = np.asarray(draft_vocab)
            if (ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= cfg.vocab_size
                    or len(set(ids.tolist())) != len(ids)):
                raise ValueError(f"draft_vocab must be distinct token ids in [0, {cfg.vocab_size})")
        self.runner, self.drafter, self.k = runner, drafter, k
        self.heads = dspark.draft_heads(drafter, params, cfg, draft_vocab)
        self._no_mask: dict[int, jax.Array] = {}  # rows -> an all-ones mask on the device(s)
        self._narrow_wants: collections.Counter = collections.Counter()  # shape -> steps that verified nothing
        #: False while drafting is deferred (``defer_drafting``): steps then draft nothing and sample through the
        #: accept-only program; True once a drafting program exists (or was wanted ``compile_after`` times).
        self.drafting_ready = True
        self._draft_wants = 0  # steps that wanted to draft while it was deferred
        ring, vd = cfg.sliding_window + cache_cfg.spec_slack, int(self.heads.ids.shape[0])
        if runner.mesh is None:
            #: The per-slot speculative state (``model.speculative.SpecState``; over a mesh stacked per DP rank).
            self.state = spec_ops.init_spec_state(cfg, cache_cfg.max_requests, ring, vd)
            self._dleaves, self._dtree = jax.tree_util.tree_flatten(drafter)
            self._forward_fn = stored_jit(_spec_forward, "spec_forward", (0, 2, 4, 5), (6, 7), on_build=count_trace,
                                         log=runner.program_log)
            self._sample_fn = stored_jit(_spec_sample, "spec_sample", (0, 1, 2, 4), (13, 14), on_build=count_trace,
                                        log=runner.program_log)
            self._accept_fn = stored_jit(_spec_accept, "spec_accept", (0, 1, 2, 4), (13, 14), on_build=count_trace,
                                        log=runner.program_log)
        else:
            self._mesh_programs(ring, vd)

    def _mesh_programs(self, ring: int, vd: int) -> None:
        from deepinfer_jax import sharding as sh
        from deepinfer_jax.runner import mesh_step

        rn = self.runner
        cfg, slots, dp = rn.cfg, rn.cache_cfg.max_requests, rn.dp_size
        self.drafter, self.heads = sh.place((self.drafter, self.heads), rn._replicated)
        stack = lambda: jax.tree.map(lambda a: jnp.broadcast_to(a[None], (dp, *a.shape)),
                                     spec_ops.init_spec_state(cfg, slots, ring, vd))
        self.state = compile_options.jit(stack, out_shardings=rn._dp)()
        leaves, treedef = jax.tree_util.tree_flatten(rn.params)
        self._forward_fn, self._sample_fn = mesh_step.spec_programs(
            cfg, rn.cache_cfg, rn.mesh, rn.preset.dp_axes, rn.manual_axes, rn.ep_spec,
            tuple(x.sharding.spec for x in leaves), treedef)

    def logit_rows(self, n: int, r: int, verify: bool = True) -> int:
        """Logit rows of a (tokens n, requests r) step: at most K + 1 per request row (the *wide* program, which
        runs any step), or one per request row (``verify=False``, the *narrow* program: only for a step that
        verifies no draft, a budget of 0 and no forced row). The narrow program computes the head and the
        sampler's [M, V] work on r rows instead of r (K + 1): measured on the shipped model, demo settings, 48
        steps of 64 tokens x 4 requests that verify nothing, 2.9-3.1 s of device time instead of 3.6 s (plain
        decoding 2.8-2.9 s). It is a second program per bucket, so only a lazy engine uses it, and like a
        tighter bucket (``BucketUse``) only once the bucket has run ``compile_after`` such steps: a short run
        (and a warm process after it) keeps to the one wide program; ``precompile="all"`` compiles the wide
        one only and never switches."""
        return min(n, r * (self.k + 1)) if verify else min(n, r)

    def _narrow(self, n: int, r: int, b: int) -> bool:
        """Whether a step of shape (n, r, b) that verifies no draft runs the narrow program (``logit_rows``)."""
        use = self.runner.bucket_use
        if not use.lazy:
            return False
        self._narrow_wants[(n, r, b)] += 1
        return self._narrow_wants[(n, r, b)] > use.compile_after

    def defer_drafting(self) -> None:
        """Let a lazy engine start without the drafter's program (``speculation="auto"``, one device). The
        drafter and the draft verification are most of a speculative bucket's sampling program (measured on the
        shipped model: 3.4-3.7 s of XLA compile with them, 0.8 s without), and a short run in a fresh process
        rarely gets that back. While deferred, every step samples through the *accept-only* program (each row's
        first position, sampled as the full program does when it verifies nothing, and the slot updates; the
        feature rings keep filling, so drafting can start at any step), and ``can_draft`` answers False until
        the bucket's drafting program is found in the program store (a warm process: from its first step on) or
        drafting was wanted ``compile_after`` times (then it compiles, like a tighter bucket in ``BucketUse``)."""
        if self.runner.mesh is None:
            self.drafting_ready = False

    def can_draft(self) -> bool:
        """Whether a step may draft the next blocks; the engine asks when its policy wants a step to draft (so
        a deferred engine counts the wants)."""
        if not self.drafting_ready:
            self._draft_wants += 1
            self.drafting_ready = self._draft_wants > self.runner.bucket_use.compile_after
        return self.drafting_ready

    def precompile(self, progress=None) -> None:
        """Compile the speculative engine step of every bucket with all-padding inputs, plus the prefix cache's
        copies (over a mesh also the weight move of a rebalance); ``progress(i, total)`` per bucket."""
        rn = self.runner
        if rn.placement is not None:  # the weight move of a rebalance (here: onto the same placement)
            rn.set_placement(rn.placement)
        rn.restore_swa(0, rn.snapshot_swa(0), [], 0)
        rn.restore_swa(0, None, [], 0)
        rn.block_payloads(rn.read_blocks([0]))
        rn.write_blocks([0], rn.block_payloads(rn.read_blocks([0])))
        shapes = rn.buckets.shapes()
        if rn.decoder_replay:
            shapes = [(n, r, b, d) for n, r, b in shapes for d in rn.buckets.tokens if d <= n]
        if progress is not None:
            progress(0, len(shapes))
        dp = rn.dp_size
        for i, (n, r, b, *d) in enumerate(shapes):
            rn.bucket_use.compiled.add((n, r, b))
            self.sample(self._dispatch([[]] * dp, [0] * dp, [True] * dp, n, r, b, *d)).result()
            if progress is not None:
                progress(i + 1, len(shapes))

    # -- the engine's step -------------------------------------------------------------------
    def forward(self, by_rank: list[list[ChunkSpec]], budget=0, draft=True, logprobs: bool = True) -> SpecForward:
        """Validate and dispatch the model step of every rank's chunks (``ModelRunner._by_rank``); ``budget``:
        drafts to verify over the non-forced verify rows (the forced ones add their caps); ``draft``: whether the
        acceptance program drafts again; ``logprobs``: whether it computes logprobs (else they come back as zeros).
        ``budget`` / ``draft`` are one value for every rank or one per rank; ``StepInputError`` names the rank and
        chunk that cannot run."""
        rn = self.runner
        if not any(by_rank):
            raise StepInputError("a step needs at least one chunk")
        dp = rn.dp_size
        budgets = list(budget) if isinstance(budget, (list, tuple)) else [budget] * dp
        drafts = [bool(x) for x in draft] if isinstance(draft, (list, tuple)) else [bool(draft)] * dp
        if len(budgets) != dp or len(drafts) != dp:
            raise StepInputError(f"budget and draft: one value, or one per DP rank ({dp})")
        need = []  # per rank: (tokens, requests, blocks) of its step
        verify = False  # whether any rank may verify a draft (else the narrow program may run, ``logit_rows``)
        for d, cs in enumerate(by_rank):
            where = "" if rn.mesh is None else f"rank {d}: "
            try:
                check_chunks(cs, rn.cfg, rn.cache_cfg)
            except StepInputError as e:
                raise StepInputError(f"{where}{e}") from None
            if not isinstance(budgets[d], (int, np.integer)) or isinstance(budgets[d], bool) or budgets[d] < 0:
                raise StepInputError(f"{where}budget must be an integer >= 0, got {budgets[d]!r}")
            host = [c for c in cs if not c.verify]
            ver = [c for c in cs if c.verify]
            budgets[d] = min(int(budgets[d]), sum(c.max_drafts for c in ver if not c.forced))
            forced = sum(c.max_drafts for c in ver if c.forced)
            verify = verify or budgets[d] + forced > 0
            if cs:
                need.append((sum(len(c.token_ids) for c in host) + len(ver) + forced + budgets[d], len(cs),
                             max(len(c.block_table) for c in cs)))
        try:
            n = Buckets.pick(rn.buckets.tokens, max(x[0] for x in need), "tokens in the step")
            r = Buckets.pick(rn.buckets.requests, max(x[1] for x in need), "requests in the step")
            b = Buckets.pick(rn.buckets.blocks, max(x[2] for x in need), "block_table length")
        except ValueError as e:
            raise StepInputError(str(e)) from None
        if rn.mesh is None:
            n, b = rn.bucket_use.choose(n, r, b)
        fwd = self._dispatch(by_rank, budgets, drafts, n, r, b, verify=verify or not self._narrow(n, r, b))
        fwd.logprobs, fwd.tokens = logprobs, n
        return fwd

    def sample(self, fwd: SpecForward, mask: np.ndarray | None = None) -> SpecPending:
        """Dispatch acceptance + drafting; ``mask`` [rows bucket, mask_words] as in ``ModelRunner.sample``
        (row i = chunk i in the caller's order; over a mesh row ``fwd.chunk_rows[i]``)."""
        rn = self.runner
        ranked = rn.mesh is not None
        if mask is None:
            dev_mask, has = no_mask(self._no_mask, fwd.rows, rn.mask_words, self._all_ones), np.False_
        else:
            rn.check_mask(mask, fwd.rows)
            dev_mask = np.full_like(mask, -1)
            given = fwd.chunk_rows or range(len(fwd.order))
            for at, row in zip(given, fwd.order):
                dev_mask[row] = mask[at]
            has = np.True_
        if not ranked:
            args = (rn.num_top_logprobs, rn.cfg, rn._ptree, rn._pleaves, self._dtree, self._dleaves, self.heads,
                    fwd.logits, dev_mask, has, fwd.sampling, fwd.layout, fwd.spec_rows, self.state, rn.last_ids,
                    fwd.slot, np.bool_(fwd.draft), np.bool_(fwd.logprobs))
            if not self.drafting_ready:  # asked to draft, or a warm process: the drafting program is stored
                self.drafting_ready = bool(fwd.draft) or self._sample_fn.available(*args)
            outs = (self._sample_fn if self.drafting_ready else self._accept_fn)(*args)
        else:
            dp = rn.dp_size
            if mask is not None:  # laid out as the all-ones mask: no retrace
                dev_mask = rn._global(dev_mask.reshape(dp, fwd.rows // dp, rn.mask_words), rn._dp, always=True)
            draft = np.asarray(fwd.draft, bool)
            has, sampling, draft, want = rn._global((has, fwd.sampling, draft, np.bool_(fwd.logprobs)),
                                                    rn._replicated)
            outs = self._sample_fn(rn.num_top_logprobs, rn.cfg, rn.params, self.drafter, self.heads, fwd.logits,
                                   dev_mask, has, sampling, fwd.layout, fwd.spec_rows, self.state, rn.last_ids,
                                   fwd.slot, draft, want)
        *result, self.state, rn.last_ids = outs
        return SpecPending(result, fwd.chunks, fwd.order, ranked)

    # -- internals ---------------------------------------------------------------------------
    def _all_ones(self, shape) -> jax.Array:
        rn = self.runner
        if rn.mesh is None:
            return filled(shape, jnp.int32, -1)
        dp = rn.dp_size  # laid out per rank, as a given mask is
        return compile_options.jit(lambda: jnp.full((dp, shape[0] // dp, shape[1]), -1, jnp.int32),
                                   out_shardings=rn._dp)()

    def _dispatch(self, chunks_by_rank, budgets, drafts, n: int, r: int, b: int, d: int | None = None,
                  verify: bool = True) -> SpecForward:
        """Every rank's inputs padded to (n, r, b) (and ``d`` decoder tokens) with the logit rows ``logit_rows(n, r,
        verify)``; one device runs its rank's, a mesh stacks them along dp."""
        rn = self.runner
        if rn.decoder_replay and d is None and rn.mesh is not None:  # one decoder-token bucket for every rank
            d = max(int(self._rank_inputs(cs, 0, n, r, b, None, verify)[0].decoder_rows.shape[0])
                    for cs in chunks_by_rank)
        parts = [self._rank_inputs(cs, budget, n, r, b, d, verify) for cs, budget in zip(chunks_by_rank, budgets)]
        chunks = [c for cs in chunks_by_rank for c in cs]
        if rn.mesh is None:
            inp, rows, sampling, order = parts[0]
            logits, rn.cache, self.state, layout, slot = self._forward_fn(
                rn._ptree, rn._pleaves, self._dtree, self._dleaves, rn.cfg, rn.cache_cfg, rn.cache, self.state,
                rn.last_ids, inp, rows)
            return SpecForward(logits, layout, rows, slot, sampling, chunks, order, r, drafts[0])
        stack = lambda *trees: jax.tree.map(lambda *a: np.stack(a), *trees)
        inp, rows, sampling = (stack(*[p[i] for p in parts]) for i in range(3))
        order = [rank * r + i for rank, p in enumerate(parts) for i in p[3]]
        chunk_rows = [rank * r + k for rank, cs in enumerate(chunks_by_rank) for k in range(len(cs))]
        inp, rows = rn._global((inp, rows), rn._dp)
        counts = None
        if rn.placement is None:
            logits, rn.cache, self.state, layout, slot = self._forward_fn(
                rn.params, self.drafter, rn.cache, self.state, rn.last_ids, inp, rows)
        else:
            logits, rn.cache, self.state, layout, slot, counts = self._forward_fn(
                rn.params, rn.tables, self.drafter, rn.cache, self.state, rn.last_ids, inp, rows)
        return SpecForward(logits, layout, rows, slot, sampling, chunks, order, rn.dp_size * r, list(drafts),
                           chunk_rows=chunk_rows, slot_counts=counts, placement=rn.placement)

    def _rank_inputs(self, chunks: Sequence[ChunkSpec], budget: int, n: int, r: int, b: int, d: int | None,
                     verify: bool = True):
        """One rank's (StepInputs, SpecRows, SamplingInputs, each chunk's request row) for a step of shape
        (n, r, b): host chunks first, then the verify rows; ``verify=False``: no draft is verified (one logit row
        per request row)."""
        rn = self.runner
        slots = rn.cache_cfg.max_requests
        host = [c for c in chunks if not c.verify]
        ver = [c for c in chunks if c.verify]
        ordered = host + ver
        order = [ordered.index(c) for c in chunks] if len(set(map(id, chunks))) == len(chunks) else None
        if order is None:
            raise StepInputError("a chunk appears twice in one step")
        m = self.logit_rows(n, r, verify)
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
        _, sampling, _ = sampling_batch(ordered, inp, n, r, slots)  # verify rows store their anchor in their slot
        inp = inp._replace(logit_rows=logit_rows)
        if rn.decoder_replay:
            inp, rows = self._spec_decoder_rows(host, ordered, inp, rows, n - p, d)
        return inp, rows, sampling, order

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
        d = d or Buckets.pick(self.runner.buckets.tokens, max(1, len(flat)), "decoder tokens in the step")
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
