"""Token sampling inside the jitted step: greedy, temperature, top-k, top-p, min-p, logprobs.

Every row is sampled on its own: its filters, its PRNG key and its noise depend only on that
row's logits and settings, never on the other rows of the batch, so a request's tokens do not
change with what else is batched (engine.md §2.5). Keys derive from ``(seed, stream, position)``
with ``jax.random.fold_in``; the engine passes the request's seed, its stream id and the index of
the output token being sampled.

Sampling is the Gumbel-max trick on the filtered, temperature-scaled logits, which draws exactly
from the renormalised distribution ``softmax(logits / T)`` restricted to the kept tokens; the
noise is indexed by token id, so a row's draw does not depend on which filters are active. The
filters follow the usual conventions: ``top_k`` keeps the k most likely tokens (0 = off), ``top_p``
keeps the most likely tokens whose mass reaches ``top_p`` (1 = off), ``min_p`` drops tokens whose
probability is below ``min_p`` times the largest one (0 = off); the most likely token is always
kept. Top-k and top-p are found as probability thresholds by bisection (no vocabulary sort), so a
token tied with the boundary value is kept with it. ``temperature == 0`` is greedy: the argmax
(lowest id on ties).

Logprobs are those of the model's raw distribution ``log_softmax(logits)`` (before temperature,
filters and token masks), for the chosen token and for the ``num_top`` most likely tokens.

Structured output (engine.md §2.4) arrives as a packed token bitmask per row, ``[R, ceil(V / 32)]``
int32 with bit ``v % 32`` of word ``v // 32`` set when token ``v`` is allowed (llguidance's
layout); disallowed logits become -inf before any filter, so greedy and sampled rows alike only
ever pick allowed tokens. The host guarantees every masked row allows at least one token.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp


class SamplingInputs(NamedTuple):
    """Per-row sampling settings, all arrays of leading size R (one row per request in the step)."""

    temperature: jax.Array  # [R] f32; 0 = greedy
    top_k: jax.Array  # [R] i32; 0 = off
    top_p: jax.Array  # [R] f32; 1 = off
    min_p: jax.Array  # [R] f32; 0 = off
    seed: jax.Array  # [R] u32
    stream: jax.Array  # [R] u32 (request stream id)
    position: jax.Array  # [R] i32 (index of the output token being sampled)


class Sampled(NamedTuple):
    """What a step returns per row."""

    token_ids: jax.Array  # [R] i32
    logprob: jax.Array  # [R] f32 log p(token) under the raw distribution
    top_ids: jax.Array  # [R, K] i32 most likely tokens
    top_logprobs: jax.Array  # [R, K] f32


def row_key(seed: jax.Array, stream: jax.Array, position: jax.Array) -> jax.Array:
    """The PRNG key of one sampled token: ``fold_in(fold_in(key(seed), stream), position)``."""
    key = jax.random.key(seed.astype(jnp.uint32))
    return jax.random.fold_in(jax.random.fold_in(key, stream.astype(jnp.uint32)), position.astype(jnp.uint32))


def _threshold_bits(p_bits, weight, target):
    """The largest float32 bit pattern ``t`` with sum(weight[p >= t]) >= target.

    Probabilities are non-negative, so their int32 bit patterns order like the values: a 31-step
    bisection over bit patterns finds the threshold exactly, with no sort of the vocabulary. With
    ``weight`` = the probabilities it is the top-p threshold; with ones, the top-k one."""

    def body(_, carry):
        lo, hi = carry
        mid = lo + (hi - lo + 1) // 2
        ok = jnp.sum(jnp.where(p_bits >= mid, weight, 0)) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 31, body, (jnp.zeros((), jnp.int32), jnp.max(p_bits)))
    return lo


def search_flags(top_k: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(any row uses top-p, any row uses top-k): one flag per filter for the whole batch."""
    return jnp.any(top_p < 1.0), jnp.any(top_k > 0)


