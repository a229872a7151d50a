"""Speculative decoding on the device (engine.md §2.3): budgeted draft selection, the verification
batch built from per-slot state, lossless acceptance, and the drafting of the next block.

Per cache slot the device keeps a ``SpecState``: the sequence length it knows (the *anchor*, the newest
token, sits at ``length - 1`` and has not run through the target yet), the drafter's context (the
target features of the last positions, projected once by ``mtp.0``, in a ring indexed by position),
and the drafts of the next block with their confidences and the logits they were drawn from. The host
never needs to know how many tokens the previous step accepted to schedule the next one: a
verification row names only its slot, and the step reads the anchor position and the drafts there.

A step with verification rows:

1. ``select_counts``: each row's survival ``S(r, k) = prod_{i<=k} c(r, i)`` over its confidences; a
   global top-``budget`` over every row's candidate drafts (a row's candidates stop at its cap; rows
   marked ``forced`` rank first, so they always get their whole cap). Survival never grows with k and
   ties go to the lower k, so every row's selection is a contiguous prefix of its drafts.
2. ``verify_inputs``: the rows' tokens ``[anchor, d_1 .. d_count]`` at positions ``a .. a + count``,
   packed after the host's prefill chunks (the host only fixes the total, rows + budget), and one logit
   row per verified token.
3. the model step (``paged_step`` with the DSpark capture), ``write_features`` keeps the new features.
4. ``accept``: greedy rows accept drafts while they equal the target's argmax; sampled rows accept
   ``d_i`` with probability ``min(1, p_t(d_i) / p_d(d_i))`` and at the first rejection draw from
   ``norm(max(0, p_t - p_d))``; when every verified draft passes, a bonus token from ``p_t``. ``p_t`` is
   the engine's sampling distribution (temperature, top-k/top-p/min-p); ``p_d`` the drafter's
   ``softmax(logits / T)``. A row with no draft samples exactly as the plain engine does (same key).
5. ``draft_next``: the drafter proposes the next block after each row's new anchor.

PRNG keys depend only on (seed, stream, output position): the coin of the draft at output position
j uses ``fold_in(row_key(j), 1)``, the draft sampled for position j ``fold_in(row_key(j), 2)``, a
residual or bonus token ``row_key(j)`` itself.

Rejected positions need no undo: every per-slot ring of the cache keeps ``spec_slack`` rows to spare
(``model.kv_cache``), the feature ring here too, and block KV past the accepted length is rewritten
before anything reads it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from deepinfer_jax.model import dspark
from deepinfer_jax.model.host_arrays import filled
from deepinfer_jax.model.paged import Captured, StepInputs
from deepinfer_jax.model.sampler import _filter, apply_bitmask, row_key, sample_tokens, search_flags

__all__ = ["SpecLayout", "SpecRows", "SpecState", "accept", "draft_next", "init_spec_state", "select_counts",
           "verify_inputs", "write_features"]


class SpecState(NamedTuple):
    """Per-slot speculative state (S slots, K = ``dspark_block_size``, C feature-ring rows, V vocab)."""

    length: jax.Array  # [S] i32 tokens the device knows; the anchor sits at length - 1
    ctx_from: jax.Array  # [S] i32 first position whose features this request computed
    feat: jax.Array  # [S, C, d] projected target features, row = position % C
    feat_pos: jax.Array  # [S, C] i32 the position each row holds (-1 = none)
    drafts: jax.Array  # [S, K] i32 the next block's drafts
    conf: jax.Array  # [S, K] f32 their confidences (sigmoid of the confidence head)
    draft_logits: jax.Array  # [S, K, Vd] f32 the logits (over the draft vocabulary) each draft was drawn from


def init_spec_state(cfg, slots: int, ring_rows: int, draft_vocab: int | None = None) -> SpecState:
    """An empty state; ``draft_vocab``: columns of the draft vocabulary (None = the whole vocabulary)."""
    k, v, d = cfg.dspark_block_size, draft_vocab or cfg.vocab_size, cfg.hidden_size
    return SpecState(length=filled((slots,), jnp.int32), ctx_from=filled((slots,), jnp.int32),
                     feat=filled((slots, ring_rows, d), jnp.float32),
                     feat_pos=filled((slots, ring_rows), jnp.int32, -1),
                     drafts=filled((slots, k), jnp.int32), conf=filled((slots, k), jnp.float32),
                     draft_logits=filled((slots, k, v), jnp.float32))


class SpecRows(NamedTuple):
    """Host inputs of a step's rows (R request rows) for the speculative programs."""

    is_verify: jax.Array  # [R] bool: the row verifies its slot's drafts (its tokens come from the device)
    cap: jax.Array  # [R] i32 most drafts the row may verify
    forced: jax.Array  # [R] bool: always verify the whole cap (deterministic rows), ahead of the budget
    limit: jax.Array  # [R] i32 most tokens the row's sequence may reach after the step (max_model_len)
    prompt_len: jax.Array  # [R] i32 (output position of a verified token = its position - prompt_len)
    host_logit: jax.Array  # [R] i32 logit row of a host chunk that samples, -1 otherwise
    ctx_from: jax.Array  # [R] i32 host chunks: first position the request computed (drafter context)
    budget: jax.Array  # [] i32 drafts to verify over all non-forced rows
    prefill_tokens: jax.Array  # [] i32 flat tokens of the host chunks (verify tokens follow them)
    prefill_logits: jax.Array  # [] i32 logit rows of the host chunks (verify logit rows follow them)
    logit_base: jax.Array  # [] i32 where the verify tokens start in the rows logits index (the flat tokens,
    #                          or the decoder rows under decoder bounded replay)


