"""Differential tests: V4.1 and V4 prompt rendering vs the official deepseek-recipe 0.2.0 wheel.

The prompt text, the special-token ranges and the image sources must be equal, for conversations
built directly (an assistant-turn matrix, curated layouts, random shapes) and for the conversations
that conversion produces from random requests.
"""

from __future__ import annotations

import copy
import itertools
import random

import gen_requests as gen
import pytest
from recipe_oracle import (  # skips the module when the wheel is missing
    PROTOCOL_CLASSES,
    diff,
    dr,
    official_render,
    our_render,
    rendered_dict,
)

from deepinfer_jax import recipe
from deepinfer_jax.recipe.conversation import (
    AssistantMessage,
    Conversation,
    ImageSource,
    LatestReminderMessage,
    SystemMessage,
    ToolCall,
    ToolDefinition,
    ToolMessage,
    UserMessage,
)

VERSIONS = ("v4.1", "v4")
TOOLS = (ToolDefinition("f", "desc", {"type": "object", "x": [1.5, 1e-7, 1e16]}), ToolDefinition("g"))


def _a(content: str, ids: str = "", **kw: object) -> AssistantMessage:
    calls = [ToolCall(i, "f", '{"a": 1, "b": "x \\"q\\"", "c": [1e-7, null]}') for i in ids] or None
    return AssistantMessage(content, tool_calls=calls, **kw)  # type: ignore[arg-type]


def _t(i: str) -> ToolMessage:
    return ToolMessage(f"result {i}", i)


U = UserMessage

CURATED: list[tuple[str, Conversation]] = [
    ("user-thinking", Conversation([U("Hello")])),
    ("user-no-thinking", Conversation([U("Hello")], thinking_mode=False)),
    ("empty", Conversation([])),
    ("effort-low", Conversation([U("u")], reasoning_effort="low")),
    ("effort-xhigh", Conversation([U("u")], reasoning_effort="xhigh")),
    ("effort-max-system", Conversation([SystemMessage("sys"), U("u")], reasoning_effort="max")),
    ("tools-system", Conversation([SystemMessage("sys"), U("u")], tools=TOOLS)),
    ("tools-none", Conversation([U("u"), _a("a", reasoning_content="r"), U("v")], tools=TOOLS, tool_choice="none")),
    ("tools-required", Conversation([U("u")], tools=TOOLS, tool_choice="required", thinking_mode=False)),
    ("reasoning-kept-with-tools", Conversation([U("u"), _a("a", "12", reasoning_content="r"), _t("2"), _t("1"),
                                                _a("b", reasoning_content="r2"), U("again")], tools=TOOLS)),
    ("reasoning-dropped-without-tools", Conversation([U("u"), _a("a", reasoning_content="r"), U("again")])),
    ("tool-results-reordered-mixed", Conversation([U("u"), _a("a", "123"), _t("3"), U("mid"), _t("1"),
                                                   ToolMessage("x", "unknown")], thinking_mode=False)),
    ("mid-system", Conversation([U("u"), SystemMessage("s2"), SystemMessage(""), U("v")], thinking_mode=False)),
    ("latest-reminders", Conversation([U("u"), LatestReminderMessage("a"), LatestReminderMessage("b"), U("v")])),
    ("prefix-open-reasoning", Conversation([U("u"), _a("", reasoning_content="half", prefix=True)])),
    ("prefix-content", Conversation([U("u"), _a("Sure, ", reasoning_content=None, prefix=True)])),
    ("prefix-first", Conversation([_a("cont", reasoning_content="r", prefix=True)])),
    ("prefix-required", Conversation([U("u"), _a("c", prefix=True)], tools=TOOLS, tool_choice="required",
                                     thinking_mode=False)),
    ("json-object", Conversation([U("json")], response_format="json_object", thinking_mode=False)),
    ("json-schema", Conversation([U("u"), SystemMessage("late")], response_schema={"type": "object", "n": 1e-7})),
    ("regex", Conversation([U("u")], response_regex="[0-9]+")),
    ("images", Conversation([U("a <｜image｜> b <｜image｜> c <｜image｜>", [ImageSource.from_url("https://1"),
                                                                          ImageSource.from_url("https://2")]),
                             SystemMessage("s <｜image｜>", [ImageSource.from_url("https://3")])])),
    ("typed-specials", Conversation([U("<｜User｜> <think> </think> <｜begin▁of▁sentence｜> ｜DSML｜")])),
    ("deferred-tools", Conversation([U("u")], tools=(ToolDefinition("f", defer_loading=True),))),
    ("system-tools", Conversation([U("u"), SystemMessage("more", tools=[ToolDefinition("late", "d")])], tools=TOOLS)),
    ("non-object-args", Conversation([U("u"), AssistantMessage("", tool_calls=[
        ToolCall("1", "f", "[1, 2]"), ToolCall("2", "f", "not json"), ToolCall("3", "f", "{}"),
        ToolCall("4", "f", '{"big": 18446744073709551616, "x": 1E400}')]), _t("1"), _t("2"), _t("3"), _t("4")],
        tools=TOOLS)),
]


