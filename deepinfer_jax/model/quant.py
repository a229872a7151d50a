"""QAT fake-quant boundaries of the V4.1 reference numerics (model.md §4.8).

The reference forward rounds three cache tensors through their storage formats even when it
computes in higher precision. Each function here quantizes and immediately dequantizes, so the
result has the input's shape and dtype but only the values the storage format can hold:

- ``fake_quant_fp8``   SWA window KV: FP8 E4M3, 32-channel groups, power-of-two (UE8M0) scale.
- ``fake_quant_nvfp4`` compressed global KV: E2M1, 16-channel groups, E4M3 scale.
- ``fake_quant_mxfp4`` indexer queries and keys: E2M1, 32-channel groups, power-of-two scale.

All arithmetic is fp32; groups run along the last axis, which must be a multiple of the group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_MAX = 448.0
FP4_MAX = 6.0
_E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def pow2_ceil(x: jax.Array) -> jax.Array:
    """Smallest power of two >= x for positive normal fp32 x, computed on the exponent bits."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    exponent = (bits >> 23) & 0xFF
    bump = ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type((exponent + bump) << 23, jnp.float32)


def _grouped(x: jax.Array, group: int) -> jax.Array:
    if x.shape[-1] % group:
        raise ValueError(f"last axis {x.shape[-1]} is not a multiple of the quantization group {group}")
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // group, group)


def round_e2m1(v: jax.Array) -> jax.Array:
    """Round fp32 values in [-6, 6] to the nearest E2M1 level; ties go to the even level index."""
    mag = jnp.abs(v)
    mids = jnp.asarray(_E2M1_MIDPOINTS, jnp.float32)
    lower = jnp.sum(mag[..., None] > mids, axis=-1)
    tie = mag == mids[jnp.minimum(lower, 6)]
    idx = lower + (tie & (lower % 2 == 1)).astype(lower.dtype)
    return jnp.copysign(jnp.asarray(_E2M1_LEVELS, jnp.float32)[idx], v)


# -- storage codecs: encode to the packed formats, decode back to fp32 ------------------------------
# ``fake_quant_*`` is literally ``decode(encode(x))``, so values read back from a quantized cache are
# bit-identical to the ones the full forward computes.


def _e8m0_byte(scale: jax.Array) -> jax.Array:
    """Biased exponent byte of a power-of-two fp32 scale (UE8M0 shares fp32's bias of 127)."""
    return ((jax.lax.bitcast_convert_type(scale, jnp.int32) >> 23) & 0xFF).astype(jnp.uint8)


def _e8m0_value(byte: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(byte.astype(jnp.int32) << 23, jnp.float32)


def _pack_e2m1(v: jax.Array) -> jax.Array:
    """fp32 values on the E2M1 grid [..., C] -> packed codes uint8 [..., C/2] (low nibble = even channel)."""
    mag = jnp.abs(v)
    idx = jnp.argmax(mag[..., None] == jnp.asarray(_E2M1_LEVELS, jnp.float32), axis=-1).astype(jnp.uint8)
    code = idx | (jnp.signbit(v).astype(jnp.uint8) << 3)
    return code[..., 0::2] | (code[..., 1::2] << 4)


def _unpack_e2m1(packed: jax.Array) -> jax.Array:
    codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    levels = jnp.asarray(_E2M1_LEVELS, jnp.float32)[(codes & 7).astype(jnp.int32)]
    return jnp.where((codes & 8) != 0, -levels, levels)


def encode_fp8(x: jax.Array, group: int = 32) -> tuple[jax.Array, jax.Array]:
    """SWA rows: (E4M3 values [..., C], UE8M0 scale bytes [..., C/group])."""
    g = _grouped(x, group)
    scale = pow2_ceil(jnp.maximum(jnp.max(jnp.abs(g), -1, keepdims=True), 1e-4) * (1.0 / FP8_MAX))
    q = jnp.clip(g / scale, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(x.shape), _e8m0_byte(scale)[..., 0]


def decode_fp8(q: jax.Array, scale: jax.Array, group: int = 32) -> jax.Array:
    g = q.astype(jnp.float32).reshape(*q.shape[:-1], -1, group)
    return (g * _e8m0_value(scale)[..., None]).reshape(q.shape)


def encode_nvfp4(x: jax.Array, group: int = 16) -> tuple[jax.Array, jax.Array]:
    """Global KV: (packed E2M1 codes [..., C/2], E4M3 scales [..., C/group])."""
    g = _grouped(x, group)
    amax = jnp.max(jnp.abs(g), -1, keepdims=True)
    scale = (jnp.maximum(amax, FP4_MAX * 2.0**-9) / FP4_MAX).astype(jnp.float8_e4m3fn)
    q = round_e2m1(jnp.clip(g / scale.astype(jnp.float32), -FP4_MAX, FP4_MAX))
    return _pack_e2m1(q.reshape(x.shape)), scale[..., 0]


def decode_nvfp4(packed: jax.Array, scale: jax.Array, group: int = 16) -> jax.Array:
    v = _unpack_e2m1(packed)
    g = v.reshape(*v.shape[:-1], -1, group) * scale.astype(jnp.float32)[..., None]
    return g.reshape(v.shape)


def encode_mxfp4(x: jax.Array, group: int = 32) -> tuple[jax.Array, jax.Array]:
    """Index keys/queries: (packed E2M1 codes [..., C/2], UE8M0 scale bytes [..., C/group])."""
    g = _grouped(x, group)
    amax = jnp.max(jnp.abs(g), -1, keepdims=True)
    scale = pow2_ceil(jnp.maximum(amax, FP4_MAX * 2.0**-126) * (1.0 / FP4_MAX))
    q = round_e2m1(jnp.clip(g / scale, -FP4_MAX, FP4_MAX))
    return _pack_e2m1(q.reshape(x.shape)), _e8m0_byte(scale)[..., 0]


def decode_mxfp4(packed: jax.Array, scale: jax.Array, group: int = 32) -> jax.Array:
    v = _unpack_e2m1(packed)
    g = v.reshape(*v.shape[:-1], -1, group) * _e8m0_value(scale)[..., None]
    return g.reshape(v.shape)


def fake_quant_fp8(x: jax.Array, group: int = 32) -> jax.Array:
    """E4M3 with one UE8M0 scale per ``group`` channels (scale = pow2_ceil(max(amax, 1e-4) / 448))."""
    return decode_fp8(*encode_fp8(x, group), group).astype(x.dtype)


def fake_quant_nvfp4(x: jax.Array, group: int = 16) -> jax.Array:
    """E2M1 with one E4M3 scale per ``group`` channels (scale = e4m3(max(amax, 6 * 2^-9) / 6))."""
    return decode_nvfp4(*encode_nvfp4(x, group), group).astype(x.dtype)


def fake_quant_mxfp4(x: jax.Array, group: int = 32) -> jax.Array:
    """E2M1 with one UE8M0 scale per ``group`` channels (scale = pow2_ceil(amax / 6))."""
    return decode_mxfp4(*encode_mxfp4(x, group), group).astype(x.dtype)