class SpecLayout(NamedTuple):
    """Where each row's verified tokens went (from ``verify_inputs``)."""

    counts: jax.Array  # [R] i32 drafts verified per row
    anchor: jax.Array  # [R] i32 anchor position of verify rows
    active: jax.Array  # [R] bool verify rows that ran (their anchor lies within the limit)
    logit_start: jax.Array  # [R] i32 logit row of the row's first produced token (-1 = none)
    new_len: jax.Array  # [R] i32 tokens computed per row after the step, counting every verified draft


def select_counts(conf_RK: jax.Array, cap_R: jax.Array, forced_R: jax.Array, budget: jax.Array) -> jax.Array:
    """Drafts to verify per row [R]: a global top-``budget`` of the survival products (plus every
    forced row's whole cap, ahead of the budget), never more than a row's ``cap``; always a prefix."""
    r, k = conf_RK.shape
    surv = jnp.cumprod(jnp.clip(conf_RK.astype(jnp.float32), 0.0, 1.0), axis=1)
    allowed = jnp.arange(k)[None, :] < cap_R[:, None]
    score = jnp.where(allowed, surv + 2.0 * forced_R[:, None], -jnp.inf).reshape(-1)
    order = jnp.argsort(-score, stable=True)  # ties keep the flat order: the lower k of a row first
    rank = jnp.zeros(r * k, jnp.int32).at[order].set(jnp.arange(r * k, dtype=jnp.int32)).reshape(r, k)
    n_forced = jnp.sum(jnp.where(forced_R, jnp.clip(cap_R, 0, k), 0))
    chosen = allowed & (rank < n_forced + jnp.maximum(budget, 0))
    return jnp.sum(chosen, axis=1).astype(jnp.int32)


