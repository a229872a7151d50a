"""Differential tests: Chat Completions conversion vs the official deepseek-recipe 0.2.0 wheel.

Every field of the converted request (conversation, inference options, parsing options, model version,
stream flag) or of the error (kind, status, OpenAI-style body) must be equal. Curated cases follow
recipe.md §2 and §12; seeded random requests cover the combinations.
"""

from __future__ import annotations

import random

import pytest
from gen_requests import random_chat
from recipe_oracle import compare_convert, diff  # skips the module when the wheel is missing

V41, V4 = "DeepSeek-V4.1-Flash", "DeepSeek-V4-Pro"
U = [{"role": "user", "content": "hi"}]
F = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _call(i: str, args: str = "{}") -> dict:
    return {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": args}}


def _tc(*ids: str, **kw: object) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [_call(i) for i in ids], **kw}


def _tm(i: str) -> dict:
    return {"role": "tool", "tool_call_id": i, "content": f"result {i}"}


CURATED: list[tuple[str, dict, dict]] = [
    ("v41-default", {"model": V41, "messages": U}, {}),
    ("v4-default", {"model": V4, "messages": U}, {}),
    ("unknown-model", {"model": "deepseek-flash", "messages": U}, {}),
    ("alias-model", {"model": "my-flash", "messages": U}, {"alias": ("my-flash", "v4.1")}),
    ("thinking-disabled", {"model": V41, "messages": U, "thinking": {"type": "disabled"}}, {}),
    ("thinking-adaptive", {"model": V4, "messages": U, "thinking": {"type": "adaptive"}}, {}),
    ("default-thinking-off", {"model": V41, "messages": U}, {"default_thinking_mode": False}),
    ("effort-none", {"model": V41, "messages": U, "reasoning_effort": "none"}, {}),
    ("effort-none-but-enabled", {"model": V41, "messages": U, "reasoning_effort": "none",
                                 "thinking": {"type": "enabled"}}, {}),
    ("effort-minimal", {"model": V41, "messages": U, "reasoning_effort": "minimal"}, {}),
    ("effort-medium", {"model": V41, "messages": U, "reasoning_effort": "medium"}, {}),
    ("effort-xhigh", {"model": V4, "messages": U, "reasoning_effort": "xhigh"}, {}),
    ("effort-ultra", {"model": V41, "messages": U, "reasoning_effort": "ultra"}, {}),
    ("effort-turns-thinking-on", {"model": V41, "messages": U, "reasoning_effort": "high"},
     {"default_thinking_mode": False}),
    ("temperature-f32", {"model": V41, "messages": U, "temperature": 0.3, "thinking": {"type": "disabled"}}, {}),
    ("temperature-ignored-thinking", {"model": V41, "messages": U, "temperature": 0.3}, {}),
    ("temperature-out-of-range", {"model": V41, "messages": U, "temperature": 2.5}, {}),
    ("top-p-v41-thinking-raised", {"model": V41, "messages": U, "top_p": 0.5}, {}),
    ("top-p-v41-thinking-kept", {"model": V41, "messages": U, "top_p": 0.97}, {}),
    ("top-p-v41-off-ignored", {"model": V41, "messages": U, "top_p": 0.5, "thinking": {"type": "disabled"}}, {}),
    ("top-p-v4-thinking-tools", {"model": V4, "messages": U, "top_p": 0.5, "tools": F}, {}),
    ("top-p-v4-off", {"model": V4, "messages": U, "top_p": 0.5, "thinking": {"type": "disabled"}}, {}),
    ("top-p-zero", {"model": V41, "messages": U, "top_p": 0}, {}),
    ("max-tokens-bound", {"model": V41, "messages": U, "max_tokens": 393217}, {}),
    ("max-tokens-custom-bound", {"model": V41, "messages": U, "max_tokens": 1000}, {"thinking_bound": 999}),
    ("max-completion-tokens-ignored", {"model": V41, "messages": U, "max_completion_tokens": 7}, {}),
    ("n-2", {"model": V41, "messages": U, "n": 2}, {}),
    ("top-logprobs-needs-logprobs", {"model": V41, "messages": U, "top_logprobs": 3}, {}),
    ("top-logprobs-range", {"model": V41, "messages": U, "top_logprobs": 21, "logprobs": True}, {}),
    ("seed-range", {"model": V41, "messages": U, "seed": 2**63}, {}),
    ("seed-negative", {"model": V41, "messages": U, "seed": -1}, {}),
    ("stop-string", {"model": V41, "messages": U, "stop": "END"}, {}),
    ("stop-empty", {"model": V41, "messages": U, "stop": ""}, {}),
    ("stop-list-empty-item", {"model": V41, "messages": U, "stop": ["a", ""]}, {}),
    ("stop-too-many", {"model": V41, "messages": U, "stop": ["x"] * 17}, {}),
    ("stream-options-without-stream", {"model": V41, "messages": U, "stream_options": {"include_usage": True}}, {}),
    ("stream", {"model": V41, "messages": U, "stream": True, "stream_options": {"include_usage": True}}, {}),
    ("unknown-fields-ignored", {"model": V41, "messages": U, "presence_penalty": 1, "foo": "bar"}, {}),
    ("empty-messages", {"model": V41, "messages": []}, {}),
    ("developer-role", {"model": V41, "messages": [{"role": "developer", "content": "x"}]}, {}),
    ("thinking-type-auto", {"model": V41, "messages": U, "thinking": {"type": "auto"}}, {}),
    ("parts-text-and-images", {"model": V41, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "https://x/a.png"}},
        {"type": "text", "text": "typed <｜image｜> stays text"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}}]}]}, {}),
    ("parts-images-v4-unsupported", {"model": V4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://x/a.png"}}, {"type": "file", "file": {}}]}]}, {}),
    ("image-bad-scheme", {"model": V41, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "ftp://x"}}]}]}, {}),
    ("image-bad-mime", {"model": V41, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:text/plain;base64,AA"}}]}]}, {}),
    ("image-bad-base64", {"model": V41, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,A"}}]}]}, {}),
    ("file-part", {"model": V41, "messages": [{"role": "user", "content": [
        {"type": "file", "file": {"file_id": "f"}}]}]},
     {}),
    ("assistant-image", {"model": V41, "messages": U + [{"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": "https://x"}}]}]}, {}),
    ("assistant-null-content", {"model": V41, "messages": U + [{"role": "assistant", "content": None}]}, {}),
    ("empty-system-dropped", {"model": V41, "messages": [{"role": "system", "content": ""}] + U}, {}),
    ("latest-reminder", {"model": V41, "messages": U + [{"role": "latest_reminder", "content": "be brief"}]}, {}),
    ("tool-history-reordered", {"model": V41, "messages": U + [_tc("a", "b"), _tm("b"), _tm("a")], "tools": F}, {}),
    ("tool-orphan", {"model": V41, "messages": U + [_tm("a")]}, {}),
    ("tool-insufficient", {"model": V41, "messages": U + [_tc("a", "b"), _tm("a")]}, {}),
    ("tool-wrong-id", {"model": V41, "messages": U + [_tc("a"), _tm("z")]}, {}),
    ("tool-duplicate-call-ids", {"model": V41, "messages": U + [_tc("a", "a"), _tm("a")]}, {}),
    ("tool-calls-empty", {"model": V41, "messages": U + [{"role": "assistant", "content": "x", "tool_calls": []}]}, {}),
    ("non-object-arguments", {"model": V41, "messages": U + [
        {"role": "assistant", "content": "", "tool_calls": [_call("a", "[1, 2]"), _call("b", "not json")]},
        _tm("a"), _tm("b")], "tools": F}, {}),
    ("prefix", {"model": V41, "messages": U + [{"role": "assistant", "content": "Sure, ", "prefix": True}]}, {}),
    ("prefix-reasoning", {"model": V41, "messages": U + [
        {"role": "assistant", "content": "", "reasoning_content": "so", "prefix": True}]}, {}),
    ("prefix-not-last", {"model": V41, "messages": U + [{"role": "assistant", "content": "a", "prefix": True}] + U},
     {}),
    ("prefix-with-tools", {"model": V41, "messages": U + [{"role": "assistant", "content": "a", "prefix": True}],
                           "tools": F}, {}),
    ("prefix-json-object", {"model": V41, "messages": [{"role": "user", "content": "json"},
                                                       {"role": "assistant", "content": "{", "prefix": True}],
                            "response_format": {"type": "json_object"}}, {}),
    ("tool-choice-none", {"model": V41, "messages": U, "tools": F, "tool_choice": "none"}, {}),
    ("tool-choice-required-thinking", {"model": V41, "messages": U, "tools": F, "tool_choice": "required"}, {}),
    ("tool-choice-required", {"model": V41, "messages": U, "tools": F, "tool_choice": "required",
                              "thinking": {"type": "disabled"}}, {}),
    ("tool-choice-named", {"model": V4, "messages": U, "tools": F + [{"type": "function", "function": {"name": "g"}}],
                           "tool_choice": {"type": "function", "function": {"name": "g"}},
                           "thinking": {"type": "disabled"}}, {}),
    ("tool-choice-named-unknown", {"model": V41, "messages": U, "tools": F, "thinking": {"type": "disabled"},
                                   "tool_choice": {"type": "function", "function": {"name": "zz"}}}, {}),
    ("required-without-tools", {"model": V41, "messages": U, "tool_choice": "required"}, {}),
    ("duplicate-tools", {"model": V41, "messages": U, "tools": F + F}, {}),
    ("strict-tool", {"model": V41, "messages": U, "tools": [{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "object", "properties": {
            "a": {"type": "string", "minLength": 1}, "b": {"type": "array", "items": {"type": "integer"}}}}}}]}, {}),
    ("strict-required-mismatch", {"model": V41, "messages": U, "tools": [{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "object", "properties": {"a": {"type": "string"}},
                                                    "required": []}}}]}, {}),
    ("strict-mixed", {"model": V41, "messages": U, "tools": F + [{"type": "function", "function": {
        "name": "s", "strict": True}}]}, {}),
    ("strict-with-response-format", {"model": V41, "messages": U, "response_format": {"type": "text"}, "tools": [
        {"type": "function", "function": {"name": "s", "strict": True}}]}, {}),
    ("nonstrict-bad-schema", {"model": V41, "messages": U, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}]}, {}),
    ("json-object", {"model": V41, "messages": [{"role": "user", "content": "Answer in JSON"}],
                     "response_format": {"type": "json_object"}}, {}),
    ("json-object-no-word", {"model": V41, "messages": U, "response_format": {"type": "json_object"}}, {}),
    ("json-schema", {"model": V41, "messages": U, "response_format": {"type": "json_schema", "json_schema": {
        "name": "o", "schema": {"type": "object", "properties": {"x": {"type": "number", "maximum": 1e-7}}}}}}, {}),
    ("json-schema-strict", {"model": V41, "messages": U, "response_format": {"type": "json_schema", "json_schema": {
        "name": "o", "strict": True, "schema": {"type": "object", "properties": {"x": {"type": "string"}}}}}}, {}),
    ("json-schema-strict-empty", {"model": V41, "messages": U, "response_format": {"type": "json_schema",
                                  "json_schema": {"name": "o", "strict": True, "schema": {"type": "object"}}}}, {}),
    ("regex", {"model": V41, "messages": U, "response_format": {"type": "regex", "regex": "[a-z]+"}}, {}),
    ("reasoning-reject", {"model": V41, "messages": U + [_tc("a"), _tm("a")]}, {"reasoning_reject": True}),
    ("reasoning-reject-declared-tools", {"model": V41, "messages": U + [{"role": "assistant", "content": "x"}],
                                         "tools": F}, {"reasoning_reject": True}),
    ("reasoning-dropped-off", {"model": V41, "messages": U + [{"role": "assistant", "content": "x",
                                                               "reasoning_content": "r"}] + U,
                               "thinking": {"type": "disabled"}}, {}),
    ("json-text-body", ('{"model": "DeepSeek-V4.1-Flash", "messages": '
                        '[{"role": "user", "content": "big 18446744073709551616"}]}'), {}),
    ("tool-name-pattern", {"model": V41, "messages": U, "tools": F + [
        {"type": "function", "function": {"name": "a b"}}]}, {}),
    ("tool-name-empty-before-messages", {"model": V41, "messages": [], "tools": [
        {"type": "function", "function": {"name": ""}}]}, {}),
    ("tool-name-too-long-choice-none", {"model": V41, "messages": U, "tool_choice": "none", "tools": [
        {"type": "function", "function": {"name": "x" * 129}}]}, {}),
    ("only-empty-system-message", {"model": V41, "messages": [{"role": "system", "content": ""}]}, {}),
    ("only-empty-system-messages-off", {"model": V41, "messages": [{"role": "system", "content": []}] * 2,
                                        "thinking": {"type": "disabled"}}, {}),
]


@pytest.mark.parametrize("name,body,opts", CURATED, ids=[c[0] for c in CURATED])
def test_chat_conversion_matches_official(name: str, body: dict, opts: dict) -> None:
    official, ours = compare_convert(body, "chat", **opts)
    assert official == ours, "\n".join(diff(official, ours))


def test_invalid_json_text_is_a_value_error_on_both_sides() -> None:
    official, ours = compare_convert("{not json", "chat")
    assert official["error"] == ours["error"] == "ValueError"
    assert official["message"].split(":")[0] == ours["message"].split(":")[0] == "invalid JSON request"


SEEDS = 160


@pytest.mark.parametrize("block", range(8))
def test_chat_random_requests_match_official(block: int) -> None:
    """Seeded random requests (20 per block), with random conversion options."""
    for seed in range(block * SEEDS // 8, (block + 1) * SEEDS // 8):
        rng = random.Random(seed)
        body = random_chat(rng)
        opts = {"default_thinking_mode": rng.random() > 0.2, "reasoning_reject": rng.random() < 0.1}
        official, ours = compare_convert(body, "chat", **opts)
        assert official == ours, f"seed {seed}: " + "\n".join(diff(official, ours))
