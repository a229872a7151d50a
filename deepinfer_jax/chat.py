"""``LLM.chat`` / ``LLM.chat_stream``: protocol requests through the recipe layer and the engine.

conversion (``recipe.convert_request`` with ``LLM.conversion_options``) -> rendering and encoding
(special tokens only at template positions) -> generation with the converted sampling settings ->
the streaming parser (``recipe.stream``), which turns generated ids into the protocol's stream
events and, accumulated, its final response JSON. Stop sequences are enforced by both the engine
(generation ends) and the parser (the text is cut where the official library cuts it).

Thinking mode is on for requests that do not say (``EngineConfig.default_thinking_mode``, the
official default). The recipe's ``output_constraint`` (``response_format`` json_object /
json_schema / regex, active tools, a required tool call) is enforced as the request's
``structured_output`` grammar (``chat_grammar``); a json_schema format is enforced with the schema
the user gave (the one the prompt shows the model), not the recipe's normalised copy, which drops
keywords such as ``maxLength``.

Refused here with a ``recipe.ConversionError`` (400) naming the field in ``param``, although the
official conversion accepts them: ``tool_choice`` "required" / a named tool / Messages ``any`` or
``tool`` without any tool (the official library silently answers as ``auto``), ``top_logprobs``
above the engine's ``max_logprobs``, and logprobs in the Responses protocol (only Chat Completions
returns them here: ``chat_logprobs``).

A thinking-mode request whose output ends with ``finish_reason`` "length" before the reasoning
ended (so no content or tool call was generated) gets a ``warning`` object in its response (and on
the final stream event): ``{"code": "reasoning_budget_exhausted", "message": ...}``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deepinfer_jax import recipe
from deepinfer_jax.chat_grammar import structured_output_for
from deepinfer_jax.chat_logprobs import attach, chat_logprobs
from deepinfer_jax.engine import SamplingParams
from deepinfer_jax.recipe.stream import ParseOptions, StreamEvent, StreamOptions, StreamParser, responses_echo

if TYPE_CHECKING:
    from deepinfer_jax.llm import LLM

__all__ = ["PreparedRequest", "chat", "chat_stream", "final_response", "prepare"]

_ID_PREFIX = {"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}


def _body(request: Any) -> dict:
    if isinstance(request, (str, bytes, bytearray)):
        try:
            return json.loads(request)
        except ValueError:
            return {}
    return request if isinstance(request, dict) else {}


def _forced_tool_choice(body: dict, protocol: str) -> bool:
    """Whether the raw request forces a tool call (required, any, or a named tool)."""
    choice = body.get("tool_choice")
    if protocol == "messages":
        return isinstance(choice, dict) and choice.get("type") in ("any", "tool")
    return choice == "required" or isinstance(choice, dict)


def _check_supported(req, body: dict, protocol: str, max_logprobs: int) -> None:
    """The requests ``LLM.chat`` refuses although the official conversion accepts them."""
    if _forced_tool_choice(body, protocol) and not req.conversation.tools:
        raise recipe.ConversionError("tool_choice: a required or named tool choice needs at least one tool in "
                                     "'tools'", param="tool_choice")
    io = req.inference_options
    if protocol != "chat" and (io.logprobs or io.top_logprobs):
        field = "top_logprobs" if protocol == "responses" or not io.logprobs else "logprobs"
        raise recipe.ConversionError(f"{field}: only Chat Completions requests return logprobs here; use "
                                     "LLM.generate with SamplingParams(logprobs=k)", param=field)
    if io.logprobs and (io.top_logprobs or 0) > max_logprobs:
        raise recipe.ConversionError(f"top_logprobs: at most {max_logprobs} (the engine's max_logprobs), got "
                                     f"{io.top_logprobs}", param="top_logprobs")


def _grammar_constraint(req):
    """The output constraint to enforce: a json_schema format's schema as the user gave it."""
    constraint = req.inference_options.output_constraint
    conv = req.conversation
    if constraint is not None and constraint.kind == "json" and conv.response_format == "json_schema":
        return recipe.OutputConstraint("json", json.dumps(conv.response_schema))
    return constraint


