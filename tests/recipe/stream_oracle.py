"""Shared harness of the streaming differential tests: run one output through the official wheel
and through ours, and compare every event after masking random ids and timestamps.

A *case* is: parse options, a protocol, the pushes (``str`` for text mode, ``list[int]`` for token
mode), an optional backend finish reason and the prompt usage.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from deepinfer_jax.recipe.stream import ParseOptions, StreamOptions, StreamParser

RESPONSE_ID = "resp-1"
MODEL = "DeepSeek-V4.1-Flash"
CREATED = 1_700_000_000


@dataclass
class Case:
    """One streamed output to compare."""

    name: str
    pushes: list[Any]
    parse: ParseOptions = field(default_factory=ParseOptions)
    protocol: str = "chat"
    finish: str | None = "stop"
    usage: tuple[int, int] = (11, 4)
    thinking: bool | None = None
    fingerprint: str | None = "fp_1"
    tokenizer: bool = True
    include_usage: bool = False  # Chat stream_options.include_usage
    body: dict[str, Any] | None = None  # Responses request body (echo, namespaces)
    ready_first: bool = True  # False: the ready chunk comes after the first push


@lru_cache(maxsize=1)
def tokenizer_path() -> str:
    from deepinfer_jax.engram_vocab import deepseek_v4_tokenizer_path

    return str(deepseek_v4_tokenizer_path())


@lru_cache(maxsize=1)
def hf_tokenizer():
    import tokenizers

    return tokenizers.Tokenizer.from_file(tokenizer_path())


@lru_cache(maxsize=1)
def official_tokenizer():
    import deepseek_recipe as dr

    return dr.Tokenizer.from_file(tokenizer_path())


def encode(text: str) -> list[int]:
    """Plain BPE ids of ``text`` (added tokens split out, as a model would produce them)."""
    return hf_tokenizer().encode(text, add_special_tokens=False).ids


def _official_options(p: ParseOptions):
    import deepseek_recipe as dr

    stage = {None: None, "reasoning_start": dr.ThinkingInitialStage.ReasoningStart,
             "reasoning_continuation": dr.ThinkingInitialStage.ReasoningContinuation,
             "content_continuation": dr.ThinkingInitialStage.ContentContinuation}[p.thinking_stage]
    return dr.ParsingOptions(parse_tool_calls=p.parse_tool_calls, starts_in_tool_calls=p.starts_in_tool_calls,
                             parse_json_output=p.parse_json_output, thinking_initial_stage=stage,
                             stop_sequences=list(p.stop_sequences))


def _chat_body(case: Case, thinking: bool) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    if case.parse.thinking_stage == "content_continuation":
        messages.append({"role": "assistant", "content": "Sure", "prefix": True})
    elif case.parse.thinking_stage == "reasoning_continuation":
        messages.append({"role": "assistant", "content": "", "reasoning_content": "hmm", "prefix": True})
    body = {"model": MODEL, "messages": messages, "stream": True,
            "thinking": {"type": "enabled" if thinking else "disabled"}}
    if case.include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


def responses_body(case: Case, thinking: bool) -> dict[str, Any]:
    body = dict(case.body or {"input": "hi"})
    body.setdefault("model", MODEL)
    body["stream"] = True
    if not thinking:
        body["reasoning"] = {**(body.get("reasoning") or {}), "effort": "none"}
    return body


def _official_generator(case: Case, thinking: bool):
    import deepseek_recipe as dr

    opts = dr.ConversionOptions()
    if case.protocol == "messages":
        return dr.MessagesChunkGenerator(RESPONSE_ID, MODEL, thinking), dr.MessagesResponse
    if case.protocol == "chat":
        req = dr.ChatCompletionRequest(_chat_body(case, thinking)).convert(opts)
        return dr.ChatCompletionRequest.chunk_generator(req, RESPONSE_ID, MODEL), dr.ChatCompletionResponse
    request = dr.ResponsesRequest(responses_body(case, thinking))
    echo, namespaces = request.echo(), request.namespace_tool_map(opts)
    gen = dr.ResponsesRequest.chunk_generator(request.convert(opts), RESPONSE_ID, MODEL)
    return gen.with_echo(echo).with_namespace_tool_map(namespaces), dr.ResponsesResponse


_REASONS = {"stop": "Stop", "length": "Length", "content_filter": "ContentFilter"}


def run_official(case: Case) -> dict[str, Any]:
    """Per-push event JSON, SSE names, the accumulated response and the error, from the wheel."""
    import deepseek_recipe as dr

    thinking = case.parse.thinking if case.thinking is None else case.thinking
    gen, acc_cls = _official_generator(case, thinking)
    sp = dr.StreamProcessor(gen, _official_options(case.parse), official_tokenizer() if case.tokenizer else None)
    acc = acc_cls(RESPONSE_ID, MODEL, CREATED, case.usage[0], case.usage[1])
    pushes: list[list[str]] = []
    names: list[str | None] = []
    error = None

    def take(events):
        pushes.append([e.to_json() for e in events])
        for e in events:
            names.append(acc_cls.sse_event_name(e))
            acc.accumulate(e)

    def ready():
        take(sp.push(dr.InferenceChunk.ready(
            prompt_usage=dr.PromptUsage(prompt_tokens=case.usage[0], prompt_cache_hit_tokens=case.usage[1]),
            system_fingerprint=case.fingerprint)))

    try:
        if case.ready_first:
            ready()
        for i, p in enumerate(case.pushes):
            if sp.finished:
                break
            take(sp.push(dr.InferenceChunk.text(p, 1) if isinstance(p, str) else dr.InferenceChunk.tokens(p)))
            if i == 0 and not case.ready_first:
                ready()
        if case.finish is not None and not sp.finished:
            take(sp.push(dr.InferenceChunk.finish(getattr(dr.InferenceFinishReason, _REASONS[case.finish]))))
        take(sp.finish())
    except RuntimeError:
        error = "RuntimeError"
    sp.close()
    return {"pushes": pushes, "names": names, "response": acc.to_json(), "done": acc_cls.sse_done_data(),
            "error": error}


def our_options(case: Case, **extra: Any) -> StreamOptions:
    from deepinfer_jax.recipe.stream import responses_echo

    thinking = case.parse.thinking if case.thinking is None else case.thinking
    if case.protocol == "responses":
        body = responses_body(case, thinking)
        extra.setdefault("responses_echo", responses_echo(body))
        namespaces = {f"{t['name']}::{f['name']}": (t["name"], f["name"]) for t in body.get("tools") or ()
                      if t.get("type") == "namespace" for f in t.get("tools") or ()}
        extra.setdefault("namespace_tool_map", namespaces)
    return StreamOptions(protocol=case.protocol, parse=case.parse, response_id=RESPONSE_ID, model=MODEL,
                         created=CREATED, thinking=thinking, chat_include_usage=case.include_usage, **extra)


def run_ours(case: Case, **extra: Any) -> dict[str, Any]:
    """The same as :func:`run_official`, from our parser."""
    from deepinfer_jax.recipe.stream.accumulate import accumulator

    opts = our_options(case, **extra)
    sp = StreamParser(opts, hf_tokenizer() if case.tokenizer else None)
    acc = accumulator(opts, case.usage[0], case.usage[1])
    pushes: list[list[str]] = []
    names: list[str | None] = []
    error = None

    def take(events):
        pushes.append([e.to_json() for e in events])
        for e in events:
            names.append(e.event)
            acc.accumulate(e)

    try:
        if case.ready_first:
            take(sp.ready(case.usage[0], case.usage[1], case.fingerprint))
        for i, p in enumerate(case.pushes):
            if sp.finished:
                break
            take(sp.push_text(p, 1) if isinstance(p, str) else sp.push_ids(p))
            if i == 0 and not case.ready_first:
                take(sp.ready(case.usage[0], case.usage[1], case.fingerprint))
        if case.finish is not None and not sp.finished:
            take(sp.finish(case.finish))
        take(sp.finish())
    except RuntimeError:
        error = "RuntimeError"
    sp.close()
    return {"pushes": pushes, "names": names, "response": acc.to_json(), "done": sp.sse_done_data, "error": error}


_CALL_ID = re.compile(r"(call_\d\d_(?:ET_)?)[A-Za-z0-9]{20}\d{4}")


def mask(obj: Any) -> Any:
    """Parse JSON strings and blank the random parts: tool-call ids, timestamps."""
    if isinstance(obj, str):
        if obj[:1] in "{[":
            try:
                return mask(json.loads(obj))
            except ValueError:
                pass
        return _CALL_ID.sub(r"\1<id>", obj)
    if isinstance(obj, list):
        return [mask(x) for x in obj]
    if isinstance(obj, dict):
        return {k: ("<ts>" if k in ("created", "created_at", "completed_at") and isinstance(v, int) else mask(v))
                for k, v in obj.items()}
    return obj


def diff(case: Case, **extra: Any) -> tuple[Any, Any]:
    """(official, ours), masked, for assertion."""
    return mask(run_official(case)), mask(run_ours(case, **extra))


def merged_text(result: dict[str, Any]) -> Any:
    """The accumulated response (masked): what chunking must not change."""
    return mask(result["response"])
