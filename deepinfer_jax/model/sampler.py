"""Token sampling inside the jitted step: greedy, temperature, top-k, top-p, min-p, logprobs.

Every row is sampled on its own: its filters, its PRNG key and its noise depend only on that
row's logits and settings, never on the other rows of the batch, so a request's tokens do not
change with what else is batched (engine.md §2.5). Keys derive from ``(seed, stream, position)``
with ``jax.random.fold_in``; the engine passes the request's seed, its stream id and the index of
the output token being sampled.

Sampling is the Gumbel-max trick on the filtered, temperature-scaled logits, which draws exactly
from the renormalised distribution ``softmax(logits / T)`` restricted to the kept tokens. The
filters follow the usual conventions: ``top_k`` keeps the k largest logits (0 = off), ``top_p``
keeps the smallest prefix of the sorted distribution whose mass reaches ``top_p`` (1 = off; the
most likely token is always kept), ``min_p`` drops tokens whose probability is below ``min_p``
times the largest one (0 = off). ``temperature == 0`` is greedy: the argmax (lowest id on ties).

Logprobs are those of the model's raw distribution ``log_softmax(logits)`` (before temperature
and filters), for the chosen token and for the ``num_top`` most likely tokens.
"""

from __future__ import annotations

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


def _sample_row(logits_V, temperature, top_k, top_p, min_p, key):
    vocab = logits_V.shape[0]
    greedy = jnp.argmax(logits_V).astype(jnp.int32)
    t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits_V / t
    order = jnp.argsort(-scaled, stable=True)  # descending, lowest id first on ties
    sorted_l = scaled[order]
    probs = jax.nn.softmax(sorted_l)
    rank = jnp.arange(vocab)
    keep = jnp.where(top_k > 0, rank < top_k, True)
    mass_before = jnp.cumsum(probs) - probs
    keep &= (mass_before < top_p) | (rank == 0)
    keep &= probs >= min_p * probs[0]
    gumbel = jax.random.gumbel(key, (vocab,), jnp.float32)
    pick = jnp.argmax(jnp.where(keep, sorted_l + gumbel, -jnp.inf))
    sampled = order[pick].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def sample_tokens(logits_RV, keys_R, temperature, top_k, top_p, min_p) -> jax.Array:
    """One token id per row [R] (i32) of ``logits_RV`` [R, V], each row with its own key and settings [R]."""
    return jax.vmap(_sample_row)(logits_RV.astype(jnp.float32), temperature, top_k, top_p, min_p, keys_R)


def sample(logits_RV: jax.Array, s: SamplingInputs, num_top: int) -> Sampled:
    """Sample one token per row of ``logits_RV`` [R, V] (f32); ``num_top`` (static) top logprobs."""
    logits_RV = logits_RV.astype(jnp.float32)
    keys = jax.vmap(row_key)(s.seed, s.stream, s.position)
    ids = sample_tokens(logits_RV, keys, s.temperature, s.top_k, s.top_p, s.min_p)
    logp = jax.vmap(jax.nn.log_softmax)(logits_RV)
    chosen = jnp.take_along_axis(logp, ids[:, None], axis=1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, num_top)
    return Sampled(ids, chosen, top_ids.astype(jnp.int32), top_lp)
