"""A fake grammar backend over any vocabulary, for engine tests of structured output without llguidance.

Grammar ``"lo-hi:n"`` allows n tokens from [lo, hi], then only EOS; ``"dead lo-hi:n"`` allows nothing after
the n tokens (the request ends with finish reason "error"). Anything else is a ``GrammarError``. Used by
``tests/test_structured.py`` (one process) and ``tests/sharded/dp_engine_check.py`` (8 fake devices).
"""

from __future__ import annotations

import numpy as np

from deepinfer_jax.engine.structured import GrammarError


class SpanGrammars:
    def __init__(self, vocab: int, eos: int):
        self.vocab_size, self.eos = vocab, eos
        self.compiled: list[str] = []

    def compile(self, kind, text):
        if kind != "grammar" or text.count(":") != 1:
            raise GrammarError(f"fake backend cannot parse {text!r}")
        self.compiled.append(text)
        dead = text.startswith("dead ")
        span, n = text.removeprefix("dead ").split(":")
        lo, hi = (int(x) for x in span.split("-"))
        return lo, hi, int(n), dead

    def matcher(self, compiled):
        return SpanMatcher(self.vocab_size, self.eos, *compiled)

    def fill_batch(self, matchers, bitmask):
        for m, i in matchers:
            m.fill(bitmask[i])


class SpanMatcher:
    def __init__(self, vocab, eos, lo, hi, n, dead):
        self.vocab, self.eos, self.lo, self.hi, self.n, self.dead = vocab, eos, lo, hi, n, dead
        self.seen: list[int] = []

    def allowed(self) -> np.ndarray:
        ok = np.zeros(self.vocab, bool)
        if len(self.seen) < self.n:
            ok[self.lo : self.hi + 1] = True
        elif not self.dead and (not self.seen or self.seen[-1] != self.eos):
            ok[self.eos] = True
        return ok

    def fill(self, row):
        bits = np.zeros(row.shape[0] * 32, np.uint8)
        bits[: self.vocab] = self.allowed()
        row[:] = np.packbits(bits, bitorder="little").view(np.int32)

    def consume(self, token):
        ok = bool(self.allowed()[token])
        self.seen.append(token)
        return ok

    def rollback(self, n):
        del self.seen[len(self.seen) - n :]

    def error(self):
        return None