def verify_inputs(inp: StepInputs, rows: SpecRows, spec: SpecState, last_ids: jax.Array) -> tuple[StepInputs, SpecLayout]:
    """The step's full inputs: the host's chunks as given (``inp.logit_rows`` [M]: theirs first), then
    every verify row's tokens packed after them, with one logit row each."""
    n, r = inp.token_ids.shape[0], inp.req_slot.shape[0]
    slots, k = spec.drafts.shape
    slot = jnp.clip(inp.req_slot, 0, slots - 1)
    anchor = spec.length[slot] - 1
    active = rows.is_verify & (anchor >= 0) & (anchor + 1 <= rows.limit)
    cap = jnp.where(active, jnp.clip(jnp.minimum(rows.cap, rows.limit - anchor - 1), 0, k), 0)
    counts = select_counts(spec.conf[slot], cap, rows.forced & active, rows.budget)
    ntok = jnp.where(active, 1 + counts, 0)
    end = rows.prefill_tokens + jnp.cumsum(ntok)
    start = end - ntok
    f = jnp.arange(n)
    in_v = (f >= rows.prefill_tokens) & (f < end[-1])
    row = jnp.clip(jnp.searchsorted(end, f, side="right"), 0, r - 1)
    off = f - start[row]
    vslot = slot[row]
    vtok = jnp.where(off == 0, last_ids[vslot], spec.drafts[vslot, jnp.clip(off - 1, 0, k - 1)])
    ver = rows.is_verify
    full = inp._replace(
        token_ids=jnp.where(in_v, vtok, inp.token_ids), positions=jnp.where(in_v, anchor[row] + off, inp.positions),
        token_req=jnp.where(in_v, row, inp.token_req), token_valid=in_v | inp.token_valid,
        req_slot=jnp.where(ver & ~active, slots, inp.req_slot), req_start=jnp.where(ver, start, inp.req_start),
        ctx_len=jnp.where(ver, anchor, inp.ctx_len), new_len=jnp.where(ver, anchor + ntok, inp.new_len),
        logit_rows=_logit_rows(inp.logit_rows, rows, n if inp.decoder_rows is None else inp.decoder_rows.shape[0]))
    logit_start = jnp.where(ver, jnp.where(active, rows.prefill_logits + start - rows.prefill_tokens, -1),
                            rows.host_logit)
    return full, SpecLayout(counts, anchor, active, logit_start, full.new_len)


def _logit_rows(host_rows: jax.Array, rows: SpecRows, n: int) -> jax.Array:
    """[M] flat token per logit row: the host chunks' rows first, then every verify token in order."""
    i = jnp.arange(host_rows.shape[0])
    return jnp.where(i < rows.prefill_logits, host_rows,
                     jnp.clip(rows.logit_base + i - rows.prefill_logits, 0, n - 1))


def write_features(spec: SpecState, drafter, cfg, cap: Captured) -> SpecState:
    """Project the step's captured target features and keep the last ring rows of each request."""
    slots, c = spec.feat_pos.shape
    keep = cap.valid & (cap.positions >= cap.new_len - c) & (cap.req_slot < slots)
    at = (jnp.where(keep, cap.req_slot, slots), jnp.mod(cap.positions, c))
    rows = dspark.project_features(drafter, cfg, cap.feats.astype(jnp.float32)).astype(jnp.float32)
    return spec._replace(feat=spec.feat.at[at].set(rows, mode="drop"),
                         feat_pos=spec.feat_pos.at[at].set(cap.positions, mode="drop"))


class Accepted(NamedTuple):
    tokens: jax.Array  # [R, K+1] i32: the accepted drafts, then the bonus / corrected token
    n_new: jax.Array  # [R] i32 tokens produced (accepted + 1; 0 for rows that produce none)
    logprob: jax.Array  # [R, K+1] f32 under the raw target distribution
    top_ids: jax.Array  # [R, K+1, T] i32
    top_logprobs: jax.Array  # [R, K+1, T] f32


