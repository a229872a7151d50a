"""Mixture of experts with the sqrt-softplus router and a shared expert (model.md §4.6).

Router in fp32: ``s = sqrt(softplus(x . W_g^T))``; top-k of ``s + bias`` selects (the bias never
weighs); weights are ``s`` at the selected experts, renormalised, times ``routed_scaling_factor``
(``model.routing.route``). Experts are clamped SwiGLU (``model.routing.swiglu``). How the routed
experts run is the step's static ``MoEStrategy`` (``model.moe_strategy``): the dense reference
evaluates every expert on every token and zero-weights the unselected ones (exact, and cheap at the
small expert counts that run on CPU); the grouped path runs expert-sorted rows through the
grouped-matmul kernel; the ``"ep"`` kind hands them to the strategy's expert-parallel
implementation (``parallel.ep_model``: ``shard_map`` over a mesh).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.model import qweight
from deepinfer_jax.model.layers import Linear, matmul_t
from deepinfer_jax.model.moe_strategy import MoEStrategy
from deepinfer_jax.model.routing import route, swiglu
from deepinfer_jax.ops import dispatch
from deepinfer_jax.ops.grouped_matmul import grouped_matmul
from deepinfer_jax.ops.grouped_matmul.reference import moe_experts
from deepinfer_jax.ops.quantized_matmul import quantized_grouped_matmul

__all__ = ["MLP", "Experts", "Gate", "MoE", "route", "swiglu"]

_AUTO = MoEStrategy()


class Gate(nnx.Module):
    """``ffn.gate.weight`` [E, d], ``ffn.gate.bias`` [E] (selection only), ``ffn.gate.bias_vl`` [E] (image tokens)."""

    def __init__(self, d: int, n_experts: int, *, rngs: nnx.Rngs, std: float):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (n_experts, d)) * std)
        self.bias = nnx.Param(jnp.zeros((n_experts,), jnp.float32))
        self.bias_vl = nnx.Param(jnp.zeros((n_experts,), jnp.float32))


class Experts(nnx.Module):
    """Routed experts stacked over the expert axis: w1/w3 [E, inter, d], w2 [E, d, inter]."""

    def __init__(self, d: int, inter: int, n_experts: int, *, rngs: nnx.Rngs, std: float):
        normal = lambda shape: nnx.Param(jax.random.normal(rngs.params(), shape) * std)
        self.w1 = normal((n_experts, inter, d))
        self.w3 = normal((n_experts, inter, d))
        self.w2 = normal((n_experts, d, inter))


class MLP(nnx.Module):
    """The shared expert: ``w1``/``w3`` [inter, d], ``w2`` [d, inter]."""

    def __init__(self, d: int, inter: int, limit: float, *, rngs: nnx.Rngs, std: float):
        self.limit = limit
        self.w1 = Linear(d, inter, rngs=rngs, std=std)
        self.w3 = Linear(d, inter, rngs=rngs, std=std)
        self.w2 = Linear(inter, d, rngs=rngs, std=std)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit).astype(x.dtype))


class MoE(nnx.Module):
    """``layers.L.ffn``: gate, routed experts and the shared expert."""

    def __init__(self, cfg, *, rngs: nnx.Rngs, n_experts: int | None = None, top_k: int | None = None):
        std, d, inter = cfg.initializer_range, cfg.hidden_size, cfg.moe_intermediate_size
        n_experts = n_experts or cfg.n_routed_experts
        self.top_k = top_k or cfg.num_experts_per_tok
        self.limit = cfg.swiglu_limit
        self.scale = cfg.routed_scaling_factor
        self.renormalize = cfg.norm_topk_prob
        self.gate = Gate(d, n_experts, rngs=rngs, std=std)
        self.experts = Experts(d, inter, n_experts, rngs=rngs, std=std)
        self.shared_experts = MLP(d, inter, self.limit, rngs=rngs, std=std)

    def __call__(self, x_BTd: jax.Array) -> jax.Array:
        """The layer's output (x's shape and dtype) with the default strategy (``"auto"``)."""
        return self.run(x_BTd)[0]

    def run(self, x_BTd: jax.Array, strategy: MoEStrategy = _AUTO, tables=None, valid=None):
        """(output in x's shape and dtype, pairs per physical slot [P] int32 or None) under ``strategy``;
        ``tables`` (this layer's routing tables) and ``valid`` (the tokens' validity [N]) for ``"ep"``."""
        shape = x_BTd.shape
        x = x_BTd.reshape(-1, shape[-1])
        counts = None
        if strategy.kind == "ep":  # routed experts over the mesh's ep axis (shard_map)
            y, counts = strategy.ep(self, x, tables, valid)
            y = y + self.shared_experts(x).astype(jnp.float32)
            return y.astype(x_BTd.dtype).reshape(shape), counts
        logits = matmul_t(x.astype(jnp.float32), self.gate.weight[...].astype(jnp.float32))
        w, ids = route(logits, self.gate.bias[...], self.top_k, self.scale, self.renormalize)
        w1, w3, w2 = self.experts.w1[...], self.experts.w3[...], self.experts.w2[...]
        dense = strategy.kind == "dense" or (strategy.kind == "auto" and dispatch.uses_reference())
        if dense:
            y = self._dense_experts(x, w, ids, w1, w3, w2)
        else:  # expert-sorted rows through the selected grouped-matmul kernel (ops/grouped_matmul)
            act = functools.partial(swiglu, limit=self.limit)
            gmm = quantized_grouped_matmul if qweight.is_quantized(w1) else grouped_matmul
            y = moe_experts(x, w1, w3, w2, ids, w, act, gmm=gmm)
        y = y + self.shared_experts(x).astype(jnp.float32)
        return y.astype(x_BTd.dtype).reshape(shape), counts

    def _dense_experts(self, x, w, ids, w1, w3, w2):
        """The reference path: every expert on every token, unselected ones zero-weighted -> fp32 [N, d]."""
        combine = jnp.zeros((x.shape[0], w1.shape[0]), jnp.float32)
        combine = combine.at[jnp.arange(x.shape[0])[:, None], ids].add(w)
        n_tok, (e, inter, _) = x.shape[0], w1.shape
        h = swiglu(matmul_t(x, _stack(w1)), matmul_t(x, _stack(w3)), self.limit)
        h = (h.reshape(n_tok, e, inter) * combine[..., None]).astype(x.dtype).reshape(n_tok, e * inter)
        return matmul_t(h, _concat_columns(w2)).astype(jnp.float32)


def _stack(w):
    """[E, inter, d] -> [E * inter, d] (every expert's rows as one matrix; a QWeight stays quantized)."""
    if qweight.is_quantized(w):
        return qweight.merge_leading(w)
    e, inter, d = w.shape
    return w.reshape(e * inter, d)


def _concat_columns(w):
    """[E, d, inter] -> [d, E * inter] (every expert's w2 side by side)."""
    if qweight.is_quantized(w):
        return qweight.concat_experts_on_columns(w)
    e, d, inter = w.shape
    return jnp.transpose(w, (1, 0, 2)).reshape(d, e * inter)