@dataclass(frozen=True)
class PreparedRequest:
    """A protocol request made ready for the engine: the prompt ids, the sampling settings (the
    recipe's sampling fields, stops, structured-output grammar) and the stream parser's options."""

    ids: list[int]
    params: SamplingParams
    options: StreamOptions

    def parser(self, llm: LLM, accumulate: bool = False) -> StreamParser:
        """A fresh ``StreamParser`` for this request's output (``accumulate``: for ``response()``)."""
        return StreamParser(self.options, llm.parser_tokenizer, accumulate=accumulate)


def prepare(llm: LLM, request: Any, protocol: str) -> PreparedRequest:
    """Convert, render and encode a Chat Completions / Responses / Messages request (``protocol``
    "chat" / "responses" / "messages") for ``llm``'s engine. Raises ``recipe.ConversionError`` (status
    400, with ``param``) for what the protocol rejects, before anything runs."""
    return PreparedRequest(*_prepare(llm, request, protocol))


def final_response(llm: LLM, prepared: PreparedRequest, token_ids, finish_reason: str | None,
                   cached_tokens: int = 0, logprobs=None) -> dict:
    """The protocol's final response JSON (as the official library's ``to_json()``) for the generated
    ``token_ids`` of ``prepared``; ``finish_reason`` is the engine's ("length" or a stop), and
    ``cached_tokens`` the prompt tokens served from the prefix cache (reported in usage).
    ``logprobs`` (the engine's, one per token) become the Chat choice's ``logprobs`` when the
    request asked for them (``chat_logprobs``)."""
    parser = prepared.parser(llm, accumulate=True)
    parser.ready(prompt_tokens=len(prepared.ids), cache_hit_tokens=cached_tokens)
    eos = llm.engine.eos_token_id
    parsed = 0
    for token in token_ids:
        if token == eos or parser.finished:  # generation ended there; the end of sequence is not text
            break
        parser.push_ids([token])
        parsed += 1
    finish = None
    if not parser.finished:
        finish = "length" if finish_reason == "length" else "stop"
        parser.finish(finish)
    resp = parser.response()
    top = prepared.params.logprobs
    if top is not None and logprobs is not None and resp.get("choices"):
        resp["choices"][0]["logprobs"] = chat_logprobs(llm.tokenizer, logprobs[:parsed], top)
    warning = budget_warning(llm, prepared.params, prepared.options, token_ids, finish)
    if warning is not None:
        resp["warning"] = warning
    return resp


def _prepare(llm: LLM, request: Any, protocol: str) -> tuple[list[int], SamplingParams, StreamOptions]:
    req = recipe.convert_request(request, protocol, llm.conversion_options)
    body = _body(request)
    _check_supported(req, body, protocol, llm.engine.max_logprobs)
    tokenizer = llm.prompt_tokenizer
    ids = recipe.encode_rendered(recipe.render(req.conversation, req.model_version), tokenizer)
    max_tokens = req.resolve_max_tokens(len(ids), llm.max_model_len)  # ConversionError past the context
    io, po = req.inference_options, req.parsing_options
    stage = None if po.thinking_initial_stage is None else po.thinking_initial_stage.name.lower()
    constraint = structured_output_for(_grammar_constraint(req), stage in ("reasoning_start", "reasoning_continuation"),
                                       llm.tokenizer, v41=req.model_version.is_v41)
    params = SamplingParams(temperature=1.0 if io.temperature is None else float(io.temperature),
                            top_p=1.0 if io.top_p is None else float(io.top_p), max_tokens=max_tokens,
                            stop=list(po.stop_sequences) or None, seed=io.seed, structured_output=constraint,
                            logprobs=(io.top_logprobs or 0) if io.logprobs else None)
    parse = ParseOptions(parse_tool_calls=po.parse_tool_calls, starts_in_tool_calls=po.starts_in_tool_calls,
                         parse_json_output=po.parse_json_output, thinking_stage=stage,
                         stop_sequences=tuple(po.stop_sequences))
    options = StreamOptions(protocol=protocol, parse=parse, response_id=_ID_PREFIX[protocol] + uuid.uuid4().hex,
                            model=req.model or "DeepSeek-V4.1-Flash", created=int(time.time()),
                            responses_echo=responses_echo(body) if protocol == "responses" else None,
                            namespace_tool_map=dict(req.namespace_tool_map) or None,
                            chat_include_usage=protocol == "chat" and (
                                not req.stream or bool((body.get("stream_options") or {}).get("include_usage"))))
    return ids, params, options


