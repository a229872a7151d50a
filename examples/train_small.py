"""Train the shipped `small` model from scratch on the Python standard library, export it and write its card.

    python examples/train_small.py [--work-dir DIR] [--out checkpoints/small-trained] [--steps 1200] [...]

One command reproduces ``checkpoints/small-trained``: it tokenizes the standard library, trains (resuming
from the latest orbax checkpoint in ``--work-dir`` if a run was interrupted), exports the FP8/FP4
checkpoint, evaluates it (held-out loss vs unigram and random init, greedy samples) and writes the model
card. Needs the ``train`` extra (``pip install -e ".[train]"``: optax). Every option of
``deepinfer_jax.research.train.TrainConfig`` is a flag; see ``--help``.
"""

import sys

from deepinfer_jax.research.train import main

if __name__ == "__main__":
    sys.exit(main())
