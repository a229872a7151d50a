"""Interleaved partial RoPE with frequency-only YaRN (model.md §4.5).

Channel pairs (2k, 2k+1) of the last ``rope_dim`` channels form a complex number rotated by
``pos * f_k``. Layers with a compress ratio use ``compress_rope_theta`` and YaRN-bent frequencies;
ratio-0 layers use plain ``rope_theta``. No attention factor is applied anywhere.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def rope_frequencies(rope_dim: int, theta: float, scaling=None) -> np.ndarray:
    """Per-pair angular frequencies ``f_k`` (fp32 numpy, shape [rope_dim // 2]).

    ``scaling`` is a ``RopeScaling`` (factor, beta_fast, beta_slow, original_max_position_embeddings)
    or None. YaRN here only bends frequencies: ``f' = f / factor * ramp + f * (1 - ramp)``.
    """
    exponents = np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)
    freqs = (1.0 / np.power(np.float32(theta), exponents, dtype=np.float32)).astype(np.float32)
    if scaling is None or scaling.original_max_position_embeddings <= 0:
        return freqs
    orig = scaling.original_max_position_embeddings
    log_theta = 2 * math.log(theta)
    low = max(math.floor(rope_dim * math.log(orig / (scaling.beta_fast * 2 * math.pi)) / log_theta), 0)
    high = min(math.ceil(rope_dim * math.log(orig / (scaling.beta_slow * 2 * math.pi)) / log_theta), rope_dim - 1)
    ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - low) / max(high - low, 1e-3), 0, 1)
    ramp = ramp.astype(np.float32)
    return (freqs / np.float32(scaling.factor) * ramp + freqs * (1 - ramp)).astype(np.float32)


def rope_angles(positions: jax.Array, freqs: np.ndarray) -> jax.Array:
    """Angles ``pos * f`` in fp32: positions [...] -> [..., rope_dim // 2]."""
    return positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs)


def apply_rope(x: jax.Array, angles: jax.Array, inverse: bool = False) -> jax.Array:
    """Rotate the last ``2 * angles.shape[-1]`` channels of ``x`` by ``angles``.

    x: [B, T, C] or [B, T, H, C]; angles: [B, T, P] (broadcast over heads). Returns x's shape and
    dtype; the leading (non-rotary) channels pass through unchanged.
    """
    rot = 2 * angles.shape[-1]
    if x.ndim == 4:
        angles = angles[:, :, None, :]
    head, tail = x[..., :-rot], x[..., -rot:].astype(jnp.float32)
    pairs = tail.reshape(*tail.shape[:-1], rot // 2, 2)
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = jnp.cos(angles), jnp.sin(angles)
    if inverse:
        s = -s
    rotated = jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(tail.shape)
    return jnp.concatenate([head, rotated.astype(x.dtype)], axis=-1)
