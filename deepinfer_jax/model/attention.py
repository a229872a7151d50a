"""CSA2 attention over a full sequence: SWA window + selected compressed global entries + sink.

Layer roles (model.md §3, §4.4): SWA layers attend to their own window only; FULL layers also
compress global KV and own index keys; REINDEX layers re-select over their source's entries;
REUSE layers take their index source's selection unchanged. Cross-layer state travels in
``GlobalState`` from one layer to the next, exactly as the reference publishes it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.config import LayerRole
from deepinfer_jax.model.compressor import Compressor
from deepinfer_jax.model.indexer import Indexer
from deepinfer_jax.model.layers import Linear, RMSNorm, matmul_t
from deepinfer_jax.model.qweight import split_rows
from deepinfer_jax.model.quant import fake_quant_fp8, fake_quant_nvfp4
from deepinfer_jax.model.rope import apply_rope, rope_angles, rope_frequencies
from deepinfer_jax.ops import dispatch
from deepinfer_jax.ops.indexer_topk import indexer_topk
from deepinfer_jax.ops.sparse_attention import sparse_attention
from deepinfer_jax.ops.sparse_attention.reference import global_rows


class GlobalState(NamedTuple):
    """Shared CSA2 tensors published by KV/index sources (None until a source has run).

    global_kv [B, W, D] (RoPE'd, NVFP4); index_keys [B, W, hd]; topk [B, T, k] (ascending, -1 empty);
    candidates [B, T, W] bool; ratio: tokens per entry of the current source.
    """

    global_kv: jax.Array | None = None
    index_keys: jax.Array | None = None
    topk: jax.Array | None = None
    candidates: jax.Array | None = None
    ratio: int = 0


class Attention(nnx.Module):
    """One CSA2 attention layer; parameter names follow the checkpoint (``layers.L.attn.*``)."""

    def __init__(self, cfg, layer: int, *, rngs: nnx.Rngs):
        std, d, eps = cfg.initializer_range, cfg.hidden_size, cfg.rms_norm_eps
        self.layer = layer
        self.ratio = cfg.compress_ratio(layer)
        self.role = cfg.layer_role(layer)
        self.n_heads, self.head_dim, self.groups = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.window = cfg.sliding_window
        self.index_topk = cfg.index_topk
        self.is_candidate_source = cfg.is_candidate_source(layer)
        self.uses_candidates = cfg.uses_candidates(layer)
        self.candidate_blocks, self.candidate_block_size = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.fake_quant = cfg.fake_quant
        self.freqs = tuple(float(f) for f in rope_frequencies(
            cfg.qk_rope_head_dim, cfg.rope_theta_for(layer), cfg.rope_scaling_for(layer)))
        hd = self.n_heads * self.head_dim
        self.wq_a = Linear(d, cfg.q_lora_rank, rngs=rngs, std=std)
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps)
        self.wq_b = Linear(cfg.q_lora_rank, hd, rngs=rngs, std=std)
        self.wkv = Linear(d, self.head_dim, rngs=rngs, std=std)
        self.kv_norm = RMSNorm(self.head_dim, eps)
        self.wo_a = Linear(hd // self.groups, self.groups * cfg.o_lora_rank, rngs=rngs, std=std)
        self.wo_b = Linear(self.groups * cfg.o_lora_rank, d, rngs=rngs, std=std)
        self.attn_sink = nnx.Param(jnp.zeros((self.n_heads,), jnp.float32))
        if self.role is LayerRole.FULL:
            self.compressor = Compressor(d, self.head_dim, self.ratio, eps, rngs=rngs, std=std)
        if self.role in (LayerRole.FULL, LayerRole.REINDEX):
            self.indexer = Indexer(cfg, owns_keys=self.role is LayerRole.FULL, rngs=rngs)

    # -- pieces shared with the paged/incremental path -------------------------------------
    def angles(self, positions: jax.Array) -> jax.Array:
        return rope_angles(positions, jnp.asarray(self.freqs, jnp.float32))

    def query(self, x_BTd: jax.Array, angles: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(q_lat [B, T, q_lora], q [B, T, H, D] with RoPE on the last rope dims)."""
        b, t, _ = x_BTd.shape
        q_lat = self.q_norm(self.wq_a(x_BTd))
        q = apply_rope(self.wq_b(q_lat).reshape(b, t, self.n_heads, self.head_dim), angles)
        return q_lat, q

    def window_kv(self, x_BTd: jax.Array, angles: jax.Array, raw: bool = False) -> jax.Array:
        """SWA KV rows [B, T, D] (K = V): RoPE(kv_norm(x . wkv)), FP8 fake-quantised unless ``raw``."""
        kv = apply_rope(self.kv_norm(self.wkv(x_BTd)), angles)
        return fake_quant_fp8(kv) if self.fake_quant and not raw else kv

    def global_kv(self, latent_BWD: jax.Array, angles_BWP: jax.Array, raw: bool = False) -> jax.Array:
        """Main global KV entries: RoPE(latent) at each entry's first position, NVFP4 unless ``raw``."""
        kv = apply_rope(latent_BWD, angles_BWP)
        return fake_quant_nvfp4(kv) if self.fake_quant and not raw else kv

    def output(self, o_BTHD: jax.Array, angles: jax.Array) -> jax.Array:
        """Inverse RoPE on o, then grouped O-LoRA: [B, T, H, D] -> [B, T, d]."""
        b, t = o_BTHD.shape[:2]
        o = apply_rope(o_BTHD, angles, inverse=True).reshape(b, t, self.groups, -1)
        wa = split_rows(self.wo_a.weight[...], self.groups)  # [rows, H*D/G] each; a QWeight stays quantized
        # one 2-D matmul per group (a batched-over-groups einsum rounds differently per batch shape)
        u = jnp.concatenate([matmul_t(o[:, :, g], wa[g]) for g in range(self.groups)], axis=-1)
        return self.wo_b(u)

    # -- full-sequence forward ----------------------------------------------------------------
    def __call__(self, x_BTd: jax.Array, state: GlobalState) -> tuple[jax.Array, GlobalState]:
        """Attention for every position of a sequence starting at position 0; returns (out, state).

        Sparse by construction: each query gathers its ``window`` SWA rows and its ``index_topk``
        selected global entries, so the cost is O(T * (window + k)), not O(T^2).
        """
        b, t, _ = x_BTd.shape
        pos = jnp.arange(t)
        angles = jnp.broadcast_to(self.angles(pos), (b, t, len(self.freqs)))
        q_lat, q = self.query(x_BTd, angles)
        kv = self.window_kv(x_BTd, angles)
        w = self.window  # always the full window (masked), so the paged step sees the same row shapes
        rows = pos[:, None] - (w - 1) + jnp.arange(w)  # [T, w]: keys max(0, t - window + 1) .. t
        keys = [jnp.take(kv, jnp.maximum(rows, 0), axis=1)]  # [B, T, w, D]
        valid = [jnp.broadcast_to(rows >= 0, (b, t, w))]
        if self.ratio:
            state = self._global(x_BTd, q_lat, angles, state)
        if not dispatch.uses_reference():  # kernels: flat tokens, each batch row's entries one block of the pool
            flat = lambda a: a.reshape(b * t, *a.shape[2:])
            paged = (None,) * 4
            if self.ratio:
                pool = state.global_kv if state.global_kv.shape[1] else jnp.zeros((b, 1, kv.shape[-1]), kv.dtype)
                paged = (pool.astype(kv.dtype), jnp.arange(b)[:, None], jnp.repeat(jnp.arange(b), t), flat(state.topk))
            o = attend_step(flat(q), flat(keys[0]), flat(valid[0]), self.attn_sink[...], *paged)
            return self.output(o.reshape(q.shape), angles), state
        if self.ratio:
            sel = state.topk  # [B, T, k], -1 = empty slot
            if state.global_kv.shape[1] == 0:
                gathered = jnp.zeros((*sel.shape, kv.shape[-1]), kv.dtype)
            else:
                gathered = jax.vmap(lambda g, i: jnp.take(g, jnp.maximum(i, 0), axis=0))(state.global_kv, sel)
            keys.append(gathered.astype(kv.dtype))
            valid.append(sel >= 0)
        return self.output(attend(q, jnp.concatenate(keys, 2), jnp.concatenate(valid, 2), self.attn_sink[...]),
                           angles), state

    def _global(self, x_BTd, q_lat, angles, state: GlobalState) -> GlobalState:
        """Publish (FULL) or consume (REINDEX/REUSE) the compressed entries and the selection."""
        b, t, _ = x_BTd.shape
        r = self.ratio
        w = t // r
        c_angles = jnp.broadcast_to(self.angles(jnp.arange(w) * r), (b, w, len(self.freqs)))
        if self.role is LayerRole.FULL:
            latent = self.compressor(x_BTd)
            state = GlobalState(global_kv=self.global_kv(latent, c_angles),
                                index_keys=self.indexer.keys(latent, c_angles),
                                candidates=state.candidates, ratio=r)
        elif state.global_kv is None or state.ratio != r:
            raise ValueError(f"layer {self.layer} needs a preceding KV source with compress ratio {r}")
        if self.role in (LayerRole.FULL, LayerRole.REINDEX) and w == 0:
            state = state._replace(topk=jnp.full((b, t, self.index_topk), -1, jnp.int32),
                                   candidates=jnp.zeros((b, t, 0), bool) if self.is_candidate_source
                                   else state.candidates)
        elif self.role in (LayerRole.FULL, LayerRole.REINDEX):
            n_visible = jnp.broadcast_to((jnp.arange(t) + 1) // r, (b, t))
            visible = jnp.arange(w) < n_visible[..., None]
            scores = self.indexer.scores(x_BTd, q_lat, angles, state.index_keys, visible)
            topk, candidates = self.select(scores, n_visible, visible, state.candidates)
            state = state._replace(topk=topk, candidates=candidates)
        return state

    def select(self, scores, n_visible, visible, candidates):
        """(top-k entry ids [..., k], candidate pool [..., W]) from index scores [..., W].

        The candidate source publishes its block pool; later index layers are confined to it.
        ``visible`` must be ``arange(W) < n_visible`` (the selection kernels derive it from n_visible).
        """
        mode = "source" if self.is_candidate_source else "confined" if self.uses_candidates else "plain"
        return indexer_topk(scores, n_visible, self.index_topk, mode, candidates, self.candidate_blocks,
                            self.candidate_block_size)


def attend(q_BTHD: jax.Array, kv_BTSD: jax.Array, valid_BTS: jax.Array, sink_H: jax.Array) -> jax.Array:
    """Sink attention of each query over its own gathered keys (K = V).

    q [B, T, H, D]; kv [B, T, S, D] (the S keys of each query); valid [B, T, S]; sink [H].
    One softmax over the valid keys plus a zero-valued sink key whose logit is ``sink[h]``;
    scale ``1/sqrt(D)``. Returns o [B, T, H, D] in q's dtype (fp32 math).
    """
    d = q_BTHD.shape[-1]
    kv = jnp.where(valid_BTS[..., None], kv_BTSD.astype(jnp.float32), 0.0)  # never let a stale row leak
    logits = jnp.einsum("bthd,btsd->bths", q_BTHD.astype(jnp.float32), kv) * d**-0.5
    logits = jnp.where(valid_BTS[:, :, None, :], logits, -jnp.inf)
    sink = jnp.broadcast_to(sink_H.astype(jnp.float32)[:, None], (*logits.shape[:-1], 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bths,btsd->bthd", probs, kv).astype(q_BTHD.dtype)


def attend_step(q_NHD: jax.Array, window_NWD: jax.Array, window_valid_NW: jax.Array, sink_H: jax.Array,
                pool_PED: jax.Array | None = None, block_tables_RM: jax.Array | None = None,
                token_req_N: jax.Array | None = None, topk_NK: jax.Array | None = None) -> jax.Array:
    """The paged step's attention: window rows plus (when ``pool_PED`` is given) the selected entries of
    the block pool via the block tables; o [N, H, D].

    The reference path gathers the entries and runs ``attend`` (the step's numerics unchanged); the
    kernel paths run ``deepinfer_jax.ops.sparse_attention`` (the two parts merged by log-sum-exp).
    """
    if pool_PED is None:  # SWA layer: window only
        n = q_NHD.shape[0]
        pool_PED, block_tables_RM = jnp.zeros((1, 1, window_NWD.shape[-1]), window_NWD.dtype), jnp.zeros((1, 1), jnp.int32)
        token_req_N, topk_NK = jnp.zeros((n,), jnp.int32), jnp.zeros((n, 0), jnp.int32)
    if not dispatch.uses_reference():
        return sparse_attention(q_NHD, window_NWD, window_valid_NW, pool_PED, block_tables_RM, token_req_N, topk_NK,
                                sink_H)
    keys, valid = window_NWD, window_valid_NW
    if topk_NK.shape[-1]:
        rows, ok = global_rows(pool_PED, block_tables_RM, token_req_N, topk_NK)
        keys, valid = jnp.concatenate([keys, rows.astype(keys.dtype)], 1), jnp.concatenate([valid, ok], 1)
    return attend(q_NHD[None], keys[None], valid[None], sink_H)[0]