#: Malformed tool placement: the official V4 encoder regroups it by counting calls (documented deviation).
V4_DEVIATIONS = {"tool-results-reordered-mixed"}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name,conv", CURATED, ids=[c[0] for c in CURATED])
def test_render_curated_matches_official(name: str, conv: Conversation, version: str) -> None:
    if version == "v4" and name in V4_DEVIATIONS:
        pytest.skip("documented deviation: V4 regrouping of misplaced tool results (render.py)")
    official, ours = official_render(conv, version), our_render(conv, version)
    assert official == ours, "\n".join(diff(official, ours))


def _matrix() -> list[Conversation]:
    """Every assistant turn shape: thinking x tools x reasoning x content x calls x position."""
    out = []
    for think, tools, reas, content, calls, pos in itertools.product(
            (True, False), (True, False), (None, "", "r"), ("", "c"), (False, True), ("mid", "last", "prefix")):
        a = AssistantMessage(content, reas, [ToolCall("1", "f", "{}")] if calls else None, prefix=pos == "prefix")
        out.append(Conversation([U("u"), a] + ([U("v")] if pos == "mid" else []), thinking_mode=think,
                                tools=TOOLS if tools else ()))
    return out


@pytest.mark.parametrize("version", VERSIONS)
def test_render_assistant_matrix_matches_official(version: str) -> None:
    for i, conv in enumerate(_matrix()):
        official, ours = official_render(conv, version), our_render(conv, version)
        assert official == ours, f"case {i}: " + "\n".join(diff(official, ours))


@pytest.mark.parametrize("block", range(4))
def test_render_random_conversations_match_official(block: int) -> None:
    """Random shapes; V4 only where tool results follow their turn (see render.py's known deviation)."""
    for seed in range(block * 60, (block + 1) * 60):
        for version in VERSIONS:
            conv = gen.random_conversation(random.Random(seed), v4_safe=version == "v4")
            official, ours = official_render(conv, version), our_render(conv, version)
            assert official == ours, f"seed {seed} {version}: " + "\n".join(diff(official, ours))


@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
def test_render_converted_requests_match_official(protocol: str) -> None:
    """Render what conversion produced (wheel: its own conversation; ours: ours), 60 random requests."""
    make = getattr(gen, f"random_{protocol}")
    checked = 0
    for seed in range(60):
        body = make(random.Random(seed))
        try:
            w = PROTOCOL_CLASSES[protocol](copy.deepcopy(body)).convert(dr.ConversionOptions())
        except (ValueError, dr.ConversionError):
            continue
        ours = recipe.convert_request(copy.deepcopy(body), protocol)
        enc = dr.DeepseekV41Encoding() if ours.model_version.is_v41 else dr.DeepseekV4Encoding()
        official = rendered_dict(enc.render_conversation(w.conversation))
        mine = rendered_dict(recipe.render(ours.conversation, ours.model_version))
        assert official == mine, f"seed {seed}: " + "\n".join(diff(official, mine))
        checked += 1
    assert checked > 20


def test_render_special_token_overrides_match_official() -> None:
    conv = Conversation([U("u"), _a("", "1"), _t("1")], tools=TOOLS)
    st_w = dr.SpecialTokens(user="<U>", dsml="|D|", thinking_end="</t>")
    st_o = recipe.SpecialTokens(user="<U>", dsml="|D|", thinking_end="</t>")
    from recipe_oracle import wheel_conversation

    for version, enc in (("v4.1", dr.DeepseekV41Encoding()), ("v4", dr.DeepseekV4Encoding())):
        official = rendered_dict(enc.with_special_tokens(st_w).render_conversation(wheel_conversation(conv)))
        assert official == rendered_dict(recipe.render(conv, version, st_o))
