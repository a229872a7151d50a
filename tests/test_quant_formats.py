"""FP8 / FP4 / UE8M0 checkpoint formats: hand-computed bytes, round trips, block inference,
and agreement with NeMo's ``dequantize_checkpoint_weight`` (the V4.1 reference port)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_jax.checkpoint import quant_formats as Q


def e4m3(byte_values, shape=None) -> np.ndarray:
    a = np.asarray(byte_values, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    return a.reshape(shape) if shape is not None else a


def e8m0(byte_values) -> np.ndarray:
    return np.asarray(byte_values, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)


# --------------------------------------------------------------------------- specific bytes


def test_e4m3_bytes_decode_to_hand_computed_values():
    # sign | exponent (4 bits, bias 7) | mantissa (3 bits)
    scale = e8m0([[127]])  # 2**0
    w = e4m3([0x38, 0x3C, 0x40, 0xC0, 0x7E, 0x01, 0x00, 0x80], (1, 8))
    got = Q.decode_fp8_blockwise(w, scale)
    np.testing.assert_array_equal(got, [[1.0, 1.5, 2.0, -2.0, 448.0, 2.0**-9, 0.0, -0.0]])


def test_every_e4m3_byte_decodes_as_ml_dtypes_casts_it():
    """The loader decodes FP8 by a 256-entry table; each byte (both zeros, subnormals, NaN codes 0x7F/0xFF)
    gives the bits ``astype(np.float32)`` gives, at unit scale and at a block's power-of-two scale."""
    w = e4m3(np.arange(256), (8, 32))
    want = w.astype(np.float32)
    for scale_byte, factor in ((127, 1.0), (130, 8.0)):
        got = Q.decode_fp8_blockwise(w, e8m0([[scale_byte]]))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), (want * np.float32(factor)).view(np.uint32))


def test_ue8m0_bytes_mean_powers_of_two():
    got = Q.scale_to_float32(e8m0([127, 128, 125, 0, 254]))
    np.testing.assert_array_equal(got, [1.0, 2.0, 0.25, 2.0**-127, 2.0**127])
    # raw uint8 bytes are read the same way
    np.testing.assert_array_equal(Q.scale_to_float32(np.array([130], np.uint8)), [8.0])
    assert np.isnan(Q.scale_to_float32(e8m0([255]))[0])


def test_fp8_32x32_blocks_take_their_own_scale():
    w = e4m3(np.full((64, 64), 0x38))  # every value 1.0
    scale = e8m0([[127, 128], [126, 130]])  # 1, 2 / 0.5, 8
    got = Q.decode_fp8_blockwise(w, scale)
    assert got.shape == (64, 64)
    np.testing.assert_array_equal(got[:32, :32], 1.0)
    np.testing.assert_array_equal(got[:32, 32:], 2.0)
    np.testing.assert_array_equal(got[32:, :32], 0.5)
    np.testing.assert_array_equal(got[32:, 32:], 8.0)
    assert got[31, 31] == 1.0 and got[31, 32] == 2.0 and got[32, 31] == 0.5


def test_fp4_nibbles_low_is_even_column():
    # 0x21: low nibble 1 (0.5) -> col 0, high nibble 2 (1.0) -> col 1
    # 0xF7: low 7 (6.0), high 15 (-6.0); 0x98: low 8 (-0.0), high 9 (-0.5); 0x5C: low 12 (-2), high 5 (3)
    packed = np.array([[0x21, 0xF7, 0x98, 0x5C]], dtype=np.uint8).view(np.int8)
    got = Q.decode_fp4_packed(packed, e8m0([[127]]))
    np.testing.assert_array_equal(got, [[0.5, 1.0, 6.0, -6.0, -0.0, -0.5, -2.0, 3.0]])
    doubled = Q.decode_fp4_packed(packed, e8m0([[128]]))
    np.testing.assert_array_equal(doubled, 2 * got)


def test_fp4_code_table():
    codes = np.arange(16, dtype=np.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)[None, :]
    np.testing.assert_array_equal(
        Q.unpack_fp4(packed)[0], [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    )


def test_fp4_one_scale_per_row_per_32_columns():
    packed = np.full((2, 32), 0x22, dtype=np.uint8)  # every value 1.0, 64 columns
    scale = e8m0([[127, 129], [126, 127]])
    got = Q.decode_fp4_packed(packed, scale)
    assert got.shape == (2, 64)
    np.testing.assert_array_equal(got[0, :32], 1.0)
    np.testing.assert_array_equal(got[0, 32:], 4.0)
    np.testing.assert_array_equal(got[1, :32], 0.5)
    np.testing.assert_array_equal(got[1, 32:], 1.0)


def test_engram_rowwise_eight_scales_of_32_columns():
    w = e4m3(np.full((2, 256), 0x38))
    scale = e8m0(np.array([[127 + g for g in range(8)], [127 - g for g in range(8)]]))
    got = Q.decode_fp8_rowwise(w, scale)
    assert Q.infer_block(w.shape, scale.shape) == (1, 32)
    for g in range(8):
        np.testing.assert_array_equal(got[0, 32 * g : 32 * (g + 1)], 2.0**g)
        np.testing.assert_array_equal(got[1, 32 * g : 32 * (g + 1)], 2.0**-g)


def test_bfloat16_output_is_exact():
    w = e4m3([0x3C, 0x01, 0x7E], (1, 3))
    got = Q.decode_fp8_blockwise(w, e8m0([[120]]), dtype=ml_dtypes.bfloat16)
    assert got.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.astype(np.float32), np.array([[1.5, 2.0**-9, 448.0]]) * 2.0**-7)


