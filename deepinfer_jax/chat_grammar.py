"""The recipe's ``output_constraint`` as an engine ``structured_output`` (for ``LLM.chat``).

``OutputConstraint.kind``:

- ``json``: the content is one JSON value of the schema (schema text ``""`` = any JSON object);
- ``regex``: the content matches the pattern;
- ``tool_call_required``: the output is the body of the DSML tool-call block the prompt opened
  (``ParsingOptions.starts_in_tool_calls``): one or more invokes of the listed tools, each
  parameter by name, then the block's end (recipe.md §7.1);
- ``tool_call``: free content, optionally followed by one DSML tool-call block as above.

In thinking mode (the prompt left ``<think>`` open) the output first has free reasoning ended by
the ``</think>`` special token, and the constraint applies after it. The grammars are Lark in
llguidance's dialect, where ``<[id]>`` is a special token by id and ``%json {...}`` an inline JSON
Schema; ``｜DSML｜`` and ``</think>`` are only ever allowed as those special ids, never as text.

What is enforced: tool names, parameter names, the ``string="true|false"`` flag (``true`` exactly
for string-typed parameters), each non-string value as JSON of its schema, a string value's
``enum`` or ``maxLength`` (other string values are free text without ``</``), every ``required``
parameter present, each parameter at most once, in the schema's property order (the order the
prompt lists them). Not enforced: other string keywords (``pattern``, ``minLength``, ...).
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["structured_output_for"]

# Compact JSON, as engine.structured generates it for json_schema requests.
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json_rule(schema: Any) -> str:
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**_LAYOUT, **schema.get("x-guidance", {})}}
    return "%json " + json.dumps(schema)


def _lark_str(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: JSON escaping is accepted


def _tools_grammar(tools: list[dict], dsml: int, v41: bool) -> list[str]:
    """Rules ``calls_body`` (invokes and the block's end) for the given Chat-style function tools.

    Each literal that precedes a special token ends right before it (``"\\n<"``, ``"\\n</"``): the
    lexer is greedy and does not split a finished piece of text afterwards."""
    d = f"<[{dsml}]>"
    block, invoke, param = (" calls", " invoke", " parameter") if v41 else ("tool_calls", "invoke", "parameter")
    rules = [f'calls_body: "<" invoke ("\\n<" invoke)* "\\n</" {d} {_lark_str(block + ">")}']
    alternatives = []
    for n, tool in enumerate(tools):
        fn = tool.get("function", tool)
        schema_n = fn.get("parameters") or {}
        props = schema_n.get("properties") or {}
        required = set(schema_n.get("required") or ()) & set(props)
        seq = []
        for k, (key, schema) in enumerate(props.items()):
            is_str = isinstance(schema, dict) and schema.get("type") == "string"
            tag = _lark_str(f'{param} name="{key}" string="{str(is_str).lower()}">')
            if is_str and isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
                value = "(" + " | ".join(_lark_str(v) for v in schema["enum"]) + ') "</"'
            elif is_str and isinstance(schema.get("maxLength"), int):
                value = f"/(?s:([^<]|<[^\\/]){{0,{schema['maxLength']}}}<\\/)/"
            elif is_str:
                value = "VALUE_END"
            else:
                rules.append(f"v{n}_{k}: {_json_rule(schema if isinstance(schema, dict) else {})}")
                value = f'v{n}_{k} "</"'
            rules.append(f'p{n}_{k}: "\\n<" {d} {tag} {value} {d} {_lark_str(param + ">")}')
            seq.append(f"p{n}_{k}" if key in required else f"p{n}_{k}?")  # schema order, each at most once
        if required:
            body = " ".join(seq)
        elif seq:  # all optional: some of them, or none (V4.1 then leaves a blank line)
            body = f'({" ".join(seq)} | "\\n")' if v41 else " ".join(seq)
        else:  # V4.1 leaves a blank line in an invoke without parameters
            body = '"\\n"' if v41 else ""
        tag = _lark_str(f'{invoke} name="{fn["name"]}">')
        rules.append(f'i{n}: {d} {tag} {body} "\\n</" {d} {_lark_str(invoke + ">")}')
        alternatives.append(f"i{n}")
    rules.append("invoke: " + " | ".join(alternatives))
    # a string value runs until "</" (which never occurs inside it), then the special token
    rules.append(r"VALUE_END: /(?s:([^<]|<[^\/])*<\/)/")
    return rules


def structured_output_for(constraint, thinking: bool, tokenizer, v41: bool = True) -> dict | None:
    """The ``SamplingParams.structured_output`` for a recipe ``OutputConstraint`` (None = none).

    ``thinking``: the output starts with reasoning closed by ``</think>``; ``tokenizer`` gives the
    special ids; ``v41``: V4.1 DSML tag names (else V4's)."""
    if constraint is None:
        return None
    kind, schema_text = constraint.kind, constraint.schema
    think = tokenizer.token_to_id("</think>")
    dsml = tokenizer.token_to_id("｜DSML｜")
    prefix = f"REASONING <[{think}]> " if thinking else ""
    rules = [r"REASONING: /(?s:.*)/"] if thinking else []
    if kind == "json":
        schema = json.loads(schema_text) if schema_text else {"type": "object"}
        if not thinking:
            return {"json_schema": schema}
        rules += [f"start: {prefix}body", f"body: {_json_rule(schema)}"]
    elif kind == "regex":
        if not thinking:
            return {"regex": schema_text}
        rules += [f"start: {prefix}BODY", "BODY: /" + re.sub(r"(?<!\\)/", r"\/", schema_text) + "/"]
    elif kind in ("tool_call", "tool_call_required"):
        tools = json.loads(schema_text)
        rules += _tools_grammar(tools, dsml, v41)
        if kind == "tool_call_required":  # the prompt opened the block: the output is its body
            rules.insert(0, "start: calls_body")
        else:
            block, nl = (" calls>" if v41 else "tool_calls>"), "\n"
            rules += [f"start: {prefix}CONTENT calls?", r"CONTENT: /(?s:.*)/",
                      f"calls: <[{dsml}]> {_lark_str(block + nl)} calls_body"]
    else:
        raise ValueError(f"unknown output constraint kind {kind!r}")
    return {"grammar": "\n".join(rules)}
