"""Unit tests of the streaming parser that need no official wheel (recipe.md §8)."""

from __future__ import annotations

import json
import random

import pytest
from stream_cases import THINK, chunk, random_output, to_ids, to_text
from stream_oracle import hf_tokenizer

from deepinfer_jax.recipe.stream import ParseOptions, StreamOptions, StreamParser, TokenTable, token_table
from deepinfer_jax.recipe.stream.json_fragments import escape_piece
from deepinfer_jax.recipe.stream.matcher import Machine, kmp_table
from deepinfer_jax.recipe.stream.protocol import dumps
from deepinfer_jax.recipe.stream.stages import grammar, initial_stage
from deepinfer_jax.recipe.stream.utf8 import TokenDecoder

D = "｜DSML｜"
CALL = (f'\n\n<{D} calls>\n<{D} invoke name="get_weather">\n<{D} parameter name="city" string="true">東京 "q"\n'
        f'</{D} parameter>\n<{D} parameter name="days" string="false">3</{D} parameter>\n</{D} invoke>\n</{D} calls>')


@pytest.fixture(scope="module")
def table() -> TokenTable:
    return token_table(hf_tokenizer())


def enc(text: str) -> list[int]:
    return hf_tokenizer().encode(text, add_special_tokens=False).ids


def parser(protocol="chat", tokenizer=None, accumulate=True, **parse) -> StreamParser:
    opts = StreamOptions(protocol=protocol, parse=ParseOptions(**parse), response_id="r1", model="m", created=7,
                         tool_call_id=lambda i: f"call_{i}")
    return StreamParser(opts, tokenizer, accumulate=accumulate)


def test_kmp_table():
    assert kmp_table("abab") == (0, 0, 1, 2)
    assert kmp_table("aaa") == (0, 1, 2)
    assert kmp_table("</think>") == (0, 0, 0, 0, 0, 0, 0, 0)


def _segments(text_chunks, **parse):
    g = grammar(ParseOptions(**parse), False)
    m = Machine(g.stage, initial_stage(ParseOptions(**parse)))
    segs = [s for c in text_chunks for s in m.feed(c)] + m.finish()
    merged: list[list] = []
    for action, text in segs:
        if merged and merged[-1][0] == action:
            merged[-1][1] += text
        else:
            merged.append([action, text])
    return merged


def test_machine_segments_do_not_depend_on_chunking():
    text = "r1\n\n</think>\n\nc1 </thinx" + CALL + "after"
    whole = _segments([text], thinking_stage="reasoning_start")
    assert whole == _segments(list(text), thinking_stage="reasoning_start")
    rng = random.Random(0)
    assert whole == _segments(chunk(rng, text, "random"), thinking_stage="reasoning_start")
    assert "".join(t for _, t in whole) == text  # every character is accounted for exactly once


def test_machine_stash_stays_bounded_no_rescans():
    """Partial label matches are carried by the automata; the stash never grows past a label."""
    g = grammar(ParseOptions(), False)
    m = Machine(g.stage, initial_stage(ParseOptions()))
    longest = max(len(b.pattern) for key in [("common", False), ("common", True)] for b in g.stage(key).branches)
    for c in ("<｜DSM" * 200 + "</thin" * 200):
        m.feed(c)
        assert len(m.stash) <= longest


def test_escape_piece_matches_json_dumps():
    rng = random.Random(1)
    alphabet = ['"', "\\", "\n", "\t", "\x00", "\x1f", "\x7f", "é", "東", "🌸", "\u2028", "a", "/", "\b", "\f", "\r"]
    for _ in range(200):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10)))
        assert escape_piece(s) == json.dumps(s, ensure_ascii=False)[1:-1]


def test_decoder_holds_incomplete_utf8_and_counts_ids(table):
    d = TokenDecoder(table)
    assert d.push([73369]) == []  # " \xf0\x9f\x8c": cut-off emoji held
    assert d.push([119]) == [(" 🌸", 2, False)]
    assert d.push([73369]) == []
    assert d.push([66]) == [(" \ufffd" + table.texts[66], 2, False)]  # not completed: one U+FFFD
    assert d.push([999999999]) == []  # unknown id: no text, held
    assert d.push(enc("ok")) == [("ok", 2, False)]
    assert d.push(enc("Hello") + [128803, 73369]) == [("Hello", 1, False), ("<｜User｜>", 1, True)]  # run cut


def _byte_ids(table, data: bytes) -> list[int]:
    first = {}
    for i, b in enumerate(table.bytes):
        if len(b) == 1:
            first.setdefault(b[0], i)
    return [first[x] for x in data]