# --------------------------------------------------------------------------- block inference


@pytest.mark.parametrize(
    "shape, scale_shape, block",
    [
        ((1280, 5120), (40, 160), (32, 32)),  # V4.1 wq_a
        ((32768, 1280), (1024, 40), (32, 32)),  # V4.1 wq_b
        ((7168, 1536), (56, 12), (128, 128)),  # V3-style 128x128 blocks are inferred, not assumed
        ((100, 70), (4, 3), (32, 32)),  # ragged edges (ceil division)
        ((2304, 5120), (2304, 160), (1, 32)),  # FP4 expert (decoded columns)
        ((384006168, 256), (384006168, 8), (1, 32)),  # Engram table
        ((16, 16), (1, 1), (16, 16)),  # smaller than a block: any block >= 16 is equivalent
    ],
)
def test_infer_block(shape, scale_shape, block):
    assert Q.infer_block(shape, scale_shape) == block


@pytest.mark.parametrize("scale_shape", [(3, 3), (65, 2), (2, 0)])
def test_inconsistent_scale_shape_is_an_error(scale_shape):
    with pytest.raises(Q.QuantFormatError, match="no block size"):
        Q.infer_block((64, 64), scale_shape, field="layers.0.attn.wkv.weight")


def test_wrong_block_size_is_detected():
    w = np.random.default_rng(0).normal(size=(256, 256)).astype(np.float32)
    q, s = Q.encode_fp8_blockwise(w, (32, 32))
    # a reader that assumed V3's 128x128 blocks is refused, naming the field
    with pytest.raises(Q.QuantFormatError, match=r"layers\.3\.attn\.wo_b\.weight.*block size \(128, 128\)"):
        Q.decode_fp8_blockwise(q, s, block=(128, 128), field="layers.3.attn.wo_b.weight")
    # and a 128-block scale is decoded with 128 blocks, not 32
    q128, s128 = Q.encode_fp8_blockwise(w, (128, 128))
    assert s128.shape == (2, 2)
    assert Q.infer_block(q128.shape, s128.shape) == (128, 128)
    np.testing.assert_allclose(Q.decode_fp8_blockwise(q128, s128), w, rtol=2**-4, atol=2**-6)
    # FP4 group given explicitly must match too
    p, ps = Q.encode_fp4_packed(w[:4, :64], group=32)
    with pytest.raises(Q.QuantFormatError):
        Q.decode_fp4_packed(p, ps, group=16)
    # row-wise needs one scale row per weight row
    with pytest.raises(Q.QuantFormatError, match="one scale row per weight row"):
        Q.decode_fp8_rowwise(q, s)


def test_decoded_shape_from_headers_only():
    assert Q.decoded_shape((2304, 2560), np.int8, (2304, 160)) == (2304, 5120)
    assert Q.decoded_shape((5120, 1152), np.int8, (5120, 72)) == (5120, 2304)
    assert Q.decoded_shape((8192, 4096), Q.E4M3, (256, 128)) == (8192, 4096)
    with pytest.raises(Q.QuantFormatError, match="float8_e4m3fn or packed int8"):
        Q.decoded_shape((4, 4), ml_dtypes.bfloat16, (1, 1))
    with pytest.raises(Q.QuantFormatError, match="2-D"):
        Q.decoded_shape((4,), Q.E4M3, (1, 1))


# --------------------------------------------------------------------------- encoders


def test_encoder_scale_is_smallest_power_of_two_covering_amax():
    w = np.zeros((1, 64), np.float32)
    w[0, 0], w[0, 32] = 448.0, 449.0
    q, s = Q.encode_fp8_blockwise(w)
    np.testing.assert_array_equal(s.view(np.uint8), [[127, 128]])
    assert q[0, 0].view(np.uint8) == 0x7E  # 448 / 1
    p, ps = Q.encode_fp4_packed(np.array([[6.0, 0.0], [6.5, 0.0]], np.float32))
    np.testing.assert_array_equal(ps.view(np.uint8), [[127], [128]])
    zero_q, zero_s = Q.encode_fp8_blockwise(np.zeros((2, 2), np.float32))
    assert zero_s.view(np.uint8)[0, 0] == 0 and not np.any(Q.decode_fp8_blockwise(zero_q, zero_s))


