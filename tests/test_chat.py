"""``LLM.chat`` / ``LLM.chat_stream`` on the shipped model for the three protocols."""

from __future__ import annotations

import json

import jsonschema
import pytest

from deepinfer_jax import LLM, recipe
from deepinfer_jax.chat import prepare


@pytest.fixture(scope="module")
def llm():
    # the engine shape of tests/test_structured_model.py: the compiled programs are shared through the cache
    return LLM(max_num_seqs=2, max_num_batched_tokens=64, token_buckets=(64,), block_size=32, max_model_len=512,
               chunking="tokens", use_tqdm=False)


REQUESTS = {
    "chat": {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "Say hi."}],
             "max_tokens": 12, "temperature": 0, "thinking": {"type": "disabled"}},
    "responses": {"model": "DeepSeek-V4.1-Flash", "input": "Say hi.", "max_output_tokens": 12, "temperature": 0,
                  "reasoning": {"effort": "none"}},
    "messages": {"model": "DeepSeek-V4.1-Flash", "max_tokens": 12, "temperature": 0,
                 "thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "Say hi."}]},
}


def _text(protocol, resp):
    if protocol == "chat":
        return resp["choices"][0]["message"].get("content") or ""
    if protocol == "responses":
        return "".join(c.get("text", "") for o in resp["output"] if o["type"] == "message" for c in o["content"])
    return "".join(b.get("text", "") for b in resp["content"] if b["type"] == "text")


def _stream_text(protocol, events):
    out = []
    for e in events:
        d = e.data
        if protocol == "chat":
            out += [c["delta"].get("content") or "" for c in d.get("choices", [])]
        elif protocol == "responses" and d.get("type") == "response.output_text.delta":
            out.append(d["delta"])
        elif protocol == "messages" and d.get("type") == "content_block_delta" and d["delta"]["type"] == "text_delta":
            out.append(d["delta"]["text"])
    return "".join(out)


@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
def test_chat_and_stream_agree_for_each_protocol(llm, protocol):
    request = REQUESTS[protocol]
    resp = llm.chat(request, protocol)
    ids = recipe.encode_rendered(recipe.render(*(lambda r: (r.conversation, r.model_version))(
        recipe.convert_request(request, protocol))), llm.prompt_tokenizer)
    usage = resp["usage"]
    assert usage.get("prompt_tokens", usage.get("input_tokens")) == len(ids)
    out_tokens = usage.get("completion_tokens", usage.get("output_tokens"))
    assert 1 <= out_tokens <= 12
    events = list(llm.chat_stream(json.dumps(request), protocol))
    assert events and all(e.to_json() for e in events)
    assert _text(protocol, resp)  # the random model's text is gibberish, but there is some
    assert _stream_text(protocol, events) == _text(protocol, resp)
    assert not llm.engine.has_unfinished and llm.engine.scheduler.pool.used_count == 0


def test_bad_request_is_a_400_before_anything_runs(llm):
    steps = llm.engine.stats.steps
    with pytest.raises(recipe.ConversionError) as e:
        llm.chat({"model": "DeepSeek-V4.1-Flash", "messages": []}, "chat")
    assert e.value.status_code == 400
    with pytest.raises(recipe.ConversionError):
        llm.chat({**REQUESTS["chat"], "max_tokens": 10_000}, "chat")  # past the context
    assert llm.engine.stats.steps == steps


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]


