"""The demo: load the shipped checkpoint, tokenize a prompt, run the jitted forward, show the top next tokens.

    python examples/forward.py [--checkpoint DIR] [--prompt TEXT] [--top 10]

The default checkpoint (checkpoints/small-trained) is the `small` model trained on the Python
standard library; every part of the path is real — FP8/FP4 checkpoint decoding, the DeepSeek-V4 tokenizer, Engram hashing with the
tokenizer-derived map, CSA2 attention, mHC, MoE.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import numpy as np

from deepinfer_jax import forward_full, load_hf_checkpoint
from deepinfer_jax.tokenizer import load_tokenizer

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "small-trained"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--prompt", default="def __init__(self")
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()

    t0 = time.perf_counter()
    cfg, params = load_hf_checkpoint(args.checkpoint)
    print(f"loaded {args.checkpoint}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"vocab {cfg.vocab_size}, {cfg.num_parameters() / 1e6:.1f}M parameters "
          f"({time.perf_counter() - t0:.1f} s)")
    tokenizer = load_tokenizer(args.checkpoint)
    ids = tokenizer.encode(args.prompt, add_special_tokens=False).ids
    ids = [cfg.bos_token_id] + ids
    print(f"prompt: {args.prompt!r} -> {len(ids)} tokens {ids}")

    fwd = jax.jit(forward_full, static_argnums=1)
    t0 = time.perf_counter()
    logits = np.asarray(fwd(params, cfg, np.asarray([ids], np.int32)))
    print(f"forward (compile + run): {time.perf_counter() - t0:.1f} s; logits {logits.shape} {logits.dtype}")
    t0 = time.perf_counter()
    np.asarray(fwd(params, cfg, np.asarray([ids], np.int32)))
    print(f"forward (compiled): {1e3 * (time.perf_counter() - t0):.1f} ms")

    last = logits[0, -1].astype(np.float64)
    probs = np.exp(last - last.max())
    probs /= probs.sum()
    print(f"top {args.top} next tokens:")
    for rank, tok in enumerate(np.argsort(-last)[: args.top], 1):
        print(f"  {rank:2d}. {tok:6d} {tokenizer.decode([int(tok)])!r:24} logit {last[tok]:+.4f}  p {probs[tok]:.5f}")


if __name__ == "__main__":
    main()
