"""``chat_grammar``: the grammars ``LLM.chat`` enforces, run through llguidance on the real tokenizer
(no model): required tool parameters, each at most once; a json_schema format keeps the user's schema."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deepinfer_jax import recipe
from deepinfer_jax.chat import _grammar_constraint
from deepinfer_jax.chat_grammar import structured_output_for
from deepinfer_jax.engine.structured import LLGuidanceBackend, mask_words
from deepinfer_jax.tokenizer import load_tokenizer

D = "｜DSML｜"
V41 = "DeepSeek-V4.1-Flash"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def backend(tok):
    return LLGuidanceBackend(tok, 129280, 1)


def _ids(tok, text: str) -> list[int]:
    out: list[int] = []
    for i, piece in enumerate(text.split(D)):
        if i:
            out.append(tok.token_to_id(D))
        out += tok.encode(piece, add_special_tokens=False).ids
    return out


def accepts(backend, tok, constraint: dict, text: str) -> bool:
    """Whether the constraint's grammar takes ``text`` whole (then allows the end of sequence)."""
    kind, value = next(iter(constraint.items()))
    m = backend.matcher(backend.compile(kind, value if isinstance(value, str) else json.dumps(value)))
    for t in _ids(tok, text):
        if not m.consume(t):
            return False
    row = np.zeros(mask_words(backend.vocab_size), np.int32)
    m.fill(row)
    return bool(np.unpackbits(row.view(np.uint8), bitorder="little")[1])


def _required_call_constraint(tok):
    req = recipe.convert_request({"model": V41, "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
                                  "tool_choice": "required", "thinking": {"type": "disabled"}}, "chat")
    return structured_output_for(req.inference_options.output_constraint, False, tok)


def _invoke(*params: str) -> str:
    return f'<{D} invoke name="get_weather">' + "".join(params) + f"\n</{D} invoke>\n</{D} calls>"


CITY = f'\n<{D} parameter name="city" string="true">Paris</{D} parameter>'
DAYS = f'\n<{D} parameter name="days" string="false">3</{D} parameter>'


def test_required_tool_parameters_are_enforced_once_each(backend, tok):
    c = _required_call_constraint(tok)
    assert accepts(backend, tok, c, _invoke(CITY))
    assert accepts(backend, tok, c, _invoke(CITY, DAYS))
    assert not accepts(backend, tok, c, _invoke(DAYS))  # the required city is missing
    assert not accepts(backend, tok, c, _invoke())
    assert not accepts(backend, tok, c, _invoke(CITY, CITY))  # twice


def test_optional_only_tool_allows_no_parameters(backend, tok):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    req = recipe.convert_request({"model": V41, "messages": [{"role": "user", "content": "x"}], "tools": tools,
                                  "tool_choice": "required", "thinking": {"type": "disabled"}}, "chat")
    c = structured_output_for(req.inference_options.output_constraint, False, tok)
    assert accepts(backend, tok, c, _invoke("\n")) and accepts(backend, tok, c, _invoke(CITY))


def test_json_schema_keeps_the_users_keywords(backend, tok):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 3}}, "required": ["name"],
              "additionalProperties": False}
    req = recipe.convert_request({"model": V41, "messages": [{"role": "user", "content": "x"}],
                                  "thinking": {"type": "disabled"}, "response_format": {
                                      "type": "json_schema", "json_schema": {"name": "n", "schema": schema,
                                                                             "strict": True}}}, "chat")
    assert "maxLength" not in req.inference_options.output_constraint.schema  # the recipe's normalised copy
    c = structured_output_for(_grammar_constraint(req), False, tok)
    assert c == {"json_schema": schema}
    assert accepts(backend, tok, c, '{"name": "abc"}')
    assert not accepts(backend, tok, c, '{"name": "abcd"}')
    thinking = structured_output_for(_grammar_constraint(req), True, tok)  # after the reasoning, too
    assert accepts(backend, tok, thinking, "hmm</think>" + '{"name": "ab"}')
    assert not accepts(backend, tok, thinking, "hmm</think>" + '{"name": "abcd"}')
