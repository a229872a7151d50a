"""The DeepSeek-V4.1 stack and its pure entry points (model.md §3-§4).

``DeepseekV41`` declares the model with Flax NNX; its parameter tree mirrors the checkpoint's
DeepSeek-native names (``layers.2.attn.wq_a.weight`` lives at ``state['layers'][2]['attn']['wq_a']
['weight']``), except that routed experts are stacked (``ffn.experts.w1`` [E, inter, d]).
The engine never calls the module statefully: ``forward_full(params, cfg, token_ids)`` merges the
cached graph definition with a state pytree inside the trace, so it is a pure function under jit.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deepinfer_jax.model import mhc
from deepinfer_jax.model.abstract_cache import abstract_model
from deepinfer_jax.model.attention import Attention, GlobalState
from deepinfer_jax.model.engram import Engram, Table
from deepinfer_jax.model.engram_consts import hash_constants
from deepinfer_jax.model.engram_hash import ngram_hash_ids
from deepinfer_jax.model.host_arrays import to_device
from deepinfer_jax.model.layers import Linear, RMSNorm, matmul_t
from deepinfer_jax.model.moe import MoE
from deepinfer_jax.model.moe_strategy import MoEStrategy, check_tables, layer_tables
from deepinfer_jax.model.qweight import QWeight


_AUTO = MoEStrategy()


class Buffer(nnx.Variable):
    """Derived, non-trainable state carried with the parameters (e.g. the Engram token map)."""


class HcSites(nnx.Module):
    """The two mHC sites (``attn``, ``ffn``) of a V4.1 block: their parameters and their mixer."""

    def init_hc_sites(self, cfg, rngs: nnx.Rngs) -> None:
        n, d, std = cfg.hc_mult, cfg.hidden_size, cfg.initializer_range
        self.iters, self.hc_eps, self.eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nnx.Param(jax.random.normal(rngs.params(), (n * (n + 2), n * d)) * std))
            setattr(self, f"hc_{site}_base", nnx.Param(jnp.zeros((n * (n + 2),), jnp.float32)))
            setattr(self, f"hc_{site}_scale", nnx.Param(jnp.ones((3,), jnp.float32)))

    def mix(self, site: str, streams: jax.Array) -> mhc.Mix:
        return mhc.hc_mix(streams, getattr(self, f"hc_{site}_fn")[...], getattr(self, f"hc_{site}_base")[...],
                          getattr(self, f"hc_{site}_scale")[...], iters=self.iters, hc_eps=self.hc_eps,
                          norm_eps=self.eps)


class Block(HcSites):
    """One layer: optional Engram write, then the attention and FFN sites with single-pass mHC."""

    def __init__(self, cfg, layer: int, *, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.engram_index = cfg.engram_index(layer)
        if self.engram_index is not None:
            self.engram = Engram(cfg, cfg.engram_num_embeddings[self.engram_index], rngs=rngs)
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.init_hc_sites(cfg, rngs)
        self.attn = Attention(cfg, layer, rngs=rngs)
        self.ffn = MoE(cfg, rngs=rngs)

    def __call__(self, streams, pre, carry, attend, *, engram_rows=None, tap=None, moe: MoEStrategy = _AUTO,
                 moe_tables=None, valid=None):
        """The block's wiring, for every entry point: streams [B, T, n, d], pre [B, T, n] (fp32) ->
        (streams, pre, carry, slot counts [P] of the ``"ep"`` MoE strategy or None).

        Engram write (``engram_rows`` [B, T, n_engram, ...]), then ``tap(streams)`` when given (the
        streams entering the attention site: DSpark target features, model.md §4.9), then the
        attention site, whose attention is ``attend(self.attn, x, carry) -> (out, carry)`` (the
        full-sequence ``Attention.__call__`` or the paged step's), then the FFN site: the MoE under
        ``moe`` with this layer's ``moe_tables`` and the tokens' validity ``valid``.
        """
        if self.engram_index is not None:
            streams = self.engram(streams, engram_rows[:, :, self.engram_index])
        if tap is not None:
            tap(streams)
        attn_mix = self.mix("attn", streams)
        out, carry = attend(self.attn, self.attn_norm(mhc.collapse(streams, pre)), carry)
        streams = mhc.expand(out, streams, attn_mix)
        ffn_mix = self.mix("ffn", streams)
        out, counts = self.ffn.run(self.ffn_norm(mhc.collapse(streams, attn_mix.pre)), moe, moe_tables, valid)
        streams = mhc.expand(out, streams, ffn_mix)
        return streams, ffn_mix.pre, carry, counts


class DeepseekV41(nnx.Module):
    """Embedding, ``num_hidden_layers`` blocks, final collapse, ``norm`` and the fp32 ``head``."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Table(cfg.vocab_size, cfg.hidden_size, rngs=rngs, std=cfg.initializer_range)
        self.layers = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, rngs=rngs, std=cfg.initializer_range)
        if cfg.engram_layer_ids:
            self.engram_token_map = Buffer(jnp.arange(cfg.vocab_size, dtype=jnp.int32))

    def engram_rows(self, token_ids_BT: jax.Array) -> jax.Array | None:
        cfg = self.cfg
        if not cfg.engram_layer_ids:
            return None
        return ngram_hash_ids(token_ids_BT, self.engram_token_map[...], hash_constants(cfg),
                              max_ngram=cfg.engram_max_ngram_size, pad_token_id=cfg.engram_pad_token_id)

    def __call__(self, token_ids_BT: jax.Array, capture: tuple[int, ...] = (), moe: MoEStrategy = _AUTO,
                 moe_tables=None):
        """Logits [B, T, V] in fp32 for every position of sequences that start at position 0.

        With ``capture`` (layer ids), returns ``(logits, features [B, T, len(capture) * d])``: the
        concatenated stream means entering those layers' attention sites (DSpark target features).
        With the ``"ep"`` MoE strategy the slot counts [L, P] follow last (``model.moe_strategy``).
        """
        cfg = self.cfg
        check_tables(moe, moe_tables, cfg.num_hidden_layers)
        x = self.embed(token_ids_BT)
        b, t = token_ids_BT.shape
        streams = jnp.broadcast_to(x[:, :, None, :], (b, t, cfg.hc_mult, cfg.hidden_size))
        pre = jnp.zeros((b, t, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
        rows = self.engram_rows(token_ids_BT)
        state = GlobalState()
        taps: list = []
        tap = lambda streams: taps.append(jnp.mean(streams.astype(jnp.float32), axis=2).astype(streams.dtype))
        counts = []
        for i, block in enumerate(self.layers):
            streams, pre, state, c = block(streams, pre, state, _full_attention, engram_rows=rows,
                                           tap=tap if i in capture else None, moe=moe,
                                           moe_tables=layer_tables(moe_tables, i))
            counts.append(c)
        h = self.norm(mhc.collapse(streams, pre))
        logits = matmul_t(h.astype(jnp.float32), self.head.weight[...].astype(jnp.float32))
        out = (logits, jnp.concatenate(taps, axis=-1)) if capture else (logits,)
        if moe.counts:
            out += (jnp.stack(counts),)
        return out if len(out) > 1 else logits


def _full_attention(attn: Attention, x, state: GlobalState):
    """The full-sequence attention site (``Block``'s ``attend``)."""
    return attn(x, state)


def _graphdef(cfg):
    return abstract_model(DeepseekV41, cfg)[0]


def init_params(cfg, seed: int = 0, token_map: np.ndarray | None = None) -> nnx.State:
    """A seeded random parameter state (normal(initializer_range) matrices, unit norms, zero biases).

    The Engram token map is the identity unless ``token_map`` is given.
    """
    _, state = nnx.split(DeepseekV41(cfg, rngs=nnx.Rngs(seed)))
    if token_map is not None and cfg.engram_layer_ids:
        state["engram_token_map"][...] = jnp.asarray(token_map, jnp.int32)
    return state


def abstract_params(cfg) -> nnx.State:
    """The parameter state's shapes and dtypes (``jax.ShapeDtypeStruct`` leaves), allocating nothing
    (a fresh state per call, from ``model.abstract_cache``)."""
    return abstract_model(DeepseekV41, cfg)[1]


def forward_full(params: nnx.State, cfg, token_ids: jax.Array, capture: tuple[int, ...] = (),
                 moe: MoEStrategy = _AUTO, moe_tables=None):
    """Pure full-sequence forward: ``token_ids`` [B, T] int -> logits [B, T, V] fp32.

    ``cfg`` (and ``capture``, ``moe``) must be static arguments under ``jax.jit``. Concrete (non-traced)
    inputs are validated: a 2-D integer array with every id in ``[0, vocab_size)``, else ``ValueError``.
    ``capture`` (backbone layer ids, e.g. ``cfg.dspark_target_layer_ids``): also return the DSpark
    target features, ``(logits, features [B, T, len(capture) * hidden])``. ``moe``: how the MoE layers
    run their routed experts (``model.moe_strategy``); the ``"ep"`` kind takes every layer's routing
    tables ``moe_tables`` (arrays) and also returns the slot counts [L, P], last.
    """
    if not isinstance(token_ids, jax.core.Tracer):
        check_token_ids(np.asarray(token_ids), cfg.vocab_size)
    capture = tuple(int(i) for i in capture)
    if any(not 0 <= i < cfg.num_hidden_layers for i in capture) or list(capture) != sorted(set(capture)):
        raise ValueError(f"capture must be strictly increasing layer ids in [0, {cfg.num_hidden_layers}), "
                         f"got {capture}")
    model = nnx.merge(_graphdef(cfg), params)
    return model(jnp.asarray(token_ids, jnp.int32), capture, moe, moe_tables)


def check_token_ids(ids: np.ndarray, vocab_size: int) -> None:
    """ValueError unless ``ids`` is a 2-D integer array ``[batch, seq_len >= 1]`` with every id in ``[0, vocab_size)``."""
    if ids.ndim != 2 or ids.shape[1] == 0:
        raise ValueError(f"token_ids must have shape [batch, seq_len] with seq_len >= 1, got {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids must be integers, got dtype {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token_ids must lie in [0, {vocab_size}); got min {ids.min()}, max {ids.max()}")


def params_from_tree(cfg, tree: Mapping, token_map: np.ndarray | None = None,
                     dtype=jnp.float32) -> nnx.State:
    """The parameter state from a nested pure dict of arrays laid out like the state (checkpoint names).

    ``token_map`` is the Engram compressed-id map [vocab], required when the config has Engram
    layers (``deepinfer_jax.params`` supplies the tokenizer-derived default).
    """
    state = abstract_params(cfg)
    pure = dict(tree)
    if cfg.engram_layer_ids:
        if token_map is None:
            raise ValueError("token_map (the Engram compressed-id map) is required for a config with Engram layers")
        pure["engram_token_map"] = np.asarray(token_map, np.int32)
    expected = nnx.to_pure_dict(state)
    flat_expected = dict(_flatten(expected))
    flat_given = dict(_flatten(pure))
    check_tree(flat_expected, flat_given, "parameter tree")

    def convert(path, leaf):
        arr = flat_given[path]
        if isinstance(arr, QWeight):  # resident in its storage format (decoded inside the matmuls)
            return arr
        if np.issubdtype(np.asarray(arr).dtype, np.integer):
            return to_device(arr)
        is_fp32 = path.split(".")[-1] in _FP32_LEAVES or path.endswith("attn_sink")
        return to_device(arr, jnp.float32 if is_fp32 else dtype)

    values = {k: convert(k, v) for k, v in flat_expected.items()}
    nnx.replace_by_pure_dict(state, _unflatten(values))
    return state


_FP32_LEAVES = {"hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                "bias", "bias_vl"}


def check_tree(flat_expected: Mapping, flat_given: Mapping, what: str) -> None:
    """One ``ValueError`` naming every missing, unexpected or misshaped leaf of ``flat_given``
    (dotted paths -> arrays) against ``flat_expected`` (dotted paths -> shaped leaves)."""
    problems = [f"missing {k}" for k in flat_expected.keys() - flat_given.keys()]
    problems += [f"unexpected {k}" for k in flat_given.keys() - flat_expected.keys()]
    problems += [f"{k}: shape {tuple(np.shape(flat_given[k]))} != {tuple(v.shape)}" for k, v in flat_expected.items()
                 if k in flat_given and tuple(np.shape(flat_given[k])) != tuple(v.shape)]
    if problems:
        raise ValueError(f"{what} does not match the config: " + "; ".join(sorted(problems)))


def _flatten(tree, prefix=""):
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            yield from _flatten(v, key + ".")
        else:
            yield key, v


def _unflatten(flat: Mapping[str, object]) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        parts = [int(p) if p.isdigit() else p for p in key.split(".")]
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out
