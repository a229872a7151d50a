"""The in-step sampler against a numpy reference of the filters and the target distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.model.sampler import SamplingInputs, row_key, sample, sample_tokens

V = 16
N = 6000


def reference_probs(logits, temperature, top_k, top_p, min_p):
    """The distribution the sampler must draw from (numpy, sort-based)."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.ones(V, bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1:
        before = np.cumsum(p[order]) - p[order]
        keep[order[before >= top_p]] = False
    keep &= p >= min_p * p.max()
    keep[order[0]] = True
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def draw(logits, temperature, top_k, top_p, min_p, n=N):
    keys = jax.vmap(lambda i: row_key(jnp.uint32(7), jnp.uint32(3), i))(jnp.arange(n))
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, V))
    full = lambda v, d: jnp.full(n, v, d)
    ids = jax.jit(sample_tokens)(rows, keys, full(temperature, jnp.float32), full(top_k, jnp.int32),
                                 full(top_p, jnp.float32), full(min_p, jnp.float32))
    return np.bincount(np.asarray(ids), minlength=V) / n


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.0, 4, 1.0, 0.0), (1.0, 0, 0.6, 0.0), (1.3, 0, 1.0, 0.1),
    (1.0, 5, 0.8, 0.05),
])
def test_samples_follow_the_filtered_distribution(temperature, top_k, top_p, min_p):
    logits = np.random.default_rng(0).normal(0, 1.5, V)
    want = reference_probs(logits, temperature, top_k, top_p, min_p)
    got = draw(logits, temperature, top_k, top_p, min_p)
    assert set(np.flatnonzero(got)) <= set(np.flatnonzero(want)), "a filtered-out token was sampled"
    assert np.abs(got - want).max() < 4 * np.sqrt(want.max() / N) + 1e-3, (got, want)


def test_greedy_and_top_k_one_take_the_argmax_lowest_id_on_ties():
    logits = np.zeros(V, np.float32)
    logits[[3, 9]] = 2.0
    assert draw(logits, 0.0, 0, 1.0, 0.0, n=8)[3] == 1.0
    assert draw(logits + np.arange(V) * 1e-3, 1.0, 1, 1.0, 0.0, n=64)[9] == 1.0


def test_rows_are_independent_of_the_batch():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, (7, V)).astype(np.float32)
    s = SamplingInputs(temperature=jnp.array([0, 1, 0.8, 1, 1, 0.5, 1.2], jnp.float32),
                       top_k=jnp.array([0, 0, 3, 0, 0, 0, 6], jnp.int32),
                       top_p=jnp.array([1, 1, 1, 0.7, 1, 1, 0.9], jnp.float32),
                       min_p=jnp.array([0, 0, 0, 0, 0.2, 0, 0], jnp.float32),
                       seed=jnp.arange(7, dtype=jnp.uint32), stream=jnp.zeros(7, jnp.uint32),
                       position=jnp.arange(7, dtype=jnp.int32) * 3)
    fn = jax.jit(sample, static_argnums=2)
    batch = fn(logits, s, 2)
    for i in range(7):
        one = fn(logits[i : i + 1], jax.tree.map(lambda a: a[i : i + 1], s), 2)
        assert int(one.token_ids[0]) == int(batch.token_ids[i])
        assert np.allclose(one.top_logprobs[0], batch.top_logprobs[i], atol=1e-6)
    lp = jax.nn.log_softmax(logits, axis=-1)
    assert np.allclose(batch.logprob, np.take_along_axis(np.asarray(lp), np.asarray(batch.token_ids)[:, None], 1)[:, 0],
                       atol=1e-6)
