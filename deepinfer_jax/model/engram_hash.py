"""Engram n-gram hash ids on device, bit-exact with the int64 reference, without x64.

The reference hash (``deepinfer_jax.engram_vocab.hash_ids_with_constants_np``) multiplies
compressed token ids by 63-bit odd multipliers in wrapping int64, XORs the products, and
takes the floor modulo of the signed result by primes. JAX runs here with 32-bit integers
only, so a 64-bit value is carried as two uint32 words ``(hi, lo)``:

- product: ``c * m mod 2**64`` from 16-bit limbs of ``c`` and of ``m``'s low word (every
  partial product < 2**32), plus ``c * m_hi`` wrapping into the high word;
- XOR: per word;
- modulo a prime ``p < 2**24``: ``hi mod p`` first, then Horner over the four bytes of ``lo``
  (``r * 256 + byte < 2**32``); a negative signed value (top bit set) subtracts
  ``2**64 mod p``, a trace-time constant.

The constants (primes, offsets, multipliers) are plain Python ints, passed in as a sequence
of objects with those three tuple attributes (``engram_consts.hash_constants(cfg)`` gives them),
so this module depends on nothing but JAX and numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["ngram_hash_ids"]

_U32 = jnp.uint32
_MASK16 = 0xFFFF
_MAX_PRIME = 1 << 24


def _u32(values: Any) -> jnp.ndarray:
    return jnp.asarray(np.asarray(values, dtype=np.uint64).astype(np.uint32))


def _mul_u32_by_u64(c: jnp.ndarray, m_lo: jnp.ndarray, m_hi: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``c * (m_hi * 2**32 + m_lo) mod 2**64`` as (hi, lo) uint32 words (all args uint32).

    ``c`` [..., 1] broadcasts against the per-layer words ``m_lo``, ``m_hi`` [L].
    """
    c0, c1 = c & _MASK16, c >> 16
    b0, b1 = m_lo & _MASK16, m_lo >> 16
    ll, lh, hl, hh = c0 * b0, c0 * b1, c1 * b0, c1 * b1  # each < 2**32, exact
    mid = (ll >> 16) + (lh & _MASK16) + (hl & _MASK16)  # < 3 * 2**16
    lo = (mid << 16) | (ll & _MASK16)
    hi = hh + (lh >> 16) + (hl >> 16) + (mid >> 16) + c * m_hi  # wraps mod 2**32 as intended
    return hi, lo


def _floor_mod_signed64(
    hi: jnp.ndarray, lo: jnp.ndarray, primes: jnp.ndarray, wrap: jnp.ndarray
) -> jnp.ndarray:
    """Floor mod of the signed 64-bit value (hi, lo) by ``primes`` (< 2**24); uint32 result.

    ``hi``/``lo`` [..., L, 1] broadcast against ``primes``/``wrap`` [L, C]; ``wrap`` holds
    ``2**64 mod primes``.
    """
    r = hi % primes
    for shift in (24, 16, 8, 0):
        r = (r * 256 + ((lo >> shift) & 0xFF)) % primes
    negative = (hi >> 31) == 1
    return jnp.where(negative, jnp.where(r >= wrap, r - wrap, r + primes - wrap), r)


def _validate(consts: Sequence[Any], max_ngram: int, vocab: int, pad_token_id: int) -> int:
    """Trace-time checks; returns the number of hash columns per layer."""
    if max_ngram < 2:
        raise ValueError(f"max_ngram (engram_max_ngram_size) must be >= 2, got {max_ngram}")
    if not consts:
        raise ValueError("consts is empty; engram_layer_ids must name at least one layer")
    if not 0 <= pad_token_id < vocab:
        raise ValueError(
            f"pad_token_id (engram_pad_token_id) {pad_token_id} lies outside the token map of {vocab}"
        )
    n_cols = len(consts[0].primes)
    for c in consts:
        if len(c.multipliers) != max_ngram:
            raise ValueError(
                f"consts has {len(c.multipliers)} multipliers per layer, expected max_ngram={max_ngram}"
            )
        if not n_cols or n_cols % (max_ngram - 1) or len(c.primes) != n_cols or len(c.offsets) != n_cols:
            raise ValueError(
                "consts needs (max_ngram - 1) * n_heads primes and offsets in every layer, "
                f"got {len(c.primes)} primes and {len(c.offsets)} offsets"
            )
        if not all(1 <= p < _MAX_PRIME for p in c.primes):
            raise ValueError(
                f"consts primes must lie in [1, 2**24) for the 32-bit modulo, got {max(c.primes)}"
            )
        if not all(0 <= o and o + p < 2**31 for o, p in zip(c.offsets, c.primes)):
            raise ValueError("consts offsets + primes must fit in int32 row ids")
    return n_cols


