"""The rendered (history) form of DSML tool calls (recipe.md §7.1).

A turn's tool calls become one block::

    \\n\\n<DSML calls>\\n<DSML invoke name="NAME">\\nPARAMS\\n</DSML invoke>\\n...\\n</DSML calls>

where ``DSML`` is the special token ``｜DSML｜`` and the tag names are those of the template
version (:class:`~deepinfer_jax.recipe.prompts.DsmlTags`). Arguments that parse as a JSON object
give one parameter per key (strings raw with ``string="true"``, other values as py-JSON with
``string="false"``); anything else gives one ``arguments`` string parameter holding the raw text.
Names and values are never escaped, as in the official template.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from deepinfer_jax.recipe.conversation import ToolCall
from deepinfer_jax.recipe.prompts import DsmlTags
from deepinfer_jax.recipe.pyjson import dumps_py, try_loads
from deepinfer_jax.recipe.special_tokens import SpecialToken

__all__ = ["tool_call_parameters", "tool_calls_block"]

_D = SpecialToken.DSML


def tool_call_parameters(arguments: str, dumps: Callable[[Any], str] = dumps_py) -> list[tuple[str, bool, str]]:
    """``(name, is_string, value_text)`` for each rendered parameter of ``arguments``.

    ``dumps`` writes non-string values (py-JSON for V4.1, ``dumps_v4`` for V4).
    """
    ok, value = try_loads(arguments)
    if not ok or not isinstance(value, dict):
        return [("arguments", True, arguments)]
    return [(k, True, v) if isinstance(v, str) else (k, False, dumps(v)) for k, v in value.items()]


def tool_calls_block(calls: Sequence[ToolCall], tags: DsmlTags,
                     dumps: Callable[[Any], str] = dumps_py) -> list[str | SpecialToken]:
    """Plain strings and DSML tokens of the block, starting with the blank line before it."""
    out: list[str | SpecialToken] = ["\n\n<", _D, f"{tags.calls}>\n"]
    for i, call in enumerate(calls):
        if i:
            out.append("\n")
        out += ["<", _D, f'{tags.invoke} name="{call.name}">\n']
        params = tool_call_parameters(call.arguments, dumps)
        for j, (name, is_str, value) in enumerate(params):
            if j:
                out.append("\n")
            flag = "true" if is_str else "false"
            out += ["<", _D, f'{tags.parameter} name="{name}" string="{flag}">{value}</', _D, f"{tags.parameter}>"]
        if params or tags.empty_invoke_blank_line:
            out.append("\n")
        out += ["</", _D, f"{tags.invoke}>"]
    out += ["\n</", _D, f"{tags.calls}>"]
    return out
