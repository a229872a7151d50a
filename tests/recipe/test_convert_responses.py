"""Differential tests: Responses conversion vs the official deepseek-recipe 0.2.0 wheel.

Besides the converted request, the namespace tool map and the echoed request settings are compared.
"""

from __future__ import annotations

import copy
import random

import pytest
from gen_requests import random_responses
from recipe_oracle import compare_convert, diff, dr, options_pair  # skips the module when the wheel is missing

from deepinfer_jax import recipe

V41, V4 = "DeepSeek-V4.1-Flash", "DeepSeek-V4-Pro"


def _fc(i: str, name: str = "f", **kw: object) -> dict:
    return {"type": "function_call", "call_id": i, "name": name, "arguments": '{"x": 1}', **kw}


def _fo(i: str, output: object = "out") -> dict:
    return {"type": "function_call_output", "call_id": i, "output": output}


def _r(*texts: str) -> dict:
    return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": t} for t in texts]}


U = {"role": "user", "content": "question"}
NS = {"type": "namespace", "name": "fs", "description": "Files", "tools": [
    {"type": "function", "name": "read", "description": "Read a file", "parameters": {"type": "object"}},
    {"type": "function", "name": "write"}]}

CURATED: list[tuple[str, dict, dict]] = [
    ("string-input", {"model": V41, "input": "hello", "instructions": "be nice"}, {}),
    ("empty-instructions", {"model": V41, "input": "x", "instructions": ""}, {}),
    ("no-input", {"model": V41}, {}),
    ("empty-items", {"model": V41, "input": []}, {}),
    ("roles", {"model": V41, "input": [{"role": "developer", "content": "d"}, U, {"role": "system", "content": "s"}]},
     {}),
    ("roles-v4", {"model": V4, "input": [{"role": "developer", "content": "d"}, U, {"role": "system", "content": "s"}]},
     {}),
    ("parts", {"model": V41, "input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "https://x/i.png", "detail": "low"},
        {"type": "input_file", "file_id": "f"}, {"type": "output_text", "text": "b"}]}]}, {}),
    ("image-file-id", {"model": V41, "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "x"}]}]},
     {}),
    ("assistant-image", {"model": V41, "input": [U, {"role": "assistant", "content": [
        {"type": "input_image", "image_url": "https://x"}]}]}, {}),
    ("reasoning-then-call", {"model": V41, "input": [U, _r("think", "more"), _fc("c1"), _fo("c1"),
                                                     {"role": "assistant", "content": "done"}]}, {}),
    ("reasoning-alone", {"model": V41, "input": [U, _r("r1"), _r("r2"), U]}, {}),
    ("calls-reordered-outputs", {"model": V41, "input": [U, {"role": "assistant", "content": "a"}, _fc("c1"),
                                                         _fc("c2", "g"), _fo("c2"), _fo("c1", [
                                                             {"type": "input_text", "text": "o1"},
                                                             {"type": "input_image", "image_url": "https://i"}])]}, {}),
    ("missing-output", {"model": V41, "input": [U, _fc("c1"), U, _fo("c1")]}, {}),
    ("output-without-call", {"model": V41, "input": [U, _fo("c9")]}, {}),
    ("duplicate-call-id", {"model": V41, "input": [U, _fc("c1"), _fo("c1"), _fc("c1"), _fo("c1")]}, {}),
    ("duplicate-output", {"model": V41, "input": [U, _fc("c1"), _fo("c1"), _fo("c1")]}, {}),
    ("namespaced-call", {"model": V41, "input": [U, _fc("c1", "read", namespace="fs"), _fo("c1")], "tools": [NS]}, {}),
    ("namespaced-call-v4", {"model": V4, "input": [U, _fc("c1", "read", namespace="fs"), _fo("c1")], "tools": [NS]},
     {}),
    ("custom-tool-call", {"model": V41, "input": [
        U, {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "ok"}]}, {}),
    ("apply-patch-tool", {"model": V41, "input": "x", "tools": [{"type": "custom", "name": "apply_patch"}]}, {}),
    ("apply-patch-tool-v4", {"model": V4, "input": "x", "tools": [{"type": "custom", "name": "apply_patch"}]}, {}),
    ("custom-other", {"model": V41, "input": "x", "tools": [{"type": "custom", "name": "other"}]}, {}),
    ("web-search-dropped", {"model": V41, "input": "x", "tools": [{"type": "web_search"}]}, {}),
    ("web-search-rejected", {"model": V41, "input": "x", "tools": [{"type": "web_search"}]},
     {"responses_web_search_reject": True}),
    ("hosted-tools-dropped", {"model": V41, "input": "x", "tools": [{"type": "file_search"}, {"type": "mcp"}]}, {}),
    ("tool-choice-named", {"model": V41, "input": "x", "reasoning": {"effort": "none"}, "tools": [NS],
                           "tool_choice": {"type": "function", "name": "fs::read"}}, {}),
    ("tool-choice-custom", {"model": V41, "input": "x", "reasoning": {"effort": "none"},
                            "tools": [{"type": "custom", "name": "apply_patch"}],
                            "tool_choice": {"type": "custom", "name": "apply_patch"}}, {}),
    ("tool-choice-web-search", {"model": V41, "input": "x", "tool_choice": {"type": "web_search"}}, {}),
    ("effort-low", {"model": V41, "input": "x", "reasoning": {"effort": "low"}, "max_output_tokens": 100,
                    "temperature": 0.5, "top_p": 0.5}, {}),
    ("effort-none-sampling", {"model": V41, "input": "x", "reasoning": {"effort": "none"}, "temperature": 0.5,
                              "top_p": 0.5, "top_logprobs": 3, "stream": True, "user": "u1"}, {}),
    ("max-output-tokens-too-big", {"model": V41, "input": "x", "max_output_tokens": 10**6}, {}),
    ("json-object", {"model": V41, "input": "json please", "text": {"format": {"type": "json_object"}}}, {}),
    ("json-object-no-word", {"model": V41, "input": "x", "text": {"format": {"type": "json_object"}}}, {}),
    ("json-schema-strict", {"model": V41, "input": "x", "text": {"format": {
        "type": "json_schema", "name": "n", "strict": True,
        "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}}, {}),
    ("strict-tools-text-format", {"model": V41, "input": "x", "text": {"format": {"type": "text"}}, "tools": [
        {"type": "function", "name": "f", "strict": True}]}, {}),
    ("reasoning-reject", {"model": V41, "input": [U, _fc("c1"), _fo("c1")]}, {"reasoning_reject": True}),
    ("unknown-item-ignored", {"model": V41, "input": [U, {"type": "item_reference", "id": "x"}]}, {}),
    ("tool-name-pattern", {"model": V41, "input": "x", "tools": [{"type": "function", "name": "ok"},
                                                               {"type": "function", "name": "a.b"}]}, {}),
    ("namespace-inner-tool-name", {"model": V41, "input": "x", "tools": [{"type": "namespace", "name": "fs",
        "description": "d", "tools": [{"type": "function", "name": "r d"}]}]}, {}),
    ("tool-name-empty-before-input", {"model": V41, "input": [], "tools": [{"type": "function", "name": ""}]}, {}),
]


@pytest.mark.parametrize("name,body,opts", CURATED, ids=[c[0] for c in CURATED])
def test_responses_conversion_matches_official(name: str, body: dict, opts: dict) -> None:
    official, ours = compare_convert(body, "responses", **opts)
    assert official == ours, "\n".join(diff(official, ours))


def _echo_and_map(body: dict) -> tuple[dict, dict]:
    w_opts, o_opts = options_pair()
    req = dr.ResponsesRequest(copy.deepcopy(body))
    e = req.echo()
    official = {"echo": {k: getattr(e, k) for k in ("instructions", "max_output_tokens", "temperature", "top_p",
                                                       "top_logprobs", "user")},
                "map": {k: tuple(v) for k, v in req.namespace_tool_map(w_opts).items()}}
    conv = recipe.convert_request(copy.deepcopy(body), "responses", o_opts)
    return official, {"echo": dict(conv.echo), "map": dict(conv.namespace_tool_map)}


@pytest.mark.parametrize("model", [V41, V4])
def test_responses_echo_and_namespace_map_match_official(model: str) -> None:
    body = {"model": model, "input": "x", "instructions": "i", "max_output_tokens": 9, "temperature": 0.3,
            "top_p": 0.7, "top_logprobs": 2, "user": "u", "tools": [NS, {"type": "custom", "name": "apply_patch"}]}
    official, ours = _echo_and_map(body)
    assert official == ours
    official, ours = _echo_and_map({"model": model, "input": "x"})
    assert official == ours


SEEDS = 160


@pytest.mark.parametrize("block", range(8))
def test_responses_random_requests_match_official(block: int) -> None:
    for seed in range(block * SEEDS // 8, (block + 1) * SEEDS // 8):
        rng = random.Random(seed)
        body = random_responses(rng)
        opts = {"default_thinking_mode": rng.random() > 0.2, "reasoning_reject": rng.random() < 0.1,
                "responses_web_search_reject": rng.random() < 0.15}
        official, ours = compare_convert(body, "responses", **opts)
        assert official == ours, f"seed {seed}: " + "\n".join(diff(official, ours))
