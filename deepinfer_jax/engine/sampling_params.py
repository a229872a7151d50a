"""``SamplingParams``: how one request samples and when it stops, validated on construction."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RequestError", "SamplingParams"]


class RequestError(ValueError):
    """A request the engine refuses; raised before anything runs. ``field`` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _int(name: str, value: Any, low: int | None = None, optional: bool = False) -> int | None:
    if optional and value is None:
        return None
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise RequestError(name, f"must be an integer, got {value!r}")
    if low is not None and value < low:
        raise RequestError(name, f"must be >= {low}, got {value!r}")
    return int(value)


def _float(name: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
        raise RequestError(name, f"must be a finite number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise RequestError(name, f"must lie in {bracket}{low}, {high}], got {value!r}")
    return float(value)


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar")


def _constraint(spec: Any) -> tuple[str, str] | None:
    """``structured_output`` as ``(kind, text)``: a JSON Schema as compact JSON text (``{}`` for
    ``json_object``), a regex or a grammar as given. Only the shape is checked here."""
    name = "structured_output"
    if spec is None:
        return None
    if not isinstance(spec, dict) or len(spec) != 1:
        raise RequestError(name, f"must be a dict with exactly one of {', '.join(STRUCTURED_KINDS)}, got {spec!r}")
    (kind, value), = spec.items()
    if kind not in STRUCTURED_KINDS:
        raise RequestError(name, f"unknown kind {kind!r}; expected one of {', '.join(STRUCTURED_KINDS)}")
    where = f"{name}.{kind}"
    if kind == "json_object":
        if value is not True:
            raise RequestError(where, f"must be True, got {value!r}")
        return kind, "{}"
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise RequestError(where, f"is not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise RequestError(where, f"must be a JSON Schema object, got {type(value).__name__}")
        return kind, json.dumps(value, separators=(",", ":"))  # key order kept: it orders the output
    if not isinstance(value, str) or not value:
        raise RequestError(where, f"must be a non-empty string, got {value!r}")
    return kind, value


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping settings (vLLM's names and meanings).

    temperature: 0 = greedy (argmax), else softmax(logits / temperature); at most 100.
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p, in (0, 1].
    top_k: keep the k most likely tokens; 0 or -1 = all.
    min_p: drop tokens below min_p x the top probability, in [0, 1].
    max_tokens: most tokens to generate (>= 1); None = up to the context limit.
    stop: strings that end the output when they appear (found across token boundaries); the
        returned text stops before the match.
    stop_token_ids: token ids that end the output (kept in ``token_ids``).
    ignore_eos: keep generating past the end-of-sequence token.
    seed: a fixed seed makes the request's tokens reproducible on their own: its keys are
        ``(seed, 0, output position)``, the same whatever else runs; None = the engine's seed with
        the request's own stream id.
    logprobs: return this many top logprobs per generated token (plus the chosen token's); None = off.
    prompt_logprobs: also score the prompt: per prompt token its logprob and this many top ones
        (vLLM's field; ``RequestOutput.prompt_logprobs``, first entry None); None = off. Costs one
        full-sequence pass over the prompt (``runner.prompt_scores``).
    structured_output: constrain the output's format, one of ``{"json_schema": <schema dict or JSON
        text>}``, ``{"json_object": True}`` (any JSON object), ``{"regex": <pattern>}`` or
        ``{"grammar": <Lark grammar, or GBNF when it uses ::=>}``; None = free text. The shape is
        checked here; the grammar itself is compiled (and its errors reported) when the request is
        added to an engine (``engine.structured``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = 16
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: dict | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    constraint: tuple[str, str] | None = field(init=False, repr=False)  # (kind, text), see _constraint

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "temperature", _float("temperature", self.temperature, 0.0, 100.0))
        set_(self, "top_p", _float("top_p", self.top_p, 0.0, 1.0, low_open=True))
        top_k = _int("top_k", self.top_k, -1)
        set_(self, "top_k", 0 if top_k == -1 else top_k)
        set_(self, "min_p", _float("min_p", self.min_p, 0.0, 1.0))
        set_(self, "max_tokens", _int("max_tokens", self.max_tokens, 1, optional=True))
        stop = self.stop
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stops = tuple(stop)
        else:
            raise RequestError("stop", f"must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stops):
            raise RequestError("stop", "stop strings must be non-empty")
        set_(self, "stop_strings", stops)
        ids = self.stop_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)):
                raise RequestError("stop_token_ids", f"must be a list of token ids, got {ids!r}")
            set_(self, "stop_token_ids", tuple(_int("stop_token_ids", i, 0) for i in ids))
        if not isinstance(self.ignore_eos, bool):
            raise RequestError("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        seed = _int("seed", self.seed, 0, optional=True)
        if seed is not None and seed >= 2**32:
            raise RequestError("seed", f"must be < 2**32, got {seed}")
        set_(self, "seed", seed)
        set_(self, "logprobs", _int("logprobs", self.logprobs, 0, optional=True))
        set_(self, "prompt_logprobs", _int("prompt_logprobs", self.prompt_logprobs, 0, optional=True))
        set_(self, "constraint", _constraint(self.structured_output))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
