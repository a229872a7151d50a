"""The device-side cache pytree (engine.md §1, model.md §5) and its storage codecs.

One pytree, sized by a ``CacheConfig``:

- ``global[L]`` for each KV-source layer L: a pool of ``num_blocks`` blocks, each holding the
  ``block_size // ratio`` compressed entries of its tokens: main KV (``kv``) and index keys (``index``).
- ``swa``: per request slot, a ring of ``sliding_window + spec_slack`` SWA rows for every layer.
- ``comp[L]`` for ratio > 1 KV sources: the compressor's recent tokens (fp32 values and gate
  scores), a ring of ``ratio + spec_slack`` rows indexed by ``position % capacity``.
- ``engram``: per request slot, a ring of the last ``max_ngram - 1 + spec_slack`` token ids, indexed
  by ``position % capacity`` (-1 = none).

Every per-slot part is a ring indexed by position with ``spec_slack`` rows to spare: a step may write
a few positions that are later rolled back (rejected speculative drafts), and the next step starting
at an earlier position still finds every row it reads intact; rows at rolled-back positions are
simply written again.

Storage ``"quantized"`` keeps the QAT formats of model.md §4.8 (SWA FP8 + UE8M0 scales, global KV
NVFP4 codes + E4M3 scales, index keys MXFP4 codes + UE8M0 scales); ``"dequantized"`` keeps the
fake-quantised fp32 values. Both decode to the same numbers, bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import LayerRole
from deepinfer_jax.model import quant
from deepinfer_jax.model.host_arrays import filled

_CODECS = {
    "fp8": (quant.encode_fp8, quant.decode_fp8, 32),
    "nvfp4": (quant.encode_nvfp4, quant.decode_nvfp4, 16),
    "mxfp4": (quant.encode_mxfp4, quant.decode_mxfp4, 32),
}


def kv_source_layers(cfg) -> tuple[int, ...]:
    return tuple(i for i in range(cfg.num_hidden_layers) if cfg.layer_role(i) is LayerRole.FULL)


def _empty(shape: tuple[int, ...], fmt: str, quantized: bool):
    """Zeroed storage for rows of ``shape`` (last axis = channels) in format ``fmt``."""
    if not quantized:
        return filled(shape, jnp.float32)
    *lead, c = shape
    group = _CODECS[fmt][2]
    if fmt == "fp8":
        return {"q": filled(shape, jnp.float8_e4m3fn), "s": filled((*lead, c // group), jnp.uint8)}
    scale_dtype = jnp.float8_e4m3fn if fmt == "nvfp4" else jnp.uint8
    return {"q": filled((*lead, c // 2), jnp.uint8), "s": filled((*lead, c // group), scale_dtype)}


def encode(x: jax.Array, fmt: str, quantized: bool):
    """Rows ``x`` (already fake-quantised or not) -> storage. Dequantized storage keeps x as is."""
    if not quantized:
        return x.astype(jnp.float32)
    q, s = _CODECS[fmt][0](x)
    return {"q": q, "s": s}


def decode(stored, fmt: str, quantized: bool) -> jax.Array:
    if not quantized:
        return stored
    return _CODECS[fmt][1](stored["q"], stored["s"])


def gather(stored, index: tuple) -> object:
    """Storage rows at ``index`` (a tuple of integer arrays over the leading axes)."""
    return jax.tree.map(lambda a: a[index], stored)


def scatter(stored, index: tuple, rows) -> object:
    """Write storage ``rows`` at ``index``; out-of-range indices are dropped (padding)."""
    return jax.tree.map(lambda a, r: a.at[index].set(r, mode="drop"), stored, rows)


def init_cache(cfg, cache_cfg) -> dict:
    """An all-empty cache for ``cfg`` laid out by ``cache_cfg`` (see the module docstring)."""
    if not cfg.fake_quant and cache_cfg.storage == "quantized":
        raise ValueError("storage='quantized' needs fake_quant=True (the stored formats are the QAT formats)")
    cache_cfg.validate_for(cfg)
    qz = cache_cfg.storage == "quantized"
    nb, bs, slots = cache_cfg.num_blocks, cache_cfg.block_size, cache_cfg.max_requests
    cap = cache_cfg.ring_capacity(cfg)
    glob, comp = {}, {}
    for layer in kv_source_layers(cfg):
        r = cfg.compress_ratio(layer)
        glob[layer] = {"kv": _empty((nb, bs // r, cfg.head_dim), "nvfp4", qz),
                       "index": _empty((nb, bs // r, cfg.index_head_dim), "mxfp4", qz)}
        if r > 1:
            cc = cache_cfg.comp_capacity(r)
            comp[layer] = {"v": filled((slots, cc, cfg.head_dim), jnp.float32),
                           "g": filled((slots, cc, cfg.head_dim), jnp.float32)}
    cache = {"global": glob, "comp": comp,
             "swa": _empty((cfg.num_hidden_layers, slots, cap, cfg.head_dim), "fp8", qz)}
    if cfg.engram_layer_ids:
        cache["engram"] = filled((slots, cache_cfg.engram_capacity(cfg)), jnp.int32, -1)
    return cache
