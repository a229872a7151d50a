"""Engram hash constants: per-layer primes, offsets and multipliers (plain Python ints).

Neutral between the two worlds (stdlib + numpy only, no JAX, no tokenizer): the host reference
(``deepinfer_jax.engram_vocab``) and device code (``deepinfer_jax.model``) both import it, and
the device hash (``engram_hash.ngram_hash_ids``) takes its result as a static argument.
"""

from __future__ import annotations

import dataclasses
import functools
import math
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
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def _first_unused_prime_above(start: int, used: set[int]) -> int:
    candidate = start + 1
    while not (_is_prime(candidate) and candidate not in used):
        candidate += 1
    return candidate


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
    used: set[int] = set()
    layers = []
    for layer_id, rows in zip(layer_ids, num_embeddings):
        primes = []
        for _order in range(2, max_ngram + 1):
            current = bucket_floor - 1
            for _head in range(n_heads):
                current = _first_unused_prime_above(current, used)
                used.add(current)
                primes.append(current)
        if sum(primes) > rows:
            raise ValueError(
                f"engram_num_embeddings for layer {layer_id} is {rows}, but its hash buckets need "
                f"{sum(primes)} rows"
            )
        offsets = tuple(int(x) for x in np.cumsum([0, *primes[:-1]], dtype=np.int64))
        draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=max_ngram, dtype=np.int64)
        layers.append(EngramLayerHash(tuple(primes), offsets, tuple(2 * int(u) + 1 for u in draws)))
    return tuple(layers)
