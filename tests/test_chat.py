"""``LLM.chat`` / ``LLM.chat_stream`` on the shipped model for the three protocols."""

from __future__ import annotations

import json

import pytest

from deepinfer_jax import LLM, recipe


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
