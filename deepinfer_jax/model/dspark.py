"""The DSpark drafter (``mtp.0..S-1``, model.md §4.9): a parallel block drafter fed by target features.

For an anchor token ``x_a`` at position ``a`` (the last accepted token: the target need not have run
on it yet, its own features are not read), the drafter reads the draft block ``[x_a, noise x (K-1)]`` (``K = dspark_block_size``, noise
id ``dspark_noise_token_id``) at positions ``a .. a+K-1`` and predicts tokens ``a+1 .. a+K`` in one
pass. Its context is the target's features at positions ``a-W .. a-1`` (``W = sliding_window``):
the streams entering the attention site of each ``dspark_target_layer_ids`` layer, averaged over the
mHC streams and concatenated (``forward_full(..., capture=...)``), projected once by ``mtp.0``'s
``main_norm(main_proj(.))``.

Each stage is a V4.1 block with SWA-only attention (its own ``wkv`` makes K = V rows of both the
projected target features and its own block; every query sees the context window and its whole
block, plus the sink), a MoE of ``dspark_n_routed_experts`` / ``dspark_num_experts_per_tok`` and
single-pass mHC. After the last stage: ``h = collapse(streams, pre)``, ``hn = norm(h)``;
``logits = head(hn) + markov_head.head(markov_head.embed(prev))`` with the target's (shared, fp32)
``head`` and ``prev`` the token before each draft position (the anchor, then the drafted tokens);
the confidence logit is ``confidence_head.proj([hn ; markov_head.embed(prev)])`` in fp32.

Semantics follow NeMo AutoModel's ``DeepseekV41DSparkModel`` where it differs from model.md: the
draft positions are ``a .. a+K-1`` (model.md: ``a+1 .. a+K``), the context excludes the anchor's own
feature, and the confidence head reads the *normalised* state ``hn`` (model.md: pre-norm ``h``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deepinfer_jax.model import mhc
from deepinfer_jax.model.abstract_cache import abstract_model
from deepinfer_jax.model.attention import Attention, attend
from deepinfer_jax.model.deepseek_v41 import HcSites, _flatten, _unflatten, check_tree
from deepinfer_jax.model.engram import Table
from deepinfer_jax.model.host_arrays import to_device
from deepinfer_jax.model.layers import Linear, RMSNorm, matmul_t, take_rows
from deepinfer_jax.model.moe import MoE

__all__ = ["DSparkDrafter", "DraftHeads", "DraftOutput", "abstract_drafter_params", "check_drafter_config",
           "confidence_logit", "draft_after_prefix", "draft_block", "draft_from_features", "draft_heads", "draft_sampled",
           "drafter_params_from_tree", "drafter_states", "init_drafter_params", "markov_bias", "project_features",
           "teacher_forced_heads"]


class MarkovHead(nnx.Module):
    """Rank-r first-order transition bias: ``embed.weight`` [V, r], ``head.weight`` [V, r]."""

    def __init__(self, vocab: int, rank: int, *, rngs: nnx.Rngs, std: float):
        self.embed = Table(vocab, rank, rngs=rngs, std=std)
        self.head = Linear(rank, vocab, rngs=rngs, std=std)


class ConfidenceHead(nnx.Module):
    """``proj.weight`` [1, d + r] (fp32): one acceptance logit per draft position."""

    def __init__(self, d: int, rank: int, *, rngs: nnx.Rngs, std: float):
        self.proj = Linear(d + rank, 1, rngs=rngs, std=std)


class DSparkStage(HcSites):
    """``mtp.S``: a ratio-0 V4.1 block (attention + MoE, single-pass mHC), plus ``main_proj``/``main_norm``
    on the first stage and ``norm``/``markov_head``/``confidence_head`` on the last."""

    def __init__(self, cfg, stage: int, *, rngs: nnx.Rngs):
        d, std = cfg.hidden_size, cfg.initializer_range
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.init_hc_sites(cfg, rngs)
        self.attn = Attention(cfg, cfg.num_hidden_layers + stage, rngs=rngs)  # past the schedule: ratio 0
        self.ffn = MoE(cfg, rngs=rngs, n_experts=cfg.dspark_n_routed_experts, top_k=cfg.dspark_num_experts_per_tok)
        if stage == 0:
            self.main_proj = Linear(len(cfg.dspark_target_layer_ids) * d, d, rngs=rngs, std=std)
            self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
        if stage == cfg.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, rngs=rngs, std=std)
            self.confidence_head = ConfidenceHead(d, cfg.dspark_markov_rank, rngs=rngs, std=std)


    def __call__(self, streams_BNnd, pre_BNn, ctx_BSd, ctx_angles, ctx_valid_BNS, angles_BNP, block: int):
        """One stage over N = A * K draft rows (A anchor blocks of K rows each).

        streams [B, N, n, d]; pre [B, N, n] fp32; ctx [B, S, d] projected target features with their
        RoPE angles [B, S, P]; ctx_valid [B, N, S]: the context rows each draft row sees; angles
        [B, N, P] of the draft rows. Returns (streams, pre).
        """
        attn = self.attn
        b, rows = streams_BNnd.shape[:2]
        attn_mix = self.mix("attn", streams_BNnd)
        x = self.attn_norm(mhc.collapse(streams_BNnd, pre_BNn))
        _, q = attn.query(x, angles_BNP)  # [B, N, H, D]
        own = attn.window_kv(x, angles_BNP).reshape(b, rows // block, 1, block, -1)  # [B, A, 1, K, D]
        own = jnp.broadcast_to(own, (b, rows // block, block, block, own.shape[-1])).reshape(b, rows, block, -1)
        ctx = attn.window_kv(ctx_BSd, ctx_angles)  # [B, S, D]
        keys = jnp.concatenate([jnp.broadcast_to(ctx[:, None], (b, rows, *ctx.shape[1:])).astype(own.dtype), own], 2)
        valid = jnp.concatenate([ctx_valid_BNS, jnp.ones((b, rows, block), bool)], 2)
        out = attn.output(attend(q, keys, valid, attn.attn_sink[...]), angles_BNP)
        streams = mhc.expand(out, streams_BNnd, attn_mix)
        ffn_mix = self.mix("ffn", streams)
        out = self.ffn(self.ffn_norm(mhc.collapse(streams, attn_mix.pre)))
        return mhc.expand(out, streams, ffn_mix), ffn_mix.pre


class DSparkDrafter(nnx.Module):
    """The drafter's parameters: ``mtp`` = the ``num_nextn_predict_layers`` stages (tree ``mtp.S.*``)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        check_drafter_config(cfg)
        self.mtp = nnx.List([DSparkStage(cfg, s, rngs=rngs) for s in range(cfg.num_nextn_predict_layers)])


