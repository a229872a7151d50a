"""Weight quantization-aware training: the forward sees every weight in its shipped storage format.

The shipped checkpoint stores dense projections as FP8 E4M3 with UE8M0 32x32 block scales, routed
experts as FP4 E2M1 with one UE8M0 scale per row and 32 columns, Engram tables as FP8 with per-row
32-column scales, the embedding and head as FP8 32x32 blocks, other weights as BF16 and the mHC /
sink / router-bias families as FP32 (``checkpoint.names.expected_tensors``). ``fake_quant_tree``
rounds each leaf of a parameter tree through its format with a straight-through gradient
(``w + stop_gradient(q(w) - w)``), using the encoders' exact rules (scale = smallest power of two
>= amax / max, round-to-nearest-even), so the exported checkpoint decodes to exactly the values the
training forward used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.checkpoint import names as N
from deepinfer_jax.model.quant import pow2_ceil, round_e2m1

__all__ = ["FORMATS", "fake_quant_tree", "leaf_formats", "quantize_leaf"]

FORMATS = ("fp8_block", "fp8_row", "fp4", "bf16", "fp32")
_KIND = {N.TensorKind.FP8_BLOCK: "fp8_block", N.TensorKind.FP8_ROW: "fp8_row", N.TensorKind.FP4_EXPERT: "fp4",
         N.TensorKind.PLAIN: "bf16", N.TensorKind.FP32: "fp32"}
_TINY = 2.0**-126  # an all-zero block keeps a finite scale (zeros decode to zero whatever the scale)


def leaf_formats(cfg, fp8_embeddings: bool = True) -> dict[tuple, str]:
    """``{tree path: format}`` for every leaf of the parameter tree (routed experts stacked)."""
    out: dict[tuple, str] = {}
    for name, (_, kind) in N.expected_tensors(cfg).items():
        path, _ = N.native_to_path(name)
        out[path] = _KIND[kind]
    if fp8_embeddings:
        out[("embed", "weight")] = out[("head", "weight")] = "fp8_block"
    return out


def _blocks(w: jax.Array, br: int, bc: int) -> tuple[jax.Array, tuple[int, int]]:
    """[..., R, C] zero-padded to block multiples and viewed as [..., R/br, br, C/bc, bc]."""
    *lead, r, c = w.shape
    pr, pc = -r % br, -c % bc
    w = jnp.pad(w, [(0, 0)] * len(lead) + [(0, pr), (0, pc)])
    return w.reshape(*lead, (r + pr) // br, br, (c + pc) // bc, bc), (r, c)


def _unblock(b: jax.Array, rc: tuple[int, int]) -> jax.Array:
    *lead, nr, br, nc, bc = b.shape
    return b.reshape(*lead, nr * br, nc * bc)[..., : rc[0], : rc[1]]


def _fp8(w: jax.Array, br: int, bc: int) -> jax.Array:
    b, rc = _blocks(w.astype(jnp.float32), br, bc)
    amax = jnp.max(jnp.abs(b), axis=(-3, -1), keepdims=True)
    scale = pow2_ceil(jnp.maximum(amax / 448.0, _TINY))
    q = (b / scale).astype(jnp.float8_e4m3fn).astype(jnp.float32) * scale
    return _unblock(q, rc)


def _fp4(w: jax.Array, group: int = 32) -> jax.Array:
    b, rc = _blocks(w.astype(jnp.float32), 1, group)
    amax = jnp.max(jnp.abs(b), axis=(-3, -1), keepdims=True)
    scale = pow2_ceil(jnp.maximum(amax / 6.0, _TINY))
    q = round_e2m1(jnp.clip(b / scale, -6.0, 6.0)) * scale
    return _unblock(q, rc)


def quantize_leaf(w: jax.Array, fmt: str) -> jax.Array:
    """The values ``w`` takes after a round trip through ``fmt`` (no gradient handling)."""
    if fmt == "fp8_block":
        return _fp8(w, 32, 32)
    if fmt == "fp8_row":
        return _fp8(w, 1, 32)
    if fmt == "fp4":
        return _fp4(w)
    if fmt == "bf16":
        return w.astype(jnp.bfloat16).astype(w.dtype)
    if fmt == "fp32":
        return w
    raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")


def fake_quant_tree(tree: dict, formats: dict[tuple, str]) -> dict:
    """Every leaf of the nested dict ``tree`` through its format, with straight-through gradients."""

    def walk(node, path):
        if isinstance(node, dict):
            return {k: walk(v, (*path, k)) for k, v in node.items()}
        fmt = formats.get(path)
        if fmt is None:
            raise KeyError(f"no storage format for parameter {'.'.join(map(str, path))}")
        if fmt == "fp32":
            return node
        return node + jax.lax.stop_gradient(quantize_leaf(node, fmt) - node)

    return walk(tree, ())
