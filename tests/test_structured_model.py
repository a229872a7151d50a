"""Structured output end to end on the shipped model: JSON Schemas, regexes, mixed batches, chat."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from deepinfer_jax import LLM, RequestError, SamplingParams


@pytest.fixture(scope="module")
def llm():  # room for the ~270-token tool prompt of the chat test; the same engine shape as tests/test_chat.py
    return LLM(max_num_seqs=2, max_num_batched_tokens=64, token_buckets=(64,), block_size=32, max_model_len=512,
               chunking="tokens", use_tqdm=False)


def random_schema(rng: np.random.Generator, depth: int = 0) -> dict:
    """A small, bounded JSON Schema (every output of it fits in a few dozen tokens)."""
    props = {}
    for k in range(int(rng.integers(1, 4))):
        kind = rng.choice(["integer", "boolean", "enum", "string", "array"] + (["object"] if depth == 0 else []))
        if kind == "integer":
            lo = int(rng.integers(-50, 50))
            s = {"type": "integer", "minimum": lo, "maximum": lo + int(rng.integers(0, 200))}
        elif kind == "boolean":
            s = {"type": "boolean"}
        elif kind == "enum":
            s = {"enum": [str(w) for w in rng.choice(["red", "green", "blue", "os", "sys"], 3, replace=False)]}
        elif kind == "string":
            s = {"type": "string", "maxLength": int(rng.integers(1, 7))}
        elif kind == "array":
            s = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                 "maxItems": int(rng.integers(1, 4))}
        else:
            s = random_schema(rng, depth + 1)
        props[f"k{k}_{kind}"] = s
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def test_random_schemas_always_give_valid_json(llm):
    rng = np.random.default_rng(7)
    schemas = [random_schema(rng) for _ in range(6)]
    prompts = ["import os\n", "def f(x):\n", "# config\n", "class A:\n", "x = ", "data = {"]
    params = [SamplingParams(temperature=1.0, max_tokens=160, seed=i, structured_output={"json_schema": s})
              for i, s in enumerate(schemas)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for schema, out in zip(schemas, outs):
        o = out.outputs[0]
        assert o.finish_reason == "stop", (o.finish_reason, o.text)
        jsonschema.validate(json.loads(o.text), schema)


def test_regex_and_json_object_outputs(llm):
    patterns = [r"def [a-z_]{1,10}\((self)?\):", r"[0-9]{3}-[0-9]{4}", r"(True|False|None)"]
    params = [SamplingParams(temperature=0.9, max_tokens=40, seed=3, structured_output={"regex": p}) for p in patterns]
    params.append(SamplingParams(temperature=0.9, max_tokens=120, seed=3, structured_output={"json_object": True}))
    outs = llm.generate(["import os\n"] * 4, params, use_tqdm=False)
    for p, out in zip(patterns, outs):
        assert out.outputs[0].finish_reason == "stop" and re.fullmatch(p, out.outputs[0].text), out.outputs[0].text
    # an open JSON object may outrun its budget: every token must still be one the grammar allows
    o = outs[3].outputs[0]
    backend = llm.engine.structured.backend
    m = backend.matcher(backend.compile("json_object", "{}"))
    assert o.text.startswith("{") and all(m.consume(t) for t in o.token_ids)
    if o.finish_reason == "stop":
        assert isinstance(json.loads(o.text), dict)


def test_constrained_and_free_requests_do_not_affect_each_other(llm):
    free = SamplingParams(temperature=0.0, max_tokens=24)
    sampled = SamplingParams(temperature=1.0, max_tokens=24, seed=11)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    constrained = SamplingParams(temperature=1.0, max_tokens=40, seed=5, structured_output={"json_schema": schema})
    alone = [llm.generate(["import sys\n"], free, use_tqdm=False)[0].outputs[0].token_ids,
             llm.generate(["def main():\n"], sampled, use_tqdm=False)[0].outputs[0].token_ids,
             llm.generate(["x = 1\n"], constrained, use_tqdm=False)[0].outputs[0].token_ids]
    mixed = llm.generate(["import sys\n", "x = 1\n", "def main():\n"], [free, constrained, sampled], use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids, mixed[1].outputs[0].token_ids] == alone
    assert json.loads(mixed[1].outputs[0].text)["n"] in range(10)


def test_bad_constraints_are_refused_before_anything_runs(llm):
    steps = llm.engine.stats.steps
    good = SamplingParams(max_tokens=4)
    with pytest.raises(RequestError) as e:
        llm.generate(["a", "b"], [good, SamplingParams(structured_output={"regex": "[unclosed"})], use_tqdm=False)
    assert e.value.field.endswith("structured_output.regex") and "unclosed" in str(e.value)
    with pytest.raises(RequestError) as e:
        llm.generate(["a"], SamplingParams(structured_output={"json_schema": {"type": "nonsense"}}), use_tqdm=False)
    assert "json_schema" in e.value.field
    assert llm.engine.stats.steps == steps and not llm.engine.has_unfinished


def test_chat_response_format_and_required_tool_call(llm):
    # (strict schemas lose maxLength in the recipe's conversion, as in the official library: an enum bounds it)
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["city", "days"], "additionalProperties": False}
    base = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "Weather for Paris?"}],
            "max_tokens": 120, "temperature": 1.0, "seed": 2, "thinking": {"type": "disabled"}}
    out = llm.chat({**base, "response_format": {"type": "json_schema",
                                                "json_schema": {"name": "w", "schema": schema, "strict": True}}})
    jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), schema)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}]
    out = llm.chat({**base, "max_tokens": 200, "tools": tools, "tool_choice": "required"})
    calls = out["choices"][0]["message"]["tool_calls"]
    assert calls and all(c["function"]["name"] == "get_weather" for c in calls)
    for c in calls:
        args = json.loads(c["function"]["arguments"])
        assert set(args) <= {"city", "days"} and len(args.get("city", "")) <= 12 and args.get("days", 1) in range(1, 8)