def ngram_hash_ids(
    token_ids_BT: jnp.ndarray,
    token_map_V: jnp.ndarray,
    consts: Sequence[Any],
    *,
    max_ngram: int,
    pad_token_id: int,
    history: jnp.ndarray | None = None,
    token_mask: jnp.ndarray | None = None,
) -> jnp.ndarray:
    """Engram logical table row ids for every token and Engram layer.

    Look-back k of position t (k = 0 is the token itself) uses the compressed id
    ``token_map_V[id]``, or ``token_map_V[pad_token_id]`` once blocked (before the row start
    or an absent history entry, or through a masked token; blocked stays blocked for larger
    k). Column ``(n - 2) * H + h`` of layer l is the floor mod of the wrapping-int64 value
    ``XOR_{k<n} c_k * multipliers[k]`` by ``primes[...]``, plus ``offsets[...]``.

    Args:
        token_ids_BT: int32 [B, T] raw token ids; out-of-range ids are clipped (validate on
            the host).
        token_map_V: int32 [V] compressed class per token id (values < 2**31).
        consts: per Engram layer, an object with ``primes``, ``offsets`` (length
            ``(max_ngram - 1) * H``) and ``multipliers`` (length ``max_ngram``) as Python
            ints; primes must be < 2**24. Static under ``jax.jit``.
        max_ngram: largest n-gram order (``engram_max_ngram_size``), static.
        pad_token_id: raw id standing for blocked look-backs (``engram_pad_token_id``), static.
        history: optional int32 [B, max_ngram - 1], raw ids of the tokens just before
            position 0 (most recent last); -1 = none / masked.
        token_mask: optional bool [B, T]; False blocks look-backs through that token.

    Returns:
        int32 [B, T, L, (max_ngram - 1) * H], equal to the numpy reference.
    """
    n_hist = max_ngram - 1
    vocab = token_map_V.shape[0]
    n_cols = _validate(consts, max_ngram, vocab, pad_token_id)
    if token_ids_BT.ndim != 2:
        raise ValueError(f"token_ids_BT must be [B, T], got shape {token_ids_BT.shape}")
    batch, seq = token_ids_BT.shape
    token_map_V = token_map_V.astype(jnp.int32)

    compressed_BT = jnp.take(token_map_V, token_ids_BT.astype(jnp.int32), mode="clip")
    if token_mask is not None:
        if token_mask.shape != (batch, seq):
            raise ValueError(f"token_mask must have shape {(batch, seq)}, got {token_mask.shape}")
        compressed_BT = jnp.where(token_mask.astype(bool), compressed_BT, -1)
    if history is None:
        past_BH = jnp.full((batch, n_hist), -1, dtype=jnp.int32)
    else:
        if history.shape != (batch, n_hist):
            raise ValueError(f"history must have shape {(batch, n_hist)}, got {history.shape}")
        history = history.astype(jnp.int32)
        past_BH = jnp.where(history >= 0, jnp.take(token_map_V, jnp.maximum(history, 0), mode="clip"), -1)
    ext = jnp.concatenate([past_BH, compressed_BT], axis=1)  # [B, n_hist + T]; -1 = blocked
    pad = token_map_V[pad_token_id]

    mults = [[int(m) % 2**64 for m in c.multipliers] for c in consts]  # [L][K] as uint64 values
    primes_LC = _u32([c.primes for c in consts])
    wrap_LC = _u32([[(1 << 64) % p for p in c.primes] for c in consts])
    offsets_LC = jnp.asarray(np.asarray([c.offsets for c in consts], dtype=np.int32))
    n_heads = n_cols // n_hist

    blocked = jnp.zeros((batch, seq), dtype=bool)
    hi = lo = None
    columns = []
    for k in range(max_ngram):
        source = ext[:, n_hist - k : n_hist - k + seq]
        blocked = blocked | (source < 0)
        gram = jnp.where(blocked, pad, source).astype(_U32)[..., None]  # [B, T, 1]
        m_lo = _u32([m[k] & 0xFFFFFFFF for m in mults])
        m_hi = _u32([m[k] >> 32 for m in mults])
        p_hi, p_lo = _mul_u32_by_u64(gram, m_lo, m_hi)  # [B, T, L]
        hi, lo = (p_hi, p_lo) if k == 0 else (hi ^ p_hi, lo ^ p_lo)
        if k >= 1:
            cols = slice((k - 1) * n_heads, k * n_heads)
            r = _floor_mod_signed64(hi[..., None], lo[..., None], primes_LC[:, cols], wrap_LC[:, cols])
            columns.append(r.astype(jnp.int32))
    return jnp.concatenate(columns, axis=-1) + offsets_LC