def budget_warning(llm: LLM, params: SamplingParams, options: StreamOptions, token_ids, finish: str | None):
    """The ``warning`` of a thinking-mode output that hit ``max_tokens`` inside its reasoning."""
    if finish != "length" or options.parse.thinking_stage not in ("reasoning_start", "reasoning_continuation"):
        return None
    if llm.tokenizer.token_to_id("</think>") in token_ids:
        return None
    return {"code": "reasoning_budget_exhausted",
            "message": f"max_tokens ({params.max_tokens}) ran out while the model was still reasoning, so no content "
                       "or tool call was generated; raise max_tokens, lower the reasoning effort, or turn thinking "
                       'off (thinking: {"type": "disabled"} in the request, or LLM(default_thinking_mode=False))'}


def chat_stream(llm: LLM, request: Any, protocol: str = "chat") -> Iterator[StreamEvent]:
    """Yield the protocol's stream events while the engine generates (``event.sse()`` is the SSE text;
    Chat ends with ``data: [DONE]``, see ``StreamParser.sse_done``). Conversion errors
    (``recipe.ConversionError``, status 400) and request errors raise before anything runs."""
    ids, params, options = _prepare(llm, request, protocol)
    parser = StreamParser(options, llm.parser_tokenizer)
    engine = llm.engine
    rid = engine.add_request(ids, params)
    req = engine.requests[rid]
    yield from parser.ready(prompt_tokens=len(ids), cache_hit_tokens=0)
    seen, eos = 0, engine.eos_token_id
    pending = []  # logprobs of tokens whose text no chunk has shown yet
    top = params.logprobs
    try:
        while not req.finished:
            engine.step()
            new = req.output_ids[seen:]
            lps = req.logprobs[seen:] if req.logprobs is not None else []
            seen += len(new)
            keep = [k for k, t in enumerate(new) if t != eos]  # the end of sequence ends generation; it is not text
            if keep and not parser.finished:
                if top is not None:
                    pending += [lps[k] for k in keep]
                events = parser.push_ids([new[k] for k in keep])
                yield from attach(events, pending, llm.tokenizer, top) if top is not None else events
            if parser.finished and not req.finished:  # the parser saw a stop sequence
                engine.abort(rid)
        if not parser.finished:
            finish = "length" if req.finish_reason == "length" else "stop"
            events = parser.finish(finish)
            if top is not None:
                events = attach(events, pending, llm.tokenizer, top)
            warning = budget_warning(llm, params, options, req.output_ids, finish)
            if warning is not None and events:
                events[-1] = StreamEvent({**events[-1].data, "warning": warning}, events[-1].event)
            yield from events
    finally:
        if not req.finished:
            engine.abort(rid)
        engine.requests.pop(rid, None)


def chat(llm: LLM, request: Any, protocol: str = "chat") -> dict:
    """The protocol's final (non-streaming) response JSON, as the official library's ``to_json()``."""
    prepared = prepare(llm, request, protocol)
    result = llm.generate({"prompt_token_ids": prepared.ids}, prepared.params, use_tqdm=False)[0]
    out = result.outputs[0]
    return final_response(llm, prepared, out.token_ids, out.finish_reason, result.num_cached_tokens, out.logprobs)
