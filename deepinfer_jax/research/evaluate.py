"""Evaluation of a trained checkpoint and its model card (``metrics.json``, ``loss_curve.png``, ``README.md``).

Every number is measured on the exported checkpoint as the engine loads it (``load_hf_checkpoint``,
full 129,280-token softmax, the config's own numerics, i.e. ``fake_quant=True``), against:

* the random-init model (``checkpoints/small-random``, the previous default; else ``init_params``);
* a unigram model fitted on the training split (add-0.5 smoothing over the whole vocabulary);
* the held-out text's own unigram entropy (a lower bound for *any* unigram model).

Greedy samples go through ``LLM`` (the engine, paged cache, in-step sampler), as ``make demo`` does.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.model.deepseek_v41 import forward_full
from deepinfer_jax.research.corpus import eval_windows, self_unigram_nll, unigram_nll

__all__ = ["PROMPTS", "evaluate_and_write_card", "greedy_samples", "model_nll"]

PROMPTS = ("import os\n", "def __init__(self", "class Queue:\n", "    for i in range(",
           'if __name__ == "__main__":\n', "The capital of France is")
EVAL_WINDOWS = 512
REPO = Path(__file__).resolve().parent.parent.parent


@functools.lru_cache(maxsize=4)
def _nll_fn(cfg):
    def nll(params, windows):
        logits = forward_full(params, cfg, windows[:, :-1])
        picked = jnp.take_along_axis(logits, windows[:, 1:, None], axis=-1)[..., 0]
        return jax.nn.logsumexp(logits, axis=-1) - picked

    return jax.jit(nll)


def model_nll(params, cfg, windows: np.ndarray, batch: int = 16) -> np.ndarray:
    """Per-token NLL [N, T] (nats) of ``windows[:, 1:]`` under the full forward, ``batch`` windows at a time."""
    fn = _nll_fn(cfg)
    out = []
    for i in range(0, len(windows), batch):
        chunk = windows[i:i + batch]
        pad = batch - len(chunk)
        if pad:  # keep one compiled shape
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, axis=0)])
        out.append(np.asarray(fn(params, jnp.asarray(chunk)))[: batch - pad])
    return np.concatenate(out)


def greedy_samples(checkpoint: str | Path, prompts=PROMPTS, max_tokens: int = 48) -> dict[str, list[dict]]:
    """Continuations through the engine (``LLM``) with the engine settings of ``make demo``: greedy, and
    sampled at temperature 0.8 / top-p 0.95 with seed ``i`` for prompt ``i`` (reproducible)."""
    from deepinfer_jax import LLM, SamplingParams

    llm = LLM(str(checkpoint), max_num_seqs=4, max_num_batched_tokens=64, block_size=32, max_model_len=256,
              chunking="tokens", use_tqdm=False)
    greedy = llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    sampled = llm.generate(list(prompts), [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, seed=i)
                                           for i in range(len(prompts))], use_tqdm=False)
    return {kind: [{"prompt": o.prompt, "completion": o.outputs[0].text} for o in outs]
            for kind, outs in (("greedy", greedy), ("sampled", sampled))}


def _summary(nll: np.ndarray) -> dict:
    mean = float(np.mean(nll))
    return {"loss": round(mean, 4), "ppl": round(math.exp(mean), 2)}


def _loss_curve(path: Path, rows: list[dict], unigram: float) -> Path:
    from deepinfer_jax.research.png import line_plot_png

    steps = [r["step"] for r in rows]
    loss = [r["loss"] for r in rows]
    ema, smooth = loss[0], []
    for v in loss:
        ema = 0.9 * ema + 0.1 * v
        smooth.append(ema)
    held = [(r["step"], r["heldout_loss"]) for r in rows if "heldout_loss" in r]
    series = [{"x": steps, "y": loss, "color": (190, 190, 190)}, {"x": steps, "y": smooth, "color": (30, 90, 200),
                                                                   "width": 3}]
    if held:
        series.append({"x": [h[0] for h in held], "y": [h[1] for h in held], "color": (220, 40, 40), "marker": True})
    top = math.ceil(max(loss[:3]) if loss else 12)
    return line_plot_png(path, series, [{"y": unigram, "color": (40, 160, 60)}], ylim=(0.0, float(top)))


def evaluate_and_write_card(out_dir, tc, corpus, info: dict, tokenizer, *, fixture: str | None = None,
                            work_dir: str | None = None, random_checkpoint: str | Path | None = None,
                            samples: bool = True) -> dict:
    """Measure the exported checkpoint in ``out_dir`` and write ``metrics.json``, the curve and the card."""
    import time

    from deepinfer_jax.checkpoint import load_hf_checkpoint

    t0 = time.perf_counter()
    out = Path(out_dir)
    cfg, params = load_hf_checkpoint(out, progress=False)
    bos, vocab = cfg.bos_token_id, cfg.vocab_size
    windows = eval_windows(corpus.heldout, tc.seq_len, bos, EVAL_WINDOWS)
    targets = windows[:, 1:]
    m: dict = {"eval": {"windows": len(windows), "seq_len": tc.seq_len, "tokens": int(targets.size)}}
    m["trained"] = _summary(model_nll(params, cfg, windows))
    m["trained_fake_quant_off"] = _summary(model_nll(params, dataclasses.replace(cfg, fake_quant=False), windows))
    random_checkpoint = Path(random_checkpoint or REPO / "checkpoints" / "small-random")
    if random_checkpoint.is_dir():
        rcfg, rparams = load_hf_checkpoint(random_checkpoint, progress=False)
        m["random_init"] = {**_summary(model_nll(rparams, rcfg, windows)), "checkpoint": random_checkpoint.name}
    else:
        from deepinfer_jax.params import init_params

        m["random_init"] = {**_summary(model_nll(init_params(cfg, tc.seed), cfg, windows)), "checkpoint": None}
    uni = unigram_nll(corpus.train, targets, vocab, alpha=0.5)
    m["unigram"] = {"loss": round(uni, 4), "ppl": round(math.exp(uni), 2), "fit": "training split, add-0.5"}
    low = self_unigram_nll(targets)
    m["unigram_heldout_entropy"] = {"loss": round(low, 4), "ppl": round(math.exp(low), 2)}
    fixture_path = Path(fixture) if fixture else None
    if fixture_path is not None and not fixture_path.is_absolute():
        fixture_path = REPO / fixture_path
    if fixture_path is not None and fixture_path.is_file():
        ids = tokenizer.encode(fixture_path.read_text(encoding="utf-8"), add_special_tokens=False).ids[: tc.seq_len]
        win = np.asarray([[bos, *ids]], np.int32)
        m["fixture"] = {"path": fixture_path.relative_to(REPO).as_posix() if fixture_path.is_relative_to(REPO)
                        else str(fixture_path), "tokens": len(ids),
                        "loss": round(float(model_nll(params, cfg, win, batch=1).mean()), 4),
                        "unigram_loss": round(unigram_nll(corpus.train, win[:, 1:], vocab, alpha=0.5), 4)}
    rows = info["metrics"]
    last = rows[-20:]
    m["training"] = {**dataclasses.asdict(tc), "steps_done": rows[-1]["step"] if rows else 0,
                     "tokens_seen": info["tokens_seen"], "wall_s": round(info["elapsed_s"], 1),
                     "final_train_loss_last20": round(float(np.mean([r["loss"] for r in last])), 4) if last else None,
                     "seen_vocab": int(info["tie"].seen_ids.size), "machine": _machine()}
    m["corpus"] = corpus.summary()
    m["corpus"]["python"] = platform.python_version()
    m["corpus"]["heldout_file_list"] = list(corpus.heldout_files)
    if samples:
        m["samples"] = greedy_samples(out)
    m["eval"]["wall_s"] = round(time.perf_counter() - t0, 1)
    (out / "metrics.json").write_text(json.dumps(m, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    if rows:
        _loss_curve(out / "loss_curve.png", rows, uni)
    (out / "README.md").write_text(model_card(m, cfg), encoding="utf-8")
    return m


def _machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} CPU cores, jax {jax.__version__} ({jax.devices()[0].platform})"


def model_card(m: dict, cfg) -> str:
    """The card's Markdown from the metrics dict."""
    t, c = m["training"], m["corpus"]
    rows = [("trained model (engine numerics, `fake_quant=True`)", m["trained"]),
            ("trained model, activation fake-quant off", m["trained_fake_quant_off"]),
            (f"random init (`{m['random_init']['checkpoint'] or 'init_params'}`)", m["random_init"]),
            ("unigram, fitted on the training split (add-0.5)", m["unigram"]),
            ("held-out text's own unigram entropy (lower bound for any unigram)", m["unigram_heldout_entropy"])]
    table = "\n".join(f"| {name} | {r['loss']:.3f} | {r['ppl']:,.1f} |" for name, r in rows)
    fx = m.get("fixture")
    fixture = (f"On the checked-in sample `{fx['path']}` (first {fx['tokens']} tokens, after BOS) the model scores "
               f"**{fx['loss']:.3f}** nats/token against **{fx['unigram_loss']:.3f}** for the unigram "
               "(`tests/test_train.py` checks this).") if fx else ""

    def show(kind):
        return "\n\n".join(f"`{s['prompt']!r}` →\n```\n{s['prompt']}{s['completion']}\n```"
                           for s in m.get("samples", {}).get(kind, []))
    ev = m["eval"]
    return f"""# small-trained: the `small` DeepSeek-V4.1-architecture model trained on the Python standard library

The default checkpoint of `LLM()` and `make demo`. Same format as `checkpoints/small-random`: HF layout,
DeepSeek-native names, FP8 E4M3 32x32-block dense weights (embedding and head too), packed FP4 routed
experts, FP8 Engram tables; `load_hf_checkpoint` reads it. Config: `ModelConfig.small()`
({cfg.num_parameters() / 1e6:.1f}M parameters, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size},
the real 129,280-token DeepSeek-V4 vocabulary, every layer role, Engram with the tokenizer-derived map).

## Data

CPython {c['python']}'s standard library: the `*.py` files under `sysconfig.get_paths()["stdlib"]` in
sorted order (test suites, `encodings`, `lib2to3`, `pydoc_data`, `ensurepip`, `turtledemo`, installed
packages and generated `_sysconfigdata*` left out), licensed under the PSF License. One file in 20 is held
out by the SHA-256 of its relative path: {c['train_files']} training files ({c['train_tokens']:,} tokens),
{c['heldout_files']} held-out files ({c['heldout_tokens']:,} tokens; listed in `metrics.json`). Tokenized with the
DeepSeek-V4 tokenizer, each file followed by EOS; a training window is BOS + {t['seq_len']} consecutive tokens
at a seeded random offset.

## Training

{t['steps_done']} steps of {t['batch_size']} x {t['seq_len']} tokens: **{t['tokens_seen']:,} tokens seen**
(~{t['tokens_seen'] / max(c['train_tokens'], 1):.2f} epochs) in **{t['wall_s'] / 60:.1f} minutes** of training wall
time (compilation and checkpoints included) on {t['machine']}, shared with other work and run at `nice -n 19`.
AdamW (b2 {t['b2']}, weight decay {t['weight_decay']} on matrices), peak learning rate {t['lr']} after
{t['warmup_steps']} warm-up steps, cosine decay to {t['min_lr_ratio']} of it, gradient clipping at {t['grad_clip']},
seed {t['seed']}, fp32.

* Weights are trained quantization-aware in their shipped formats (straight-through estimator), so the
  exported FP8/FP4 checkpoint computes what training optimised.
* The forward ran without the activation fake-quant boundaries (FP4 rounding has no gradient); the
  shipped config keeps the engine's default `fake_quant=True`, and both are measured below.
* The {cfg.vocab_size - t['seen_vocab']:,} vocabulary entries that never occur in the training split
  share one trained head row, which keeps the full softmax exact with one extra logit and makes the
  head several times cheaper (its forward and backward over all 129,280 columns otherwise dominate a
  step); they are still scored: all metrics below are full-vocabulary.

**Reproduce** with one command, `python examples/train_small.py` (the `train` extra: optax): it tokenizes,
trains (resuming from the latest orbax checkpoint of an interrupted run, bit for bit), exports, evaluates
and rewrites this card and `metrics.json`; the evaluation took {ev['wall_s'] / 60:.1f} minutes more.

![loss curve](loss_curve.png)

Grey: training loss per step; blue: its moving average; red squares: held-out loss during training
(training numerics) on the first {t['eval_windows']} held-out windows only, i.e. the first held-out files, which
happen to be easier than the average (the table below scores {ev['windows']} windows); dashed green: the unigram
baseline.
Final training loss (mean of the last 20 steps): {t['final_train_loss_last20']:.3f}.

## Held-out metrics

{ev['windows']} windows of BOS + {ev['seq_len']} tokens from the held-out files ({ev['tokens']:,} scored tokens),
full-vocabulary softmax, nats per token:

| model | loss | perplexity |
|---|---:|---:|
{table}

{fixture}

## Samples (through `LLM`, 48 tokens, the prompt shown first)

Greedy (temperature 0). A model this small falls into loops quickly when decoded greedily:

{show("greedy")}

Sampled at temperature 0.8, top-p 0.95, seed = the prompt's index (as `make demo` samples):

{show("sampled")}

## Known limits

* A 39M-parameter model (most of it the 129,280 x 128 embedding and head) that has seen ~{t['tokens_seen'] / 1e6:.1f}M
  tokens of Python: it continues Python source with plausible local structure (imports, `def`/`self`
  patterns, indentation, docstrings), not correct programs, and knows nothing else (English prose or
  other languages come back as Python-flavoured text). Greedy decoding repeats itself within a few lines.
* Trained on windows of {t['seq_len']} tokens: positions beyond that were never seen in training.
* The lightning indexer and the router's selection bias receive no gradient from the language-model loss
  (top-k selection is discrete; aux-loss-free balancing is not implemented) and keep their initial values,
  so the sparse global attention selects entries with random projections.
* No multi-token-prediction / DSpark head is trained (the checkpoint has none, like `small-random`).
"""
