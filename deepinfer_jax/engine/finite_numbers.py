"""Keep JSON numbers finite under structured output.

llguidance's JSON number terminal is ``-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?`` with no
bound on the exponent or the digit count, so a constrained output may contain ``5.0e661``, which
every JSON reader turns into infinity (Python's ``json.loads`` gives ``inf``; ``json.dumps`` of it
is not JSON). A schema cannot bound it either: llguidance refuses a ``minimum``/``maximum`` pair
as wide as the float range. So the engine adds its own rule on top of the grammar's mask:

    a token is masked off when the number-shaped literal the output would end in after it is a
    float (it has a fraction or an exponent) whose value overflows to infinity.

"Number-shaped literal" is the longest suffix matching ``-?digits(.digits*)?([eE][+-]?digits*)?``;
an incomplete one (``1e+``, ``3.``) is judged completed by one ``0``, which is always a legal next
token, so the rule never leaves a number without a way to end. Integers (no fraction, no exponent)
are exact in Python and never masked. The check runs only while the output ends in such a literal
with an exponent or 300+ digits, over the vocabulary's tokens made only of ``0-9 . e E + -``
(1,191 of the V4.1 tokenizer's 129,280: its pre-tokenizer never mixes digits with other text), so
other steps pay nothing. It is applied to JSON constraints only (``json_object``, ``json_schema``
and grammars with an inline ``%json`` schema); inside a JSON string the same text is masked off
too, which only forbids string contents like ``"1e999"`` (harmless, and documented).
"""

from __future__ import annotations

import math
import re

import numpy as np

__all__ = ["NumberGuard", "NumberTail", "guards_numbers"]

_CHARSET = re.compile(r"[0-9.eE+\-]+")
_TAIL = re.compile(r"[0-9.eE+\-]*$")
_LITERAL = re.compile(r"-?[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]*)?$")
_KEEP = 1024  # characters of the trailing run kept per matcher


def guards_numbers(kind: str, text: str) -> bool:
    """Whether a ``(kind, text)`` constraint produces JSON (and so gets the finite-number rule)."""
    return kind in ("json_object", "json_schema") or (kind == "grammar" and "%json" in text)


def overflows(literal: str) -> bool:
    """True when the number-shaped literal ending ``literal`` is a float that parses to infinity."""
    m = _LITERAL.search(literal)
    if m is None:
        return False
    s = m.group(0)
    if "." not in s and "e" not in s and "E" not in s:
        return False
    if s[-1] in ".eE+-":
        s += "0"
    return math.isinf(float(s))


class NumberGuard:
    """The vocabulary side: which token ids can extend a number, and their texts.

    ``token_text(i)`` gives a token's text (for byte-level vocabularies the token string itself:
    digits and ``. e E + -`` are their own characters); ``special`` ids have no text.
    """

    def __init__(self, vocab: dict[str, int], vocab_size: int, special: set[int] = frozenset()) -> None:
        items = sorted((i, t) for t, i in vocab.items() if i < vocab_size and i not in special and _CHARSET.fullmatch(t))
        self.ids = np.array([i for i, _ in items], np.int64)
        self.texts = [t for _, t in items]
        self._text = {i: t for t, i in vocab.items()}
        self.special = set(special)

    def text(self, token: int) -> str:
        return "" if token in self.special else self._text.get(int(token), "")

    def tail(self) -> "NumberTail":
        return NumberTail(self)


class NumberTail:
    """One matcher's side: the output's trailing run of number characters, with a history so
    rejected speculative tokens roll back."""

    def __init__(self, guard: NumberGuard) -> None:
        self.guard = guard
        self.run = ""
        self._history: list[str] = []

    def consume(self, token: int) -> None:
        self._history.append(self.run)
        text = self.guard.text(token)
        if text and _CHARSET.fullmatch(text):
            self.run = (self.run + text)[-_KEEP:]
        else:
            self.run = _TAIL.search(text).group(0)

    def rollback(self, n: int) -> None:
        if n:
            self.run = self._history[-n]
            del self._history[-n:]

    def _live(self) -> bool:
        m = _LITERAL.search(self.run)
        return m is not None and ("e" in m.group(0) or "E" in m.group(0) or len(m.group(0)) >= 300)

    def restrict(self, row_W: np.ndarray) -> int:
        """Clear, in the packed bitmask row, the allowed tokens that would overflow; returns how many."""
        if not self._live():
            return 0
        ids = self.guard.ids
        words = row_W.view(np.uint32)
        allowed = (words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1
        cleared = 0
        for k in np.nonzero(allowed)[0]:
            if overflows(self.run + self.guard.texts[k]):
                t = int(ids[k])
                words[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
                cleared += 1
        return cleared
