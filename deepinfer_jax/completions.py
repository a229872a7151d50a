"""``/v1/completions``: OpenAI's legacy text-completion protocol over ``LLM``'s engine.

The recipe layer covers the three conversation protocols (Chat Completions, Responses, Messages);
a completion request is plain text in, plain text out, so it maps straight onto ``SamplingParams``:

    prepared = prepare_completion(llm, {"model": "m", "prompt": "def f(x):", "max_tokens": 16})
    out = llm.generate({"prompt_token_ids": prepared.ids}, prepared.params)[0]
    body = completion_response(prepared, out)

Accepted fields: ``prompt`` (a string, a list of token ids, or a one-element list of either),
``max_tokens`` (default 16, as OpenAI), ``temperature`` (default 1), ``top_p``, ``stop`` (a string
or up to 4 strings), ``seed``, ``logprobs`` (0..``max_logprobs``: the top alternatives per token,
OpenAI's ``tokens`` / ``token_logprobs`` / ``top_logprobs`` shape), ``n`` (1 only), ``stream`` and
``stream_options``, ``user``, ``presence_penalty`` / ``frequency_penalty`` (0 only), ``model``
(echoed). Refused with ``recipe.ConversionError`` (400, ``param`` naming the field): any other
field, ``echo``, ``best_of`` > 1, ``suffix``, ``logit_bias``, and bad values.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deepinfer_jax.engine import RequestError, SamplingParams
from deepinfer_jax.recipe import ConversionError

if TYPE_CHECKING:
    from deepinfer_jax.engine import RequestOutput
    from deepinfer_jax.llm import LLM

__all__ = ["PreparedCompletion", "completion_chunk", "completion_response", "prepare_completion"]

_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "logprobs", "n", "stream",
          "stream_options", "user", "presence_penalty", "frequency_penalty", "echo", "best_of", "suffix", "logit_bias"}


@dataclass(frozen=True)
class PreparedCompletion:
    """A completion request made ready for the engine."""

    ids: list[int]
    params: SamplingParams
    prompt: str | None
    model: str
    response_id: str
    created: int
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, default, low: float, high: float):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ConversionError(f"{name} must be a number in [{low}, {high}], got {value!r}", param=name)
    return value


def prepare_completion(llm: LLM, body: Any) -> PreparedCompletion:
    """Validate a completion request body and turn it into prompt ids and ``SamplingParams``."""
    if not isinstance(body, dict):
        raise ConversionError("the request body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise ConversionError(f"unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    if body.get("echo"):
        raise ConversionError("echo is not supported", param="echo")
    for name in ("suffix", "logit_bias"):
        if body.get(name) not in (None, {}, ""):
            raise ConversionError(f"{name} is not supported", param=name)
    if body.get("best_of") not in (None, 1):
        raise ConversionError("best_of must be 1", param="best_of")
    if body.get("n") not in (None, 1):
        raise ConversionError("n must be 1 (one completion per request)", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0, -2, 2) != 0:
            raise ConversionError(f"{name} is not supported (only 0)", param=name)
    prompt, ids = _prompt(llm, body.get("prompt"))
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                             or any(not isinstance(s, str) or not s for s in stop)):
        raise ConversionError("stop must be a non-empty string or a list of up to 4 of them", param="stop")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= llm.engine_config.max_logprobs):
        raise ConversionError(f"logprobs must be an integer in [0, {llm.engine_config.max_logprobs}], got "
                              f"{logprobs!r}", param="logprobs")
    max_tokens = body.get("max_tokens", 16)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ConversionError(f"max_tokens must be an integer >= 1, got {max_tokens!r}", param="max_tokens")
    room = llm.max_model_len - len(ids)
    if room < 1:
        raise ConversionError(f"the prompt has {len(ids)} tokens, which leaves no room within the context length "
                              f"{llm.max_model_len}", param="prompt")
    max_tokens = room if max_tokens is None else min(max_tokens, room)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32):
        raise ConversionError(f"seed must be an integer in [0, 2**32), got {seed!r}", param="seed")
    try:
        params = SamplingParams(temperature=float(_number(body, "temperature", 1.0, 0, 2)),
                                top_p=float(_number(body, "top_p", 1.0, 0, 1)) or 1.0, max_tokens=max_tokens,
                                stop=stop, seed=seed, logprobs=logprobs)
        ids = llm.engine.validate(ids, params)
    except (RequestError, ValueError) as e:
        field = getattr(e, "field", None)
        raise ConversionError(str(e), param=field) from None
    opts = body.get("stream_options") or {}
    stream = bool(body.get("stream"))
    return PreparedCompletion(ids=list(ids), params=params, prompt=prompt, model=str(body.get("model") or "default"),
                              response_id="cmpl-" + uuid.uuid4().hex, created=int(time.time()), stream=stream,
                              include_usage=not stream or bool(isinstance(opts, dict) and opts.get("include_usage")))


def _prompt(llm: LLM, prompt) -> tuple[str | None, list[int]]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ConversionError("prompt must not be empty", param="prompt")
        return prompt, [llm.model_config.bos_token_id, *llm.tokenizer.encode(prompt, add_special_tokens=False).ids]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < llm.model_config.vocab_size]
        if bad:
            raise ConversionError(f"prompt token ids must lie in [0, {llm.model_config.vocab_size}), got {bad[0]}",
                                  param="prompt")
        return None, list(prompt)
    raise ConversionError("prompt must be a non-empty string or a list of token ids (one prompt per request)",
                          param="prompt")


def _usage(prepared: PreparedCompletion, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": len(prepared.ids), "completion_tokens": completion_tokens,
            "total_tokens": len(prepared.ids) + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _logprobs(llm: LLM, logprobs) -> dict | None:
    if logprobs is None:
        return None
    text = lambda i: llm.tokenizer.decode([int(i)], skip_special_tokens=False)  # one token's text (bytes of a
    # split character decode to U+FFFD, as OpenAI shows them)
    return {"tokens": [text(lp.token_id) for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{text(k): v for k, v in lp.top.items()} for lp in logprobs],
            "text_offset": None}


def completion_response(llm: LLM, prepared: PreparedCompletion, out: RequestOutput) -> dict:
    """OpenAI's ``text_completion`` object for a finished engine request."""
    c = out.outputs[0]
    finish = "length" if c.finish_reason == "length" else "stop"
    return {"id": prepared.response_id, "object": "text_completion", "created": prepared.created,
            "model": prepared.model,
            "choices": [{"index": 0, "text": c.text, "finish_reason": finish,
                         "logprobs": _logprobs(llm, c.logprobs) if prepared.params.logprobs is not None else None}],
            "usage": _usage(prepared, len(c.token_ids), out.num_cached_tokens)}


def completion_chunk(prepared: PreparedCompletion, text: str, finish_reason: str | None = None,
                     usage: tuple[int, int] | None = None) -> dict:
    """One streamed ``text_completion`` chunk: a text delta, the last one with its ``finish_reason``;
    ``usage`` = (completion tokens, cached prompt tokens) gives the usage-only chunk of
    ``stream_options.include_usage`` (empty ``choices``)."""
    base = {"id": prepared.response_id, "object": "text_completion", "created": prepared.created,
            "model": prepared.model}
    if usage is not None:
        return {**base, "choices": [], "usage": _usage(prepared, *usage)}
    return {**base, "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
            "usage": None}
