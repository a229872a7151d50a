"""The HTTP server (``deepinfer_jax.serve``) on 127.0.0.1, driven by the official ``openai`` and
``anthropic`` clients, with the shipped model: one server for the module."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import jsonschema
import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
uvicorn = pytest.importorskip("uvicorn")

from deepinfer_jax import LLM  # noqa: E402
from deepinfer_jax.chat import final_response, prepare  # noqa: E402
from deepinfer_jax.serve import build_app  # noqa: E402

MODEL = "DeepSeek-V4.1-Flash"
KEY = "test-key"
HI = [{"role": "user", "content": "Say hi."}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}]
PROMPTS = ["Say hi.", "Write a haiku.", "What is 2 + 2?", "Name a color."]


def _concurrent_body(i: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[i % 4]}], "max_tokens": 6,
            "temperature": 1.0, "seed": i}


@pytest.fixture(scope="module")
def llm():
    # the engine shape of tests/test_chat.py: the compiled programs are shared through the cache; "dspark" (what
    # "auto" resolves to) so that the drafter runs from the first step and /metrics has acceptance to report
    return LLM(max_num_seqs=2, max_num_batched_tokens=64, token_buckets=(64,), block_size=32, max_model_len=512,
               chunking="tokens", use_tqdm=False, default_thinking_mode=False, speculation="dspark")


@pytest.fixture(scope="module")
def offline(llm):
    """The 16 concurrent requests' answers from the offline engine (before the server owns it)."""
    prepared = [prepare(llm, _concurrent_body(i), "chat") for i in range(16)]
    outs = llm.generate([{"prompt_token_ids": p.ids} for p in prepared], [p.params for p in prepared],
                        use_tqdm=False)
    return [final_response(llm, p, o.outputs[0].token_ids, o.outputs[0].finish_reason)["choices"][0]
            for p, o in zip(prepared, outs)]


@pytest.fixture(scope="module")
def server(llm, offline):
    app = build_app(llm, api_key=KEY, max_queued=64, max_body_bytes=1 << 20)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", app.state.server
    srv.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key=KEY, max_retries=0, timeout=120)


def _engine(state, fn):
    return state.engine.call(fn).result(timeout=60)


def test_chat_non_streaming_and_streaming(oai):
    resp = oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length") and 1 <= resp.usage.completion_tokens <= 8
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=8, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [choice.finish_reason]
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_chat_logprobs_through_the_openai_client(oai):
    resp = oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert all(t.top_logprobs[0].token == t.token for t in content)  # greedy
    chunks = list(oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=6, temperature=0, logprobs=True,
                                              top_logprobs=2, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == [t.logprob for t in content]


def test_tool_call_round_trip(server, oai):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    resp = oai.chat.completions.create(model=MODEL, messages=ask, tools=WEATHER, tool_choice="required",
                                       max_tokens=60, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER[0]["function"]["parameters"])
    history = [*ask, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})}]
    body = {"model": MODEL, "messages": history, "tools": WEATHER, "tool_choice": "none", "max_tokens": 6,
            "temperature": 0}
    answer = oai.chat.completions.create(**body)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    llm = server[1].llm  # the prompt the server rendered holds the call and its result
    ids = prepare(llm, body, "chat").ids
    assert answer.usage.prompt_tokens == len(ids)
    rendered = llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert '"temp_c": 21' in rendered and "get_weather" in rendered and "Paris" in rendered


def test_response_format_json_schema(oai):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    resp = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A name and a number, as JSON."}], max_tokens=40,
        seed=0, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                        "strict": True}})
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].message.content), schema)


def test_responses_streaming_events(oai):
    kw = dict(model=MODEL, input="Say hi.", max_output_tokens=8, temperature=0)
    final = oai.responses.create(**kw)
    assert final.object == "response" and final.output_text
    events = list(oai.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete") and types[-1].split(".")[1] == final.status
    assert "response.output_text.delta" in types and "response.output_item.done" in types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert events[-1].response.usage.output_tokens == final.usage.output_tokens


def test_messages_streaming_events(claude):
    kw = dict(model=MODEL, max_tokens=8, messages=HI, extra_body={"temperature": 0})  # no such argument in 2.x
    final = claude.messages.create(**kw)
    assert final.type == "message" and final.role == "assistant" and final.content[0].type == "text"
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.input_tokens > 0
    with claude.messages.stream(**kw) as stream:
        types = [e.type for e in stream]
        message = stream.get_final_message()
    raw = [t for t in types if t not in ("text",)]  # the SDK adds "text" events beside the deltas
    assert raw[0] == "message_start" and raw[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(raw)
    assert message.content[0].text == final.content[0].text and message.stop_reason == final.stop_reason
    assert message.usage.output_tokens == final.usage.output_tokens


def test_completions_endpoint(oai):
    resp = oai.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=6, temperature=0)
    assert resp.object == "text_completion" and resp.usage.completion_tokens == 6
    chunks = list(oai.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=6, temperature=0,
                                         stream=True))
    assert "".join(c.choices[0].text for c in chunks) == resp.choices[0].text
    assert chunks[-1].choices[0].finish_reason == resp.choices[0].finish_reason == "length"


