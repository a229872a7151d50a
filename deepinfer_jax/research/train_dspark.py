"""Distil the DSpark drafter (``mtp.*``) from a frozen trained target, evaluate it, ship it next to the target.

    python -m deepinfer_jax.research.train_dspark [--target checkpoints/small-trained] [--steps N]

Data: the target's own corpus (:mod:`deepinfer_jax.research.corpus`: the Python standard library, the
same file split), windows ``[BOS] + 128 tokens`` drawn with ``batch_for_step`` from a seed of our own.

One step (jitted, the target frozen):

* the target runs once over the windows with the engine's numerics (``fake_quant`` as shipped), giving
  the DSpark features (``forward_full(..., capture=dspark_target_layer_ids)``) and its next-token logits;
* ``anchors`` positions per window are drawn (host, seeded by the step); each anchor ``a`` gets the block
  ``[x_a, noise x (K-1)]`` at positions ``a .. a+K-1``, context = features at ``a-W .. a-1`` (model.md
  §4.9, NeMo semantics), and the Markov head reads the true previous tokens (teacher forcing);
* loss = mean over draft positions of ``KL(p_t || p_d)``, ``p_t`` the target's distribution at position
  ``a+k`` (for token ``a+k+1``), plus ``conf_weight`` x BCE(confidence logit, alpha) with
  ``alpha = 1 - 0.5 ||p_t - p_d||_1`` detached; with ``conf_stop_gradient`` (the shipped recipe, NeMo's
  ``confidence_head_stop_gradient``) the head reads detached inputs, so the BCE never pulls on the
  drafter; ``--conf-stop-gradient false`` is NeMo's default (the BCE also shapes the states).

Exact vocabulary compression: the shipped target's head has 22,968 distinct rows (the tokens that never
occur in its training split share one tied row). Tokens with identical head rows get identical target
*and* draft probabilities once the drafter's Markov rows are tied the same way, so every softmax, KL and
L1 distance is computed over one column per distinct row plus ``log(multiplicity)``: exact, ~5.6x
cheaper. The Markov tables are trained per column and written out per token on export.

Weights are trained quantization-aware in their shipped formats (:mod:`deepinfer_jax.research.qat`) and
the drafter forward runs without the activation fake-quant (its rounding has no gradient), as for the
target; the reported metrics use the exported drafter with the shipped config (``fake_quant=True``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from deepinfer_jax.checkpoint import names as N
from deepinfer_jax.model import dspark
from deepinfer_jax.model.deepseek_v41 import abstract_params, forward_full
from deepinfer_jax.model.layers import matmul_t
from deepinfer_jax.research.corpus import batch_for_step, eval_windows
from deepinfer_jax.research.qat import _KIND, fake_quant_tree

__all__ = ["DraftTrainConfig", "VocabColumns", "evaluate_drafter", "export_drafter", "main", "train_drafter"]

DEFAULT_TARGET = Path(__file__).resolve().parents[2] / "checkpoints" / "small-trained"


@dataclass(frozen=True)
class DraftTrainConfig:
    """Everything that determines a drafter run."""

    seed: int = 0
    steps: int = 360
    batch_size: int = 8
    seq_len: int = 128
    anchors: int = 16
    lr: float = 4e-3
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    b2: float = 0.95
    grad_clip: float = 1.0
    conf_weight: float = 1.0
    conf_stop_gradient: bool = True  # the BCE trains confidence_head.proj only (NeMo's option; False: NeMo's default)
    qat: bool = True
    heldout_every: int = 20  # the target's corpus split

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "anchors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0 or self.conf_weight < 0:
            raise ValueError("lr must be > 0, min_lr_ratio in [0, 1], warmup_steps >= 0 and conf_weight >= 0")


class VocabColumns(NamedTuple):
    """Tokens grouped by identical target head rows: ``column[v]`` of every token, the representative
    token of each column (``rep_ids``) and ``log_count`` [C] (log of each column's multiplicity)."""

    column: np.ndarray
    rep_ids: np.ndarray
    log_count: np.ndarray

    @classmethod
    def from_head(cls, head_Vd: np.ndarray) -> VocabColumns:
        _, first, inverse, counts = np.unique(np.asarray(head_Vd), axis=0, return_index=True, return_inverse=True,
                                              return_counts=True)
        return cls(inverse.reshape(-1).astype(np.int32), first.astype(np.int32), np.log(counts).astype(np.float32))


# ---- the pure functions ---------------------------------------------------------------------------


def _drafter_formats(cfg) -> dict[tuple, str]:
    out = {}
    for name, (_, kind) in N.expected_drafter_tensors(cfg).items():
        path, _ = N.native_to_path(name)
        out[path] = _KIND[kind]
    return out


def _drafter_state(cfg, tree: dict) -> nnx.State:
    state = dspark.abstract_drafter_params(cfg)
    nnx.replace_by_pure_dict(state, tree)
    return state


def sample_anchors(seed: int, step: int, batch: int, n: int, length: int, block: int) -> np.ndarray:
    """[batch, n] distinct sorted anchors in ``[0, length - 1 - block]`` (every block target exists)."""
    rng = np.random.default_rng([seed, step, 7])
    hi = length - block
    return np.sort(np.stack([rng.choice(hi, size=min(n, hi), replace=False) for _ in range(batch)]), axis=1)


def target_pass(target: dict, cfg, cols: dict, windows_BL: jax.Array):
    """(features [B, L, F], column log-probabilities [B, L, C]) of the frozen target (a pure parameter
    tree) on ``windows``; its head holds one row per column."""
    state = abstract_params(cfg)
    nnx.replace_by_pure_dict(state, {**target, "head": {"weight": jnp.take(target["head"]["weight"],
                                                                            cols["rep_ids"], axis=0)}})
    logits, feats = forward_full(state, cfg, windows_BL, capture=cfg.dspark_target_layer_ids)
    logits = logits + cols["log_count"]
    return jax.lax.stop_gradient(feats), jax.lax.stop_gradient(jax.nn.log_softmax(logits, axis=-1))


def draft_pass(params: dict, cfg, cols: dict, embed_Vd, head_Cd, feats_BLF, windows_BL, anchors_BA,
               formats=None, detach_conf: bool = True):
    """(draft column log-probs [B, A, K, C], confidence logits [B, A, K]) teacher-forced at ``anchors``."""
    k = cfg.dspark_block_size
    b, length = windows_BL.shape
    tree = params["drafter"]
    if formats is not None:
        tree = fake_quant_tree(tree, formats)
    state = _drafter_state(cfg, tree)
    offs = anchors_BA[..., None] + jnp.arange(k)  # [B, A, K] positions of the block
    toks = jnp.take_along_axis(windows_BL[:, None, :], offs.reshape(b, 1, -1), axis=2).reshape(offs.shape)
    block = jnp.where(jnp.arange(k) == 0, toks, cfg.dspark_noise_token_id)
    pos = jnp.broadcast_to(jnp.arange(length), (b, length))
    hn = dspark.drafter_states(state, embed_Vd, cfg, feats_BLF, pos, jnp.ones((b, length), bool), block, anchors_BA)
    prev_col = jnp.asarray(cols["column"])[toks]  # prev of draft k = token at a+k (the anchor, then true tokens)
    bias, emb = dspark.markov_bias(state, cfg, prev_col)  # Markov tables are per column in training
    logits = matmul_t(hn.astype(jnp.float32), head_Cd.astype(jnp.float32)) + bias + cols["log_count"]
    if detach_conf:
        hn, emb = jax.lax.stop_gradient(hn), jax.lax.stop_gradient(emb)
    conf = dspark.confidence_logit(state, cfg, hn, emb)
    return jax.nn.log_softmax(logits, axis=-1), conf


def block_targets(logp_t_BLC, anchors_BA, k: int):
    """The target's log-probs at positions ``a .. a+K-1`` (for tokens ``a+1 .. a+K``): [B, A, K, C]."""
    offs = anchors_BA[..., None] + jnp.arange(k)
    return jax.vmap(lambda lp, o: lp[o])(logp_t_BLC, offs)


def distill_terms(logp_t, logp_d, conf_logit):
    """Per position: KL(p_t || p_d), alpha = 1 - 0.5 ||p_t - p_d||_1 (detached), BCE(conf, alpha)."""
    p_t, p_d = jnp.exp(logp_t), jnp.exp(logp_d)
    kl = jnp.sum(p_t * (logp_t - logp_d), axis=-1)
    alpha = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * jnp.sum(jnp.abs(p_t - p_d), axis=-1), 0.0, 1.0))
    bce = optax.sigmoid_binary_cross_entropy(conf_logit, alpha)
    return kl, alpha, bce


