"""Prompt encoding: rendered prompt -> token ids (recipe.md §6).

Only the template's special-token ranges become added-vocabulary ids; each stretch of text between
them is encoded with the plain BPE (no added vocabulary), independently, so a user who types
``<｜User｜>`` gets ``<``, ``｜``, ``User``, ``｜``, ``>`` and the pre-tokenizer restarts at every
special token. No BOS/EOS is added beyond the rendered ones.

Speed: all plain stretches go through one ``encode_batch_fast`` call of the Rust ``tokenizers``
library, which encodes them in parallel (identical stretches, frequent in long chats, only once). A long
stretch (one big user message) is first cut into
pieces at *pre-token boundaries that cannot move*: after a newline that is followed by an ASCII
letter, or between an ASCII letter and a space followed by an ASCII letter. No alternative of the
DeepSeek pre-tokenizer regex matches across such a point, and the digit and CJK splits never touch
it, so the concatenated ids equal those of the whole stretch (tested on random and real text).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from deepinfer_jax.recipe.conversation import Conversation
from deepinfer_jax.recipe.render import ModelVersion, RenderedPrompt, render
from deepinfer_jax.recipe.special_tokens import SpecialTokens
from deepinfer_jax.recipe.tokenizer import PromptTokenizer, load_prompt_tokenizer

__all__ = ["EncodingError", "encode", "encode_many", "encode_rendered", "split_plain_text"]

#: Pieces of plain text are cut near this many code points (when a safe boundary exists).
PIECE_CHARS = 4096

_NEWLINE_LETTER = re.compile(r"\n(?=[A-Za-z])")
_LETTER_SPACE_LETTER = re.compile(r"(?<=[A-Za-z])(?= [A-Za-z])")


class EncodingError(RuntimeError):
    """A special token of the prompt is missing from the tokenizer's added vocabulary."""


def split_plain_text(text: str, piece_chars: int = PIECE_CHARS) -> list[str]:
    """Cut ``text`` at BPE-safe boundaries into pieces of about ``piece_chars`` code points.

    Encoding each piece and concatenating gives the ids of encoding ``text`` whole.
    """
    n = len(text)
    if n <= 2 * piece_chars:
        return [text]
    out: list[str] = []
    start = 0
    while n - start > 2 * piece_chars:
        target = start + piece_chars
        m = _NEWLINE_LETTER.search(text, target, target + piece_chars)
        cut = m.end() if m else -1
        if cut < 0:
            m = _LETTER_SPACE_LETTER.search(text, target, target + piece_chars)
            cut = m.start() if m else -1
        if cut < 0:  # no safe point nearby: keep the rest whole
            break
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def _plan(rendered: RenderedPrompt, tok: PromptTokenizer) -> tuple[list[str], list[int | None]]:
    """Plain pieces to encode, and the output layout: an id for a special, None for the next piece's ids."""
    prompt = rendered.prompt
    pieces: list[str] = []
    layout: list[int | None] = []
    pos = 0
    for start, end in rendered.special_ranges:
        if start > pos:
            for p in split_plain_text(prompt[pos:start]):
                pieces.append(p)
                layout.append(None)
        spelling = prompt[start:end]
        tid = tok.special_id(spelling)
        if tid is None:
            raise EncodingError(f'special token "{spelling}" is not in the added vocabulary')
        layout.append(tid)
        pos = end
    if pos < len(prompt):
        for p in split_plain_text(prompt[pos:]):
            pieces.append(p)
            layout.append(None)
    return pieces, layout


def _encode_pieces(tok: PromptTokenizer, pieces: list[str]) -> list[list[int]]:
    """Ids of each piece: identical pieces are encoded once, the unique ones in one parallel batch."""
    if not pieces:
        return []
    index: dict[str, int] = {}
    unique: list[str] = []
    slots = []
    for p in pieces:
        k = index.get(p)
        if k is None:
            k = index[p] = len(unique)
            unique.append(p)
        slots.append(k)
    encoded = [e.ids for e in tok.plain.encode_batch_fast(unique, add_special_tokens=False)]
    return [encoded[k] for k in slots]


def _assemble(layout: list[int | None], encoded: list[list[int]]) -> list[int]:
    ids: list[int] = []
    k = 0
    for item in layout:
        if item is None:
            ids += encoded[k]
            k += 1
        else:
            ids.append(item)
    return ids


def encode_rendered(rendered: RenderedPrompt, tokenizer: PromptTokenizer | str | Path | None = None) -> list[int]:
    """Token ids of a rendered prompt (``tokenizer``: a PromptTokenizer, a tokenizer.json path, or
    None for the default V4.1-compatible one). Raises :class:`EncodingError` for a missing special."""
    tok = tokenizer if isinstance(tokenizer, PromptTokenizer) else load_prompt_tokenizer(tokenizer)
    pieces, layout = _plan(rendered, tok)
    return _assemble(layout, _encode_pieces(tok, pieces))


def encode(conversation: Conversation, version: ModelVersion | str = ModelVersion.DEEPSEEK_V41_FLASH,
           tokenizer: PromptTokenizer | str | Path | None = None,
           special_tokens: SpecialTokens | None = None) -> list[int]:
    """Render ``conversation`` with the ``version`` template and encode it to token ids."""
    if tokenizer is None:
        tokenizer = load_prompt_tokenizer(v41=ModelVersion.parse(version).is_v41)
    return encode_rendered(render(conversation, version, special_tokens), tokenizer)


def encode_many(rendered: Sequence[RenderedPrompt], tokenizer: PromptTokenizer) -> list[list[int]]:
    """Encode several rendered prompts with one parallel batch."""
    plans = [_plan(r, tokenizer) for r in rendered]
    encoded = _encode_pieces(tokenizer, [p for pieces, _ in plans for p in pieces])
    out: list[list[int]] = []
    start = 0
    for pieces, layout in plans:
        out.append(_assemble(layout, encoded[start:start + len(pieces)]))
        start += len(pieces)
    return out
