"""Engram hash constants: per-layer primes, offsets and multipliers (plain Python ints).

Neutral between the two worlds (stdlib + numpy only, no JAX, no tokenizer): the host reference
(``deepinfer_jax.engram_vocab``) and device code (``deepinfer_jax.model``) both import it, and
the device hash (``engram_hash.ngram_hash_ids``) takes its result as a static argument.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

__all__ = ["EngramLayerHash", "hash_constants"]

_INT64_MAX = int(np.iinfo(np.int64).max)


@dataclasses.dataclass(frozen=True)
class EngramLayerHash:
    """Hash constants of one Engram layer (plain Python ints, hashable: jit-static friendly).

    Attributes:
        primes: bucket count per hash column, length ``(max_ngram - 1) * n_heads``, ordered
            n-gram order 2 heads 0..n_heads-1, then order 3, ...
        offsets: exclusive cumulative sums of ``primes`` (the column's first table row).
        multipliers: odd per-position multipliers, length ``max_ngram`` (position 0 is the
            current token, position k the token k steps back).
    """

    primes: tuple[int, ...]
    offsets: tuple[int, ...]
    multipliers: tuple[int, ...]


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact below 3.3e24)."""
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    if n < 2 or any(n % p == 0 for p in bases):
        return n in bases
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    return all(pow(a, d, n) == 1 or any(pow(a, d << k, n) == n - 1 for k in range(s)) for a in bases)


@functools.lru_cache(maxsize=64)
def engram_primes(bucket_floor: int, num_layers: int, per_layer: int) -> tuple[tuple[int, ...], ...]:
    """Hash-bucket primes of every Engram layer, each ordered by (n-gram order, head).

    The reference gives each column the first prime above ``bucket_floor - 1`` not used by an
    earlier column of any layer, restarting the search for every n-gram order; that is exactly the
    run of consecutive primes >= ``bucket_floor``, handed out in layer order.
    """
    primes, candidate = [], bucket_floor
    while len(primes) < num_layers * per_layer:
        if _is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    return tuple(tuple(primes[i * per_layer : (i + 1) * per_layer]) for i in range(num_layers))


def _positive_int(cfg: Any, name: str, minimum: int = 1) -> int:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def hash_constants(cfg: Any) -> tuple[EngramLayerHash, ...]:
    """Per-layer Engram hash constants for ``cfg``, one entry per ``cfg.engram_layer_ids``.

    Primes: for each layer in order, for each n-gram order 2..max_ngram, the search restarts
    just above ``engram_vocab_size - 1`` and takes the next ``engram_n_heads`` primes not yet
    used by any earlier column of any layer. Multipliers: ``2 * u + 1`` with ``u`` drawn by
    ``numpy.random.default_rng(10007 * layer_id).integers(0, bound, max_ngram, dtype=int64)``,
    ``bound = max(1, (2**63 - 1) // engram_compressed_vocab_size // 2)``.

    Raises:
        ValueError: naming the config field that is inconsistent (e.g. ``engram_num_embeddings``
            when a layer's primes sum past its table rows).
    """
    layer_ids = tuple(int(x) for x in cfg.engram_layer_ids)
    num_embeddings = tuple(int(x) for x in cfg.engram_num_embeddings)
    return _hash_constants(
        layer_ids,
        num_embeddings,
        _positive_int(cfg, "engram_max_ngram_size", 2),
        _positive_int(cfg, "engram_n_heads"),
        _positive_int(cfg, "engram_vocab_size", 2),
        _positive_int(cfg, "engram_compressed_vocab_size"),
    )


@functools.lru_cache(maxsize=32)
def _hash_constants(
    layer_ids: tuple[int, ...],
    num_embeddings: tuple[int, ...],
    max_ngram: int,
    n_heads: int,
    bucket_floor: int,
    n_compressed: int,
) -> tuple[EngramLayerHash, ...]:
    if not layer_ids:
        raise ValueError("engram_layer_ids is empty; Engram hashing needs at least one layer")
    if len(set(layer_ids)) != len(layer_ids) or min(layer_ids) < 0:
        raise ValueError(f"engram_layer_ids must be distinct non-negative layer ids, got {layer_ids}")
    if len(num_embeddings) != len(layer_ids):
        raise ValueError(
            f"engram_num_embeddings has {len(num_embeddings)} entries but engram_layer_ids "
            f"has {len(layer_ids)}"
        )
    bound = max(1, (_INT64_MAX // n_compressed) // 2)
    layers = []
    all_primes = engram_primes(bucket_floor, len(layer_ids), (max_ngram - 1) * n_heads)
    for layer_id, rows, primes in zip(layer_ids, num_embeddings, all_primes):
        if sum(primes) > rows:
            raise ValueError(
                f"engram_num_embeddings for layer {layer_id} is {rows}, but its hash buckets need "
                f"{sum(primes)} rows"
            )
        offsets = tuple(int(x) for x in np.cumsum([0, *primes[:-1]], dtype=np.int64))
        draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=max_ngram, dtype=np.int64)
        layers.append(EngramLayerHash(primes, offsets, tuple(2 * int(u) + 1 for u in draws)))
    return tuple(layers)
