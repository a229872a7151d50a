"""Train a V4.1-architecture model from scratch with optax: one jitted pure step, resumable with orbax.

    python -m deepinfer_jax.research.train [--work-dir DIR] [--out checkpoints/small-trained] [--steps N]

The ``small`` preset (the real DeepSeek-V4 tokenizer and vocabulary, every layer role, Engram with the
tokenizer-derived map) learns next-token prediction on the Python standard library's sources
(:mod:`deepinfer_jax.research.corpus`). Choices, all for a 2-core CPU budget:

* **Numerics.** The forward runs without the activation fake-quant boundaries (``fake_quant=False``):
  the FP4 rounding of the compressed KV has zero gradient, which would leave the compressor untrained.
  The *weights* are trained quantization-aware (:mod:`deepinfer_jax.research.qat`): the forward sees
  each weight in its shipped format (FP8 / FP4 / BF16) with straight-through gradients, so the exported
  checkpoint computes what training optimised. The shipped config keeps the engine's default
  ``fake_quant=True``; the model card reports held-out loss both ways.
* **Vocabulary.** Only ~23K of the 129,280 tokens occur in the training split. The head rows of the
  tokens that never occur are tied to one trained vector ``tail`` (the data cannot tell them apart), so
  the full-vocabulary softmax is exact with one extra logit ``h . tail + log(n_unseen)``: the step scores
  ``len(seen) + 1`` columns instead of 129,280 (the head's matmul and softmax dominate a step otherwise).
  The export writes ``tail`` into every unseen row, and every reported metric is the real full-vocabulary
  forward of the exported checkpoint.
* **Not trained by the language-model loss:** the indexer (its top-k selection is discrete) and the
  router's selection bias (aux-loss-free balancing is not implemented); both keep their initial values.

Determinism: parameters come from ``init_params(cfg, seed)``, the batch of step ``s`` from
``(seed, s)``; the training state (parameters, optimizer state, step) is saved with orbax every
``ckpt_every`` steps, and a run restarted in the same work directory continues bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
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

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.model.deepseek_v41 import abstract_params, forward_full
from deepinfer_jax.research.corpus import batch_for_step, eval_windows
from deepinfer_jax.research.qat import fake_quant_tree, leaf_formats

__all__ = ["TrainConfig", "TrainData", "TrainState", "VocabTie", "export_checkpoint", "init_state", "main",
           "make_eval_fn", "make_train_step", "restore_checkpoint", "save_checkpoint", "train"]

STATE_DIR, META_FILE, CKPT_DIR, METRICS_FILE, CONFIG_FILE = "state", "meta.json", "ckpt", "metrics.jsonl", \
    "train_config.json"


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a run (saved as ``train_config.json``; a resume must match it)."""

    preset: str = "small"
    seed: int = 0
    steps: int = 1200
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 8e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    b2: float = 0.95
    grad_clip: float = 1.0
    qat: bool = True
    heldout_every: int = 20
    eval_every: int = 100
    eval_windows: int = 16
    ckpt_every: int = 200
    keep_checkpoints: int = 2

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "eval_every", "ckpt_every", "keep_checkpoints", "heldout_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_windows < 0:
            raise ValueError(f"eval_windows must be >= 0 (0: no held-out loss while training), got {self.eval_windows}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise ValueError("lr must be > 0, min_lr_ratio in [0, 1] and warmup_steps >= 0")

    @classmethod
    def from_json(cls, data: dict) -> TrainConfig:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})


@dataclass(frozen=True)
class TrainData:
    """Token streams (int32) to train and validate on, and the special ids windows use."""

    train: np.ndarray
    heldout: np.ndarray
    bos_id: int = 0
    eos_id: int = 1


