"""Incremental detokenization with stop strings (host side).

Text grows one token at a time through ``tokenizers.decoders.DecodeStream``, which holds back the
bytes of an incomplete UTF-8 character until the token that completes it arrives, so the text
never contains a split character. Stop strings are searched only in the tail that the newest text
could have completed (a stop string may span several tokens); on a match the text is cut before it.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Accumulates the text of one request's output tokens."""

    def __init__(self, tokenizer: Tokenizer | None, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True) if tokenizer is not None else None
        self._stop = stop
        self._longest = max((len(s) for s in stop), default=0)
        self.text = ""
        self.stopped_by: str | None = None

    def push(self, token_id: int) -> str | None:
        """Append one token; returns the stop string it completed (text cut before it), else None."""
        if self._stream is None or self.stopped_by is not None:
            return None
        piece = self._stream.step(self._tokenizer, int(token_id))
        if not piece:
            return None
        start = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        if self._stop:
            hits = [(i, s) for s in self._stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                at, which = min(hits)
                self.text = self.text[:at]
                self.stopped_by = which
                return which
        return None