def check_drafter_config(cfg) -> None:
    """ValueError naming the field when ``cfg`` cannot carry a DSpark drafter (the rest of the dspark_*
    fields are validated by ``ModelConfig``): at least one stage, and SWA-only (ratio 0) stages. A
    truncated backbone prefix whose schedule puts compressed layers at the stage indices has no drafter."""
    n, first = cfg.num_nextn_predict_layers, cfg.num_hidden_layers
    if n < 1:
        raise ValueError(f"num_nextn_predict_layers must be >= 1 for a DSpark drafter, got {n}")
    bad = [first + s for s in range(n) if cfg.compress_ratio(first + s)]
    if bad:
        raise ValueError(f"compress_ratios must be 0 (SWA-only) at the DSpark stages (layers {first}..{first + n - 1}), "
                         f"got nonzero ratios at layers {bad}")


def _graphdef(cfg):
    return abstract_model(DSparkDrafter, cfg)[0]


def init_drafter_params(cfg, seed: int = 0) -> nnx.State:
    """Seeded random drafter parameters (normal(initializer_range) matrices, unit norms, zero biases)."""
    _, state = nnx.split(DSparkDrafter(cfg, rngs=nnx.Rngs(seed)))
    return state


def abstract_drafter_params(cfg) -> nnx.State:
    """The drafter state's shapes and dtypes, allocating nothing (``model.abstract_cache``)."""
    return abstract_model(DSparkDrafter, cfg)[1]


def drafter_params_from_tree(cfg, tree: Mapping, dtype=jnp.float32) -> nnx.State:
    """The drafter state from a nested dict ``{"mtp": {0: {...}, ...}}`` (checkpoint names, experts
    stacked). Missing, unexpected or misshaped leaves raise one ``ValueError`` naming them all."""
    state = abstract_drafter_params(cfg)
    flat_expected = dict(_flatten(nnx.to_pure_dict(state)))
    flat_given = dict(_flatten(tree))
    check_tree(flat_expected, flat_given, "drafter parameter tree")

    def convert(path, arr):
        fp32 = path.split(".")[-1] in _FP32_LEAVES or path.endswith(("attn_sink", "confidence_head.proj.weight"))
        return jnp.asarray(arr, jnp.float32 if fp32 else dtype)

    nnx.replace_by_pure_dict(state, _unflatten({k: convert(k, flat_given[k]) for k in flat_expected}))
    return state


