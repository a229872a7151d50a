"""Unit tests of the request layer that need no official wheel (they run everywhere)."""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path

import pytest

from deepinfer_jax import recipe
from deepinfer_jax.recipe.conversation import Conversation, ImageSource, UserMessage
from deepinfer_jax.recipe.encode import encode_rendered, split_plain_text
from deepinfer_jax.recipe.pyjson import dumps_compact, dumps_py, dumps_v4, loads
from deepinfer_jax.recipe.special_tokens import DEFAULT_SPELLINGS, SpecialToken, SpecialTokens
from deepinfer_jax.recipe.tokenizer import load_prompt_tokenizer

RECIPE = Path(__file__).resolve().parents[2] / "deepinfer_jax" / "recipe"


def test_recipe_package_never_imports_jax() -> None:
    """Host code (docs/architecture.md §4): no jax/flax import anywhere in recipe/, not even a lazy one."""
    for path in RECIPE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad = [n for n in names if n == "jax" or n.startswith(("jax.", "flax"))]
            assert not bad, f"{path.relative_to(RECIPE)} imports {bad}"


def test_json_number_model_and_text_forms() -> None:
    value = loads('{"a": 1e-7, "b": 18446744073709551616, "c": 12345678901234567890, "d": -0.0, "e": 100.0, '
                  '"a": 2, "s": "é\\u2028\\u0001"}')
    assert list(value) == ["a", "b", "c", "d", "e", "s"] and value["a"] == 2  # first position, last value
    assert isinstance(value["b"], float) and value["c"] == 12345678901234567890
    assert dumps_py([1e-7, 1e16, 100.0]) == "[1e-07, 1e+16, 100.0]"
    assert dumps_v4([1e-7, 1e-5, 1e16, 100.0, -0.0]) == "[1e-7, 0.00001, 1e+16, 100.0, -0.0]"
    assert dumps_compact({"k": [1.5e300, 5e-324, 1e15], "s": "\u0001"}) == \
        '{"k":[1.5e+300,5e-324,1000000000000000.0],"s":"\\u0001"}'
    for bad in ('{"a": NaN}', '{"a": 1E400}', "[1,", b"\xff"):
        with pytest.raises(ValueError):
            loads(bad)


def test_conversion_error_body_is_openai_style() -> None:
    with pytest.raises(recipe.ConversionError) as info:
        recipe.convert_request({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, "chat")
    err = info.value
    assert err.status_code == 400
    assert json.loads(err.body) == {"error": {
        "message": "The supported API model names are DeepSeek-V4-Pro, DeepSeek-V4.1-Flash, but you passed nope.",
        "type": "invalid_request_error", "param": None, "code": "invalid_request_error"}}
    with pytest.raises(ValueError, match="missing field `messages`") as info2:
        recipe.convert_request({"model": "x"}, "chat")
    assert isinstance(info2.value, recipe.ConversionError) and info2.value.status_code == 400


def test_resolve_max_tokens() -> None:
    conv = recipe.convert_request({"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "x"}]})
    assert conv.resolve_max_tokens(10, 100) == 90
    assert conv.resolve_max_tokens(100, 100) == 1
    assert conv.resolve_max_tokens(10, 10**6) == 65536
    with pytest.raises(recipe.ConversionError, match="maximum context length is 100 tokens"):
        conv.resolve_max_tokens(101, 100)


def test_converted_settings_are_f32_and_parsing_options_follow_the_prompt() -> None:
    conv = recipe.convert_request({"model": "DeepSeek-V4-Pro", "thinking": {"type": "disabled"}, "temperature": 0.3,
                                   "messages": [{"role": "user", "content": "x"},
                                                {"role": "assistant", "content": "Sure", "prefix": True}]})
    assert conv.inference_options.temperature == 0.30000001192092896
    assert conv.parsing_options.thinking_initial_stage is None
    conv = recipe.convert_request({"model": "DeepSeek-V4.1-Flash", "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "", "reasoning_content": "so",
                                           "prefix": True}]})
    assert conv.parsing_options.thinking_initial_stage is recipe.ThinkingInitialStage.REASONING_CONTINUATION
    assert recipe.render(conv.conversation, conv.model_version).prompt.endswith("<｜Assistant｜><think>so")


def test_conversation_validation_and_placeholders() -> None:
    msg = UserMessage("a <｜image｜> b <｜image｜>", [ImageSource.from_url("https://x")])
    assert msg.image_offsets == (2,)  # only the first occurrence is a placeholder
    rendered = recipe.render(Conversation([msg], thinking_mode=False))
    assert [rendered.prompt[a:b] for a, b in rendered.special_ranges].count("<｜image｜>") == 1
    with pytest.raises(ValueError):
        Conversation([], response_schema={}, response_regex="x")
    with pytest.raises(ValueError):
        Conversation([], tool_choice="any")  # type: ignore[arg-type]


def test_special_tokens_mapping() -> None:
    st = SpecialTokens(user="<U>")
    assert st[SpecialToken.USER] == "<U>"
    assert st.token(SpecialToken.ASSISTANT) == DEFAULT_SPELLINGS[SpecialToken.ASSISTANT]
    assert len(st) == 18 and SpecialToken.DSML.default_str() == "｜DSML｜"
    with pytest.raises(TypeError):
        SpecialTokens(bogus="x")


@pytest.fixture(scope="module")
def tok():
    return load_prompt_tokenizer()


def test_split_points_never_change_the_ids(tok) -> None:
    """Pieces cut at the safe boundaries encode to exactly the ids of the whole text."""
    rng = random.Random(0)
    alphabet = ["a", "Z", " ", "\n", "\n\n", "  ", "1", "23", "東京", "タ", "!", "'s", ".", "é", "\t", "🌸", "\r\n",
                "x"]
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(200, 3000)))
        pieces = split_plain_text(text, piece_chars=rng.randint(8, 64))
        assert "".join(pieces) == text
        whole = tok.plain.encode(text, add_special_tokens=False).ids
        assert [i for p in pieces for i in tok.plain.encode(p, add_special_tokens=False).ids] == whole


def test_encode_is_special_ranges_plus_plain_bpe(tok) -> None:
    conv = Conversation([UserMessage("x " * 5000 + "<｜User｜>\nEnd")], thinking_mode=False)
    rendered = recipe.render(conv)
    ids = encode_rendered(rendered, tok)
    expected: list[int] = []
    pos = 0
    for a, b in rendered.special_ranges:
        expected += tok.plain.encode(rendered.prompt[pos:a], add_special_tokens=False).ids
        expected.append(tok.special_id(rendered.prompt[a:b]))
        pos = b
    assert ids == expected
