"""Fixed prompt texts of the V4 and V4.1 chat templates (recipe.md §4).

These strings are part of the model's input format, so they must match the official library byte
for byte; the differential tests check every one of them. Inside a template, ``⟦DSML⟧``,
``⟦THINK⟧`` and ``⟦/THINK⟧`` mark where the *special* tokens ``｜DSML｜``, ``<think>`` and
``</think>`` go (:func:`split_template`); everything else is plain text.
"""

from __future__ import annotations

import re

from deepinfer_jax.recipe.special_tokens import SpecialToken

__all__ = [
    "V4_TAGS",
    "V41_TAGS",
    "DsmlTags",
    "json_object_text",
    "json_schema_text",
    "split_template",
    "tool_prompt_template",
    "updated_tools_header",
    "v4_effort_text",
    "v41_effort_header",
]


class DsmlTags:
    """Tag names written after ``｜DSML｜`` in one template version."""

    __slots__ = ("calls", "empty_invoke_blank_line", "invoke", "parameter")

    def __init__(self, calls: str, invoke: str, parameter: str, empty_invoke_blank_line: bool) -> None:
        self.calls = calls
        self.invoke = invoke
        self.parameter = parameter
        self.empty_invoke_blank_line = empty_invoke_blank_line


V41_TAGS = DsmlTags(" calls", " invoke", " parameter", True)
V4_TAGS = DsmlTags("tool_calls", "invoke", "parameter", False)

_TOOL_PROMPT = (
    "\n\n## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    '"<⟦DSML⟧{calls}>" block like the following:\n\n'
    "<⟦DSML⟧{calls}>\n"
    '<⟦DSML⟧{invoke} name="$TOOL_NAME">\n'
    '<⟦DSML⟧{parameter} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</⟦DSML⟧{parameter}>\n'
    "...\n"
    "</⟦DSML⟧{invoke}>\n"
    '<⟦DSML⟧{invoke} name="$TOOL_NAME2">\n'
    "...\n"
    "</⟦DSML⟧{invoke}>\n"
    "</⟦DSML⟧{calls}>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by ⟦THINK⟧), you MUST output your complete reasoning inside "
    "⟦THINK⟧...⟦/THINK⟧ BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after ⟦/THINK⟧ with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    "{schemas}\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)

_UPDATED_TOOLS = "\n\n### Updated Tool Schemas\n\n"

_JSON_SCHEMA = "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
_V4_JSON_OBJECT = ("\n\nYou are a helpful assistant designed to output JSON.\n## Response Format:\n\n"
                   "Reply with JSON object ONLY.")

_V41_EFFORT = {"low": 50, "high": 75, "xhigh": 75, "max": 100}

_V4_EFFORT_HIGH = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
_V4_EFFORT_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose "
    "the problem into its most fundamental components, trace every causal chain to its root, and resolve the "
    "underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)

_MARKERS = {"⟦DSML⟧": SpecialToken.DSML, "⟦THINK⟧": SpecialToken.THINKING_START, "⟦/THINK⟧": SpecialToken.THINKING_END}
_MARKER_RE = re.compile("(" + "|".join(re.escape(m) for m in _MARKERS) + ")")


def split_template(template: str) -> list[str | SpecialToken]:
    """Split a marked template into plain strings and special-token kinds, in order."""
    out: list[str | SpecialToken] = []
    for i, piece in enumerate(_MARKER_RE.split(template)):
        if i % 2:
            out.append(_MARKERS[piece])
        elif piece:
            out.append(piece)
    return out


def tool_prompt_template(tags: DsmlTags, schema_lines: str) -> list[str | SpecialToken]:
    """The tool prompt (starting with ``\\n\\n## Tools``) for ``tags``; ``schema_lines`` holds one schema
    per line, each ending with a newline (empty when every tool is deferred)."""
    text = (_TOOL_PROMPT.replace("{calls}", tags.calls).replace("{invoke}", tags.invoke)
            .replace("{parameter}", tags.parameter))
    head, tail = text.split("{schemas}")
    return [*split_template(head), schema_lines, *split_template(tail)]


def updated_tools_header() -> str:
    """The heading before a V4.1 system message's own tool schemas."""
    return _UPDATED_TOOLS


def json_schema_text(schema_json: str) -> str:
    """Response-format text for a schema (V4.1 for json_object too, V4 for json_schema)."""
    return _JSON_SCHEMA + schema_json


def json_object_text(v41: bool) -> str:
    """Response-format text for ``json_object``."""
    return json_schema_text('{"type": "json_object"}') if v41 else _V4_JSON_OBJECT


def v41_effort_header(effort: str | None) -> str:
    """V4.1 effort text (after a ``<｜System｜>`` token); None counts as ``high``."""
    n = _V41_EFFORT[effort or "high"]
    return f"Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def v4_effort_text(effort: str | None) -> str:
    """V4 effort text placed right after BOS; empty for ``low``; None counts as ``high``."""
    effort = effort or "high"
    if effort == "low":
        return ""
    return _V4_EFFORT_MAX if effort == "max" else _V4_EFFORT_HIGH
