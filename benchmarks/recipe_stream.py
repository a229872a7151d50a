"""Streaming parse cost per token: ours against the official ``deepseek-recipe`` wheel, in one run.

    python benchmarks/recipe_stream.py [--repeats 7]

One synthetic model output (thinking, content and one long DSML tool call, ~3k tokens, encoded with
the DeepSeek-V4 tokenizer, markers as their special ids) is parsed by both sides for each protocol:
pushed one token at a time (the engine's decode loop) and in one push of all tokens, each with the
protocol events serialised (``to_json``). Prints a table of microseconds per token (medians) and
writes benchmarks/results/recipe_stream.json; the last line is the ours/official ratio for one
token per push, Chat. ``run()`` returns the rows for ``benchmarks/recipe.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DSML_ID, THINK_END_ID = 128825, 128822
D = "｜DSML｜"


def _output_ids(tok) -> list[int]:
    """A ~3k-token output: reasoning, </think>, content, one tool call with a long string argument."""
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids
    reasoning = ("The user wants the weather in Tokyo for the next days. I should call the weather tool, "
                 "then summarise the forecast in a short, friendly answer.\n") * 12
    content = "Let me look that up for you. 東京の天気を調べます 🌸.\n" * 10
    value = ("Line of a long report with \"quotes\", back\\slashes and unicode: 日本語 — ok.\n") * 60
    ids = enc(reasoning) + [THINK_END_ID] + enc(content)

    def dsml(text: str) -> list[int]:
        out: list[int] = []
        for i, piece in enumerate(text.split(D)):
            if i:
                out.append(DSML_ID)
            out += enc(piece)
        return out

    ids += dsml(f'\n\n<{D} calls>\n<{D} invoke name="write_report">\n<{D} parameter name="city" string="true">'
                f'Tokyo</{D} parameter>\n<{D} parameter name="days" string="false">7</{D} parameter>\n'
                f'<{D} parameter name="body" string="true">')
    ids += enc(value)
    ids += dsml(f"</{D} parameter>\n</{D} invoke>\n</{D} calls>")
    return ids


def _ours(protocol: str, tok, ids: list[int], per_push: int):
    from deepinfer_jax.recipe.stream import ParseOptions, StreamOptions, StreamParser, token_table

    table = token_table(tok)
    opts = StreamOptions(protocol=protocol, parse=ParseOptions(thinking_stage="reasoning_start"), response_id="r",
                         model="m", created=0)

    def go() -> int:
        sp = StreamParser(opts, table)
        n = len(sp.ready(10, 0))
        for i in range(0, len(ids), per_push):
            for e in sp.push_ids(ids[i:i + per_push]):
                e.to_json()
                n += 1
        for e in sp.finish("stop"):
            e.to_json()
        return n

    return go


def _official(protocol: str, ids: list[int], per_push: int, tok_path: str):
    import deepseek_recipe as dr

    tok = dr.Tokenizer.from_file(tok_path)
    po = {"thinking_initial_stage": dr.ThinkingInitialStage.ReasoningStart}
    conv = dr.ConversationRequest(dr.Conversation([dr.UserMessage("hi")]), dr.ModelVersion.DeepseekV41Flash)

    def gen():
        if protocol == "chat":
            return dr.ChatCompletionRequest.chunk_generator(conv, "r", "m")
        if protocol == "responses":
            return dr.ResponsesRequest.chunk_generator(conv, "r", "m")
        return dr.MessagesChunkGenerator("r", "m", True)

    def go() -> int:
        sp = dr.StreamProcessor(gen(), dr.ParsingOptions(**po), tok)
        n = len(sp.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=10))))
        for c in [dr.InferenceChunk.tokens(ids[i:i + per_push]) for i in range(0, len(ids), per_push)]:
            for e in sp.push(c):
                e.to_json()
                n += 1
        for e in sp.push(dr.InferenceChunk.finish(dr.InferenceFinishReason.Stop)) + sp.finish():
            e.to_json()
        sp.close()
        return n

    return go


def _median_times(fns: list, repeats: int) -> list[float]:
    """Median wall time of each function, runs interleaved so machine noise hits all alike."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def run(repeats: int = 7) -> list[dict[str, Any]]:
    """Rows ``{name, ours_s, official_s, ratio}``: seconds per token, medians of ``repeats`` runs."""
    import tokenizers

    from deepinfer_jax.engram_vocab import deepseek_v4_tokenizer_path

    tok_path = str(deepseek_v4_tokenizer_path())
    tok = tokenizers.Tokenizer.from_file(tok_path)
    ids = _output_ids(tok)
    try:
        import deepseek_recipe  # noqa: F401

        have_official = True
    except ImportError:
        have_official = False
    rows = []
    for protocol in ("chat", "responses", "messages"):
        for label, per_push in (("1 token/push", 1), ("all tokens, 1 push", len(ids))):
            fns = [_ours(protocol, tok, ids, per_push)]
            if have_official:
                fns.append(_official(protocol, ids, per_push, tok_path))
            medians = _median_times(fns, repeats)
            ours = medians[0] / len(ids)
            official = medians[1] / len(ids) if have_official else float("nan")
            rows.append({"name": f"stream parse {protocol}, {label} ({len(ids)} tokens)", "ours_s": ours,
                         "official_s": official, "ratio": ours / official if have_official else float("nan")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rows = run(args.repeats)
    print(f"{'case':<58} {'ours µs/tok':>12} {'official µs/tok':>16} {'ratio':>7}")
    for r in rows:
        print(f"{r['name']:<58} {r['ours_s'] * 1e6:>12.2f} {r['official_s'] * 1e6:>16.2f} {r['ratio']:>7.2f}")
    out = ROOT / "benchmarks" / "results" / "recipe_stream.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"ours/official per token, 1 token/push, chat: {rows[0]['ratio']:.2f}")


if __name__ == "__main__":
    main()