def make_optimizer(tc: DraftTrainConfig):
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps, max(tc.steps, tc.warmup_steps + 1),
                                                  tc.lr * tc.min_lr_ratio)
    opt = optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                      optax.adamw(schedule, b1=0.9, b2=tc.b2, weight_decay=tc.weight_decay,
                                  mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
    return opt, schedule


@functools.lru_cache(maxsize=4)
def make_train_step(cfg, tc: DraftTrainConfig):
    """``step(params, opt_state, target, cols, windows, anchors) -> (params, opt_state, metrics)``, jitted."""
    draft_cfg = dataclasses.replace(cfg, fake_quant=False)
    formats = _drafter_formats(cfg) if tc.qat else None
    opt, _ = make_optimizer(tc)
    k = cfg.dspark_block_size

    def loss_fn(params, target, cols, feats, logp_t_all, windows, anchors):
        head = jnp.take(target["head"]["weight"], cols["rep_ids"], axis=0)
        logp_d, conf = draft_pass(params, draft_cfg, cols, target["embed"]["weight"], head, feats, windows, anchors,
                                  formats, detach_conf=tc.conf_stop_gradient)
        kl, alpha, bce = distill_terms(block_targets(logp_t_all, anchors, k), logp_d, conf)
        loss = jnp.mean(kl) + tc.conf_weight * jnp.mean(bce)
        return loss, {"kl": jnp.mean(kl), "bce": jnp.mean(bce), "alpha": jnp.mean(alpha, axis=(0, 1))}

    def step(params, opt_state, target, cols, windows, anchors):
        feats, logp_t = target_pass(target, cfg, cols, windows)
        (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, target, cols, feats, logp_t, windows,
                                                                     anchors)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {**m, "loss": loss}

    return jax.jit(step, donate_argnums=(0, 1))


def init_params(cfg, n_columns: int, seed: int) -> dict:
    """The drafter tree with its Markov tables at column granularity ([C, r])."""
    tree = nnx.to_pure_dict(dspark.init_drafter_params(cfg, seed))
    tree = jax.tree.map(jnp.asarray, tree)
    last = tree["mtp"][cfg.num_nextn_predict_layers - 1]
    key = jax.random.key(seed + 1)
    r, std = cfg.dspark_markov_rank, cfg.initializer_range
    last["markov_head"] = {"embed": {"weight": jax.random.normal(key, (n_columns, r)) * std},
                           "head": {"weight": jnp.zeros((n_columns, r), jnp.float32)}}
    return {"drafter": tree}


def export_tree(params: dict, cfg, cols: VocabColumns) -> dict:
    """The drafter tree (numpy fp32) with per-token Markov rows (each token gets its column's row)."""
    tree = jax.tree.map(lambda x: np.asarray(x, np.float32), params["drafter"])
    last = tree["mtp"][cfg.num_nextn_predict_layers - 1]["markov_head"]
    for part in ("embed", "head"):
        last[part]["weight"] = last[part]["weight"][cols.column]
    return tree


def export_drafter(path: str | Path, params: dict, cfg, cols: VocabColumns) -> Path:
    """Write ``drafter.safetensors``: the ``mtp.*`` tensors in the released storage formats."""
    from deepinfer_jax.checkpoint.hf_export import tree_to_hf_tensors
    from deepinfer_jax.checkpoint.safetensors_io import save_file

    tensors = tree_to_hf_tensors(cfg, export_tree(params, cfg, cols), quantize=True, drafter=True)
    path = Path(path)
    save_file(path, tensors, metadata={"format": "pt", "content": "DSpark drafter (mtp.*)"})
    return path


# ---- evaluation ---------------------------------------------------------------------------------------


def _ece(pred: np.ndarray, target: np.ndarray, bins: int = 10) -> float:
    edges = np.linspace(0, 1, bins + 1)
    idx = np.clip(np.digitize(pred, edges[1:-1]), 0, bins - 1)
    total = 0.0
    for i in range(bins):
        sel = idx == i
        if sel.any():
            total += sel.mean() * abs(pred[sel].mean() - target[sel].mean())
    return float(total)


def _auroc(score: np.ndarray, label: np.ndarray) -> float:
    """Mann-Whitney AUROC (ties count one half)."""
    label = label.astype(bool)
    pos, neg = score[label], score[~label]
    if not pos.size or not neg.size:
        return float("nan")
    order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
    ranks = np.empty(order.size)
    ranks[order] = np.arange(1, order.size + 1)
    allv = np.concatenate([pos, neg])
    for v in np.unique(allv):  # average ranks of ties
        m = allv == v
        if m.sum() > 1:
            ranks[m] = ranks[m].mean()
    return float((ranks[: pos.size].sum() - pos.size * (pos.size + 1) / 2) / (pos.size * neg.size))


def evaluate_drafter(target, drafter, cfg, heldout: np.ndarray, *, windows: int = 64, seq_len: int = 128,
                     anchors_per_window: int = 24, rollout_prompts: int = 96, bos_id: int = 0, seed: int = 1,
                     log=print) -> dict:
    """Held-out metrics of a drafter (full-vocabulary numerics of the served model).

    ``teacher_forced``: on held-out windows, every position k = 1..K of blocks at seeded anchors:
    alpha_k = 1 - 0.5 ||p_t - p_d||_1 (p_t given the true prefix through a+k-1, p_d with the true previous
    tokens in the Markov head), the greedy match rate (argmax p_d = argmax p_t) and the confidence.
    Calibration: ECE of sigmoid(confidence) against alpha and against the greedy match, AUROC against the
    greedy match. ``greedy_rollout``: at held-out prompts the target's greedy continuation of K tokens
    vs the drafter's greedy block (``draft_block``, Markov head chained on its own drafts): conditional
    and cumulative acceptance per position and the mean accepted length (greedy verification).
    """
    k = cfg.dspark_block_size
    t0 = time.perf_counter()
    wins = eval_windows(heldout, seq_len, bos_id, windows)
    rng = np.random.default_rng(seed)

    @jax.jit
    def tf(target, drafter, ws, anchors):
        logits, feats = forward_full(target, cfg, ws, capture=cfg.dspark_target_layer_ids)
        b, length = ws.shape
        offs = anchors[..., None] + jnp.arange(k)
        toks = jnp.take_along_axis(ws[:, None, :], offs.reshape(b, 1, -1), axis=2).reshape(offs.shape)
        block = jnp.where(jnp.arange(k) == 0, toks, cfg.dspark_noise_token_id)
        pos = jnp.broadcast_to(jnp.arange(length), (b, length))
        hn = dspark.drafter_states(drafter, target["embed"]["weight"][...], cfg, feats, pos,
                                   jnp.ones((b, length), bool), block, anchors)
        logit_d, conf = dspark.teacher_forced_heads(drafter, cfg, target["head"]["weight"][...], hn, toks)
        logp_t = jax.nn.log_softmax(jax.vmap(lambda lg, o: lg[o])(logits, offs), -1)
        logp_d = jax.nn.log_softmax(logit_d, -1)
        alpha = 1.0 - 0.5 * jnp.sum(jnp.abs(jnp.exp(logp_t) - jnp.exp(logp_d)), -1)
        match = jnp.argmax(logp_t, -1) == jnp.argmax(logp_d, -1)
        return alpha, match, jax.nn.sigmoid(conf)

    alphas, matches, confs = [], [], []
    for i in range(0, len(wins), 8):
        ws = wins[i:i + 8]
        anchors = np.sort(np.stack([rng.choice(ws.shape[1] - k, anchors_per_window, replace=False)
                                    for _ in range(len(ws))]), 1)
        a, m, c = (np.asarray(v) for v in tf(target, drafter, jnp.asarray(ws), jnp.asarray(anchors)))
        alphas.append(a.reshape(-1, k))
        matches.append(m.reshape(-1, k))
        confs.append(c.reshape(-1, k))
    alpha, match, conf = (np.concatenate(v) for v in (alphas, matches, confs))
    tf_metrics = {
        "blocks": int(alpha.shape[0]),
        "alpha_per_position": [round(float(v), 4) for v in alpha.mean(0)],
        "greedy_match_per_position": [round(float(v), 4) for v in match.mean(0)],
        "confidence_mean_per_position": [round(float(v), 4) for v in conf.mean(0)],
        "ece_vs_alpha": round(_ece(conf.ravel(), alpha.ravel()), 4),
        "ece_vs_greedy_match": round(_ece(conf.ravel(), match.ravel().astype(float)), 4),
        "auroc_vs_greedy_match": round(_auroc(conf.ravel(), match.ravel()), 4),
        "auroc_vs_greedy_match_per_position": [round(_auroc(conf[:, j], match[:, j]), 4) for j in range(k)],
    }
    log(f"teacher-forced eval: {tf_metrics}")
    roll = greedy_rollout(target, drafter, cfg, heldout, rollout_prompts, seq_len, bos_id, seed)
    log(f"greedy rollout: {roll}")
    return {"teacher_forced": tf_metrics, "greedy_rollout": roll, "eval_wall_s": round(time.perf_counter() - t0, 1)}


def greedy_rollout(target, drafter, cfg, heldout: np.ndarray, prompts: int, seq_len: int, bos_id: int, seed: int,
                   batch: int = 16) -> dict:
    """Greedy acceptance at ``prompts`` held-out prefixes of ``seq_len`` tokens (see ``evaluate_drafter``)."""
    k = cfg.dspark_block_size
    rng = np.random.default_rng([seed, 11])
    starts = rng.integers(0, heldout.size - seq_len, prompts)
    ids = np.stack([np.concatenate([[bos_id], heldout[s:s + seq_len - 1]]) for s in starts]).astype(np.int32)

    @jax.jit
    def step(target, drafter, ids_BT):
        b, t = ids_BT.shape
        seq = jnp.concatenate([ids_BT, jnp.zeros((b, k), jnp.int32)], 1)
        for j in range(k):  # causal: the zero tail never reaches earlier positions
            nxt = jnp.argmax(forward_full(target, cfg, seq)[:, t - 1 + j], -1).astype(jnp.int32)
            seq = seq.at[:, t + j].set(nxt)
        out = dspark.draft_after_prefix(target, drafter, cfg, ids_BT)
        return seq[:, t:], out.draft_ids, out.confidence

    want, got, conf = [], [], []
    for i in range(0, prompts, batch):
        w, g, c = (np.asarray(v) for v in step(target, drafter, jnp.asarray(ids[i:i + batch])))
        want.append(w)
        got.append(g)
        conf.append(c)
    want, got, conf = (np.concatenate(v) for v in (want, got, conf))
    match = want == got
    prefix = np.cumprod(match, axis=1).astype(bool)
    cond = [float(match[:, j][prefix[:, j - 1]].mean()) if j and prefix[:, j - 1].any() else float(match[:, 0].mean())
            for j in range(k)]
    reached = np.concatenate([np.ones((len(match), 1), bool), prefix[:, :-1]], 1)
    return {
        "prompts": int(prompts),
        "accept_conditional_per_position": [round(v, 4) for v in cond],
        "accept_cumulative_per_position": [round(float(v), 4) for v in prefix.mean(0)],
        "mean_accepted_length": round(float(prefix.sum(1).mean()), 4),
        "auroc_conditional": round(_auroc(conf[reached], match[reached]), 4),
    }


# ---- the loop -----------------------------------------------------------------------------------------


def train_drafter(tc: DraftTrainConfig, target, cfg, train_stream: np.ndarray, cols: VocabColumns, *,
                  bos_id: int = 0, log=print, progress: bool = True) -> tuple[dict, list[dict]]:
    """Train from scratch for ``tc.steps``; returns (params, metrics rows)."""
    from tqdm.auto import tqdm

    params = init_params(cfg, len(cols.rep_ids), tc.seed)
    opt, schedule = make_optimizer(tc)
    opt_state = opt.init(params)
    step_fn = make_train_step(cfg, tc)
    consts = {"rep_ids": jnp.asarray(cols.rep_ids), "log_count": jnp.asarray(cols.log_count),
              "column": jnp.asarray(cols.column)}
    rows, t0 = [], time.perf_counter()
    for s in tqdm(range(tc.steps), desc="drafter", disable=not progress, dynamic_ncols=True):
        windows = batch_for_step(train_stream, tc.seed + 1000, s, tc.batch_size, tc.seq_len, bos_id)
        anchors = sample_anchors(tc.seed, s, tc.batch_size, tc.anchors, windows.shape[1], cfg.dspark_block_size)
        params, opt_state, m = step_fn(params, opt_state, target, consts, jnp.asarray(windows), jnp.asarray(anchors))
        if s % 10 == 0 or s + 1 == tc.steps:
            row = {"step": s + 1, "loss": float(m["loss"]), "kl": float(m["kl"]), "bce": float(m["bce"]),
                   "alpha": [round(float(v), 4) for v in m["alpha"]], "lr": float(schedule(s)),
                   "elapsed_s": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            log(json.dumps(row))
    return params, rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Distil the DSpark drafter from the shipped small target.")
    p.add_argument("--target", default=str(DEFAULT_TARGET), help="the frozen target checkpoint directory")
    p.add_argument("--out", default=None, help="drafter file (default: <target>/drafter.safetensors)")
    p.add_argument("--metrics", default=None, help="metrics JSON (default: <target>/drafter_metrics.json)")
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--rollout-prompts", type=int, default=96)
    for f in dataclasses.fields(DraftTrainConfig):
        if str(f.type) == "bool":
            p.add_argument(f"--{f.name.replace('_', '-')}", type=lambda v: v.lower() in ("1", "true", "yes"),
                           default=f.default)
        else:
            p.add_argument(f"--{f.name.replace('_', '-')}", type={"int": int, "float": float}[str(f.type)],
                           default=f.default)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    tc = DraftTrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(DraftTrainConfig)})
    from deepinfer_jax.checkpoint import load_hf_checkpoint, load_hf_drafter
    from deepinfer_jax.checkpoint.loader import load_hf_checkpoint_tree
    from deepinfer_jax.research.corpus import load_stdlib_corpus
    from deepinfer_jax.tokenizer import load_tokenizer

    t_start = time.perf_counter()
    target_dir = Path(args.target)
    out = Path(args.out) if args.out else target_dir / "drafter.safetensors"
    metrics_path = Path(args.metrics) if args.metrics else target_dir / "drafter_metrics.json"
    cfg, target = load_hf_checkpoint(target_dir, progress=False)
    dspark.check_drafter_config(cfg)
    _, tree = load_hf_checkpoint_tree(target_dir, progress=False)
    cols = VocabColumns.from_head(tree["head"]["weight"])
    del tree
    corpus = load_stdlib_corpus(load_tokenizer(), tc.heldout_every, eos_id=cfg.eos_token_id)
    print(f"corpus: {corpus.summary()}; {len(cols.rep_ids)} distinct head rows of {cfg.vocab_size}")
    target_tree = nnx.to_pure_dict(target)
    params, rows = train_drafter(tc, target_tree, cfg, corpus.train, cols, bos_id=cfg.bos_token_id)
    train_s = time.perf_counter() - t_start
    export_drafter(out, params, cfg, cols)
    print(f"wrote {out} ({out.stat().st_size / 2**20:.2f} MiB) after {train_s / 60:.1f} min")
    drafter = load_hf_drafter(target_dir, cfg) if out.parent == target_dir and out.name == "drafter.safetensors" \
        else _load_file(out, cfg)
    metrics = evaluate_drafter(target, drafter, cfg, corpus.heldout, windows=args.eval_windows,
                               rollout_prompts=args.rollout_prompts, bos_id=cfg.bos_token_id)
    n_params = int(sum(np.asarray(v).size for v in jax.tree.leaves(nnx.to_pure_dict(drafter))))
    record = {
        "drafter": {"file": out.name, "bytes": out.stat().st_size, "parameters": n_params,
                    "stages": cfg.num_nextn_predict_layers, "block_size": cfg.dspark_block_size,
                    "experts": [cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok],
                    "markov_rank": cfg.dspark_markov_rank, "target_layers": list(cfg.dspark_target_layer_ids),
                    "noise_token_id": cfg.dspark_noise_token_id},
        "training": {**dataclasses.asdict(tc), "wall_s": round(train_s, 1), "tokens_seen":
                     tc.steps * tc.batch_size * (tc.seq_len + 1), "draft_positions_seen":
                     tc.steps * tc.batch_size * tc.anchors * cfg.dspark_block_size,
                     "distinct_head_rows": len(cols.rep_ids), "final": rows[-1] if rows else None,
                     "machine": "x86_64, 2 shared CPU cores, nice -n 19, jax " + jax.__version__},
        "heldout": {"files": len(corpus.heldout_files), "tokens": int(corpus.heldout.size), **metrics},
        "curve": rows,
    }
    metrics_path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {metrics_path}")
    return 0


def _load_file(path: Path, cfg):
    from deepinfer_jax.checkpoint import drafter_params_from_state_dict
    from deepinfer_jax.checkpoint.safetensors_io import open_checkpoint

    with open_checkpoint(path) as reader:
        return drafter_params_from_state_dict(cfg, reader)


if __name__ == "__main__":
    sys.exit(main())
