"""Chat Completions ``logprobs`` / ``top_logprobs``: OpenAI's ``choices[i].logprobs`` object.

``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
"refusal": None}``, one entry per generated token the response was parsed from: reasoning and
tool-call tokens included (the engine samples them like any other; a client that wants the
answer's tokens only can match ``bytes`` against ``content``), the end-of-sequence token and
tokens after a stop sequence excluded. ``token`` is the token's text (a byte of a split UTF-8
character shows as U+FFFD, as OpenAI does), ``bytes`` its exact UTF-8 bytes from the byte-level
vocabulary. Logprobs are the raw distribution's (``model.sampler``). ``top_logprobs`` is at most
the engine's ``max_logprobs``. Streams carry each chunk's tokens on the chunk that first shows
their text (tokens that complete no text yet ride on the next chunk).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from deepinfer_jax.engine.outputs import TokenLogprobs
from deepinfer_jax.recipe.stream import StreamEvent

__all__ = ["attach", "chat_logprobs", "token_bytes"]


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes
    for the code points from U+0100 in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_bytes(tokenizer, token_id: int) -> bytes:
    """A token's exact bytes (a special token: its text's UTF-8)."""
    piece = tokenizer.id_to_token(int(token_id)) or ""
    table = _byte_of_char()
    if piece and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return piece.encode("utf-8")


def _entry(tokenizer, token_id: int, logprob: float) -> dict:
    raw = token_bytes(tokenizer, token_id)
    return {"token": raw.decode("utf-8", "replace"), "logprob": float(logprob), "bytes": list(raw)}


def chat_logprobs(tokenizer, logprobs: Sequence[TokenLogprobs], top: int) -> dict:
    """The ``logprobs`` object of a choice for these tokens (``top`` alternatives each)."""
    content = [{**_entry(tokenizer, lp.token_id, lp.logprob),
                "top_logprobs": [_entry(tokenizer, i, v) for i, v in list(lp.top.items())[:top]]} for lp in logprobs]
    return {"content": content, "refusal": None}


def attach(events: list[StreamEvent], pending: list[TokenLogprobs], tokenizer, top: int) -> list[StreamEvent]:
    """Put the ``pending`` tokens' logprobs on the first chat chunk of ``events`` that has a choice
    (and empty ``pending``); with none, they wait for a later call."""
    if not pending:
        return events
    targets = [k for k, e in enumerate(events) if e.data.get("choices")]
    if not targets:
        return events
    k = targets[0]
    data = dict(events[k].data)
    choice = {**data["choices"][0], "logprobs": chat_logprobs(tokenizer, pending, top)}
    data["choices"] = [choice, *data["choices"][1:]]
    pending.clear()
    return [*events[:k], StreamEvent(data, events[k].event), *events[k + 1:]]