class VocabTie(NamedTuple):
    """The tokens seen in training (``seen_ids`` ascending) and, for every id, its column in the
    scored logits (``target_index``: unseen ids map to the tail column ``len(seen_ids)``)."""

    seen_ids: np.ndarray
    target_index: np.ndarray
    n_unseen: int

    @classmethod
    def from_stream(cls, stream: np.ndarray, vocab_size: int, always: tuple[int, ...] = ()) -> VocabTie:
        seen = np.zeros(vocab_size, bool)
        seen[np.asarray(stream, np.int64)] = True
        seen[list(always)] = True
        seen_ids = np.flatnonzero(seen).astype(np.int32)
        index = np.full(vocab_size, seen_ids.size, np.int32)
        index[seen_ids] = np.arange(seen_ids.size, dtype=np.int32)
        return cls(seen_ids, index, int(vocab_size - seen_ids.size))

    def consts(self) -> dict:
        mask = np.zeros(self.target_index.size, bool)
        mask[self.seen_ids] = True
        return {"seen_ids": jnp.asarray(self.seen_ids), "seen_mask": jnp.asarray(mask),
                "target_index": jnp.asarray(self.target_index)}


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: dict  # {"model": parameter tree (checkpoint layout), "tail": [d] tied head row of unseen tokens}
    opt_state: optax.OptState


# ---- the pure functions ---------------------------------------------------------------------------


def _as_state(cfg, tree: dict, token_map) -> nnx.State:
    state = abstract_params(cfg)
    full = dict(tree)
    if token_map is not None:
        full["engram_token_map"] = token_map
    nnx.replace_by_pure_dict(state, full)
    return state


def scored_logits(params: dict, consts: dict, cfg, tie_unseen: int, formats, token_ids: jax.Array) -> jax.Array:
    """Logits [B, T, len(seen) + (1 if tie_unseen)] of the tokens seen in training and the tail.

    ``forward_full``'s head is ``x @ W.T`` over the rows the state holds, so the state carries the seen
    rows (plus ``tail``) in place of the whole head. The tail column adds ``log(tie_unseen)``: it stands
    for every unseen token at once.
    """
    tree = params["model"]
    if tie_unseen:
        head = jnp.where(consts["seen_mask"][:, None], tree["head"]["weight"], params["tail"][None, :])
        tree = {**tree, "head": {"weight": head}}
    if formats is not None:
        tree = fake_quant_tree(tree, formats)
    head = jnp.take(tree["head"]["weight"], consts["seen_ids"], axis=0)
    if tie_unseen:
        head = jnp.concatenate([head, params["tail"][None, :].astype(head.dtype)], axis=0)
    state = _as_state(cfg, {**tree, "head": {"weight": head}}, consts.get("token_map"))
    logits = forward_full(state, cfg, token_ids)
    if tie_unseen:
        logits = logits.at[..., -1].add(math.log(tie_unseen))
    return logits


def token_nll(params, consts, cfg, tie_unseen: int, formats, windows: jax.Array) -> jax.Array:
    """Per-token negative log-likelihood [B, T] (nats) of ``windows[:, 1:]`` given ``windows[:, :-1]``."""
    logits = scored_logits(params, consts, cfg, tie_unseen, formats, windows[:, :-1])
    cols = consts["target_index"][windows[:, 1:]]
    picked = jnp.take_along_axis(logits, cols[..., None], axis=-1)[..., 0]
    nll = jax.nn.logsumexp(logits, axis=-1) - picked
    if tie_unseen:  # one unseen token's own probability is the tail's share
        nll = nll + jnp.where(cols == logits.shape[-1] - 1, math.log(tie_unseen), 0.0)
    return nll


def _norm(tree) -> jax.Array:
    """The global L2 norm of a pytree (``optax.tree.norm``; ``optax.global_norm`` before optax 0.2.5)."""
    tree_utils = getattr(optax, "tree", None)
    return tree_utils.norm(tree) if hasattr(tree_utils, "norm") else optax.global_norm(tree)