def test_thinking_default_is_the_engine_setting(llm):
    assert llm.engine_config.default_thinking_mode is True  # the official default, documented in docs/usage.md
    assert llm.conversion_options.default_thinking_mode is True
    body = {"model": "DeepSeek-V4.1-Flash", "messages": ASK, "tools": WEATHER, "tool_choice": "required",
            "max_tokens": 60, "temperature": 0}
    with pytest.raises(recipe.ConversionError, match="Thinking mode does not support"):
        llm.chat(body)
    before = llm.conversion_options
    llm.conversion_options = recipe.ConversionOptions(default_thinking_mode=False)
    try:
        resp = llm.chat(body)
    finally:
        llm.conversion_options = before
    calls = resp["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), WEATHER[0]["function"]["parameters"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_satisfies_the_users_schema(llm, seed):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                               "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    resp = llm.chat({"model": "DeepSeek-V4.1-Flash", "messages": ASK, "max_tokens": 40, "seed": seed,
                     "temperature": 1.0, "thinking": {"type": "disabled"},
                     "response_format": {"type": "json_schema",
                                         "json_schema": {"name": "x", "schema": schema, "strict": True}}})
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_reasoning_budget_exhausted_is_reported(llm):
    body = {"model": "DeepSeek-V4.1-Flash", "messages": ASK, "max_tokens": 3, "seed": 0,
            "response_format": {"type": "json_object"}}  # thinking on by default
    resp = llm.chat(body)
    assert resp["choices"][0]["finish_reason"] == "length" and not resp["choices"][0]["message"].get("content")
    assert resp["warning"]["code"] == "reasoning_budget_exhausted" and "max_tokens (3)" in resp["warning"]["message"]
    events = list(llm.chat_stream({**body, "stream": True}))
    assert [e for e in events if "warning" in e.data][-1].data["warning"]["code"] == "reasoning_budget_exhausted"
    ok = llm.chat({**body, "max_tokens": 12, "thinking": {"type": "disabled"}})
    assert "warning" not in ok


def test_chat_refuses_what_it_would_silently_ignore(llm):
    base = {"model": "DeepSeek-V4.1-Flash", "messages": ASK, "thinking": {"type": "disabled"}, "max_tokens": 4}
    with pytest.raises(recipe.ConversionError) as e:
        llm.chat({**base, "tool_choice": "required"})
    assert e.value.param == "tool_choice" and "tool_choice" in e.value.message
    with pytest.raises(recipe.ConversionError) as e:
        llm.chat({**base, "logprobs": True, "top_logprobs": 6})  # the engine keeps 5
    assert e.value.param == "top_logprobs" and "max_logprobs" in e.value.message
    with pytest.raises(recipe.ConversionError) as e:
        llm.chat({"model": "DeepSeek-V4.1-Flash", "input": "hi", "top_logprobs": 2}, "responses")
    assert e.value.param == "top_logprobs"
    with pytest.raises(recipe.ConversionError) as e:
        llm.chat({"model": "DeepSeek-V4.1-Flash", "max_tokens": 4, "messages": ASK, "tool_choice": {"type": "any"}},
                 "messages")
    assert e.value.param == "tool_choice"


def test_chat_logprobs_are_the_engines_in_openai_shape(llm):
    body = {"model": "DeepSeek-V4.1-Flash", "messages": ASK, "thinking": {"type": "disabled"}, "max_tokens": 6,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    resp = llm.chat(body)
    prepared = prepare(llm, body, "chat")
    ref = llm.generate({"prompt_token_ids": prepared.ids}, prepared.params, use_tqdm=False)[0].outputs[0]
    content = resp["choices"][0]["logprobs"]["content"]
    eos = llm.engine.eos_token_id
    tokens = [t for t in ref.token_ids if t != eos]
    assert len(content) == len(tokens) == resp["usage"]["completion_tokens"] - (eos in ref.token_ids)
    for entry, lp, t in zip(content, ref.logprobs, tokens):
        assert entry["logprob"] == pytest.approx(lp.logprob, abs=1e-6) and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["bytes"] == entry["bytes"]  # greedy: the chosen token is the top one
    raw = b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", "replace")
    answer = resp["choices"][0]["message"]["content"]  # the parser drops the answer's leading newlines
    assert answer and raw.endswith(answer) and not raw[: len(raw) - len(answer)].strip()
    streamed = [c for e in llm.chat_stream({**body, "stream": True}) for c in e.data.get("choices", [])
                if c.get("logprobs")]
    assert [x["logprob"] for c in streamed for x in c["logprobs"]["content"]] == [e["logprob"] for e in content]
    assert "logprobs" not in llm.chat({**body, "logprobs": False, "top_logprobs": None})["choices"][0] or \
        llm.chat({**body, "logprobs": False, "top_logprobs": None})["choices"][0]["logprobs"] is None
