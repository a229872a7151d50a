"""The request layer (``deepinfer_jax.recipe``) against the official ``deepseek-recipe`` wheel, in one run.

    python benchmarks/recipe.py [--repeats 9] [--no-stream]

Cases (recipe.md §10): encoding a ~100k-token conversation (system + one long user message of license
text with its paragraphs reshuffled per repetition, thinking) with V4.1 (our V4.1-compatible tokenizer
on both sides) and V4 (the real V4 tokenizer),
encoding a 2,001-message conversation, rendering both conversations, and converting a ~470 KB Chat
request. Both sides get the same conversation and tokenizer file; times are medians of ``repeats``
runs, ours and official interleaved. The rows of ``benchmarks/recipe_stream.py`` (streaming parse
cost per token) are appended when that file exists. Prints a table, writes
benchmarks/results/recipe.json; the last line is the ours/official time ratio for the 100k-token
V4.1 encode (below 1 means ours is faster).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from deepinfer_jax import recipe
from deepinfer_jax.engram_vocab import deepseek_v4_tokenizer_path
from deepinfer_jax.recipe.conversation import AssistantMessage, Conversation, SystemMessage, UserMessage
from deepinfer_jax.recipe.encode import encode_rendered
from deepinfer_jax.recipe.tokenizer import load_prompt_tokenizer, v41_tokenizer_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recipe_stream
from recipe_stream import _median_times

ROOT = Path(__file__).resolve().parent.parent
LICENSES = Path("/usr/share/common-licenses")


def _long_text(chars: int = 474_000) -> str:
    """License prose (GPL-3 + Apache-2.0, as in recipe.md §10), or seeded pseudo-English where those files
    are missing. Each repetition has its paragraphs in a different seeded order, so the text has no
    period (our encoder encodes identical pieces once; a periodic text would flatter it)."""
    import random

    rng = random.Random(0)
    parts = [LICENSES / "GPL-3", LICENSES / "Apache-2.0"]
    if all(p.is_file() for p in parts):
        text = "".join(p.read_text(encoding="utf-8") for p in parts)
    else:
        words = ["the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "with", "on", "be", "by",
                 "this", "software", "license", "may", "terms", "conditions", "work", "source", "code", "1989"]
        text = "\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))).capitalize() + "."
                           for _ in range(500))
    paragraphs = text.split("\n\n")
    out: list[str] = []
    size = 0
    while size < chars:
        rng.shuffle(paragraphs)
        chunk = "\n\n".join(paragraphs) + "\n\n"
        out.append(chunk)
        size += len(chunk)
    return "".join(out)[:chars]


def _many_messages(n: int = 2001) -> Conversation:
    msgs: list[Any] = [SystemMessage("You are a helpful assistant.")]
    for i in range(n - 1):
        if i % 2 == 0:
            msgs.append(UserMessage(f"Question {i}: what is {i} + {i * 7}? Explain briefly."))
        else:
            msgs.append(AssistantMessage(f"The answer is {i - 1 + (i - 1) * 7}. Adding the two numbers gives it.",
                                         "Simple arithmetic."))
    return Conversation(msgs, thinking_mode=True)


def _row(name: str, ours: float, official: float | None, **extra: Any) -> dict[str, Any]:
    ratio = ours / official if official else float("nan")
    return {"name": name, "ours_s": ours, "official_s": official if official else float("nan"), "ratio": ratio,
            **extra}


def core_rows(repeats: int) -> list[dict[str, Any]]:
    """Encode / render / convert rows (seconds per operation)."""
    try:
        import deepseek_recipe as dr
    except ImportError:
        dr = None
        print("note: deepseek-recipe is not importable here; official columns are n/a")
    sys.path.insert(0, str(ROOT / "tests" / "recipe"))
    tok41, tok4 = load_prompt_tokenizer(), load_prompt_tokenizer(v41=False)
    big = Conversation([SystemMessage("You are a helpful assistant."), UserMessage(_long_text())], thinking_mode=True)
    many = _many_messages()
    body = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "system", "content": "You are helpful."},
                                                          {"role": "user", "content": _long_text()}]}
    rows = []
    wheel = None
    if dr is not None:
        from recipe_oracle import wheel_conversation

        wt41 = dr.Tokenizer.from_str(v41_tokenizer_json())
        wt4 = dr.Tokenizer.from_file(str(deepseek_v4_tokenizer_path()))
        wheel = {"v4.1": dr.DeepseekV41Encoding().with_tokenizer(wt41),
                 "v4": dr.DeepseekV4Encoding().with_tokenizer(wt4)}
        wbig, wmany = wheel_conversation(big), wheel_conversation(many)
    for name, conv, wconv, version in (("encode 100k-token conversation, V4.1", big, "big", "v4.1"),
                                       ("encode 100k-token conversation, V4", big, "big", "v4"),
                                       ("encode 2,001-message conversation, V4.1", many, "many", "v4.1")):
        tok = tok41 if version == "v4.1" else tok4
        ours_fn = (lambda c=conv, v=version, t=tok: encode_rendered(recipe.render(c, v), t))
        n_tokens = len(ours_fn())
        fns = [ours_fn]
        if wheel is not None:
            wc = wbig if wconv == "big" else wmany
            fns.append(lambda w=wheel[version], c=wc: w.encode(c))
            assert fns[1]() == ours_fn(), f"token ids differ: {name}"
        t = _median_times(fns, repeats)
        rows.append(_row(name, t[0], t[1] if len(t) > 1 else None, tokens=n_tokens))
    for name, conv, wconv in (("render 100k-token conversation, V4.1", big, "big"),
                              ("render 2,001-message conversation, V4.1", many, "many")):
        fns = [lambda c=conv: recipe.render(c, "v4.1")]
        if wheel is not None:
            fns.append(lambda w=wheel["v4.1"], c=(wbig if wconv == "big" else wmany): w.render_conversation(c))
        t = _median_times(fns, max(repeats, 25))
        rows.append(_row(name, t[0], t[1] if len(t) > 1 else None))
    fns = [lambda: recipe.convert_request(copy.deepcopy(body), "chat")]
    if dr is not None:
        fns.append(lambda: dr.ChatCompletionRequest(copy.deepcopy(body)).convert(dr.ConversionOptions()))
    t = _median_times(fns, max(repeats, 25))
    rows.append(_row("convert a ~470 KB Chat request (incl. body copy)", t[0], t[1] if len(t) > 1 else None))
    return rows


def stream_rows(repeats: int) -> list[dict[str, Any]]:
    """The rows of benchmarks/recipe_stream.py (streaming parse cost per token)."""
    return list(recipe_stream.run(repeats))


def _fmt(seconds: float) -> str:
    if math.isnan(seconds):
        return "n/a"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--no-stream", action="store_true", help="skip the streaming rows")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPU cores, Python {sys.version.split()[0]}")
    rows = core_rows(args.repeats)
    rows += [] if args.no_stream else stream_rows(args.repeats)
    print()
    print(f"{'case':<66} {'ours':>11} {'official':>11} {'ours/official':>14}")
    for r in rows:
        print(f"{r['name']:<66} {_fmt(r['ours_s']):>11} {_fmt(r['official_s']):>11} {r['ratio']:>14.2f}")
    out = ROOT / "benchmarks" / "results" / "recipe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu_count": os.cpu_count(), "rows": rows}, indent=2))
    head = rows[0]
    print(f"encode 100k-token conversation ({head['tokens']} tokens), ours/official time: {head['ratio']:.2f}")


if __name__ == "__main__":
    main()