def make_optimizer(tc: TrainConfig):
    """(AdamW with global-norm clipping and warmup + cosine decay, the learning-rate schedule)."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps, max(tc.steps, tc.warmup_steps + 1),
                                                  tc.lr * tc.min_lr_ratio)

    def decay_mask(params):  # weight decay on matrices only
        return jax.tree.map(lambda x: x.ndim >= 2, params)

    opt = optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                      optax.adamw(schedule, b1=0.9, b2=tc.b2, weight_decay=tc.weight_decay, mask=decay_mask))
    return opt, schedule


def train_forward_config(cfg):
    """The forward's config during training: the engine's config with the activation fake-quant off."""
    return dataclasses.replace(cfg, fake_quant=False)


@functools.lru_cache(maxsize=8)
def make_train_step(cfg, tc: TrainConfig, tie_unseen: int):
    """``step(state, consts, windows [B, T+1]) -> (state, {"loss", "grad_norm"})``, jitted, state donated.

    Cached per ``(cfg, tc, tie_unseen)``, so runs in one process share one compilation.
    """
    fwd_cfg = train_forward_config(cfg)
    formats = leaf_formats(cfg) if tc.qat else None
    opt, _ = make_optimizer(tc)

    def loss_fn(params, consts, windows):
        return jnp.mean(token_nll(params, consts, fwd_cfg, tie_unseen, formats, windows))

    def step(state: TrainState, consts: dict, windows: jax.Array):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, consts, windows)
        updates, opt_state = opt.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(state.step + 1, params, opt_state), {"loss": loss, "grad_norm": _norm(grads)}

    return jax.jit(step, donate_argnums=0)


@functools.lru_cache(maxsize=8)
def make_eval_fn(cfg, tc: TrainConfig, tie_unseen: int):
    """``nll(params, consts, windows) -> [B, T]`` with the training numerics, jitted."""
    fwd_cfg = train_forward_config(cfg)
    formats = leaf_formats(cfg) if tc.qat else None
    return jax.jit(lambda params, consts, windows: token_nll(params, consts, fwd_cfg, tie_unseen, formats, windows))


def init_state(cfg, tc: TrainConfig) -> tuple[TrainState, np.ndarray | None]:
    """(the step-0 training state, the Engram token map) from ``init_params(cfg, tc.seed)``."""
    from deepinfer_jax.params import init_params

    tree = nnx.to_pure_dict(init_params(cfg, tc.seed))
    token_map = tree.pop("engram_token_map", None)
    params = {"model": jax.tree.map(jnp.asarray, tree), "tail": jnp.zeros((cfg.hidden_size,), jnp.float32)}
    opt, _ = make_optimizer(tc)
    return TrainState(jnp.zeros((), jnp.int32), params, opt.init(params)), token_map


# ---- checkpoints of the training state ------------------------------------------------------------


def save_checkpoint(ckpt_dir: str | Path, state: TrainState, meta: dict, keep: int = 2) -> Path:
    """Write ``ckpt_dir/step_NNNNNNN/{state/, meta.json}``; ``meta.json`` last (it marks completion)."""
    import orbax.checkpoint as ocp

    step = int(state.step)
    path = Path(ckpt_dir).absolute() / f"step_{step:07d}"
    leaves = jax.tree_util.tree_leaves(state)
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(path / STATE_DIR, {f"leaf_{i:05d}": np.asarray(x) for i, x in enumerate(leaves)}, force=True)
    (path / META_FILE).write_text(json.dumps({**meta, "step": step}, indent=1) + "\n")
    for old in _checkpoints(ckpt_dir)[:-keep]:
        _rmtree(old)
    return path


def _checkpoints(ckpt_dir: str | Path) -> list[Path]:
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / META_FILE).is_file())


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    found = _checkpoints(ckpt_dir)
    return found[-1] if found else None


def restore_checkpoint(path: str | Path, template: TrainState) -> tuple[TrainState, dict]:
    """The state saved at ``path``, laid out like ``template`` (same config); and its meta dict."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    t_leaves, treedef = jax.tree_util.tree_flatten(template)
    keys = [f"leaf_{i:05d}" for i in range(len(t_leaves))]
    with ocp.PyTreeCheckpointer() as ckptr:
        args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in keys}
        saved = ckptr.restore(path / STATE_DIR, args=ocp.args.PyTreeRestore(restore_args=args))
    if sorted(saved) != keys:
        raise ValueError(f"{path}: {len(saved)} saved arrays, the training state has {len(keys)}")
    bad = [f"{k}: {saved[k].shape}/{saved[k].dtype} != {tuple(t.shape)}/{t.dtype}"
           for k, t in zip(keys, t_leaves) if saved[k].shape != tuple(t.shape) or saved[k].dtype != t.dtype]
    if bad:
        raise ValueError(f"{path} does not match the training state: " + "; ".join(bad[:5]))
    state = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(saved[k]) for k in keys])
    return state, json.loads((path / META_FILE).read_text())


