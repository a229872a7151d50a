"""Token ids to text, with UTF-8 bytes held across pushes (recipe.md §8.2).

Byte-level BPE tokens are looked up in a table built once from the tokenizer (the GPT-2
byte-to-unicode map undone); added tokens decode to their spelling, except the two markers, which
become sentinels (:mod:`.markers`). One push decodes into *pieces*: each added token is a piece of
its own, and each run of BPE tokens between them is one piece. A run is decoded lossily (one U+FFFD
per maximal invalid subsequence, Python's ``decode("utf-8", "replace")``, which restarts right
after each broken sequence); when its bytes are empty or its decoded text ends in U+FFFD (an
incomplete character, a lone invalid byte, or a U+FFFD token) it is held whole (its ids too) and
joined to the next push, as the official library does. A run that an added token interrupts is
released as it decodes. Ids count as completion tokens when the text they belong to is released;
ids still held at the end of the stream are dropped uncounted. Unknown or out-of-range ids decode
to nothing. Each piece says whether it is an added token's (stop sequences never match those).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from deepinfer_jax.recipe.stream.markers import DSML, DSML_SENTINEL, THINK_END, THINK_END_SENTINEL


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode map used by the ByteLevel pre-tokenizer."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


class TokenTable:
    """Per-id bytes of a byte-level BPE tokenizer, the added tokens, and the tokenizer itself.

    ``tokenizer`` is a ``tokenizers.Tokenizer``; it is kept to count reasoning tokens.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        u2b = _unicode_to_byte()
        added = tokenizer.get_added_tokens_decoder()
        vocab = tokenizer.get_vocab(with_added_tokens=False)
        size = max([*vocab.values(), *added.keys(), -1]) + 1
        table: list[bytes] = [b""] * size
        for token, i in vocab.items():
            table[i] = bytes(u2b[c] for c in token if c in u2b)
        self.bytes = table
        texts: list[str | None] = [None] * size  # the text of each token that is valid UTF-8 alone
        for i, b in enumerate(table):
            if b:
                try:
                    texts[i] = b.decode("utf-8")
                except UnicodeDecodeError:
                    pass
        self.added: dict[int, str] = {}
        for i, tok in added.items():
            content = tok.content
            self.added[i] = {THINK_END: THINK_END_SENTINEL, DSML: DSML_SENTINEL}.get(content, content)
            texts[i] = self.added[i]
        self.texts = texts

    @classmethod
    def from_file(cls, path: str | Path) -> TokenTable:
        import tokenizers

        return cls(tokenizers.Tokenizer.from_file(str(path)))

    def count(self, text: str) -> int:
        """Tokens of ``text`` encoded with the full vocabulary (how reasoning tokens are counted)."""
        if not text:
            return 0
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)


def _decode_run(run: bytes) -> str | None:
    """The text of a BPE run, or None when it must be held (its lossy text ends in U+FFFD)."""
    text = run.decode("utf-8", "replace")
    return None if text.endswith("\ufffd") else text


class TokenDecoder:
    """Incremental decoder of one stream; see the module docstring."""

    __slots__ = ("pending", "pending_ids", "table")

    def __init__(self, table: TokenTable) -> None:
        self.table = table
        self.pending = b""
        self.pending_ids = 0

    def push(self, ids: list[int]) -> list[tuple[str, int, bool]]:
        """Decode one push: the released pieces, each with the number of ids it accounts for and
        whether it is an added token's text."""
        if len(ids) == 1 and not self.pending_ids:  # the decode loop's case: one complete token
            i = ids[0]
            if 0 <= i < len(self.table.texts):
                text = self.table.texts[i]
                if text is not None and not text.endswith("\ufffd"):
                    return [(text, 1, i in self.table.added)]
        table, added = self.table.bytes, self.table.added
        size = len(table)
        pieces: list[tuple[str, int, bool]] = []
        run = self.pending
        run_ids = self.pending_ids
        parts: list[bytes] = [run] if run else []
        for i in ids:
            special = added.get(i)
            if special is None:
                if 0 <= i < size:
                    parts.append(table[i])
                run_ids += 1
                continue
            joined = b"".join(parts) if parts else b""
            parts = []
            if joined:
                pieces.append((joined.decode("utf-8", "replace"), run_ids, False))
                run_ids = 0
            pieces.append((special, run_ids + 1, True))
            run_ids = 0
        joined = b"".join(parts)
        text = _decode_run(joined) if joined else None
        if text is None:
            self.pending, self.pending_ids = joined, run_ids
        else:
            pieces.append((text, run_ids, False))
            self.pending, self.pending_ids = b"", 0
        return pieces
