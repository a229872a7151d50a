"""The request settings a Responses object repeats (its *echo*), read from a Responses request body.

The official library reports them as the request gave them (not the converted sampling values):
``instructions``, ``max_output_tokens``, ``reasoning.effort``, ``temperature`` / ``top_p`` (1.0 when
absent), ``text.format``, ``tool_choice``, ``tools`` (normalised: absent optional fields as null),
``top_logprobs`` (0 when absent) and ``user``. Other response fields are constants.
"""

from __future__ import annotations

from typing import Any


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict")}


def _tool(tool: dict[str, Any]) -> dict[str, Any] | None:
    kind = tool.get("type")
    if kind == "function":
        return _function(tool)
    if kind == "namespace":
        return {"type": "namespace", "name": tool.get("name"), "description": tool.get("description"),
                "tools": [_function(t) for t in tool.get("tools") or ()]}
    if kind == "custom":
        out = {"type": "custom", "name": tool.get("name")}
        for key in ("description", "format"):
            if key in tool:
                out[key] = tool[key]
        return out
    return None  # server tools (web search) are not echoed


def _format(fmt: dict[str, Any] | None) -> dict[str, Any]:
    if not fmt or fmt.get("type") in (None, "text"):
        return {"type": "text"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "name": fmt.get("name"), "schema": fmt.get("schema"),
                "description": fmt.get("description"), "strict": fmt.get("strict")}
    return {"type": fmt["type"]}


def responses_echo(body: dict[str, Any]) -> dict[str, Any]:
    """The echo of a Responses request body, for ``StreamOptions.responses_echo``."""
    reasoning = body.get("reasoning") or {}
    text = body.get("text") or {}
    tools = [t for t in (_tool(t) for t in body.get("tools") or ()) if t is not None]
    return {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": None},
        "temperature": float(body["temperature"]) if body.get("temperature") is not None else 1.0,
        "text": {"format": _format(text.get("format")), "verbosity": None},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": tools,
        "top_logprobs": body.get("top_logprobs") or 0,
        "top_p": float(body["top_p"]) if body.get("top_p") is not None else 1.0,
        "user": body.get("user"),
    }