def _accept_sampled(search, vocab_ids, flat_MV, idx_RJ, produce_R, count_R, drafts_RK, dlogits_RKV, sampling, keys_RJ):
    """(accepted drafts m [R], the token at position m [R]) of every row as a sampled row.

    ``flat_MV``: the step's logit rows (masks applied); row r's position j is ``idx_RJ[r, j]``. The
    engine's filter (``sampler._filter``) runs once per logit row with the settings of the row that
    owns it, not once per (row, position): a step verifies far fewer tokens than R x (K + 1). The
    draft logits [R, K, Vd] are over the draft vocabulary ``vocab_ids`` [Vd] (p_d is 0 elsewhere)."""
    r, j = idx_RJ.shape
    k = j - 1
    m_rows, v = flat_MV.shape
    # the request row owning each logit row: positions 0..count of every row (disjoint ranges)
    own = jnp.where((jnp.arange(j)[None, :] <= count_R[:, None]) & produce_R[:, None], idx_RJ, m_rows)
    owner = jnp.zeros(m_rows, jnp.int32).at[own.reshape(-1)].set(jnp.repeat(jnp.arange(r, dtype=jnp.int32), j),
                                                                 mode="drop")
    T, top_k, top_p, min_p = (x[owner] for x in (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p))
    scaled, keep, greedy = jax.vmap(lambda *a: _filter(search, *a))(flat_MV, T, top_k, top_p, min_p)
    p_t = jnp.where(keep, jax.nn.softmax(scaled, axis=-1), 0.0)
    p_t = p_t / jnp.sum(p_t, axis=-1, keepdims=True)  # [M, V] the distribution each logit row samples
    temp = jnp.where(sampling.temperature > 0, sampling.temperature, 1.0)
    p_sub = jax.nn.softmax(dlogits_RKV / temp[:, None, None], axis=-1)  # [R, K, Vd]
    col = jnp.zeros(v, jnp.int32).at[vocab_ids].set(jnp.arange(vocab_ids.shape[0], dtype=jnp.int32))
    pt_x = p_t[idx_RJ[:, :k], drafts_RK]  # [R, K]
    pd_x = jnp.take_along_axis(p_sub, col[drafts_RK][..., None], axis=2)[..., 0]  # drafts lie in the vocabulary
    u = jax.vmap(jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1))))(keys_RJ[:, :k])
    ok = (u * pd_x < pt_x) & (jnp.arange(k)[None, :] < count_R[:, None])  # u < p_t / p_d, without dividing
    m = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    rows = jnp.arange(r)
    at = jnp.minimum(m, k - 1)
    p_d = jnp.zeros((r, v), jnp.float32).at[rows[:, None], vocab_ids[None, :]].set(p_sub[rows, at])
    pt_at = p_t[idx_RJ[rows, at]]
    resid = jnp.maximum(pt_at - p_d, 0.0)
    resid = jnp.where(jnp.sum(resid, axis=1, keepdims=True) > 0, resid, pt_at)
    g = jax.vmap(lambda key: jax.random.gumbel(key, (v,), jnp.float32))(keys_RJ[rows, m])
    corrected = jnp.argmax(jnp.where(resid > 0, jnp.log(resid) + g, -jnp.inf), axis=1).astype(jnp.int32)
    at_m = idx_RJ[rows, m]  # the bonus: exactly ``sampler._sample_row`` on logit row at_m with the same key
    bonus = jnp.argmax(jnp.where(keep[at_m], scaled[at_m] + g, -jnp.inf), axis=1).astype(jnp.int32)
    bonus = jnp.where(sampling.temperature > 0, bonus, greedy[at_m])
    return m, jnp.where(m < count_R, corrected, bonus)


