"""Special-token spellings and the labels the streaming parser matches (recipe.md §5, §7.2, §8.4).

The parser works on Python ``str``. In text mode every label is matched by its spelling. In token
mode the two marker tokens, ``</think>`` and ``｜DSML｜``, count only when they arrive as their special
ids: the decoder turns those ids into one *sentinel* character each, a lone surrogate that no UTF-8
decoding can ever produce, and the token-mode labels are spelled with the sentinels. Plain BPE text
spelling ``</think>`` therefore never matches. Sentinels are turned back into spellings on output.
"""

from __future__ import annotations

from dataclasses import dataclass

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

THINK_END_SENTINEL = "\udc01"
DSML_SENTINEL = "\udc02"


@dataclass(frozen=True)
class Labels:
    """The marker-bearing labels of one mode (text or token)."""

    think_end: str
    dsml_begin: str  # "<｜DSML｜": opens a tool-call block
    dsml_end: str  # "</｜DSML｜": closes an argument value or an invoke
    block_ends: tuple[str, ...]  # the two spellings that close a block (V4 and V4.1)
    dsml: str  # the DSML symbol itself

    def restore(self, text: str) -> str:
        """Spell the sentinels of ``text`` out (no-op in text mode)."""
        if self.dsml == DSML_SENTINEL and ("\udc01" in text or "\udc02" in text):
            return text.replace(THINK_END_SENTINEL, THINK_END).replace(DSML_SENTINEL, DSML)
        return text


def _labels(think_end: str, dsml: str) -> Labels:
    return Labels(think_end=think_end, dsml_begin="<" + dsml, dsml_end="</" + dsml,
                  block_ends=("</" + dsml + "tool_calls>", "</" + dsml + " calls>"), dsml=dsml)


TEXT_LABELS = _labels(THINK_END, DSML)
TOKEN_LABELS = _labels(THINK_END_SENTINEL, DSML_SENTINEL)
