"""Differential tests: Messages (Anthropic-style) conversion vs the official deepseek-recipe 0.2.0 wheel."""

from __future__ import annotations

import random

import pytest
from gen_requests import random_messages
from recipe_oracle import compare_convert, diff  # skips the module when the wheel is missing

V41, V4 = "DeepSeek-V4.1-Flash", "DeepSeek-V4-Pro"
U = {"role": "user", "content": "hi"}
TOOL = {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}


def _tu(i: str, inp: object = None) -> dict:
    return {"type": "tool_use", "id": i, "name": "get_weather", "input": {} if inp is None else inp}


def _tr(i: str, content: object = "r") -> dict:
    return {"type": "tool_result", "tool_use_id": i, "content": content}


def _user(*blocks: dict) -> dict:
    return {"role": "user", "content": list(blocks)}


def _asst(*blocks: dict) -> dict:
    return {"role": "assistant", "content": list(blocks)}


def _text(t: str) -> dict:
    return {"type": "text", "text": t}


IMG = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
TA = {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "later"}}
LATER = {"name": "later", "input_schema": {"type": "object"}, "defer_loading": True}

CURATED: list[tuple[str, dict, dict]] = [
    ("system-string", {"model": V41, "max_tokens": 100, "system": "sys", "messages": [U]}, {}),
    ("system-blocks", {"model": V41, "system": [_text("a"), _text("b")], "messages": [U]}, {}),
    ("no-max-tokens", {"model": V41, "messages": [U]}, {}),
    ("max-tokens-clamped", {"model": V41, "max_tokens": 10**6, "messages": [U]}, {}),
    ("max-tokens-zero", {"model": V41, "max_tokens": 0, "messages": [U]}, {}),
    ("user-blocks-split", {"model": V41, "messages": [_user(_text("a"), IMG, _text("b"),
                                                            {"type": "image", "source": {"type": "url",
                                                                                         "url": "https://x"}})]}, {}),
    ("user-blocks-v4", {"model": V4, "messages": [_user(_text("a"), IMG)]}, {}),
    ("document", {"model": V41, "messages": [_user({"type": "document", "source": {
        "type": "base64", "media_type": "application/pdf", "data": "AAAA"}})]}, {}),
    ("image-bad-base64", {"model": V41, "messages": [_user({"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "A"}})]}, {}),
    ("image-bad-url", {"model": V41, "messages": [_user({"type": "image", "source": {"type": "url", "url": "ftp://x"}})]},
     {}),
    ("image-file", {"model": V41, "messages": [_user({"type": "image", "source": {"type": "file", "file_id": "f"}})]},
     {}),
    ("assistant-blocks", {"model": V41, "messages": [U, _asst({"type": "thinking", "thinking": "t1", "signature": "s"},
                                                              _text(""), _text("a"),
                                                              {"type": "thinking", "thinking": "t2", "signature": ""},
                                                              _text("b"), _text(""))]}, {}),
    ("tool-use-results", {"model": V41, "tools": [TOOL], "messages": [
        U, _asst(_text("let me"), _tu("t1", {"b": 1, "a": "x y", "f": 1e-7}), _tu("t2", [1, 2])),
        _user(_tr("t2", [_text("r1"), _text("r2")]), _tr("t1"), _text("more"))]}, {}),
    ("tool-use-then-text", {"model": V41, "messages": [U, _asst(_tu("t1"), _text("after")), _user(_tr("t1"))]}, {}),
    ("tool-result-missing", {"model": V41, "messages": [U, _asst(_tu("t1"), _tu("t2")), _user(_tr("t2"))]}, {}),
    ("tool-result-after-text", {"model": V41, "messages": [U, _asst(_tu("t1")), _user(_text("x"), _tr("t1"))]}, {}),
    ("tool-result-unexpected", {"model": V41, "messages": [U, _asst(_text("a")), _user(_tr("t1"))]}, {}),
    ("tool-result-duplicate", {"model": V41, "messages": [U, _asst(_tu("t1")), _user(_tr("t1"), _tr("t1"))]}, {}),
    ("tool-use-dangling", {"model": V41, "messages": [U, _asst(_tu("t1"))]}, {}),
    ("tool-use-duplicate-id", {"model": V41, "messages": [U, _asst(_tu("t1"), _tu("t1")), _user(_tr("t1"))]}, {}),
    ("thinking-in-user", {"model": V41, "messages": [_user({"type": "thinking", "thinking": "t"})]}, {}),
    ("tool-use-in-user", {"model": V41, "messages": [_user(_tu("t1"))]}, {}),
    ("empty-content", {"model": V41, "messages": [U, _asst()]}, {}),
    ("empty-messages", {"model": V41, "messages": []}, {}),
    ("mid-system", {"model": V41, "messages": [U, {"role": "system", "content": [_text("s"), IMG]}, U]}, {}),
    ("mid-system-v4-reminder", {"model": V4, "messages": [U, {"role": "system", "content": "s"},
                                                          {"role": "system", "content": ""}, U]}, {}),
    ("tool-addition", {"model": V41, "tools": [TOOL, LATER], "messages": [
        U, {"role": "system", "content": [_text("now"), TA]}]}, {}),
    ("tool-addition-unknown", {"model": V41, "tools": [TOOL], "messages": [U, {"role": "system", "content": [TA]}]},
     {}),
    ("tool-addition-in-user", {"model": V41, "messages": [_user(TA)]}, {}),
    ("all-deferred", {"model": V41, "tools": [LATER], "messages": [U]}, {}),
    ("deferred-v4-ignored", {"model": V4, "tools": [TOOL, LATER], "messages": [U]}, {}),
    ("tool-without-schema", {"model": V41, "tools": [{"name": "f"}], "messages": [U]}, {}),
    ("web-search-rejected", {"model": V41, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                             "messages": [U]}, {}),
    ("web-search-dropped", {"model": V41, "tools": [{"type": "web_search_20250305", "name": "web_search"}, TOOL],
                            "messages": [U]}, {"messages_web_search_drop": True}),
    ("server-tool", {"model": V41, "tools": [{"type": "bash_20250124", "name": "bash"}], "messages": [U]},
     {"messages_web_search_drop": True}),
    ("server-blocks-dropped", {"model": V41, "messages": [U, _asst({"type": "server_tool_use", "id": "s",
                                                                    "name": "web_search", "input": {}}, _text("a"))]},
     {"messages_web_search_drop": True}),
    ("server-blocks-rejected", {"model": V41, "messages": [U, _asst({"type": "server_tool_use", "id": "s",
                                                                     "name": "web_search", "input": {}})]}, {}),
    ("tool-choice-any-is-auto", {"model": V41, "tools": [TOOL], "tool_choice": {"type": "any"}, "messages": [U]}, {}),
    ("tool-choice-tool", {"model": V41, "tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather"},
                          "thinking": {"type": "disabled"}, "messages": [U]}, {}),
    ("tool-choice-tool-thinking", {"model": V41, "tools": [TOOL],
                                   "tool_choice": {"type": "tool", "name": "get_weather"},
                                   "messages": [U]}, {}),
    ("tool-choice-none", {"model": V41, "tools": [TOOL], "tool_choice": {"type": "none"}, "messages": [U]}, {}),
    ("effort", {"model": V41, "output_config": {"effort": "max"}, "stop_sequences": ["x", "y"], "temperature": 0.2,
                "top_k": 5, "messages": [U]}, {}),
    ("thinking-disabled-sampling", {"model": V4, "thinking": {"type": "disabled"}, "temperature": 0.2, "top_p": 0.9,
                                    "messages": [U]}, {}),
    ("stop-empty", {"model": V41, "stop_sequences": [""], "messages": [U]}, {}),
    ("reasoning-reject", {"model": V41, "messages": [U, _asst(_tu("t1")), _user(_tr("t1"))]},
     {"reasoning_reject": True}),
    ("redacted-thinking", {"model": V41, "messages": [_user({"type": "redacted_thinking", "data": "x"})]}, {}),
    ("tool-name-pattern", {"model": V41, "max_tokens": 5, "messages": [U], "tools": [
        {"name": "日本", "input_schema": {"type": "object"}}]}, {}),
    ("tool-name-too-long", {"model": V41, "max_tokens": 5, "messages": [U], "tools": [
        {"name": "x" * 129, "input_schema": {"type": "object"}}]}, {}),
]


@pytest.mark.parametrize("name,body,opts", CURATED, ids=[c[0] for c in CURATED])
def test_messages_conversion_matches_official(name: str, body: dict, opts: dict) -> None:
    official, ours = compare_convert(body, "messages", **opts)
    assert official == ours, "\n".join(diff(official, ours))


SEEDS = 160


@pytest.mark.parametrize("block", range(8))
def test_messages_random_requests_match_official(block: int) -> None:
    for seed in range(block * SEEDS // 8, (block + 1) * SEEDS // 8):
        rng = random.Random(seed)
        body = random_messages(rng)
        opts = {"default_thinking_mode": rng.random() > 0.2, "reasoning_reject": rng.random() < 0.1,
                "messages_web_search_drop": rng.random() < 0.3}
        official, ours = compare_convert(body, "messages", **opts)
        assert official == ours, f"seed {seed}: " + "\n".join(diff(official, ours))
