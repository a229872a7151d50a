"""Measuring SWA bounded replay (engine.md §1.4) against the exact state, teacher-forced.

For each token sequence and replay length ``W``, two requests run side by side in one paged cache:

- **exact**: the whole sequence, chunk by chunk, as a cold engine computes it;
- **approximate**: the blocks of the first ``hit`` tokens are shared with the exact request (block
  KV reused as is, never rewritten), the window at ``hit`` is missing, and positions
  ``hit - W .. hit - 1`` are replayed with attention truncated to the replayed segment
  (``window_floor``), then the same continuation runs on top.

At every continuation position ``hit + d`` it records KL(p_exact || p_approx), whether the two
argmaxes agree, and |delta logprob| of the reference (next) token; and for every layer the
relative error ||kv_approx - kv_exact|| / ||kv_exact|| of the SWA row written at that position.
``mode="encoder"`` is encoder bounded replay (``EngineConfig.encoder_replay``; applied to every
layer's window, as in the engine). ``mode="decoder"`` is decoder bounded replay (YOCO prefill,
``EngineConfig.decoder_replay``): the approximate request prefills ``0 .. hit - 1`` itself, with
only the last ``W`` prompt tokens running the layers after the decoder's KV source (their windows
truncated there); its block KV is exact, only decoder windows differ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from deepinfer_jax.config import CacheConfig
from deepinfer_jax.runner import Buckets, ChunkSpec, ModelRunner

__all__ = ["ReplayResult", "replay_study"]


@dataclass
class ReplayResult:
    """Per replay length: arrays over the continuation distance d = 0 .. n-1 (mean over sequences)."""

    replay_tokens: int
    kl: np.ndarray
    top1_agree: np.ndarray
    dlogprob: np.ndarray
    swa_rel_err: np.ndarray  # [layers, n]
    summary: dict = field(default_factory=dict)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def replay_study(params, cfg, sequences: Sequence[Sequence[int]], hit: int, replay_lengths: Sequence[int],
                 block_size: int = 16, chunk: int | None = None, mode: str = "encoder") -> list[ReplayResult]:
    """Run the comparison (module docstring). ``hit`` is a multiple of ``block_size``; every sequence
    is longer than ``hit + 1``; each ``W`` in ``replay_lengths`` is <= ``hit``. Sequences are cut to
    the shortest one's length."""
    n_tok = min(len(s) for s in sequences)
    if hit % block_size or not 0 < hit < n_tok - 1:
        raise ValueError(f"hit must be a positive multiple of block_size={block_size} below {n_tok - 1}")
    if any(not 0 < w <= hit for w in replay_lengths):
        raise ValueError(f"replay_lengths must lie in (0, hit={hit}]")
    if mode not in ("encoder", "decoder"):
        raise ValueError(f"mode must be 'encoder' or 'decoder', got {mode!r}")
    decoder = mode == "decoder"
    per = math.ceil(n_tok / block_size)
    cc = CacheConfig(block_size=block_size, num_blocks=2 * per, max_requests=2, max_blocks_per_request=per,
                     storage="dequantized")
    cap = cc.ring_capacity(cfg)
    chunk = chunk or max(1, cap - cfg.sliding_window)  # the ring still holds every row of the chunk after it
    tokens = 1 << max(4, math.ceil(math.log2(max(hit, chunk + max(replay_lengths)))))
    runner = ModelRunner(cfg, params, cc, Buckets(tokens=(tokens,), requests=(2,), blocks=(per,)),
                         decoder_replay=decoder)
    exact_blocks = list(range(per))
    shared = 0 if decoder else hit // block_size  # decoder replay prefills its own blocks
    approx_blocks = list(range(shared)) + list(range(per + shared, 2 * per))
    results = []
    for w in replay_lengths:
        kl, agree, dlp, err = [], [], [], []
        for seq in sequences:
            seq = list(seq[:n_tok])
            runner.execute([ChunkSpec(slot=0, block_table=exact_blocks, ctx_len=0, token_ids=seq[:hit])])
            rows = {0: [], 1: []}
            errs = []
            start_a, pos = hit - w, hit
            approx = {"window_floor": hit - w, "global_write_from": hit}
            if decoder:  # its own prefill: the decoder runs on the last w prompt tokens only
                approx = {"decoder_from": hit - w, "decoder_floor": hit - w}
                runner.execute([ChunkSpec(slot=1, block_table=approx_blocks, ctx_len=0, token_ids=seq[:hit], **approx)])
                start_a = hit
            while pos < n_tok - 1:
                end = min(n_tok - 1, pos + chunk)
                a_ids = seq[start_a:end]
                out = runner.execute([
                    ChunkSpec(slot=0, block_table=exact_blocks, ctx_len=pos, token_ids=seq[pos:end],
                              logits=range(end - pos)),
                    ChunkSpec(slot=1, block_table=approx_blocks, ctx_len=start_a, token_ids=a_ids,
                              logits=range(pos - start_a, end - start_a), **approx)])
                rows[0].append(out[0])
                rows[1].append(out[1])
                ring_e = np.asarray(jax.tree.leaves(runner.snapshot_swa(0))[0])  # [L, cap, D]
                ring_a = np.asarray(jax.tree.leaves(runner.snapshot_swa(1))[0])
                at = np.arange(pos, end) % cap
                e, a = ring_e[:, at], ring_a[:, at]
                errs.append(np.linalg.norm(a - e, axis=-1) / np.maximum(np.linalg.norm(e, axis=-1), 1e-30))
                start_a, pos = end, end
            le, la = _log_softmax(np.concatenate(rows[0])), _log_softmax(np.concatenate(rows[1]))
            ref = np.asarray(seq[hit + 1 : n_tok])
            kl.append((np.exp(le) * (le - la)).sum(-1))
            agree.append(le.argmax(-1) == la.argmax(-1))
            idx = np.arange(len(ref))
            dlp.append(np.abs(le[idx, ref] - la[idx, ref]))
            err.append(np.concatenate(errs, axis=1))
        r = ReplayResult(w, np.mean(kl, 0), np.mean(agree, 0), np.mean(dlp, 0), np.mean(err, 0))
        r.summary = {"replay_tokens": w, "mean_kl": float(r.kl.mean()), "top1_agree": float(r.top1_agree.mean()),
                     "mean_abs_dlogprob": float(r.dlogprob.mean()), "max_swa_rel_err": float(r.swa_rel_err.max()),
                     "mean_swa_rel_err_first_window": float(r.swa_rel_err[:, : cfg.sliding_window].mean())}
        results.append(r)
    return results