# ---- the loop ---------------------------------------------------------------------------------------


def _read_metrics(path: Path, upto_step: int) -> list[dict]:
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["step"] <= upto_step]


def train(tc: TrainConfig, work_dir: str | Path, data: TrainData, cfg: ModelConfig | None = None, *,
          progress: bool = True, stop_after: int | None = None, log=print) -> tuple[TrainState, dict]:
    """Train (or resume, when ``work_dir`` holds checkpoints of the same ``tc``) up to ``tc.steps``.

    ``stop_after``: stop once this many steps are done (a checkpoint is written there), as an interrupted
    run would. Returns ``(state, info)``; ``info`` has the vocabulary tie, the token map, elapsed seconds
    and the metrics rows.
    """
    from tqdm.auto import tqdm

    cfg = cfg or getattr(ModelConfig, tc.preset)()
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    cfg_file = work / CONFIG_FILE
    record = {"train": dataclasses.asdict(tc), "model": cfg.to_hf_config()}
    if cfg_file.is_file() and json.loads(cfg_file.read_text()) != json.loads(json.dumps(record)):
        raise ValueError(f"{work} holds a run with a different configuration ({cfg_file}); use another work dir")
    cfg_file.write_text(json.dumps(record, indent=1) + "\n")

    tie = VocabTie.from_stream(data.train, cfg.vocab_size, always=(data.bos_id, data.eos_id))
    state, token_map = init_state(cfg, tc)
    consts = tie.consts()
    if token_map is not None:
        consts["token_map"] = jnp.asarray(token_map)
    elapsed0, start = 0.0, 0
    if (ckpt := latest_checkpoint(work / CKPT_DIR)) is not None:
        state, meta = restore_checkpoint(ckpt, state)
        elapsed0, start = float(meta["elapsed_s"]), int(meta["step"])
        log(f"resumed from {ckpt} (step {start}, {elapsed0:.0f} s so far)")
    rows = _read_metrics(work / METRICS_FILE, start)
    (work / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))

    step_fn = make_train_step(cfg, tc, tie.n_unseen)
    eval_fn = make_eval_fn(cfg, tc, tie.n_unseen)
    _, schedule = make_optimizer(tc)
    heldout = jnp.asarray(eval_windows(data.heldout, tc.seq_len, data.bos_id, tc.eval_windows))
    tokens_per_step = tc.batch_size * tc.seq_len
    t0 = time.perf_counter()
    end = tc.steps if stop_after is None else min(tc.steps, stop_after)
    with open(work / METRICS_FILE, "a") as metrics_out, \
            tqdm(total=tc.steps, initial=start, desc="training", disable=not progress, dynamic_ncols=True) as bar:
        for s in range(start, end):
            windows = batch_for_step(data.train, tc.seed, s, tc.batch_size, tc.seq_len, data.bos_id)
            state, m = step_fn(state, consts, jnp.asarray(windows))
            row = {"step": s + 1, "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                   "lr": float(schedule(s)), "tokens": (s + 1) * tokens_per_step,
                   "elapsed_s": round(elapsed0 + time.perf_counter() - t0, 2)}
            if tc.eval_windows and ((s + 1) % tc.eval_every == 0 or s + 1 == tc.steps):
                row["heldout_loss"] = float(jnp.mean(eval_fn(state.params, consts, heldout)))
            rows.append(row)
            metrics_out.write(json.dumps(row) + "\n")
            metrics_out.flush()
            bar.set_postfix(loss=f"{row['loss']:.3f}", **({"heldout": f"{row['heldout_loss']:.3f}"}
                                                           if "heldout_loss" in row else {}))
            bar.update(1)
            if (s + 1) % tc.ckpt_every == 0 or s + 1 == end:
                meta = {"elapsed_s": elapsed0 + time.perf_counter() - t0, "tokens": (s + 1) * tokens_per_step}
                save_checkpoint(work / CKPT_DIR, state, meta, tc.keep_checkpoints)
    elapsed = elapsed0 + (time.perf_counter() - t0 if end > start else 0.0)
    return state, {"tie": tie, "token_map": token_map, "elapsed_s": elapsed, "metrics": rows,
                   "tokens_seen": int(state.step) * tokens_per_step}


