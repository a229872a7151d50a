"""Write a seeded random checkpoint of a preset config in the released storage formats.

    python -m deepinfer_jax.checkpoint.make_random OUT_DIR [--preset small] [--seed 0]

The shipped default (``checkpoints/small-random``) is made by this script: ``init_params`` of the
preset with the given seed, written as an HF-style directory (config.json + safetensors) with FP8
32x32 dense weights, packed FP4 experts and row-scaled FP8 Engram tables. With
``--fp8-embeddings`` (the default) the embedding and head matrices are FP8-encoded as well, which
keeps the 129,280-row vocabulary of ``small`` at about a quarter of its BF16 size; the loader
decodes any weight that has a ``.scale`` partner. Deterministic: the same seed gives the same bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from deepinfer_jax.checkpoint import quant_formats as Q
from deepinfer_jax.checkpoint.hf_export import save_hf_checkpoint
from deepinfer_jax.config import ModelConfig


def write_random_checkpoint(out_dir: str | Path, preset: str = "small", seed: int = 0,
                            fp8_embeddings: bool = True) -> list[Path]:
    """Create ``out_dir`` with a seeded random ``preset`` checkpoint; returns the files written."""
    from flax import nnx

    from deepinfer_jax.model.deepseek_v41 import init_params  # identity map: not stored in the checkpoint

    cfg = getattr(ModelConfig, preset)()
    tree = nnx.to_pure_dict(init_params(cfg, seed))
    tree.pop("engram_token_map", None)
    tree = _numpy(tree)
    extra = {}
    if fp8_embeddings:
        for name in ("embed", "head"):
            extra[f"{name}.weight"], extra[f"{name}.scale"] = Q.encode_fp8_blockwise(tree[name]["weight"], (32, 32))
    return save_hf_checkpoint(out_dir, cfg, tree, quantize=True, extra_tensors=extra,
                              max_shard_bytes=48 * 1024**2)


def _numpy(tree):
    return {k: _numpy(v) if isinstance(v, dict) else np.asarray(v, np.float32) for k, v in tree.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--preset", choices=("tiny", "small"), default="small")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bf16-embeddings", action="store_true", help="store embed/head in BF16, not FP8")
    args = parser.parse_args(argv)
    files = write_random_checkpoint(args.out_dir, args.preset, args.seed, not args.bf16_embeddings)
    size = sum(f.stat().st_size for f in files)
    print(f"wrote {len(files)} files to {args.out_dir} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
