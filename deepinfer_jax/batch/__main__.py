"""``python -m deepinfer_jax.batch``: see ``deepinfer_jax.batch.cli``."""

import sys

from deepinfer_jax.batch.cli import main

sys.exit(main())
