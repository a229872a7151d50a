"""Weights resident in their checkpoint storage formats, decoded on the fly (model.md §7).

A ``QWeight`` is a pytree leaf-pair standing where a float weight matrix would: ``data`` holds the
checkpoint's bytes as they are and ``scale`` its UE8M0 block exponents. Three kinds:

- ``"fp8"``: E4M3 bytes ``[..., R, C]`` (``uint8`` on the device, see below; ``float8_e4m3fn`` accepted), UE8M0 scale bytes ``[..., ceil(R/br), ceil(C/bc)]``
  (dense 32x32 blocks, or row-wise ``(1, 32)`` for the Engram tables);
- ``"fp4"``: packed E2M1 data ``uint8 [..., R, C/2]`` (low nibble = even column), UE8M0 scale bytes
  ``[..., R/br, C/bc]`` (routed experts: ``(1, 32)``);
- ``"bf16"``: bfloat16 data, no scale (the plain embedding / head of a BF16 checkpoint).

Leading axes (the stacked experts ``[E, out, in]``) carry no blocks. ``W[r, c] = value[r, c] *
2**(scale[r // br, c // bc] - 127)``: every decoded value is exact in float32, so decoding here is
bit-identical to the host decoder (``checkpoint.quant_formats``) and the float-resident path.

The decoders use integer bit manipulation only, on ``uint8`` bytes: an ``float8_e4m3fn`` array in the
program, even only bitcast, makes XLA:CPU convert the *whole* weight to f16 ahead of any loop (seen in
the optimized HLO), which is the full-size copy residency is meant to avoid. ``dequantize`` decodes everything (tests,
fallbacks); the matmuls that decode tile by tile live in ``deepinfer_jax.ops.quantized_matmul``.

A ``QWeight`` answers the small array protocol the model uses on weights: ``w[...]`` (an
``nnx.Param``'s value), ``.shape`` / ``.ndim`` / ``.dtype`` (the logical, decoded ones) and
``.astype`` (lazy: only the logical dtype changes).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("fp8", "fp4", "bf16")


class QWeightError(ValueError):
    """A quantized weight's data, scale and declared layout disagree (``field`` names the part)."""

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@jax.tree_util.register_pytree_node_class
class QWeight:
    """A weight held in its storage format: ``data``, ``scale`` (or None), static ``kind``,
    ``block`` (rows, cols per scale entry), ``shape`` (decoded) and ``dtype`` (the decode target)."""

    __slots__ = ("block", "data", "dtype", "kind", "scale", "shape")

    def __init__(self, data, scale, kind: str, block: Sequence[int], shape: Sequence[int], dtype=jnp.float32):
        self.data, self.scale, self.kind = data, scale, kind
        self.block = tuple(int(b) for b in block)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = jnp.dtype(dtype)

    # -- pytree ---------------------------------------------------------------------------------------
    def tree_flatten(self):
        return (self.data, self.scale), (self.kind, self.block, self.shape, self.dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        obj = object.__new__(cls)
        obj.data, obj.scale = children
        obj.kind, obj.block, obj.shape, obj.dtype = aux
        return obj

    # -- the array protocol the model uses on weights -------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Resident bytes (data + scale), not the decoded size."""
        return int(sum(np.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in (self.data, self.scale)
                       if a is not None))

    def __getitem__(self, key):
        if key is Ellipsis:
            return self
        raise TypeError("QWeight supports only w[...]; use qweight.take_rows / split_rows for parts")

    def astype(self, dtype) -> QWeight:
        return QWeight(self.data, self.scale, self.kind, self.block, self.shape, dtype)

    def replace(self, data, scale, shape) -> QWeight:
        return QWeight(data, scale, self.kind, self.block, shape, self.dtype)

    def __repr__(self) -> str:
        return f"QWeight({self.kind}, shape={self.shape}, block={self.block}, dtype={self.dtype.name})"


def validate(w: QWeight, field: str | None = None) -> QWeight:
    """Check ``w``'s kind, dtypes and shapes against each other; raises :class:`QWeightError`."""
    if w.kind not in KINDS:
        raise QWeightError(f"kind must be one of {KINDS}, got {w.kind!r}", field)
    lead, (r, c) = w.shape[:-2], w.shape[-2:]
    dshape = tuple(w.data.shape)
    if w.kind == "bf16":
        if dshape != w.shape or w.scale is not None:
            raise QWeightError(f"bf16 data must have the decoded shape {w.shape} and no scale", field)
        return w
    want = lead + ((r, c) if w.kind == "fp8" else (r, c // 2))
    if w.kind == "fp4" and c % 2:
        raise QWeightError(f"packed FP4 needs an even column count, got {w.shape}", field)
    if dshape != want:
        raise QWeightError(f"{w.kind} data shape {dshape} does not match decoded shape {w.shape} (expected {want})",
                           field)
    if w.scale is None:
        raise QWeightError(f"{w.kind} weight has no scale", field)
    br, bc = w.block
    sw = lead + (_ceil_div(r, br), _ceil_div(c, bc))
    if tuple(w.scale.shape) != sw:
        raise QWeightError(f"scale shape {tuple(w.scale.shape)} does not match block {w.block} of {w.shape} "
                           f"(expected {sw})", field)
    return w


# -- element decoders (integer bit manipulation, exact) ----------------------------------------------


def _u8(a: jax.Array) -> jax.Array:
    if a.dtype == jnp.uint8:
        return a
    if a.dtype == jnp.int8 or jnp.dtype(a.dtype).itemsize == 1:
        return jax.lax.bitcast_convert_type(a, jnp.uint8)
    raise QWeightError(f"expected 1-byte storage, got {a.dtype}")


def _f32_bits(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def e4m3_to_f32(code_u8: jax.Array) -> jax.Array:
    """E4M3 bytes -> float32 (normals by re-biasing the exponent, subnormals as ``m * 2**-9``)."""
    b = code_u8.astype(jnp.int32)
    em = b & 0x7F
    sign = (b & 0x80) << 24
    normal = _f32_bits(((em << 20) + (120 << 23)) | sign)
    sub = (em & 0x7).astype(jnp.float32) * (2.0**-9)
    sub = jnp.where(sign != 0, -sub, sub)
    return jnp.where((em >> 3) == 0, sub, normal)


def e2m1_to_f32(code: jax.Array) -> jax.Array:
    """E2M1 nibbles (int32, bit 3 = sign) -> float32: 0, .5 | 2**(e-1) * (1 + m/2)."""
    e, m = (code >> 1) & 0x3, code & 0x1
    sign = (code & 0x8) << 28
    normal = _f32_bits((((e + 126) << 23) | (m << 22)) | sign)
    sub = m.astype(jnp.float32) * 0.5
    sub = jnp.where(sign != 0, -sub, sub)
    return jnp.where(e == 0, sub, normal)


def ue8m0_to_f32(scale_u8: jax.Array) -> jax.Array:
    """UE8M0 bytes -> ``2**(b - 127)`` (byte 0 -> 2**-127 is a float32 subnormal: bits ``1 << 22``)."""
    b = _u8(scale_u8).astype(jnp.int32)
    return _f32_bits(jnp.where(b == 0, 1 << 22, b << 23))


def _values(w: QWeight, data: jax.Array) -> jax.Array:
    """Unscaled decoded values of ``data`` (a row slice of ``w.data``) as float32 ``[..., rows, C]``."""
    if w.kind == "fp8":
        return e4m3_to_f32(_u8(data))
    raw = _u8(data).astype(jnp.int32)
    pair = jnp.stack([e2m1_to_f32(raw & 0xF), e2m1_to_f32(raw >> 4)], axis=-1)
    return pair.reshape(*data.shape[:-1], data.shape[-1] * 2)


def _apply_scale(v: jax.Array, s: jax.Array, block: tuple[int, int]) -> jax.Array:
    """``v [..., r, c] * scale [..., ceil(r/br), ceil(c/bc)]`` broadcast over blocks."""
    br, bc = block
    r, c = v.shape[-2:]
    sf = ue8m0_to_f32(s)
    lead = v.shape[:-2]
    if r % br == 0 and c % bc == 0:
        g = v.reshape(*lead, r // br, br, c // bc, bc) * sf[..., :, None, :, None]
        return g.reshape(v.shape)
    full = jnp.repeat(jnp.repeat(sf, br, axis=-2)[..., :r, :], bc, axis=-1)[..., :c]
    return v * full


def decode(w: QWeight, data: jax.Array, scale: jax.Array | None) -> jax.Array:
    """Decode ``data``/``scale`` laid out like ``w`` (any row slice aligned to the row block) to ``w.dtype``."""
    if w.kind == "bf16":
        return data.astype(w.dtype)
    return _apply_scale(_values(w, data), scale, w.block).astype(w.dtype)


def dequantize(w, dtype=None) -> jax.Array:
    """The full decoded array (a plain array passes through, cast to ``dtype`` if given)."""
    if not isinstance(w, QWeight):
        return w if dtype is None else w.astype(dtype)
    out = decode(w, w.data, w.scale)
    return out if dtype is None else out.astype(dtype)


# -- structural helpers the model needs on weights ----------------------------------------------------


def take_rows(w, ids: jax.Array) -> jax.Array:
    """``w[ids]`` along axis 0 (a table lookup), decoding only the gathered rows: ``[*ids.shape, C]``."""
    if not isinstance(w, QWeight):
        return jnp.take(w, ids, axis=0)
    if w.ndim != 2:
        raise QWeightError(f"take_rows needs a 2-D weight, got {w.shape}")
    flat = ids.reshape(-1)
    data = jnp.take(w.data, flat, axis=0)
    if w.kind == "bf16":
        rows = data.astype(w.dtype)
    else:
        br, bc = w.block
        v = _values(w, data)  # [n, C]
        sf = ue8m0_to_f32(jnp.take(w.scale, flat // br, axis=0))  # [n, ceil(C/bc)]
        c = v.shape[-1]
        full = sf.reshape(-1, sf.shape[-1], 1)
        if c % bc == 0:
            rows = (v.reshape(v.shape[0], c // bc, bc) * full).reshape(v.shape)
        else:
            rows = v * jnp.repeat(sf, bc, axis=-1)[:, :c]
        rows = rows.astype(w.dtype)
    return rows.reshape(*ids.shape, w.shape[-1])


def split_rows(w, parts: int) -> list:
    """``parts`` equal row slices of a 2-D weight (grouped O-LoRA); a quantized slice stays quantized when
    the slice boundary falls on a row block, else it is decoded (correct, but materialised)."""
    rows = w.shape[0] // parts
    if not isinstance(w, QWeight):
        return [w[g * rows:(g + 1) * rows] for g in range(parts)]
    br = w.block[0]
    if w.kind == "bf16":
        return [w.replace(w.data[g * rows:(g + 1) * rows], None, (rows, w.shape[1])) for g in range(parts)]
    if rows % br:
        full = dequantize(w)
        return [full[g * rows:(g + 1) * rows] for g in range(parts)]
    sr = rows // br
    return [w.replace(w.data[g * rows:(g + 1) * rows], w.scale[g * sr:(g + 1) * sr], (rows, w.shape[1]))
            for g in range(parts)]


def merge_leading(w: QWeight) -> QWeight:
    """``[E, R, C] -> [E*R, C]`` for a row-block-1 (or bf16) stacked weight (experts as one matrix)."""
    e, r, c = w.shape
    scale = None if w.scale is None else w.scale.reshape(e * w.scale.shape[1], w.scale.shape[2])
    if w.kind != "bf16" and w.block[0] != 1 and r % w.block[0]:
        raise QWeightError(f"cannot merge experts of {w.shape} with row block {w.block[0]}")
    return w.replace(w.data.reshape(e * w.data.shape[1], w.data.shape[2]), scale, (e * r, c))


def concat_experts_on_columns(w: QWeight) -> QWeight:
    """``[E, d, I] -> [d, E*I]`` (``transpose(1, 0, 2)`` then merge): w2 of every expert as one matrix.
    Needs a row block of 1 and ``I`` a multiple of the column block (so no scale group straddles experts)."""
    e, d, i = w.shape
    if w.kind != "bf16" and (w.block[0] != 1 or i % w.block[1]):
        raise QWeightError(f"cannot concatenate experts of {w.shape} on columns with block {w.block}")
    data = jnp.transpose(w.data, (1, 0, 2)).reshape(d, -1)
    scale = None if w.scale is None else jnp.transpose(w.scale, (1, 0, 2)).reshape(d, -1)
    return w.replace(data, scale, (d, e * i))


def stacked_as_held(w: QWeight) -> QWeight:
    """A stacked ``[E, ...]`` weight whose declared leading size follows its data: after its stack was taken into
    other slots (``parallel.weight_moves.physical_params``) or split over devices (one device's slots inside
    ``shard_map``), where the static shape still names the old count."""
    n = int(w.data.shape[0])
    return w if n == w.shape[0] else w.replace(w.data, w.scale, (n, *w.shape[1:]))


def is_quantized(w) -> bool:
    return isinstance(w, QWeight)
