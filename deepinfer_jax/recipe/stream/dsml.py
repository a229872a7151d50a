"""The DSML tool-call stages (recipe.md §7.2, as the official 0.2.0 wheel parses them).

Inside a block (after ``<｜DSML｜``, any run of ``\\n`` before it swallowed), text is skipped until
``invoke name="`` opens a call or a block end (``</｜DSML｜ calls>`` or ``</｜DSML｜tool_calls>``, either
model version) finishes the output. The tool name runs to the next ``"``; only then is the call
announced. Inside an invoke, ``parameter name=`` opens a parameter (``{`` first, ``, `` later) and
``</｜DSML｜`` closes the arguments (``{}`` with no parameter, else ``}``).

Wheel behaviour kept on purpose (it differs from the public repo's ``state_machine.rs``): the
parameter name is everything after ``parameter name=`` up to the next **space**, quotes included
and unescaped, so ``name="shipping address"`` yields the key ``"shipping`` and the rest is skipped
as attribute text. The value type is found by skipping to ``true">`` (a JSON string, escaped piece
by piece, closed by ``"``) or ``false">`` (raw text, passed through); any other spelling never
matches and the rest of the block is skipped. A value runs to the next ``</｜DSML｜``.
"""

from __future__ import annotations

from collections.abc import Hashable

from deepinfer_jax.recipe.stream.markers import Labels
from deepinfer_jax.recipe.stream.matcher import STRING, Branch, StageSpec

A_SKIP, A_TOOL_BEGIN, A_TOOL_NAME, A_TOOL_NAME_END, A_ARGS_LABEL, A_ARGS_RAW, A_ARGS_STRING = 3, 7, 8, 9, 10, 11, 12
SKIP = (A_SKIP,)

BLOCK = ("tool_calls",)
TOOL_NAME = ("tool_name",)
PARAM_NAME = ("param_name",)
PARAM_TYPE = ("param_type",)

INVOKE_LABEL = 'invoke name="'
PARAM_LABEL = "parameter name="
NAME_END = '"'
PARAM_NAME_END = " "
STRING_TYPE = 'true">'
RAW_TYPE = 'false">'


def build_stage(key: Hashable, labels: Labels) -> StageSpec:
    """Compile one DSML stage."""
    kind = key[0]
    if kind == "tool_calls":
        branches = [Branch(STRING, INVOKE_LABEL, TOOL_NAME, (A_TOOL_BEGIN,))]
        branches += [Branch(STRING, end, ("finished",), SKIP) for end in labels.block_ends]
        return StageSpec(key, branches, SKIP)
    if kind == "tool_name":
        return StageSpec(key, [Branch(STRING, NAME_END, ("args", True), (A_TOOL_NAME_END,))], (A_TOOL_NAME,))
    if kind == "args":
        first = key[1]
        return StageSpec(key, [
            Branch(STRING, PARAM_LABEL, PARAM_NAME, (A_ARGS_LABEL, "{" if first else ", ", 0 if first else 1)),
            Branch(STRING, labels.dsml_end, BLOCK, (A_ARGS_LABEL, "{}" if first else "}", 5)),
        ], SKIP)
    if kind == "param_name":
        return StageSpec(key, [Branch(STRING, PARAM_NAME_END, PARAM_TYPE, (A_ARGS_LABEL, ": ", 2))], (A_ARGS_RAW,))
    if kind == "param_type":
        return StageSpec(key, [
            Branch(STRING, STRING_TYPE, ("value", True), (A_ARGS_LABEL, '"', 3)),
            Branch(STRING, RAW_TYPE, ("value", False), SKIP),
        ], SKIP)
    if kind == "value":
        string = key[1]
        close = (A_ARGS_LABEL, '"', 4) if string else SKIP
        return StageSpec(key, [Branch(STRING, labels.dsml_end, ("args", False), close)],
                         (A_ARGS_STRING,) if string else (A_ARGS_RAW,))
    raise ValueError(f"unknown parser stage {key!r}")
