"""Block-scaled weight formats of the released checkpoints (host code, numpy only).

Three storage formats appear in DeepSeek-V4.1-Flash checkpoints (model.md §7):

- **FP8 dense**: ``float8_e4m3fn`` matrix ``[R, C]`` with a UE8M0 scale matrix
  ``[ceil(R/br), ceil(C/bc)]`` (br = bc = 32 in V4.1, 128 in V3/V4).
- **FP8 row-wise** (Engram tables): ``float8_e4m3fn`` ``[R, C]`` with UE8M0 scales
  ``[R, ceil(C/32)]`` -- the same rule with a row block of 1.
- **FP4 packed** (routed experts): ``int8``/``uint8`` ``[R, C/2]``, two E2M1 codes per byte
  (low nibble = even column, high nibble = odd column), UE8M0 scales ``[R, ceil(C/32)]``.

In every case ``W[r, c] = value[r, c] * scale[r // br, c // bc]`` where a UE8M0 byte ``b``
means ``2**(b - 127)`` (``ml_dtypes.float8_e8m0fnu``). The block sizes are **inferred** from
the scale shape (see :func:`infer_block`) and never assumed: a wrong block size would decode
without error into garbage.

The encoders produce the same formats (power-of-two scales rounded up, round-to-nearest-even
values) for test checkpoints and the small shipped checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E4M3_MAX = 448.0
#: The float32 value of every E4M3 byte (NaN codes included): decoding by table lookup gives the same
#: bits as ``astype(np.float32)`` in about half the time.
_E4M3_TO_F32 = np.arange(256, dtype=np.uint8).view(E4M3).astype(np.float32)
E2M1_MAX = 6.0

# E2M1 code -> value; bit 3 is the sign, bits 0-2 index the magnitude grid.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
_E2M1_GRID = E2M1_VALUES[:8]
_E2M1_MIDPOINTS = (_E2M1_GRID[1:] + _E2M1_GRID[:-1]) / 2

# Bound on float32 temporaries while decoding (elements), so a large matrix is decoded in
# row chunks instead of materialising a full-size expanded scale.
_CHUNK_ELEMENTS = 1 << 22


class QuantFormatError(ValueError):
    """A quantized tensor and its scale do not form a valid block-scaled pair.

    ``field`` names the offending tensor when the caller knows it (else ``None``).
    """

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


# --------------------------------------------------------------------------- block geometry


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _infer_axis_block(size: int, scale_size: int) -> int | None:
    """The block length ``b`` along one axis with ``ceil(size / b) == scale_size``.

    Powers of two are tried first; at most one of them can give ``scale_size > 1`` blocks, and
    when ``scale_size == 1`` every ``b >= size`` is equivalent. Otherwise an exact divisor
    ``size / scale_size`` is accepted. ``None`` when no block length is consistent.
    """
    if size == 0 and scale_size == 0:
        return 1
    if size <= 0 or scale_size <= 0 or scale_size > size:
        return None
    b = 1
    while True:
        n = _ceil_div(size, b)
        if n == scale_size:
            return b
        if n < scale_size:
            break
        b *= 2
    if size % scale_size == 0:
        return size // scale_size
    return None


def infer_block(
    shape: Sequence[int], scale_shape: Sequence[int], *, field: str | None = None
) -> tuple[int, int]:
    """Infer ``(row_block, col_block)`` of a 2-D (decoded) matrix from its scale shape.

    ``shape`` is the decoded ``[R, C]`` (for packed FP4 pass the unpacked column count).
    Raises :class:`QuantFormatError` when either axis has no consistent block size.
    """
    if len(shape) != 2 or len(scale_shape) != 2:
        raise QuantFormatError(
            f"block-scaled weights must be 2-D with a 2-D scale, got weight {tuple(shape)} "
            f"and scale {tuple(scale_shape)}",
            field,
        )
    blocks = []
    for axis, (n, s) in enumerate(zip(shape, scale_shape)):
        b = _infer_axis_block(int(n), int(s))
        if b is None:
            raise QuantFormatError(
                f"no block size is consistent with weight {tuple(shape)} and scale "
                f"{tuple(scale_shape)} along axis {axis} ({n} values, {s} scales)",
                field,
            )
        blocks.append(b)
    return blocks[0], blocks[1]


def _check_block(
    shape: Sequence[int], scale_shape: Sequence[int], block: Sequence[int], field: str | None
) -> tuple[int, int]:
    br, bc = (int(b) for b in block)
    want = (_ceil_div(int(shape[0]), br), _ceil_div(int(shape[1]), bc))
    if tuple(int(s) for s in scale_shape) != want:
        raise QuantFormatError(
            f"scale shape {tuple(scale_shape)} does not match block size {(br, bc)} for weight "
            f"{tuple(shape)} (expected scale {want}); inferred block would be "
            f"{_describe_inferred(shape, scale_shape)}",
            field,
        )
    return br, bc


def _describe_inferred(shape: Sequence[int], scale_shape: Sequence[int]) -> str:
    try:
        return str(infer_block(shape, scale_shape))
    except QuantFormatError:
        return "none"


# --------------------------------------------------------------------------- scales


def scale_to_float32(scale: np.ndarray) -> np.ndarray:
    """Decode a scale array to float32 multipliers.

    ``float8_e8m0fnu`` (and raw ``uint8`` UE8M0 bytes) mean ``2**(byte - 127)``; byte 255 is
    NaN. Floating scales (float32/bfloat16/float16) are taken as the multipliers themselves.
    """
    scale = np.asarray(scale)
    if scale.dtype == E8M0:
        return scale.astype(np.float32)
    if scale.dtype == np.uint8:
        return scale.view(E8M0).astype(np.float32)
    if scale.dtype.kind == "f" or scale.dtype == np.dtype(ml_dtypes.bfloat16):
        return scale.astype(np.float32)
    raise QuantFormatError(f"unsupported scale dtype {scale.dtype} (expected float8_e8m0fnu)")


def _pow2_exponent_ceil(x: np.ndarray) -> np.ndarray:
    """Smallest integer ``e`` with ``2**e >= x`` for positive float32 ``x`` (exact, via frexp)."""
    mant, exp = np.frexp(x.astype(np.float64))
    return np.where(mant == 0.5, exp - 1, exp).astype(np.int32)


def ue8m0_ceil(required: np.ndarray) -> np.ndarray:
    """UE8M0 scales ``2**e`` with the smallest ``e >= log2(required)``, clamped to [-127, 127].

    Zero or non-positive entries get ``2**-127`` (any scale decodes zeros exactly).
    """
    required = np.asarray(required, dtype=np.float64)
    positive = required > 0
    exp = _pow2_exponent_ceil(np.where(positive, required, 1.0))
    exp = np.where(positive, exp, -127)
    exp = np.clip(exp, -127, 127)
    return (exp + 127).astype(np.uint8).view(E8M0)


# --------------------------------------------------------------------------- decoders


def _apply_scales(
    decode_rows, rows: int, cols: int, scale: np.ndarray, block: tuple[int, int], dtype
) -> np.ndarray:
    """Fill ``out[r, c] = decode_rows(r0, r1)[r - r0, c] * scale[r // br, c // bc]`` in chunks."""
    br, bc = block
    # one scale per column for every row block: [ceil(rows / br), cols], small next to the weight
    col_scale = np.repeat(scale_to_float32(scale), bc, axis=1)[:, :cols]
    out = np.empty((rows, cols), dtype=dtype)
    step = max(br, (_CHUNK_ELEMENTS // max(cols, 1)) // br * br)
    for r0 in range(0, rows, step):  # r0 is a multiple of br: the chunk's rows start a row block
        r1 = min(rows, r0 + step)
        values = decode_rows(r0, r1)
        full = (r1 - r0) // br * br  # rows in whole blocks; a last partial block only at the matrix's end
        if full:
            blocks = values[:full].reshape(full // br, br, cols)
            blocks *= col_scale[r0 // br : (r0 + full) // br, None, :]
        if full < r1 - r0:
            values[full:] *= col_scale[(r0 + full) // br]
        out[r0:r1] = values
    return out


def decode_fp8_blockwise(
    weight: np.ndarray,
    scale: np.ndarray,
    *,
    block: Sequence[int] | None = None,
    dtype=np.float32,
    field: str | None = None,
) -> np.ndarray:
    """Decode an FP8 E4M3 ``[R, C]`` matrix with block scales ``[ceil(R/br), ceil(C/bc)]``.

    ``block`` (optional) is checked against the shapes; without it the block is inferred.
    Returns ``[R, C]`` in ``dtype``.
    """
    weight = np.asarray(weight)
    if weight.dtype != E4M3:
        raise QuantFormatError(f"expected float8_e4m3fn weight, got {weight.dtype}", field)
    scale = np.asarray(scale)
    if block is None:
        blk = infer_block(weight.shape, scale.shape, field=field)
    else:
        blk = _check_block(weight.shape, scale.shape, block, field)
    rows, cols = weight.shape
    return _apply_scales(
        lambda r0, r1: _E4M3_TO_F32[weight[r0:r1].view(np.uint8)], rows, cols, scale, blk, dtype
    )


def decode_fp8_rowwise(
    weight: np.ndarray,
    scale: np.ndarray,
    *,
    group: int | None = None,
    dtype=np.float32,
    field: str | None = None,
) -> np.ndarray:
    """Decode an FP8 E4M3 ``[R, C]`` table with per-row scales ``[R, ceil(C/group)]`` (Engram)."""
    weight = np.asarray(weight)
    scale = np.asarray(scale)
    if weight.ndim != 2 or scale.ndim != 2 or scale.shape[0] != weight.shape[0]:
        raise QuantFormatError(
            f"row-wise FP8 needs one scale row per weight row, got weight {weight.shape} and "
            f"scale {scale.shape}",
            field,
        )
    block = None if group is None else (1, group)
    return decode_fp8_blockwise(weight, scale, block=block, dtype=dtype, field=field)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """Unpack ``[R, P]`` int8/uint8 bytes into ``[R, 2P]`` float32 E2M1 values (unscaled)."""
    raw = np.asarray(packed)
    if raw.dtype not in (np.int8, np.uint8):
        raise QuantFormatError(f"expected packed int8/uint8 FP4 bytes, got {raw.dtype}")
    raw = raw.view(np.uint8)
    out = np.empty(raw.shape[:-1] + (raw.shape[-1] * 2,), dtype=np.float32)
    out[..., 0::2] = E2M1_VALUES[raw & 0x0F]
    out[..., 1::2] = E2M1_VALUES[raw >> 4]
    return out


def decode_fp4_packed(
    packed: np.ndarray,
    scale: np.ndarray,
    *,
    group: int | None = None,
    dtype=np.float32,
    field: str | None = None,
) -> np.ndarray:
    """Decode packed FP4 E2M1 ``[R, C/2]`` bytes with scales ``[R, ceil(C/group)]`` to ``[R, C]``.

    The group size (and the row block, normally 1) is inferred from the scale shape unless
    ``group`` is given, in which case the shapes are checked against ``(1, group)``.
    """
    packed = np.asarray(packed)
    if packed.dtype not in (np.int8, np.uint8):
        raise QuantFormatError(f"expected packed int8/uint8 FP4 bytes, got {packed.dtype}", field)
    scale = np.asarray(scale)
    if packed.ndim != 2:
        raise QuantFormatError(f"packed FP4 weight must be 2-D, got {packed.shape}", field)
    shape = (packed.shape[0], packed.shape[1] * 2)
    if group is None:
        blk = infer_block(shape, scale.shape, field=field)
    else:
        blk = _check_block(shape, scale.shape, (1, group), field)
    return _apply_scales(
        lambda r0, r1: unpack_fp4(packed[r0:r1]), shape[0], shape[1], scale, blk, dtype
    )


def is_quantized_dtype(dtype) -> bool:
    """True for storage dtypes that need a scale partner (FP8 E4M3, packed FP4 int8/uint8)."""
    dtype = np.dtype(dtype)
    return dtype == E4M3 or dtype in (np.dtype(np.int8), np.dtype(np.uint8))


def decoded_shape(
    weight_shape: Sequence[int], weight_dtype, scale_shape: Sequence[int], *, field: str | None = None
) -> tuple[int, int]:
    """Shape after decoding a (weight, scale) pair, validating the pair from shapes alone.

    Raises :class:`QuantFormatError` for an unsupported dtype or an inconsistent scale.
    """
    dtype = np.dtype(weight_dtype)
    if len(weight_shape) != 2:
        raise QuantFormatError(f"quantized weight must be 2-D, got shape {tuple(weight_shape)}", field)
    if dtype == E4M3:
        shape = (int(weight_shape[0]), int(weight_shape[1]))
    elif dtype in (np.dtype(np.int8), np.dtype(np.uint8)):
        shape = (int(weight_shape[0]), int(weight_shape[1]) * 2)
    else:
        raise QuantFormatError(
            f"a weight with a scale partner must be float8_e4m3fn or packed int8, got {dtype}", field
        )
    infer_block(shape, scale_shape, field=field)
    return shape


def decode_weight(
    weight: np.ndarray, scale: np.ndarray, *, dtype=np.float32, field: str | None = None
) -> np.ndarray:
    """Decode any supported (weight, scale) pair; the format follows the weight dtype.

    ``float8_e4m3fn`` -> FP8 with inferred blocks (dense 32x32, Engram row-wise, ...);
    ``int8``/``uint8`` -> packed FP4 E2M1 with inferred groups.
    """
    weight = np.asarray(weight)
    if weight.dtype == E4M3:
        return decode_fp8_blockwise(weight, scale, dtype=dtype, field=field)
    if weight.dtype in (np.int8, np.uint8):
        return decode_fp4_packed(weight, scale, dtype=dtype, field=field)
    raise QuantFormatError(
        f"a weight with a scale partner must be float8_e4m3fn or packed int8, got {weight.dtype}",
        field,
    )


# --------------------------------------------------------------------------- encoders


def _block_amax(w: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    br, bc = block
    rows, cols = w.shape
    nr, nc = _ceil_div(rows, br), _ceil_div(cols, bc)
    padded = np.zeros((nr * br, nc * bc), dtype=np.float32)
    padded[:rows, :cols] = np.abs(w)
    return padded.reshape(nr, br, nc, bc).max(axis=(1, 3))


def _expand(scale_f: np.ndarray, block: tuple[int, int], shape: tuple[int, int]) -> np.ndarray:
    br, bc = block
    return np.repeat(np.repeat(scale_f, br, axis=0), bc, axis=1)[: shape[0], : shape[1]]


def _as_matrix(w: np.ndarray, what: str) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise QuantFormatError(f"{what} encodes 2-D matrices, got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise QuantFormatError(f"{what}: matrix has non-finite values")
    return w


def encode_fp8_blockwise(
    w: np.ndarray, block: Sequence[int] = (32, 32)
) -> tuple[np.ndarray, np.ndarray]:
    """Encode ``[R, C]`` as (float8_e4m3fn ``[R, C]``, float8_e8m0fnu ``[ceil(R/br), ceil(C/bc)]``).

    Each block's scale is the smallest power of two ``>= amax / 448``; values round to
    nearest-even E4M3.
    """
    w = _as_matrix(w, "encode_fp8_blockwise")
    blk = (int(block[0]), int(block[1]))
    scale = ue8m0_ceil(_block_amax(w, blk) / E4M3_MAX)
    q = (w / _expand(scale.astype(np.float32), blk, w.shape)).astype(E4M3)
    return q, scale


def encode_fp8_rowwise(w: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Encode ``[R, C]`` as FP8 E4M3 with per-row scales ``[R, ceil(C/group)]`` (Engram tables)."""
    return encode_fp8_blockwise(w, (1, group))


def encode_fp4_packed(w: np.ndarray, group: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Encode ``[R, C]`` (C even) as packed FP4 (int8 ``[R, C/2]``, e8m0 ``[R, ceil(C/group)]``).

    Scale: smallest power of two ``>= amax / 6`` per row and group; magnitudes round to the
    nearest of {0, .5, 1, 1.5, 2, 3, 4, 6} with ties to the even grid index; code bit 3 is the
    sign (set only for non-zero negatives). Low nibble = even column, high nibble = odd column.
    """
    w = _as_matrix(w, "encode_fp4_packed")
    if w.shape[1] % 2:
        raise QuantFormatError(f"encode_fp4_packed needs an even column count, got {w.shape}")
    blk = (1, int(group))
    scale = ue8m0_ceil(_block_amax(w, blk) / E2M1_MAX)
    a = w / _expand(scale.astype(np.float32), blk, w.shape)
    mag = np.abs(a)
    lo = np.searchsorted(_E2M1_MIDPOINTS, mag, side="left")
    hi = np.searchsorted(_E2M1_MIDPOINTS, mag, side="right")
    idx = np.where(lo != hi, np.where(lo % 2 == 0, lo, hi), lo).astype(np.uint8)
    codes = idx | np.where((a < 0) & (idx > 0), np.uint8(8), np.uint8(0)).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed.view(np.int8), scale
