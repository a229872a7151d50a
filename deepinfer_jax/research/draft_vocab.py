"""Write a checkpoint's ``draft_vocab.json`` from its training corpus (``checkpoint.draft_vocab``).

    python -m deepinfer_jax.research.draft_vocab checkpoints/small-trained [--default-size 8192]

Ranks the tokens of the training split of the standard-library corpus (``research.corpus``) by
frequency; prints the held-out coverage of a few sizes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from deepinfer_jax.checkpoint.draft_vocab import DRAFT_VOCAB_FILE, ranked_vocab, save_draft_vocab


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--default-size", type=int, default=8192)
    p.add_argument("--heldout-every", type=int, default=20)
    args = p.parse_args(argv)
    from deepinfer_jax.checkpoint.loader import read_hf_config
    from deepinfer_jax.research.corpus import load_stdlib_corpus
    from deepinfer_jax.tokenizer import load_tokenizer

    cfg = read_hf_config(args.checkpoint)
    corpus = load_stdlib_corpus(load_tokenizer(), args.heldout_every, eos_id=cfg.eos_token_id)
    ids = ranked_vocab(corpus.train, cfg.vocab_size)
    held = np.bincount(corpus.heldout, minlength=cfg.vocab_size)
    for n in (2048, 4096, 8192, 16384, len(ids)):
        print(f"top {n:6d}: held-out token coverage {held[ids[:n]].sum() / held.sum():.4f}")
    out = Path(args.checkpoint) / DRAFT_VOCAB_FILE
    save_draft_vocab(out, ids, min(args.default_size, len(ids)),
                     f"training split of the standard-library corpus ({corpus.summary()['train_tokens']} tokens), "
                     f"ranked by frequency")
    print(f"wrote {out}: {len(ids)} ids, default size {min(args.default_size, len(ids))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
