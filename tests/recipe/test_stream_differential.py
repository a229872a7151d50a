"""Differential tests of the streaming parser against the official ``deepseek-recipe==0.2.0`` wheel.

Every case runs the same output through the wheel's ``StreamProcessor`` and through our
:class:`StreamParser`, and compares the per-push events, their SSE names, the done marker, the
accumulated final response and the raised error, field by field after masking the random parts
of tool-call ids and the timestamps. Hand-built cases follow recipe.md §12's streaming list; the
generated ones mix reasoning, content and tool calls and chunk them in several ways (seeded).
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("deepseek_recipe", reason="the official deepseek-recipe wheel (x86_64 only) is not installed")

from stream_cases import DSML, THINK, chunk, plain, random_output, to_ids, to_text
from stream_oracle import Case, diff, encode

from deepinfer_jax.recipe.stream import ParseOptions

D = "｜DSML｜"
# single raw bytes as token ids (byte-level BPE): a continuation byte, 0xFF, and the first two and the
# last byte of "中" (E4 B8 AD)
BYTE_80, BYTE_FF, BYTE_E4, BYTE_B8, BYTE_AD = 225, 190, 163, 119, 258
THINKING = ParseOptions(thinking_stage="reasoning_start")
TOOLS_OFF = ParseOptions(parse_tool_calls=False)
CALL = (f'\n\n<{D} calls>\n<{D} invoke name="get_weather">\n<{D} parameter name="city" string="true">東京 "quoted" 🌸'
        f'</{D} parameter>\n<{D} parameter name="days" string="false">3</{D} parameter>\n</{D} invoke>\n</{D} calls>')
CALL_V4 = (f'\n\n<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="x" string="false">{{"a": [1, 2]}}'
           f'</{D}parameter>\n</{D}invoke>\n<{D}invoke name="g">\n</{D}invoke>\n</{D}tool_calls>')


def ids(text: str) -> list[int]:
    return encode(text)


def one_by_one(seq):
    return [seq[i:i + 1] for i in range(len(seq))]


def think_ids(reasoning: str, content: str) -> list[int]:
    return ids(reasoning) + [THINK[1]] + ids(content)


def call_ids(text: str) -> list[int]:
    """Token ids of DSML text, ``｜DSML｜`` as its special id."""
    out: list[int] = []
    for i, piece in enumerate(text.split(D)):
        if i:
            out.append(DSML[1])
        out += ids(piece)
    return out


def _one_param(attributes_and_value: str) -> str:
    return (f'\n\n<{D} calls>\n<{D} invoke name="f">\n<{D} parameter {attributes_and_value}</{D} parameter>\n'
            f'</{D} invoke>\n</{D} calls>')


HAND_CASES = [
    Case("plain-text", ["Hello", " world", "!"]),
    Case("plain-tokens-one-by-one", one_by_one(ids("Hello world, how are you?"))),
    Case("thinking-tokens-one-by-one", one_by_one(think_ids("Let me think.\n\n", "\n\nHello world!")), THINKING),
    Case("thinking-tokens-one-push", [think_ids("Let me think.\n\n", "Hello world!")], THINKING),
    Case("thinking-text-chars", one_by_one("r1\n\n</think>\n\nc1"), THINKING),
    Case("thinking-newline-quirk", ["a\n\n<\n</think>b"], THINKING),
    Case("plain-text-think-end-not-a-marker", one_by_one([1718, 37947, 32] + ids(" still reasoning")), THINKING),
    Case("extra-think-end-dropped-in-content", [ids("Hello") + [THINK[1]] + ids(" world")]),
    Case("leading-think-end-no-thinking", [[THINK[1]] + ids("\n\nHello")]),
    Case("reasoning-continuation", ["\n\nkeep newlines", "</think>", "\n\nanswer"],
         ParseOptions(thinking_stage="reasoning_continuation")),
    Case("content-continuation", ["\n\nmore content", "</think>x"], ParseOptions(thinking_stage="content_continuation")),
    Case("tool-call-text-one-push", ["Checking." + CALL]),
    Case("tool-call-text-chars", one_by_one("Checking." + CALL)),
    Case("tool-call-tokens-one-by-one", one_by_one(call_ids("Checking." + CALL))),
    Case("tool-call-tokens-one-push", [call_ids(CALL)]),
    Case("tool-call-v4-spelling", one_by_one(call_ids(CALL_V4))),
    Case("tool-call-after-thinking", [think_ids("plan", "")] + one_by_one(call_ids(CALL)), THINKING),
    Case("dsml-inside-reasoning", one_by_one(call_ids("thinking about it" + CALL)), THINKING),
    Case("dsml-without-tools", [call_ids("text" + CALL)], TOOLS_OFF),
    Case("plain-text-dsml-not-a-marker", one_by_one(ids("a\n\n<" + D + " calls>\n<" + D + ' invoke name="f">'))),
    Case("plain-dsml-inside-value", one_by_one(call_ids(f'\n\n<{D} calls>\n<{D} invoke name="f">\n<{D} parameter '
                                                        f'name="a" string="true">x') + ids(f"</{D} parameter>")
                                               + call_ids(f"</{D} parameter>\n</{D} invoke>\n</{D} calls>"))),
    Case("special-think-end-inside-value", [call_ids(f'\n\n<{D} calls>\n<{D} invoke name="f">\n<{D} parameter name="a"'
                                                     f' string="true">x') + [THINK[1]]
                                            + call_ids(f"y</{D} parameter>\n</{D} invoke>\n</{D} calls>")]),
    Case("malformed-param-name-with-space", [_one_param('name="shipping address" string="true">v')]),
    Case("malformed-type-attribute", [_one_param('name="a" string="yes">v') + "tail"]),
    Case("non-json-raw-value", [_one_param('name="a" string="false">not json')]),
    Case("truncated-arguments-length", one_by_one(call_ids(CALL[:150])), finish="length"),
    Case("truncated-tool-name", [CALL[:45]], finish="length"),
    Case("tool-call-no-finish-chunk", [CALL], finish=None),
    Case("tool-call-content-filter", [CALL], finish="content_filter"),
    Case("content-after-block-dropped", [CALL + "\n\nignored text"]),
    Case("required-tool-choice", one_by_one(call_ids(CALL[CALL.index(">") + 1:])),
         ParseOptions(starts_in_tool_calls=True)),
    Case("stop-split-across-chunks", ["ab", "cST", "OPdef", "more"], ParseOptions(stop_sequences=("STOP", "xyz"))),
    Case("stop-partial-flushed-at-end", ["abxy"], ParseOptions(stop_sequences=("STOP", "xyz"))),
    Case("stop-not-in-reasoning", ["STOP in reasoning</think>then STOP"],
         ParseOptions(thinking_stage="reasoning_start", stop_sequences=("STOP",))),
    Case("stop-tokens", one_by_one(ids("one two three four")), ParseOptions(stop_sequences=(" three",))),
    Case("stop-then-length-ignored", ["abSTOP"], ParseOptions(stop_sequences=("STOP",)), finish="length"),
    Case("utf8-held-across-pushes", [[73369], [119], ids("ok"), [73369], [66]]),
    Case("utf8-incomplete-at-end-dropped", [ids("Hi"), [73369]]),
    Case("utf8-run-cut-by-special", [ids("Hello") + [128803, 73369], [119]]),
    Case("utf8-lone-invalid-last-byte-held-and-dropped", [ids("Hi") + [BYTE_80]]),
    Case("utf8-lone-invalid-byte-then-text", [ids("A") + [BYTE_80], ids("B"), [BYTE_80]]),
    Case("utf8-restart-after-broken-sequence", [[BYTE_FF, BYTE_E4, BYTE_B8], [BYTE_AD], ids("ok")]),
    Case("utf8-replacement-char-token-held", [ids("A\ufffd"), ids("B")]),
    Case("json-lone-invalid-byte-spacing", [ids("x ") + [BYTE_80], ids('{"a": 1}'), ids(" y")],
         ParseOptions(parse_json_output=True)),
    Case("stop-never-matches-special-token-text", [ids("ab") + [128803] + ids("cd")],
         ParseOptions(stop_sequences=("<｜User｜>",))),
    Case("stop-never-spans-special-token", [ids("ab") + [128803] + ids("cd")],
         ParseOptions(stop_sequences=("b<｜U", "｜>c"))),
    Case("stop-spelled-special-in-text-mode", ["ab<｜User｜>cd"], ParseOptions(stop_sequences=("<｜User｜>",))),
    Case("unknown-ids", [[999999999], ids("x"), [129280], ids("y") + [999999999]]),
    Case("special-tokens-as-text", [[128803, 128821, 1, 0, 129279]]),
    Case("empty-text-chunks", ["", "a", "", "", "b"]),
    Case("empty-chunk-after-partial", ["x", "</", "", "y"]),
    Case("length", ["Hello world"], finish="length"),
    Case("content-filter", ["Hello world"], finish="content_filter"),
    Case("json-fenced", ["x ", "```json\n{\"a\":", " 1}\n```", " after"], ParseOptions(parse_json_output=True)),
    Case("json-bare", ["pre ", "y {\"a\":", " 1}", " after"], ParseOptions(parse_json_output=True)),
    Case("json-none", ["no json here", " at all"], ParseOptions(parse_json_output=True)),
    Case("json-then-tool-call", ["```\n[1]\n```", " x" + CALL], ParseOptions(parse_json_output=True)),
    Case("json-stop-inside", ["{\"a\": \"END", "\"}"], ParseOptions(parse_json_output=True, stop_sequences=("END",))),
    Case("text-mode-no-tokenizer", ["r</think>", "c"], THINKING, tokenizer=False),
    Case("tokens-without-tokenizer-error", [ids("x")], tokenizer=False),
    Case("chat-include-usage", ["a", "b"], include_usage=True),
    Case("chat-data-before-ready", ["abc", "def"], ready_first=False),
    Case("chat-no-fingerprint", ["a"], fingerprint=None),
    Case("messages-thinking-mode-no-stage", ["x"], ParseOptions(), protocol="messages", thinking=True),
]

PROTOCOL_CASES = []
for proto in ("responses", "messages"):
    PROTOCOL_CASES += [
        Case(f"{proto}-thinking-content-call", one_by_one(think_ids("plan\n", "Sure.") + call_ids(CALL)), THINKING,
             protocol=proto),
        Case(f"{proto}-content-only", ["Hello", " world"], protocol=proto),
        Case(f"{proto}-empty-output", [], THINKING, protocol=proto),
        Case(f"{proto}-length-in-call", [call_ids(CALL[:120])], protocol=proto, finish="length"),
        Case(f"{proto}-content-filter", ["text"], THINKING, protocol=proto, finish="content_filter"),
        Case(f"{proto}-stop-sequence", ["abc STOP x"], ParseOptions(stop_sequences=("STOP",)), protocol=proto),
        Case(f"{proto}-two-calls-v4", [CALL_V4], protocol=proto),
        Case(f"{proto}-no-tokenizer", ["r</think>c"], THINKING, protocol=proto, tokenizer=False),
        Case(f"{proto}-data-before-ready", ["abc", "def"], protocol=proto, ready_first=False),
    ]
PROTOCOL_CASES += [
    Case("responses-echo-and-namespaces", [CALL.replace("get_weather", "fs::read")], protocol="responses", body={
        "input": "hi", "instructions": "be brief", "max_output_tokens": 500, "temperature": 0.3, "top_p": 0.5,
        "user": "u1", "top_logprobs": 2, "reasoning": {"effort": "medium"}, "tool_choice": "auto",
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "tools": [{"type": "function", "name": "get_weather", "description": "d", "parameters": {"type": "object"},
                   "strict": False},
                  {"type": "namespace", "name": "fs", "description": "files",
                   "tools": [{"type": "function", "name": "read", "parameters": {"type": "object"}}]}]}),
    Case("responses-json-object-echo", ["{}"], protocol="responses",
         body={"input": "json please", "text": {"format": {"type": "json_object"}}}),
]


def _assert_same(case: Case) -> None:
    official, ours = diff(case)
    for key in ("error", "pushes", "names", "done", "response"):
        assert ours[key] == official[key], f"{case.name}: {key} differs"


@pytest.mark.parametrize("case", HAND_CASES + PROTOCOL_CASES, ids=lambda c: c.name)
def test_hand_built_case_matches_official(case):
    _assert_same(case)


def _generated(seed: int) -> Case:
    rng = random.Random(seed)
    thinking = rng.random() < 0.6
    tools = rng.random() < 0.7
    stop = rng.choice([None, None, "STOP", "\n\n", "wor"])
    stage = rng.choice(["reasoning_start"] * 4 + ["reasoning_continuation", "content_continuation"]) if thinking \
        else None
    parse = ParseOptions(parse_tool_calls=tools, thinking_stage=stage, stop_sequences=(stop,) if stop else (),
                         parse_json_output=not thinking and rng.random() < 0.15,
                         starts_in_tool_calls=tools and not thinking and rng.random() < 0.1)
    parts = random_output(rng, thinking, tools, stop)
    token_mode = rng.random() < 0.6
    seq = to_ids(parts, encode) if token_mode else to_text(parts)
    pushes = chunk(rng, seq, rng.choice(["one", "all", "random", "random"]))
    return Case(f"seed{seed}", pushes, parse, protocol=rng.choice(["chat", "responses", "messages"]),
                finish=rng.choice(["stop", "stop", "length", "content_filter", None]),
                include_usage=rng.random() < 0.2)


@pytest.mark.parametrize("seed", range(60))
def test_generated_output_matches_official(seed):
    _assert_same(_generated(seed))


@pytest.mark.parametrize("seed", range(12))
def test_chunking_invariance_and_official_agreement(seed):
    """The same output in four chunkings: every one equals the wheel, and the accumulated response
    is the same for all of them (JSON mode excepted by design, so it is off here)."""
    rng = random.Random(1000 + seed)
    thinking = rng.random() < 0.6
    parse = ParseOptions(parse_tool_calls=True, thinking_stage="reasoning_start" if thinking else None)
    parts = random_output(rng, thinking, True)
    protocol = ("chat", "responses", "messages")[seed % 3]
    token_mode = seed % 2 == 0
    seq = to_ids(parts, encode) if token_mode else to_text(parts)
    merged = None
    for mode in ("one", "all", "random", "random"):
        case = Case(f"seed{seed}-{mode}", chunk(rng, seq, mode), parse, protocol=protocol)
        official, ours = diff(case)
        assert ours == official, case.name
        response = ours["response"] if token_mode else _without_usage(ours["response"])  # text: 1 token/push
        merged = response if merged is None else merged
        assert response == merged, f"{case.name}: accumulated response depends on chunking"


def _without_usage(obj):
    if isinstance(obj, dict):
        return {k: _without_usage(v) for k, v in obj.items() if k != "usage"}
    if isinstance(obj, list):
        return [_without_usage(v) for v in obj]
    return obj


def test_harness_detects_a_difference():
    """The comparison can fail: a parser with a different stop sequence disagrees with the wheel."""
    case = Case("stop", ["abc STOP x"], ParseOptions(stop_sequences=("STOP",)))
    official, _ = diff(case)
    _, ours = diff(Case("stop", ["abc STOP x"], ParseOptions(stop_sequences=("X",))))
    assert ours != official


def test_marker_spellings_in_cases():
    """Sanity of the case builders: markers are ids in token mode and spellings in text mode."""
    parts = [plain("a"), THINK, plain("b"), DSML]
    assert to_text(parts) == "a</think>b｜DSML｜"
    assert to_ids(parts, encode)[1] == THINK[1] and to_ids(parts, encode)[-1] == DSML[1]