def accept(logits_MV: jax.Array, layout: SpecLayout, rows: SpecRows, sampling, spec: SpecState, slot_R: jax.Array,
           num_top: int, vocab_ids: jax.Array, mask_RW=None, has_mask=None, want_logprobs=None,
           verifies: bool = True) -> Accepted:
    """Verify every row's drafts against the step's logits (see the module docstring). ``verifies=False`` (static):
    the caller guarantees that no row verifies a draft (every count is 0: the accept-only program, which runs
    while no draft exists), so only each row's first position is sampled, as ``True`` would.

    ``sampling``: the rows' ``SamplingInputs`` (``position`` = output position of a host chunk's
    sampled token; verify rows derive theirs from the anchor). ``vocab_ids`` [Vd]: the draft vocabulary.
    ``mask_RW``: structured-output bitmasks, applied to each row's first logit row (constrained rows
    verify no drafts). ``want_logprobs`` (a scalar bool, None = True): False skips the logprobs (zeros
    are returned). An all-greedy step without logprobs reads only one argmax per logit row."""
    r = layout.counts.shape[0]
    slots, k = spec.drafts.shape
    j = jnp.arange(k + 1)
    s = jnp.clip(slot_R, 0, slots - 1)
    produce = layout.logit_start >= 0
    idx = jnp.clip(layout.logit_start[:, None] + j[None, :], 0, logits_MV.shape[0] - 1)  # [R, J]
    first = logits_MV[idx[:, 0]].astype(jnp.float32)  # [R, V]
    if mask_RW is not None:
        first = apply_bitmask(first, mask_RW, has_mask)
    greedy = jnp.argmax(logits_MV, axis=-1).astype(jnp.int32)[idx]  # [R, J]
    greedy = greedy.at[:, 0].set(jnp.argmax(first, axis=-1).astype(jnp.int32))
    base = jnp.where(rows.is_verify, layout.anchor + 1 - rows.prompt_len, sampling.position)
    drafts = spec.drafts[s]
    count = jnp.where(rows.is_verify, layout.counts, 0)

    def greedy_rows():
        match = (drafts == greedy[:, :k]) & (j[None, :k] < count[:, None])
        m = jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)
        return m, jnp.take_along_axis(greedy, m[:, None], axis=1)[:, 0]

    def sampled_rows():
        keys = jax.vmap(lambda sd, st, b: jax.vmap(lambda i: row_key(sd, st, b + i))(j))(
            sampling.seed, sampling.stream, base)
        def verify():
            flat = logits_MV.astype(jnp.float32).at[jnp.where(produce, idx[:, 0], logits_MV.shape[0])].set(
                first, mode="drop")  # each row's first position carries its mask
            return _accept_sampled(search_flags(sampling.top_k, sampling.top_p), vocab_ids, flat, idx, produce,
                                   count, drafts, spec.draft_logits[s], sampling, keys)

        def plain():  # no row verifies a draft: the plain sampler on each row's first position (same keys)
            return jnp.zeros(r, jnp.int32), sample_tokens(first, keys[:, 0], sampling.temperature, sampling.top_k,
                                                          sampling.top_p, sampling.min_p)

        m_s, last_s = jax.lax.cond(jnp.any(count > 0), verify, plain)
        m_g, last_g = greedy_rows()
        hot = sampling.temperature > 0
        return jnp.where(hot, m_s, m_g), jnp.where(hot, last_s, last_g)

    def first_only():  # every count is 0: ``sampled_rows``' plain branch and ``greedy_rows`` at m = 0
        keys = jax.vmap(row_key)(sampling.seed, sampling.stream, base)
        picked = sample_tokens(first, keys, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
        return jnp.zeros(r, jnp.int32), jnp.where(sampling.temperature > 0, picked, greedy[:, 0])

    if verifies:
        m, last = jax.lax.cond(jnp.any(sampling.temperature > 0), sampled_rows, greedy_rows)
    else:
        m, last = jax.lax.cond(jnp.any(sampling.temperature > 0), first_only,
                               lambda: (jnp.zeros(r, jnp.int32), greedy[:, 0]))
    padded = jnp.concatenate([drafts, jnp.zeros((r, 1), jnp.int32)], axis=1)
    tokens = jnp.where(j[None, :] < m[:, None], padded, jnp.where(j[None, :] == m[:, None], last[:, None], 0))

    def logprobs():  # per logit row, then gathered: the raw distribution
        logp = jax.nn.log_softmax(logits_MV.astype(jnp.float32), axis=-1)
        top_lp, top_ids = jax.lax.top_k(logp, num_top)
        return logp[idx, tokens], top_ids[idx].astype(jnp.int32), top_lp[idx]

    def none():
        zeros = jnp.zeros((r, k + 1, num_top))
        return jnp.zeros((r, k + 1)), zeros.astype(jnp.int32), zeros

    chosen, top_ids, top_lp = (logprobs() if want_logprobs is None else
                               jax.lax.cond(want_logprobs, logprobs, none))
    return Accepted(tokens.astype(jnp.int32), jnp.where(produce, m + 1, 0).astype(jnp.int32), chosen, top_ids, top_lp)


def draft_next(spec: SpecState, last_ids: jax.Array, drafter, target, cfg, heads, out: Accepted, layout: SpecLayout,
               rows: SpecRows, sampling, slot_R: jax.Array, enabled: jax.Array,
               drafting: bool = True) -> tuple[SpecState, jax.Array]:
    """Take each producing row's new tokens into its slot (length, anchor) and draft the next block after
    the new anchor over the draft vocabulary ``heads`` (``dspark.DraftHeads``); skipped when ``enabled``
    is False: the slots' drafts then go stale and the host must not verify them. ``drafting=False`` (static)
    leaves the drafter out of the traced program altogether, as if ``enabled`` were always False.
    Returns (spec, last_ids)."""
    slots, c = spec.feat_pos.shape
    k = spec.drafts.shape[1]
    produce = out.n_new > 0
    # the computed tokens: a verify row's anchor + its accepted drafts; a host chunk's whole chunk
    computed = jnp.where(rows.is_verify, layout.anchor + out.n_new, layout.new_len)
    at = jnp.where(produce, slot_R, slots)
    anchor_tok = jnp.take_along_axis(out.tokens, jnp.maximum(out.n_new - 1, 0)[:, None], axis=1)[:, 0]
    length = spec.length.at[at].set(computed + 1, mode="drop")
    last_ids = last_ids.at[at].set(anchor_tok, mode="drop")
    host_rows = (~rows.is_verify) & (slot_R < slots)
    ctx_from = spec.ctx_from.at[jnp.where(host_rows, slot_R, slots)].set(rows.ctx_from, mode="drop")
    spec = spec._replace(length=length, ctx_from=ctx_from)
    if not drafting:
        return spec, last_ids

    def run(spec):
        s = jnp.clip(slot_R, 0, slots - 1)
        apos = computed  # the new anchor's position
        pos, feat = spec.feat_pos[s], spec.feat[s]  # [R, C]
        ok = (pos >= jnp.maximum(spec.ctx_from[s], 0)[:, None]) & (pos < apos[:, None])
        out_pos = apos + 1 - rows.prompt_len  # output position of the first draft

        def noise():
            keys = jax.vmap(lambda sd, st, b: jax.vmap(lambda i: jax.random.fold_in(row_key(sd, st, b + i), 2))(
                jnp.arange(k)))(sampling.seed, sampling.stream, out_pos)
            return jax.vmap(jax.vmap(lambda key: jax.random.gumbel(key, heads.ids.shape, jnp.float32)))(keys)

        d = dspark.draft_sampled(drafter, target, cfg, heads, feat, pos, ok, anchor_tok, apos, sampling.temperature,
                                 noise)
        sampled = sampling.temperature > 0  # only sampled rows need the logits (lossless acceptance)
        keep_logits = lambda: spec.draft_logits.at[jnp.where(sampled, at, slots)].set(d.logits, mode="drop")
        dl = jax.lax.cond(jnp.any(sampled & produce), keep_logits, lambda: spec.draft_logits)
        return spec._replace(drafts=spec.drafts.at[at].set(d.draft_ids, mode="drop"),
                             conf=spec.conf.at[at].set(d.confidence, mode="drop"), draft_logits=dl)

    spec = jax.lax.cond(enabled & jnp.any(produce), run, lambda s: s, spec)
    return spec, last_ids