def test_decoder_holds_a_trailing_invalid_byte_and_restarts_after_it(table):
    d = TokenDecoder(table)
    assert d.push(enc("A") + _byte_ids(table, b"\x80")) == []  # a lone invalid last byte is held, "A" too
    assert d.push(enc("B")) == [("A\ufffdB", 3, False)]  # then released lossily
    assert d.push(_byte_ids(table, b"\xff\xe4\xb8")) == []  # invalid, then an incomplete character
    assert d.push(_byte_ids(table, b"\xad")) == [("\ufffd中", 4, False)]  # decoding restarts after \xff
    assert d.push(enc("\ufffd")) == []  # a U+FFFD token at the end is held as well (official)
    assert d.push(enc("C")) == [("\ufffdC", 2, False)]


def test_marker_only_as_special_id_in_token_mode(table):
    sp = parser(tokenizer=table, thinking_stage="reasoning_start")
    sp.ready()
    sp.push_ids([1718, 37947, 32])  # "</think>" spelled by plain tokens: still reasoning
    sp.push_ids(enc(" more") + [THINK[1]] + enc("answer"))
    sp.finish("stop")
    message = sp.response()["choices"][0]["message"]
    assert message["reasoning_content"] == "</think> more"
    assert message["content"] == "answer"


def test_tool_call_arguments_stream_as_json(table):
    ids = []
    for i, piece in enumerate(CALL.split(D)):
        ids += ([128825] if i else []) + enc(piece)
    sp = parser(tokenizer=table)
    sp.ready(5, 1)
    events = [e for i in ids for e in sp.push_ids([i])] + sp.finish("stop")
    deltas = [e.data["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] for e in events
              if "tool_calls" in e.data["choices"][0]["delta"]]
    assert "".join(deltas) == '{"city": "東京 \\"q\\"\\n", "days": 3}'
    assert json.loads("".join(deltas)) == {"city": '東京 "q"\n', "days": 3}
    assert events[-1].data["choices"][0]["finish_reason"] == "tool_calls"
    assert sp.response()["choices"][0]["message"]["tool_calls"][0]["id"] == "call_0"


def test_stop_sequence_across_chunks_finishes_the_stream():
    sp = parser(stop_sequences=("STOP",))
    sp.ready()
    assert sp.push_text("ab", 1)[0].data["choices"][0]["delta"] == {"content": "ab"}
    assert sp.push_text("cST", 1) == []
    events = sp.push_text("OPdef", 1)
    assert [e.data["choices"][0]["delta"] for e in events] == [{"content": "c"}, {"content": ""}]
    assert events[-1].data["choices"][0]["finish_reason"] == "stop" and sp.finished
    with pytest.raises(RuntimeError):
        sp.push_text("more", 1)
    assert sp.finish("length") == []


def test_tokens_without_tokenizer_raise_and_close():
    sp = parser()
    sp.ready()
    with pytest.raises(RuntimeError):
        sp.push_ids([1, 2])
    with pytest.raises(RuntimeError):
        sp.push_text("x")


def test_chat_response_shape_and_sse():
    sp = parser(thinking_stage="reasoning_start")
    events = sp.ready(10, 3, "fp") + sp.push_text("hmm</think>Hi", 4) + sp.finish("length")
    assert sp.response() == {
        "id": "r1", "object": "chat.completion", "created": 7, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi", "reasoning_content": "hmm"},
                     "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                  "prompt_tokens_details": {"cached_tokens": 3}, "prompt_cache_hit_tokens": 3,
                  "prompt_cache_miss_tokens": 7},
        "system_fingerprint": "fp"}
    assert events[0].sse().startswith("data: {") and sp.sse_done() == "data: [DONE]\n\n"


@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
def test_event_json_equals_its_data_and_output_is_chunking_invariant(protocol, table):
    """The template-built JSON of hot events equals ``dumps(data)``; merged output ignores chunking."""
    for seed in range(6):
        rng = random.Random(seed)
        parts = random_output(rng, seed % 2 == 0, True)
        ids = to_ids(parts, enc)
        results = []
        for mode in ("one", "all", "random"):
            sp = parser(protocol, table, thinking_stage="reasoning_start" if seed % 2 == 0 else None)
            events = sp.ready(3, 1)
            for push in chunk(rng, ids, mode):
                if not sp.finished:
                    events += sp.push_ids(push)
            events += sp.finish("stop")
            for e in events:
                assert e.to_json() == dumps(e.data)
                assert e.event == (e.data.get("type") if protocol != "chat" else None)
            results.append(sp.response())
        assert results[0] == results[1] == results[2], to_text(parts)


def test_options_validation():
    with pytest.raises(ValueError):
        ParseOptions(thinking_stage="thinking")
    with pytest.raises(TypeError):
        ParseOptions(stop_sequences="STOP")
    with pytest.raises(ValueError):
        StreamOptions(protocol="grpc")
    assert ParseOptions(stop_sequences=("", "x")).stop_sequences == ("x",)
    assert StreamOptions().created > 0
    with pytest.raises(ValueError):
        parser().finish("timeout")
