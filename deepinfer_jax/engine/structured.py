"""Structured output (engine.md §2.4): grammars as token masks, computed on the host.

A request's ``SamplingParams.structured_output`` (a JSON Schema, any JSON object, a regular
expression or a Lark/GBNF grammar) is compiled once per distinct constraint by a
``GrammarBackend`` and cached; each request gets its own ``Matcher`` (the grammar's state after
the tokens generated so far). Before a step samples, the host fills one packed bitmask row per
constrained request (``[ceil(vocab / 32)]`` int32, bit set = token allowed; the layout the
jitted sampler unpacks, ``model.sampler.apply_bitmask``); accepted tokens advance the matcher,
rejected speculative drafts roll it back.

``LLGuidanceBackend`` is the backend: llguidance's numpy bitmask path, no torch. It is given the
real tokenizer's vocabulary (the ``tokenizers`` JSON) padded to the model's vocabulary size, so
ids the tokenizer does not know are never allowed, and the model's EOS id, which the grammar
allows exactly when the output may end. The tokenizer conversion (~1 s at 129,280 tokens) and
each grammar compile happen on first use, not at engine start-up.

``StructuredOutputs`` is the engine's side: compile-and-check when a request is added (errors
become ``RequestError`` with llguidance's message), mask computation for a step on a worker
thread (``submit``) so it overlaps with the device running the step, and per-call mask timings
(``mask_seconds``) for the benchmark.

On top of the grammar, JSON constraints get one rule of the engine's own: no number that parses
to infinity (``engine.finite_numbers``; llguidance's number terminal is unbounded).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np

from deepinfer_jax.engine.finite_numbers import NumberGuard, NumberTail, guards_numbers
from deepinfer_jax.engine.sampling_params import RequestError

__all__ = ["GrammarBackend", "GrammarError", "LLGuidanceBackend", "Matcher", "StructuredOutputs", "mask_words"]


# JSON is generated compactly (", " and ": " separators, no free whitespace): flexible whitespace
# lets a model fill its budget with blanks. A schema's own "x-guidance" options take precedence.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def mask_words(vocab_size: int) -> int:
    """32-bit words per packed bitmask row."""
    return (vocab_size + 31) // 32


class GrammarError(ValueError):
    """A constraint the backend cannot compile (the message is the backend's)."""


class Matcher(Protocol):
    """One request's grammar state."""

    def fill(self, row_W: np.ndarray) -> None:
        """Write the allowed next tokens into ``row_W`` (a C-contiguous int32 row)."""

    def consume(self, token: int) -> bool:
        """Advance by one generated token; False when the grammar did not allow it."""

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens (rejected speculative drafts)."""

    def error(self) -> str | None:
        """Why no token can follow (an unsatisfiable or broken state), else None."""


class GrammarBackend(Protocol):
    """Compiles constraints and makes matchers; ``kind`` is one of ``SamplingParams``' kinds."""

    vocab_size: int

    def compile(self, kind: str, text: str) -> object:
        """A compiled grammar (raises ``GrammarError``)."""

    def matcher(self, compiled: object) -> Matcher:
        """A fresh matcher at the grammar's start."""

    def fill_batch(self, matchers: list[tuple[Matcher, int]], bitmask_RW: np.ndarray) -> None:
        """Fill row ``i`` of ``bitmask_RW`` for each ``(matcher, i)`` (may run in parallel)."""


class _LLMatcher:
    """An llguidance ``LLMatcher`` behind the ``Matcher`` protocol."""

    def __init__(self, m, numbers: NumberTail | None = None) -> None:
        self.m, self.numbers = m, numbers

    def fill(self, row_W: np.ndarray) -> None:
        self.m.unsafe_compute_mask_ptr(row_W.ctypes.data, row_W.nbytes)
        self.restrict(row_W)

    def restrict(self, row_W: np.ndarray) -> None:
        """The engine's own rules on top of llguidance's mask (finite JSON numbers)."""
        if self.numbers is not None:
            self.numbers.restrict(row_W)

    def consume(self, token: int) -> bool:
        ok = bool(self.m.consume_token(int(token)))
        if ok and self.numbers is not None:
            self.numbers.consume(token)
        return ok

    def rollback(self, n: int) -> None:
        if n and not self.m.rollback(int(n)):
            raise ValueError(f"cannot roll back {n} tokens: {self.m.get_error()}")
        if n and self.numbers is not None:
            self.numbers.rollback(n)

    def error(self) -> str | None:
        if self.m.is_error():
            return self.m.get_error() or "the grammar entered an error state"
        return None


class _Compiled:
    """A compiled llguidance grammar and whether its outputs are JSON (finite-number rule)."""

    __slots__ = ("template", "finite_numbers")

    def __init__(self, template, finite_numbers: bool) -> None:
        self.template, self.finite_numbers = template, finite_numbers


class LLGuidanceBackend:
    """llguidance with the real tokenizer's vocabulary (see the module docstring)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int, cache_size: int = 64) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_id = tokenizer, vocab_size, eos_token_id
        self.cache_size = cache_size
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lltok = self._executor = self._numbers = None

    @property
    def lltokenizer(self):
        if self._lltok is None:
            import llguidance

            self._lltok = llguidance.LLTokenizer(self.tokenizer.to_str(), n_vocab=self.vocab_size,
                                                 eos_token=self.eos_token_id)
        return self._lltok

    @staticmethod
    def grammar(kind: str, text: str) -> str:
        """The llguidance grammar text of a ``(kind, text)`` constraint (raises ``GrammarError``)."""
        from llguidance import LLMatcher, gbnf_to_lark, grammar_from

        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_LAYOUT)
        if kind == "json_schema":
            try:
                return LLMatcher.grammar_from_json_schema(json.loads(text), defaults=_JSON_LAYOUT)
            except ValueError as e:
                raise GrammarError(str(e)) from None
        if kind == "regex":
            return LLMatcher.grammar_from_regex(text)
        if kind == "grammar":
            if "::=" in text:  # GBNF (llama.cpp's EBNF) -> Lark
                try:
                    text = gbnf_to_lark(text)
                except (TypeError, ValueError, KeyError, IndexError) as e:  # the converter's errors on bad input
                    raise GrammarError(f"invalid GBNF grammar: {e}") from None
            return grammar_from("lark", text)
        raise GrammarError(f"unknown constraint kind {kind!r}")

    def compile(self, kind: str, text: str) -> object:
        key = (kind, text)
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        from llguidance import LLMatcher

        grammar = self.grammar(kind, text)
        message = LLMatcher.validate_grammar(grammar, self.lltokenizer)
        if message:
            raise GrammarError(message.strip())
        template = LLMatcher(self.lltokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(template.get_error().strip())
        compiled = _Compiled(template, guards_numbers(kind, text))
        self._compiled[key] = compiled
        while len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return compiled

    @property
    def number_guard(self) -> NumberGuard:
        """The vocabulary's number tokens (``engine.finite_numbers``), built on first use."""
        if self._numbers is None:
            special = set(self.tokenizer.get_added_tokens_decoder())
            self._numbers = NumberGuard(self.tokenizer.get_vocab(), self.vocab_size, special)
        return self._numbers

    def matcher(self, compiled) -> Matcher:
        numbers = self.number_guard.tail() if compiled.finite_numbers else None
        return _LLMatcher(compiled.template.deep_copy(), numbers)

    def fill_batch(self, matchers: list[tuple[Matcher, int]], bitmask_RW: np.ndarray) -> None:
        if len(matchers) == 1:
            m, i = matchers[0]
            m.fill(bitmask_RW[i])
            return
        from llguidance import LLExecutor
        from llguidance.numpy import fill_next_token_bitmask_par

        if self._executor is None:
            self._executor = LLExecutor()
        fill_next_token_bitmask_par(self._executor, [(m.m, i) for m, i in matchers], bitmask_RW)
        for m, i in matchers:
            m.restrict(bitmask_RW[i])


class StructuredOutputs:
    """The engine's structured-output state: backend, compile cache, mask worker and timings."""

    def __init__(self, backend: GrammarBackend, overlap: bool = True) -> None:
        self.backend, self.overlap = backend, overlap
        self.words = mask_words(backend.vocab_size)
        self._worker = ThreadPoolExecutor(1, "token-masks")
        self.mask_seconds: list[float] = []  # one entry per step that computed masks
        self.mask_rows = 0

    def matcher(self, constraint: tuple[str, str]) -> Matcher:
        """A matcher for a request's constraint; ``RequestError('structured_output', ...)`` when the
        backend cannot compile it."""
        kind, text = constraint
        try:
            return self.backend.matcher(self.backend.compile(kind, text))
        except GrammarError as e:
            raise RequestError(f"structured_output.{kind}", str(e)) from None

    def masks(self, rows: int, matchers: list[tuple[Matcher, int]]) -> tuple[np.ndarray, dict[int, str]]:
        """A ``[rows, words]`` bitmask: the matchers' rows filled, the others all ones; plus the rows
        whose matcher allows nothing (row -> reason; their mask is left all ones, the caller ends
        those requests)."""
        t0 = time.perf_counter()
        mask = np.full((rows, self.words), -1, np.int32)
        dead: dict[int, str] = {}
        live = []
        for m, i in matchers:
            err = m.error()
            if err is not None:
                dead[i] = err
            else:
                live.append((m, i))
        if live:
            self.backend.fill_batch(live, mask)
        for m, i in live:
            if not mask[i].any():
                dead[i] = m.error() or "no token can continue the output under its grammar"
                mask[i] = -1
        self.mask_seconds.append(time.perf_counter() - t0)
        self.mask_rows += len(matchers)
        return mask, dead

    def submit(self, rows: int, matchers: list[tuple[Matcher, int]]) -> Future:
        """``masks`` on the worker thread (llguidance releases the GIL while it computes)."""
        return self._worker.submit(self.masks, rows, matchers)