def test_sixteen_concurrent_streams_equal_the_offline_engine(server, offline):
    client = openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)

    async def one(i):
        text, finish = [], None
        stream = await client.chat.completions.create(**_concurrent_body(i), stream=True)
        async for chunk in stream:
            for c in chunk.choices:
                text.append(c.delta.content or "")
                finish = c.finish_reason or finish
        return "".join(text), finish

    async def main():
        try:
            return await asyncio.gather(*[one(i) for i in range(16)])
        finally:
            await client.close()

    got = asyncio.run(main())
    want = [(c["message"].get("content") or "", c["finish_reason"]) for c in offline]
    assert got == want
    assert len({t for t, _ in got}) > 1  # the seeds differ, so do the answers
    assert server[1].engine.num_admitted == 0


def test_client_disconnect_mid_stream_frees_blocks(server):
    base, state = server
    aborted = state.engine.aborted
    body = {"model": MODEL, "messages": HI, "max_tokens": 400, "stream": True, "temperature": 1.0, "seed": 0}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # streaming has begun
        used = _engine(state, lambda: state.llm.engine.scheduler.pool.used_count)
    deadline = time.time() + 30
    while state.engine.aborted == aborted or state.engine.num_admitted:
        assert time.time() < deadline, "the request was not aborted after the client left"
        time.sleep(0.05)
    assert used > 0
    assert _engine(state, lambda: state.llm.engine.scheduler.pool.used_count) == 0


def test_client_gone_before_a_non_streaming_answer_aborts_it(server):
    base, state = server
    aborted = state.engine.aborted
    body = {"model": MODEL, "messages": HI, "max_tokens": 400, "temperature": 1.0, "seed": 0}  # runs 400 tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=1.0)
    deadline = time.time() + 30
    while state.engine.aborted == aborted or state.engine.num_admitted:
        assert time.time() < deadline, "the request was not aborted after the client left"
        time.sleep(0.05)
    assert _engine(state, lambda: state.llm.engine.scheduler.pool.used_count) == 0


def test_bad_requests_get_the_protocols_error_and_the_server_keeps_serving(server, oai, claude):
    base, state = server
    auth = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(base + "/v1/chat/completions", content=b'{"model": ', headers=auth)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "JSON" in r.json()["error"]["message"]
    r = httpx.post(base + "/v1/messages", content=b"[1, 2]", headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "JSON object" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-17", messages=HI, max_tokens=4)
    assert e.value.status_code == 404 and e.value.body["param"] == "model" and e.value.code == "model_not_found"
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-17", max_tokens=4, messages=HI)
    assert e.value.body["error"]["type"] == "not_found_error" and "model" in e.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, temperature=5)
    assert "temperature" in e.value.message  # the recipe's message
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=0, messages=HI)
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=4, n=3)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):  # far past the context length
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 2000}], max_tokens=4)
    r = httpx.post(base + "/v1/chat/completions", content=b"x" * (2 << 20), headers=auth)
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("the request body is larger")
    state.engine.max_queued, queued = 0, state.engine.max_queued
    try:
        with pytest.raises(openai.InternalServerError) as e:
            oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=4)
        assert e.value.status_code == 503 and e.value.code == "overloaded"
        assert e.value.response.headers["retry-after"] == "1"
        with pytest.raises(anthropic.APIStatusError) as e:
            claude.messages.create(model=MODEL, max_tokens=4, messages=HI)
        assert e.value.status_code == 503 and e.value.body["error"]["type"] == "overloaded_error"
    finally:
        state.engine.max_queued = queued
    assert oai.chat.completions.create(model=MODEL, messages=HI, max_tokens=2).choices[0].message.content
    assert httpx.get(base + "/health").json() == {"status": "ok"}


def test_api_key_is_required(server):
    base, _ = server
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=HI)
    assert e.value.body["error"]["type"] == "authentication_error"
    assert httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
    assert httpx.get(base + "/health").status_code == 200  # open without the key


def test_models_and_metrics(server, oai, claude):
    base, _ = server
    assert MODEL in [m.id for m in oai.models.list()]
    assert MODEL in [m.id for m in claude.models.list()]
    assert oai.models.retrieve(MODEL).id == MODEL
    text = httpx.get(base + "/metrics").text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(samples['deepinfer_requests_total{endpoint="/v1/chat/completions",status="200"}']) >= 16
    assert float(samples['deepinfer_requests_total{endpoint="/v1/chat/completions",status="400"}']) >= 1
    assert float(samples["deepinfer_time_to_first_token_seconds_count"]) >= 16
    assert float(samples['deepinfer_time_per_output_token_seconds_bucket{le="+Inf"}']) >= 16
    assert float(samples["deepinfer_generation_tokens_total"]) >= 16 * 5
    assert float(samples["deepinfer_kv_blocks_total"]) > 0 and float(samples["deepinfer_kv_blocks_used"]) == 0
    assert 0 <= float(samples["deepinfer_prefix_cache_hit_rate"]) <= 1
    assert 0 <= float(samples["deepinfer_spec_acceptance_rate"]) <= 1
    assert float(samples["deepinfer_engine_steps_total"]) > 0 and samples["deepinfer_requests_running"] == "0"
