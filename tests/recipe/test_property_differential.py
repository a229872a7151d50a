"""Property-based differential tests (hypothesis) against the official ``deepseek-recipe==0.2.0`` wheel.

Two generators: request bodies for the three protocols (the seeded builders of ``gen_requests``
driven by hypothesis' random source, then mutated where conformance bugs hid: tool names from an
alphabet with invalid characters and lengths around the 128 limit, conversations made only of
empty system messages), and output streams (token ids mixing BPE words, single raw bytes that
form broken or cut-off UTF-8, the markers and other added tokens, a U+FFFD token; or spelled text)
with stop sequences that overlap the added tokens' spellings, pushed in random chunks.

Each example compares every field (conversion result or error; per-push events, SSE names, the
accumulated response) with the wheel. The example counts are bounded and the search derandomized,
so the module runs in seconds and the same examples run every time.
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("deepseek_recipe", reason="the official deepseek-recipe wheel (x86_64 only) is not installed")
hypothesis = pytest.importorskip("hypothesis")

from gen_requests import random_chat, random_messages, random_responses
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from recipe_oracle import compare_convert
from recipe_oracle import diff as value_diff
from stream_cases import DSML_ID, THINK_END_ID, WORDS
from stream_oracle import Case, diff, encode

from deepinfer_jax.recipe.stream import ParseOptions

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

_BUILDERS = {"chat": random_chat, "responses": random_responses, "messages": random_messages}
_NAME_CHARS = "abcXYZ019_- .:/é東"
tool_names = st.one_of(st.text(_NAME_CHARS, max_size=6), st.sampled_from(["", "x" * 128, "x" * 129, "é" * 70]))


def _set_tool_name(protocol: str, tool: dict, name: str) -> None:
    if protocol == "chat":
        if isinstance(tool.get("function"), dict):
            tool["function"]["name"] = name
    elif "name" in tool:
        tool["name"] = name
        for inner in tool.get("tools") or ():  # a Responses namespace
            if isinstance(inner, dict):
                inner["name"] = name + "_f"


@st.composite
def request_bodies(draw):
    protocol = draw(st.sampled_from(sorted(_BUILDERS)))
    body = _BUILDERS[protocol](draw(st.randoms(use_true_random=False)))
    tools = body.get("tools")
    if isinstance(tools, list) and tools and draw(st.booleans()):
        for _ in range(draw(st.integers(1, 2))):
            tool = tools[draw(st.integers(0, len(tools) - 1))]
            if isinstance(tool, dict):
                _set_tool_name(protocol, tool, draw(tool_names))
    if protocol == "chat" and draw(st.integers(0, 5)) == 0:
        empty = {"role": "system", "content": draw(st.sampled_from(["", []]))}
        rest = body["messages"] if draw(st.booleans()) and isinstance(body.get("messages"), list) else []
        body["messages"] = [empty] * draw(st.integers(1, 2)) + rest[:1]
    return protocol, body, draw(st.booleans())


@SETTINGS
@given(request_bodies())
def test_random_requests_convert_like_the_wheel(example):
    protocol, body, thinking_default = example
    official, ours = compare_convert(copy.deepcopy(body), protocol, default_thinking_mode=thinking_default)
    assert ours == official, value_diff(official, ours)


# ------------------------------------------------------------------------------------ streams

_USER_ID = 128803  # <｜User｜>: an added token that is neither marker
_SPECIAL = [THINK_END_ID, DSML_ID, _USER_ID, 0, 1]
_STOPS = ["STOP", "｜>", "<｜User", "User｜>w", "\ufffd", "A\ufffd", "wor", "\n\n", "}", "🌸"]


def _byte_tokens() -> dict[int, int]:
    from stream_oracle import hf_tokenizer

    from deepinfer_jax.recipe.stream.utf8 import TokenTable

    table = TokenTable(hf_tokenizer())
    first: dict[int, int] = {}
    for i, b in enumerate(table.bytes):
        if len(b) == 1:
            first.setdefault(b[0], i)
    return first


_BYTES = _byte_tokens()
_RAW = [_BYTES[b] for b in b"\x80\xbf\xc0\xc3\xa9\xe4\xb8\xad\xed\xa0\xf0\x9f\x8c\xb8\xf4\x90\xffA"]
_WORD_IDS = [encode(w) for w in WORDS + ["STOP", "\ufffd", "A", "User", "｜>", '{"a": 1}']]

token_items = st.one_of(st.sampled_from(_WORD_IDS), st.sampled_from(_RAW).map(lambda i: [i]),
                        st.sampled_from(_SPECIAL).map(lambda i: [i]))
text_items = st.sampled_from(WORDS + ["</think>", "｜DSML｜", "<｜User｜>", "STOP", "\ufffd", "<", "｜"])


@st.composite
def streams(draw):
    thinking = draw(st.booleans())
    tools = draw(st.booleans())
    stage = draw(st.sampled_from(["reasoning_start", "reasoning_start", "reasoning_continuation",
                                  "content_continuation"])) if thinking else None
    parse = ParseOptions(parse_tool_calls=tools, thinking_stage=stage,
                         stop_sequences=tuple(draw(st.lists(st.sampled_from(_STOPS), max_size=2, unique=True))),
                         parse_json_output=not thinking and draw(st.integers(0, 4)) == 0,
                         starts_in_tool_calls=tools and not thinking and draw(st.integers(0, 9)) == 0)
    if draw(st.integers(0, 3)):  # token mode
        seq: list = [i for item in draw(st.lists(token_items, max_size=30)) for i in item]
    else:
        seq = "".join(draw(st.lists(text_items, max_size=20)))
    cuts = sorted(set(draw(st.lists(st.integers(0, len(seq)), max_size=8))))
    pushes = [seq[a:b] for a, b in zip([0, *cuts], [*cuts, len(seq)]) if b > a or isinstance(seq, str)]
    return Case("hypothesis", pushes, parse, protocol=draw(st.sampled_from(["chat", "responses", "messages"])),
                finish=draw(st.sampled_from(["stop", "length", "content_filter", None])),
                include_usage=draw(st.booleans()))


@SETTINGS
@given(streams())
def test_random_streams_parse_like_the_wheel(case):
    official, ours = diff(case)
    for key in ("error", "pushes", "names", "done", "response"):
        assert ours[key] == official[key], f"{key} differs: {case.pushes!r} {case.parse!r}"