_FP32_LEAVES = {"hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                "bias", "bias_vl"}


# ---- the pure forward -------------------------------------------------------------------------------


def project_features(drafter: nnx.State, cfg, feats_F: jax.Array) -> jax.Array:
    """Target features [..., L*d] -> the drafter's context rows [..., d]: ``mtp.0``'s
    ``main_norm(main_proj(.))``. The engine projects each token's features once, when the target step
    computes them, and keeps the projected rows per request."""
    first = nnx.merge(_graphdef(cfg), drafter).mtp[0]
    return first.main_norm(first.main_proj(feats_F))


def drafter_states(drafter: nnx.State, embed_Vd: jax.Array, cfg, ctx_BSF: jax.Array, ctx_pos_BS: jax.Array,
                   ctx_ok_BS: jax.Array, block_ids_BAK: jax.Array, anchor_pos_BA: jax.Array,
                   projected: bool = False) -> jax.Array:
    """Final normalised draft states ``hn`` [B, A, K, d] of A draft blocks per sequence.

    drafter: the ``mtp.*`` state; embed [V, d]: the target's embedding (shared); ctx [B, S, L*d]: target
    features at positions ``ctx_pos`` [B, S] (``ctx_ok`` [B, S] marks real rows), or with ``projected``
    the rows ``project_features`` made of them [B, S, d]; block_ids [B, A, K]: ``[anchor, noise, ...]``
    per block; anchor_pos [B, A]. Block ``j`` sits at positions ``anchor_pos[j] + 0..K-1`` and sees the
    context rows with ``anchor - W <= pos < anchor``.
    """
    model = nnx.merge(_graphdef(cfg), drafter)
    stages = list(model.mtp)
    b, a, k = block_ids_BAK.shape
    n, d = cfg.hc_mult, cfg.hidden_size
    x = take_rows(embed_Vd, block_ids_BAK.reshape(b, a * k))
    streams = jnp.broadcast_to(x[:, :, None, :], (b, a * k, n, d))
    pre = jnp.zeros((b, a * k, n), jnp.float32).at[..., 0].set(1.0)
    pos = (anchor_pos_BA[..., None] + jnp.arange(k)).reshape(b, a * k)
    anchor = jnp.repeat(anchor_pos_BA, k, axis=1)  # [B, N]
    cp = ctx_pos_BS[:, None, :]
    ctx_valid = ctx_ok_BS[:, None, :] & (cp < anchor[..., None]) & (cp >= anchor[..., None] - cfg.sliding_window)
    first = stages[0]
    ctx = ctx_BSF.astype(x.dtype) if projected else first.main_norm(first.main_proj(ctx_BSF.astype(x.dtype)))
    for stage in stages:
        angles = stage.attn.angles(pos)
        ctx_angles = stage.attn.angles(ctx_pos_BS)
        streams, pre = stage(streams, pre, ctx, ctx_angles, ctx_valid, angles, k)
    last = stages[-1]
    return last.norm(mhc.collapse(streams, pre)).reshape(b, a, k, d)


def markov_bias(drafter: nnx.State, cfg, prev_ids: jax.Array, head_rows: jax.Array | None = None):
    """(transition logits [..., V] fp32, Markov embedding [..., r]) of the previous tokens ``prev_ids``.

    ``head_rows`` restricts the transition logits to those vocabulary rows (training on a sub-vocabulary).
    """
    mk = nnx.merge(_graphdef(cfg), drafter).mtp[cfg.num_nextn_predict_layers - 1].markov_head
    emb = jnp.take(mk.embed.weight[...], prev_ids, axis=0)
    w = mk.head.weight[...] if head_rows is None else jnp.take(mk.head.weight[...], head_rows, axis=0)
    return matmul_t(emb.astype(jnp.float32), w.astype(jnp.float32)), emb


def confidence_logit(drafter: nnx.State, cfg, hn: jax.Array, markov_emb: jax.Array) -> jax.Array:
    """``confidence_head.proj([hn ; markov_emb])`` in fp32: [...] (one logit per draft position)."""
    w = nnx.merge(_graphdef(cfg), drafter).mtp[cfg.num_nextn_predict_layers - 1].confidence_head.proj.weight[...]
    feats = jnp.concatenate([hn.astype(jnp.float32), markov_emb.astype(jnp.float32)], axis=-1)
    return matmul_t(feats, w.astype(jnp.float32))[..., 0]


def teacher_forced_heads(drafter, cfg, head_Vd, hn_BAKd, prev_ids_BAK):
    """(draft logits [B, A, K, V] fp32, confidence logits [B, A, K]) with the given previous tokens
    (training: the true tokens; NeMo's ``draft_logits`` / ``confidence_pred``)."""
    base = matmul_t(hn_BAKd.astype(jnp.float32), head_Vd.astype(jnp.float32))
    bias, emb = markov_bias(drafter, cfg, prev_ids_BAK)
    return base + bias, confidence_logit(drafter, cfg, hn_BAKd, emb)


class DraftOutput(NamedTuple):
    """One draft block per sequence: logits [B, K, V] fp32 (each conditioned through the Markov head on
    the greedy draft before it), draft_ids [B, K] (greedy), confidence [B, K] = sigmoid(confidence_logits)."""

    logits: jax.Array
    draft_ids: jax.Array
    confidence: jax.Array
    confidence_logits: jax.Array


def draft_block(drafter: nnx.State, target: nnx.State, cfg, ctx_BSF: jax.Array, ctx_pos_BS: jax.Array,
                ctx_ok_BS: jax.Array, anchor_ids_B: jax.Array, anchor_pos_B: jax.Array) -> DraftOutput:
    """Greedy draft of ``dspark_block_size`` tokens after each sequence's anchor (pure; jit with cfg static).

    target: the backbone state (its ``embed`` and ``head`` are shared); ctx [B, S, L*d]: captured target
    features at positions ``ctx_pos`` [B, S] (valid where ``ctx_ok``), normally the last W before the
    anchor; anchor_ids / anchor_pos [B]. The backbone runs in parallel over the block; the Markov head
    then chains position by position (``prev`` = anchor, then each greedy draft).
    """
    k = cfg.dspark_block_size
    b = anchor_ids_B.shape[0]
    block = jnp.concatenate([anchor_ids_B[:, None], jnp.full((b, k - 1), cfg.dspark_noise_token_id)], 1)
    hn = drafter_states(drafter, target["embed"]["weight"][...], cfg, ctx_BSF, ctx_pos_BS, ctx_ok_BS,
                        block[:, None].astype(jnp.int32), anchor_pos_B[:, None])[:, 0]  # [B, K, d]
    base = matmul_t(hn.astype(jnp.float32), target["head"]["weight"][...].astype(jnp.float32))  # [B, K, V]

    def one(prev, xs):
        base_BV, hn_Bd = xs
        bias, emb = markov_bias(drafter, cfg, prev)
        logits = base_BV + bias
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return tok, (logits, tok, confidence_logit(drafter, cfg, hn_Bd, emb))

    _, (logits, ids, conf) = jax.lax.scan(one, anchor_ids_B.astype(jnp.int32),
                                          (jnp.swapaxes(base, 0, 1), jnp.swapaxes(hn, 0, 1)))
    logits, ids, conf = (jnp.swapaxes(v, 0, 1) for v in (logits, ids, conf))
    return DraftOutput(logits, ids, jax.nn.sigmoid(conf), conf)


class DraftHeads(NamedTuple):
    """The output rows the engine's drafter scores: the target head's and the Markov head's rows of the
    draft vocabulary ``ids`` [Vd] (all tokens, or a frequency-ranked subset: FR-Spec style drafting)."""

    ids: jax.Array  # [Vd] i32
    head: jax.Array  # [Vd, d] rows of the target's head
    markov: jax.Array  # [Vd, r] rows of markov_head.head


def draft_heads(drafter: nnx.State, target: nnx.State, cfg, ids=None) -> DraftHeads:
    """``DraftHeads`` for the token ids ``ids`` (None = the whole vocabulary)."""
    ids = to_device(np.arange(cfg.vocab_size) if ids is None else ids, jnp.int32)
    mk = nnx.merge(_graphdef(cfg), drafter).mtp[cfg.num_nextn_predict_layers - 1].markov_head
    return DraftHeads(ids, *_head_rows(target["head"]["weight"][...], mk.head.weight[...], ids))


@jax.jit
def _head_rows(head, markov, ids):
    """One program for the gathers (decoding the rows of a quantized head) instead of a dozen eager ops."""
    return take_rows(head, ids).astype(jnp.float32), jnp.take(markov, ids, axis=0).astype(jnp.float32)


def draft_sampled(drafter: nnx.State, target: nnx.State, cfg, heads: DraftHeads, ctx_BSd: jax.Array,
                  ctx_pos_BS: jax.Array, ctx_ok_BS: jax.Array, anchor_ids_B: jax.Array, anchor_pos_B: jax.Array,
                  temperature_B: jax.Array, gumbel_BKV) -> DraftOutput:
    """The engine's draft: like ``draft_block`` from projected context rows (``project_features``), over
    the draft vocabulary ``heads`` (logits [B, K, Vd] of its columns; ``draft_ids`` are token ids). Each
    token is taken greedily where ``temperature`` [B] is 0 and sampled from ``softmax(logits / T)``
    otherwise (``gumbel_BKV()``: Gumbel noise [B, K, Vd], called only when some row samples). The Markov
    head conditions each position on the token actually drafted before it, so ``logits`` are the exact
    distributions the drafts were drawn from (what lossless verification needs)."""
    k = cfg.dspark_block_size
    b = anchor_ids_B.shape[0]
    block = jnp.concatenate([anchor_ids_B[:, None], jnp.full((b, k - 1), cfg.dspark_noise_token_id)], 1)
    hn = drafter_states(drafter, target["embed"]["weight"][...], cfg, ctx_BSd, ctx_pos_BS, ctx_ok_BS,
                        block[:, None].astype(jnp.int32), anchor_pos_B[:, None], projected=True)[:, 0]  # [B, K, d]
    base = matmul_t(hn.astype(jnp.float32), heads.head)  # [B, K, Vd]
    sampled = temperature_B > 0
    t = jnp.where(sampled, temperature_B, 1.0)[:, None]
    noise = jax.lax.cond(jnp.any(sampled), gumbel_BKV, lambda: jnp.zeros(base.shape, jnp.float32))
    mk = nnx.merge(_graphdef(cfg), drafter).mtp[cfg.num_nextn_predict_layers - 1].markov_head
    table = mk.embed.weight[...]

    def one(prev, xs):
        base_BV, hn_Bd, noise_BV = xs
        emb = jnp.take(table, prev, axis=0).astype(jnp.float32)
        logits = base_BV + matmul_t(emb, heads.markov)
        col = jnp.where(sampled, jnp.argmax(logits / t + noise_BV, axis=-1), jnp.argmax(logits, axis=-1))
        tok = heads.ids[col]
        return tok, (logits, tok, confidence_logit(drafter, cfg, hn_Bd, emb))

    xs = (jnp.swapaxes(base, 0, 1), jnp.swapaxes(hn, 0, 1), jnp.swapaxes(noise, 0, 1))
    _, (logits, ids, conf) = jax.lax.scan(one, anchor_ids_B.astype(jnp.int32), xs)
    logits, ids, conf = (jnp.swapaxes(v, 0, 1) for v in (logits, ids, conf))
    return DraftOutput(logits, ids, jax.nn.sigmoid(conf), conf)


def draft_after_prefix(target: nnx.State, drafter: nnx.State, cfg, token_ids_BT: jax.Array) -> DraftOutput:
    """Run the target over ``token_ids`` [B, T] capturing the DSpark features, then draft the block after
    it (``draft_from_features``)."""
    from deepinfer_jax.model.deepseek_v41 import forward_full

    _, feats = forward_full(target, cfg, token_ids_BT, capture=cfg.dspark_target_layer_ids)
    return draft_from_features(target, drafter, cfg, feats, token_ids_BT)


def draft_from_features(target: nnx.State, drafter: nnx.State, cfg, feats_BTF: jax.Array,
                        token_ids_BT: jax.Array) -> DraftOutput:
    """The block after sequences ``token_ids`` [B, T] whose target features ``feats`` [B, T, L*d] are known
    (``forward_full(..., capture=cfg.dspark_target_layer_ids)``): the anchor is the last token (position
    T-1), the context the features at positions ``T-1-W .. T-2`` (those before 0 masked)."""
    b, t = token_ids_BT.shape
    w = cfg.sliding_window
    pos = jnp.broadcast_to(t - 1 - w + jnp.arange(w), (b, w))
    ctx = jnp.take(feats_BTF, jnp.maximum(pos[0], 0), axis=1)
    anchor_pos = jnp.full((b,), t - 1, jnp.int32)
    return draft_block(drafter, target, cfg, ctx, pos, pos >= 0, jnp.asarray(token_ids_BT)[:, -1], anchor_pos)