def _filter(search, logits_V, temperature, top_k, top_p, min_p):
    """(scaled logits, kept tokens [V] bool, greedy id) of one row: the filters as thresholds on the
    probabilities of ``softmax(logits / T)``; the most likely token is always kept.

    ``search`` = (search top-p, search top-k) (``search_flags``: one pair for the whole batch); a
    threshold search no row needs is skipped, which changes nothing for any row."""
    vocab = logits_V.shape[0]
    search_p, search_k = search
    greedy = jnp.argmax(logits_V).astype(jnp.int32)
    t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits_V / t
    p = jax.nn.softmax(scaled)
    p_bits = jax.lax.bitcast_convert_type(p, jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    tp = jax.lax.cond(search_p, lambda: _threshold_bits(p_bits, p, top_p), lambda: zero)
    ones = jnp.ones((), jnp.int32)
    tk = jax.lax.cond(search_k, lambda: _threshold_bits(p_bits, ones, jnp.where(top_k > 0, top_k, 1)), lambda: zero)
    keep = (p_bits >= tp) | (top_p >= 1.0)
    keep &= (p_bits >= tk) | (top_k <= 0)
    keep &= p >= min_p * jnp.max(p)
    keep |= jnp.arange(vocab) == greedy  # the most likely token is always allowed
    return scaled, keep, greedy


def _sample_row(search, logits_V, temperature, top_k, top_p, min_p, key):
    """One row: the filters, then Gumbel-max in token order."""
    scaled, keep, greedy = _filter(search, logits_V, temperature, top_k, top_p, min_p)
    gumbel = jax.random.gumbel(key, scaled.shape, jnp.float32)
    sampled = jnp.argmax(jnp.where(keep, scaled + gumbel, -jnp.inf)).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def sample_tokens(logits_RV, keys_R, temperature, top_k, top_p, min_p) -> jax.Array:
    """One token id per row [R] (i32) of ``logits_RV`` [R, V], each row with its own key and settings [R].

    An all-greedy batch skips the stochastic path (its rows would take the argmax anyway)."""
    logits_RV = logits_RV.astype(jnp.float32)
    search = search_flags(top_k, top_p)

    def stochastic():
        return jax.vmap(partial(_sample_row, search))(logits_RV, temperature, top_k, top_p, min_p, keys_R)

    return jax.lax.cond(jnp.any(temperature > 0), stochastic,
                        lambda: jnp.argmax(logits_RV, axis=-1).astype(jnp.int32))


def unpack_bitmask(mask_RW: jax.Array, vocab: int) -> jax.Array:
    """Allowed tokens [R, vocab] (bool) from a packed bitmask [R, ceil(vocab / 32)] (i32)."""
    bits = (mask_RW[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    return bits.reshape(mask_RW.shape[0], -1)[:, :vocab].astype(bool)


def apply_bitmask(logits_RV: jax.Array, mask_RW: jax.Array, has_mask: jax.Array) -> jax.Array:
    """``logits_RV`` with disallowed tokens at -inf; ``has_mask`` (a scalar bool) False skips the work
    (the mask is then all ones)."""
    vocab = logits_RV.shape[1]
    return jax.lax.cond(has_mask, lambda: jnp.where(unpack_bitmask(mask_RW, vocab), logits_RV, -jnp.inf),
                        lambda: logits_RV)


def sample(logits_RV: jax.Array, s: SamplingInputs, num_top: int, mask_RW: jax.Array | None = None,
           has_mask: jax.Array | None = None) -> Sampled:
    """Sample one token per row of ``logits_RV`` [R, V] (f32); ``num_top`` (static) top logprobs;
    ``mask_RW`` (optional, with the scalar ``has_mask``): the rows' packed allowed-token bitmasks."""
    logits_RV = logits_RV.astype(jnp.float32)
    keys = jax.vmap(row_key)(s.seed, s.stream, s.position)
    allowed = logits_RV if mask_RW is None else apply_bitmask(logits_RV, mask_RW, has_mask)
    ids = sample_tokens(allowed, keys, s.temperature, s.top_k, s.top_p, s.min_p)
    logp = jax.vmap(jax.nn.log_softmax)(logits_RV)
    chosen = jnp.take_along_axis(logp, ids[:, None], axis=1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, num_top)
    return Sampled(ids, chosen, top_ids.astype(jnp.int32), top_lp)
