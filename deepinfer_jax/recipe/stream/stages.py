"""The output grammar: stages, their labels and the action each piece of text gets (recipe.md §8.3).

Stage keys are small tuples: ``("reasoning", leading)``, ``("common", leading)``, ``("json",)``,
``("matched_json",)``, ``("finished",)`` plus the DSML stages of :mod:`.dsml`. ``leading`` means
leading newlines are still dropped. Actions are tuples whose first item is one of the ``A_*``
kinds below; adjacent pieces of one input chunk merge when their actions are equal.
"""

from __future__ import annotations

from collections.abc import Hashable
from functools import lru_cache

from deepinfer_jax.recipe.stream import dsml
from deepinfer_jax.recipe.stream.markers import TEXT_LABELS, TOKEN_LABELS, Labels
from deepinfer_jax.recipe.stream.matcher import LEADING_NEWLINE, NEWLINES_STRING, STRING, Branch, StageSpec
from deepinfer_jax.recipe.stream.options import ParseOptions

# action kinds
A_CONTENT = 0  # text emitted as content
A_TO_SPACE = 1  # JSON mode: text around the JSON, one space per input chunk
A_REASONING = 2
A_SKIP = 3  # swallowed (labels, newlines, DSML markup)
A_INVALID = 4  # swallowed: an extra </think> or text after the block end
A_STOP = 5  # a stop sequence: the stream ends here
A_CONTENT_LABEL = 6  # a fixed content text: "{" / "[" opening bare JSON
A_TOOL_BEGIN = 7  # `invoke name="`: a tool call starts (its name follows)
A_TOOL_NAME = 8  # name characters, collected
A_TOOL_NAME_END = 9  # the closing quote: the tool call is announced
A_ARGS_LABEL = 10  # a fixed argument fragment ("{", ", ", ": ", '"', "}", "{}"): (kind, text, slot)
A_ARGS_RAW = 11  # argument text as written: parameter names, non-string values
A_ARGS_STRING = 12  # string value text, JSON-escaped piece by piece

CONTENT = (A_CONTENT,)
TO_SPACE = (A_TO_SPACE,)
REASONING = (A_REASONING,)
SKIP = (A_SKIP,)
EXTRA_THINK_END = (A_INVALID, "extra_end_of_thinking")
AFTER_FINISHED = (A_INVALID, "content_after_finished")

JSON_FENCES = ("```json\n", "```\n")
JSON_END = "\n```"

FINISHED = ("finished",)


def initial_stage(opts: ParseOptions) -> Hashable:
    """The stage parsing begins in (recipe.md §8.3 table)."""
    if opts.starts_in_tool_calls:
        return dsml.BLOCK
    return {None: ("common", True), "reasoning_start": ("reasoning", True),
            "reasoning_continuation": ("reasoning", False),
            "content_continuation": ("common", False)}[opts.thinking_stage]


def _stops(opts: ParseOptions) -> list[Branch]:
    return [Branch(STRING, s, FINISHED, (A_STOP, s), bpe_only=True) for s in opts.stop_sequences]


def _dsml_begin(labels: Labels) -> Branch:
    return Branch(NEWLINES_STRING, labels.dsml_begin, dsml.BLOCK, SKIP)


def build_stage(key: Hashable, opts: ParseOptions, labels: Labels) -> StageSpec:
    """Compile one stage of the grammar."""
    kind = key[0]
    branches: list[Branch] = []
    if kind == "common":
        leading = key[1]
        if opts.parse_json_output:
            branches += [Branch(STRING, f, ("json",), SKIP) for f in JSON_FENCES]
            branches += [Branch(STRING, b, ("json",), (A_CONTENT_LABEL, b)) for b in ("{", "[")]
        else:
            branches += _stops(opts)
        if opts.parse_tool_calls:
            branches.append(_dsml_begin(labels))
        if leading:
            branches.append(Branch(LEADING_NEWLINE, "\n", ("common", True), SKIP))
        branches.append(Branch(STRING, labels.think_end, ("common", False), EXTRA_THINK_END))
        return StageSpec(key, branches, TO_SPACE if opts.parse_json_output else CONTENT)
    if kind == "json":
        branches += _stops(opts)
        branches.append(Branch(STRING, JSON_END, ("matched_json",), SKIP))
        return StageSpec(key, branches, CONTENT)
    if kind == "matched_json":
        if opts.parse_tool_calls:
            branches.append(_dsml_begin(labels))
        return StageSpec(key, branches, TO_SPACE)
    if kind == "reasoning":
        leading = key[1]
        if opts.parse_tool_calls:
            branches.append(_dsml_begin(labels))
        if leading:
            branches.append(Branch(LEADING_NEWLINE, "\n", ("reasoning", True), SKIP))
        branches.append(Branch(NEWLINES_STRING, labels.think_end, ("common", True), SKIP))
        return StageSpec(key, branches, REASONING)
    if kind == "finished":
        return StageSpec(key, branches, AFTER_FINISHED)
    return dsml.build_stage(key, labels)


class Grammar:
    """The compiled stages for one ``ParseOptions`` and one mode, built on first use."""

    def __init__(self, opts: ParseOptions, token_mode: bool) -> None:
        self.opts = opts
        self.labels = TOKEN_LABELS if token_mode else TEXT_LABELS
        self._stages: dict[Hashable, StageSpec] = {}

    def stage(self, key: Hashable) -> StageSpec:
        spec = self._stages.get(key)
        if spec is None:
            spec = self._stages[key] = build_stage(key, self.opts, self.labels)
        return spec


@lru_cache(maxsize=64)
def grammar(opts: ParseOptions, token_mode: bool) -> Grammar:
    """The shared compiled grammar of these options (stage specs are immutable)."""
    return Grammar(opts, token_mode)