def test_fp4_encoder_rounds_ties_to_even_grid_index():
    x = np.array([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.1, 0.3, -2.9]], np.float32)
    p, s = Q.encode_fp4_packed(x)
    assert s.view(np.uint8)[0, 0] == 127  # amax 6 -> scale 1
    np.testing.assert_array_equal(
        Q.decode_fp4_packed(p, s), [[6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 0.0, 0.5, -3.0]]
    )
    # bytes: (6.0 -> 7, 0.25 -> 0) = 0x07; (0.75 -> 2, 1.25 -> 2) = 0x22
    np.testing.assert_array_equal(p.view(np.uint8)[0, :2], [0x07, 0x22])


def test_fp4_encoder_needs_even_columns():
    with pytest.raises(Q.QuantFormatError, match="even column"):
        Q.encode_fp4_packed(np.ones((2, 3), np.float32))


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 70),
    half_cols=st.integers(1, 40),
    log_scale=st.integers(-20, 20),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trips(rows, half_cols, log_scale, seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, 2 * half_cols)) * 2.0**log_scale).astype(np.float32)
    # |error| <= max(rel * |w|, abs * block_scale): half an E4M3 ulp (3 mantissa bits, subnormal
    # step 2**-9) or half the widest E2M1 gap around the value
    for encode, decode, rel, abs_ in (
        (Q.encode_fp8_blockwise, Q.decode_fp8_blockwise, 2.0**-4, 2.0**-10),
        (Q.encode_fp8_rowwise, Q.decode_fp8_rowwise, 2.0**-4, 2.0**-10),
        (Q.encode_fp4_packed, Q.decode_fp4_packed, 0.25, 0.25),
    ):
        q, s = encode(w)
        d = decode(q, s)
        blk = Q.infer_block(d.shape, s.shape)
        scale = np.repeat(np.repeat(Q.scale_to_float32(s), blk[0], 0), blk[1], 1)[:rows, : w.shape[1]]
        assert np.all(np.abs(d - w) <= np.maximum(rel * np.abs(w), abs_ * scale))
        # decoded values are fixed points of encode -> decode
        q2, s2 = encode(d)
        np.testing.assert_array_equal(decode(q2, s2), d)


# --------------------------------------------------------------------------- NeMo oracle


def _random_e4m3(rng, shape):
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] = 0x38  # no NaN encodings
    return b.view(ml_dtypes.float8_e4m3fn)


def _torch(a: np.ndarray, dtype):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).view(dtype)


@pytest.mark.oracle
@pytest.mark.parametrize("chunk", [None, 64])
@pytest.mark.parametrize("shape", [(96, 160), (100, 70), (33, 31)])
def test_fp8_dense_matches_nemo(shape, chunk, monkeypatch):
    """``chunk``: decode in chunks of ~64 elements (several chunks per matrix, a partial row block at the end),
    as large weights are decoded."""
    import torch

    if chunk is not None:
        monkeypatch.setattr(Q, "_CHUNK_ELEMENTS", chunk)
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import dequantize_checkpoint_weight

    rng = np.random.default_rng(1)
    w = _random_e4m3(rng, shape)
    s = e8m0(rng.integers(110, 140, size=(-(-shape[0] // 32), -(-shape[1] // 32))))
    ref = dequantize_checkpoint_weight(
        _torch(w, torch.float8_e4m3fn), _torch(s, torch.float8_e8m0fnu), dtype=torch.float32
    ).numpy()
    np.testing.assert_array_equal(Q.decode_weight(w, s), ref)


@pytest.mark.oracle
def test_fp4_packed_matches_nemo():
    import torch
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import dequantize_checkpoint_weight

    rng = np.random.default_rng(2)
    packed = rng.integers(-128, 128, size=(48, 40), dtype=np.int8)  # 80 columns, 3 groups
    s = e8m0(rng.integers(110, 140, size=(48, 3)))
    ref = dequantize_checkpoint_weight(
        torch.from_numpy(packed.copy()), _torch(s, torch.float8_e8m0fnu), dtype=torch.float32
    ).numpy()
    np.testing.assert_array_equal(Q.decode_weight(packed, s), ref)


@pytest.mark.oracle
def test_engram_rowwise_matches_nemo():
    import torch
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import dequantize_checkpoint_weight

    rng = np.random.default_rng(3)
    w = _random_e4m3(rng, (37, 256))
    s = e8m0(rng.integers(110, 140, size=(37, 8)))
    ref = dequantize_checkpoint_weight(
        _torch(w, torch.float8_e4m3fn), _torch(s, torch.float8_e8m0fnu), dtype=torch.float32, rowwise=True
    ).numpy()
    np.testing.assert_array_equal(Q.decode_weight(w, s), ref)
    np.testing.assert_array_equal(Q.decode_fp8_rowwise(w, s, group=32), ref)
