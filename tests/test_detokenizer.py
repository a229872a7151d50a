"""Incremental detokenization: never a split UTF-8 character, stop strings across tokens."""

from __future__ import annotations

import pytest

from deepinfer_jax.engine.detokenizer import IncrementalDetokenizer
from deepinfer_jax.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_text_grows_without_split_characters(tok):
    text = "héllo 世界 🤖🦀 naïve — ok 深度求索"
    ids = tok.encode(text, add_special_tokens=False).ids
    # some token must end inside a multi-byte character, or the test proves nothing
    assert any("\ufffd" in tok.decode(ids[:k]) for k in range(1, len(ids)))
    d = IncrementalDetokenizer(tok)
    for k, i in enumerate(ids, 1):
        d.push(i)
        assert "\ufffd" not in d.text
        assert tok.decode(ids[:k]).startswith(d.text)
    assert d.text == text


def test_stop_string_spanning_tokens_is_found_and_cut(tok):
    text = "alpha beta gamma delta"
    ids = tok.encode(text, add_special_tokens=False).ids
    d = IncrementalDetokenizer(tok, ("a gam", "zeta"))
    hit = [d.push(i) for i in ids]
    stops = [h for h in hit if h]
    assert stops == ["a gam"] and d.text == "alpha bet"
    assert d.push(ids[0]) is None and d.text == "alpha bet"  # nothing after a stop


def test_special_tokens_are_skipped(tok):
    d = IncrementalDetokenizer(tok)
    for i in [0, *tok.encode("hi", add_special_tokens=False).ids, 1]:
        d.push(i)
    assert d.text == "hi"
