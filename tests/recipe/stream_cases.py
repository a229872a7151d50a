"""Random model outputs for the streaming differential tests (seeded, reproducible).

An output is a list of parts: plain text, or a marker (``</think>`` / ``｜DSML｜``) that the model
emits as its special id. Token mode encodes plain parts with the BPE vocabulary and markers as
their ids (sometimes a marker is *spelled* as plain text instead, which must not count as one);
text mode concatenates spellings. Chunkings split the same output in different ways.
"""

from __future__ import annotations

import json
import random
from typing import Any

THINK_END_ID, DSML_ID = 128822, 128825
THINK = ("special", THINK_END_ID, "</think>")
DSML = ("special", DSML_ID, "｜DSML｜")

WORDS = ["hello", "world", "the", "東京", "🌸", "naïve", "x", "42", "a\"b", "c\\d", "tab\there", "<", "</", ">",
         "\n", "\n\n", " ", "```", "{", "}", "[1, 2]", "DSML", "think", "ok.", "Ω≈ç", "\u2028", "日本語のテキスト"]


def words(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice(["", " ", "", "\n"]) for _ in range(n))


def plain(text: str) -> tuple:
    return ("plain", text)


def _value(rng: random.Random) -> tuple[str, str]:
    """(string attribute, value text) of one parameter."""
    r = rng.random()
    if r < 0.55:
        return "true", words(rng, rng.randint(0, 6))
    if r < 0.9:
        v = rng.choice([3, -1.5, True, None, {"k": [1, "x"]}, [1, 2, 3], "quoted", 1e-07])
        return "false", json.dumps(v, ensure_ascii=False)
    return "false", rng.choice(["not json", "{\"open\": ", ""])


def dsml_block(rng: random.Random, v41: bool = True, malformed: float = 0.15) -> list[tuple]:
    """A DSML tool-call block (V4.1 or V4 spelling), sometimes malformed."""
    calls_tag, invoke_tag, param_tag = (" calls", " invoke", " parameter") if v41 else ("tool_calls", "invoke",
                                                                                        "parameter")
    parts: list[tuple] = [plain("\n\n" if rng.random() < 0.8 else rng.choice(["", "\n"])), plain("<"), DSML,
                          plain(calls_tag + ">\n")]
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(["get_weather", "search", "fs::read", "f", "a b", ""])
        parts += [plain("<"), DSML, plain(f'{invoke_tag} name="{name}">\n')]
        for _ in range(rng.randint(0, 3)):
            key = rng.choice(["city", "days", "q", "shipping address", "", "k\"ey"])
            typ, value = _value(rng)
            if rng.random() < malformed:
                typ = rng.choice(["yes", "tru", "false"])
            parts += [plain("<"), DSML, plain(param_tag), plain(f' name="{key}" string="{typ}">'),
                      plain(value), plain("</"), DSML, plain(f"{param_tag}>\n")]
            if rng.random() < 0.1:
                parts.append(rng.choice([THINK, plain("</think>")]))
        if v41 and rng.random() < 0.3:
            parts.append(plain("\n"))
        parts += [plain("</"), DSML, plain(f"{invoke_tag}>\n")]
    if rng.random() > malformed:
        parts += [plain("</"), DSML, plain(f"{calls_tag}>")]
    if rng.random() < 0.2:
        parts.append(plain(rng.choice(["trailing text", "\n\nmore"])))
    return parts


def random_output(rng: random.Random, thinking: bool, tools: bool, stop: str | None = None) -> list[tuple]:
    """Reasoning, then content, then (maybe) tool calls, with assorted noise."""
    parts: list[tuple] = []
    if thinking:
        parts.append(plain(rng.choice(["", "\n", "\n\n"]) + words(rng, rng.randint(0, 8))))
        if rng.random() < 0.15:
            parts.append(plain("</think>"))  # spelled, not the special token
            parts.append(plain(words(rng, 2)))
        if rng.random() < 0.1 and tools:
            return parts + dsml_block(rng, rng.random() < 0.7)
        parts.append(plain(rng.choice(["", "\n", "\n\n", "\n\n\n"])))
        if rng.random() < 0.9:
            parts.append(THINK)
    parts.append(plain(rng.choice(["", "\n", "\n\n"]) + words(rng, rng.randint(0, 10))))
    if stop and rng.random() < 0.6:
        parts.append(plain(stop + words(rng, 2)))
    if rng.random() < 0.15:
        parts.append(THINK)
        parts.append(plain(words(rng, 2)))
    if rng.random() < 0.15:
        parts += [plain("<"), plain("｜DSML｜"), plain(" calls>")]  # spelled DSML: not a marker in token mode
    if tools and rng.random() < 0.6 or rng.random() < 0.1:
        parts += dsml_block(rng, rng.random() < 0.7)
    if rng.random() < 0.2:
        parts.append(plain(words(rng, 3)))
    return parts


def to_text(parts: list[tuple]) -> str:
    return "".join(p[1] if p[0] == "plain" else p[2] for p in parts)


def to_ids(parts: list[tuple], encode) -> list[int]:
    ids: list[int] = []
    for p in parts:
        ids += encode(p[1]) if p[0] == "plain" else [p[1]]
    return ids


def chunk(rng: random.Random, seq: Any, mode: str) -> list[Any]:
    """Split a string or id list: ``one`` (each item alone), ``all`` (one push) or ``random``."""
    if mode == "one":
        return [seq[i:i + 1] for i in range(len(seq))]
    if mode == "all":
        return [seq]
    out, i = [], 0
    while i < len(seq):
        n = rng.choice([1, 1, 2, 3, 5, 8])
        out.append(seq[i:i + n])
        i += n
    return out