# ---- export -----------------------------------------------------------------------------------------


def export_tree(params: dict, tie: VocabTie) -> dict:
    """The model's parameter tree (numpy fp32) with the tied head rows written out."""
    tree = jax.tree.map(lambda x: np.asarray(x, np.float32), params["model"])
    if tie.n_unseen:
        head = tree["head"]["weight"].copy()
        unseen = np.ones(head.shape[0], bool)
        unseen[tie.seen_ids] = False
        head[unseen] = np.asarray(params["tail"], np.float32)
        tree["head"] = {"weight": head}
    return tree


def export_checkpoint(out_dir: str | Path, cfg, params: dict, tie: VocabTie) -> list[Path]:
    """An HF-format directory like ``checkpoints/small-random``: FP8 dense and embedding/head matrices,
    FP4 experts, FP8 Engram tables (``load_hf_checkpoint`` reads it; ``LLM(out_dir)`` serves it)."""
    from deepinfer_jax.checkpoint import quant_formats as Q
    from deepinfer_jax.checkpoint.hf_export import save_hf_checkpoint

    tree = export_tree(params, tie)
    extra = {}
    for name in ("embed", "head"):
        extra[f"{name}.weight"], extra[f"{name}.scale"] = Q.encode_fp8_blockwise(tree[name]["weight"], (32, 32))
    return save_hf_checkpoint(out_dir, cfg, tree, quantize=True, extra_tensors=extra, max_shard_bytes=48 * 1024**2)


# ---- command line -----------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train the small V4.1 model on the Python standard library.")
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "deepinfer_jax" / "train" / "small-stdlib"),
                   help="training state, checkpoints and metrics (a rerun resumes here)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "checkpoints" / "small-trained"),
                   help="where the trained checkpoint and card go (default: the repository's checkpoints/small-trained)")
    p.add_argument("--no-export", action="store_true", help="train only")
    p.add_argument("--no-eval", action="store_true", help="export without evaluating or writing the model card")
    p.add_argument("--fixture", default="tests/fixtures/stdlib_heldout_sample.py.txt",
                   help="the checked-in held-out sample scored for the card (skipped if missing)")
    for f in dataclasses.fields(TrainConfig):
        kind = {"int": int, "float": float, "str": str}.get(str(f.type))
        if str(f.type) == "bool":
            p.add_argument(f"--{f.name.replace('_', '-')}", type=lambda v: v.lower() in ("1", "true", "yes"),
                           default=f.default)
        else:
            p.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    tc = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    from deepinfer_jax.research.corpus import load_stdlib_corpus
    from deepinfer_jax.tokenizer import load_tokenizer

    cfg = getattr(ModelConfig, tc.preset)()
    tokenizer = load_tokenizer()
    corpus = load_stdlib_corpus(tokenizer, tc.heldout_every, eos_id=cfg.eos_token_id)
    print(f"corpus: {corpus.summary()}")
    data = TrainData(corpus.train, corpus.heldout, cfg.bos_token_id, cfg.eos_token_id)
    state, info = train(tc, args.work_dir, data, cfg)
    print(f"trained {int(state.step)} steps, {info['tokens_seen']:,} tokens, {info['elapsed_s'] / 60:.1f} min")
    if args.no_export:
        return 0
    files = export_checkpoint(args.out, cfg, state.params, info["tie"])
    print(f"exported {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB to {args.out}")
    if not args.no_eval:
        from deepinfer_jax.research.evaluate import evaluate_and_write_card

        evaluate_and_write_card(args.out, tc, corpus, info, tokenizer, fixture=args.fixture, work_dir=args.work_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
