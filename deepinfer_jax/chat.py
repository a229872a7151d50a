"""``LLM.chat`` / ``LLM.chat_stream``: protocol requests through the recipe layer and the engine.

conversion (``recipe.convert_request``) -> rendering and encoding (special tokens only at template
positions) -> generation with the converted sampling settings -> the streaming parser
(``recipe.stream``), which turns generated ids into the protocol's stream events and, accumulated,
its final response JSON. Stop sequences are enforced by both the engine (generation ends) and
the parser (the text is cut where the official library cuts it).

The recipe's ``output_constraint`` (``response_format`` json_object / json_schema / regex, active
tools, a required tool call) is enforced as the request's ``structured_output`` grammar
(``chat_grammar``). Not wired: logprobs in responses.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from deepinfer_jax import recipe
from deepinfer_jax.chat_grammar import structured_output_for
from deepinfer_jax.engine import SamplingParams
from deepinfer_jax.recipe.stream import ParseOptions, StreamEvent, StreamOptions, StreamParser, responses_echo

if TYPE_CHECKING:
    from deepinfer_jax.llm import LLM

__all__ = ["chat", "chat_stream"]

_ID_PREFIX = {"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}


def _body(request: Any) -> dict:
    if isinstance(request, (str, bytes, bytearray)):
        try:
            return json.loads(request)
        except ValueError:
            return {}
    return request if isinstance(request, dict) else {}


def _prepare(llm: LLM, request: Any, protocol: str) -> tuple[list[int], SamplingParams, StreamOptions]:
    req = recipe.convert_request(request, protocol)
    tokenizer = llm.prompt_tokenizer
    ids = recipe.encode_rendered(recipe.render(req.conversation, req.model_version), tokenizer)
    max_tokens = req.resolve_max_tokens(len(ids), llm.max_model_len)  # ConversionError past the context
    io, po = req.inference_options, req.parsing_options
    stage = None if po.thinking_initial_stage is None else po.thinking_initial_stage.name.lower()
    constraint = structured_output_for(io.output_constraint, stage in ("reasoning_start", "reasoning_continuation"),
                                       llm.tokenizer, v41=req.model_version.is_v41)
    params = SamplingParams(temperature=1.0 if io.temperature is None else float(io.temperature),
                            top_p=1.0 if io.top_p is None else float(io.top_p), max_tokens=max_tokens,
                            stop=list(po.stop_sequences) or None, seed=io.seed, structured_output=constraint)
    parse = ParseOptions(parse_tool_calls=po.parse_tool_calls, starts_in_tool_calls=po.starts_in_tool_calls,
                         parse_json_output=po.parse_json_output, thinking_stage=stage,
                         stop_sequences=tuple(po.stop_sequences))
    body = _body(request)
    options = StreamOptions(protocol=protocol, parse=parse, response_id=_ID_PREFIX[protocol] + uuid.uuid4().hex,
                            model=req.model or "DeepSeek-V4.1-Flash", created=int(time.time()),
                            responses_echo=responses_echo(body) if protocol == "responses" else None,
                            namespace_tool_map=dict(req.namespace_tool_map) or None,
                            chat_include_usage=protocol == "chat" and (
                                not req.stream or bool((body.get("stream_options") or {}).get("include_usage"))))
    return ids, params, options


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
    try:
        while not req.finished:
            engine.step()
            new = req.output_ids[seen:]
            seen += len(new)
            new = [t for t in new if t != eos]  # the end of sequence ends generation; it is not text
            if new and not parser.finished:
                yield from parser.push_ids(new)
            if parser.finished and not req.finished:  # the parser saw a stop sequence
                engine.abort(rid)
        if not parser.finished:
            yield from parser.finish("length" if req.finish_reason == "length" else "stop")
    finally:
        if not req.finished:
            engine.abort(rid)
        engine.requests.pop(rid, None)


def chat(llm: LLM, request: Any, protocol: str = "chat") -> dict:
    """The protocol's final (non-streaming) response JSON, as the official library's ``to_json()``."""
    ids, params, options = _prepare(llm, request, protocol)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    parser = StreamParser(options, llm.parser_tokenizer, accumulate=True)
    parser.ready(prompt_tokens=len(ids), cache_hit_tokens=0)
    eos = llm.engine.eos_token_id
    for token in out.token_ids:
        if token == eos:  # generation ended there; the end of sequence is not text
            break
        if parser.finished:
            break
        parser.push_ids([token])
    if not parser.finished:
        parser.finish("length" if out.finish_reason == "length" else "stop")
    return parser.response()
