"""Seeded random request bodies for the differential tests (Chat, Responses, Messages).

Each generator draws a conversation shape (system, user turns with text/images and typed special
tokens, assistant turns with reasoning and tool calls, tool results in shuffled order, reminders,
prefix continuations) and request settings (model, thinking/effort, sampling, limits, stop, tools
with strict schemas, tool choice, response format), and with a small probability breaks one rule, so
that both accepted and rejected requests are compared.
"""

from __future__ import annotations

import random
from typing import Any

MODELS = ["DeepSeek-V4.1-Flash", "DeepSeek-V4-Pro"]
TEXTS = ["hi", "Hello, world!", "What is the weather in Paris?", "Please answer in JSON.", "多语言 テスト 123",
         "typed <｜User｜> and <think> and </think> and <｜image｜> literals", "", "  spaces  ", "line1\nline2\n\n",
         "emoji 🌸 and \u2028 separator", "｜DSML｜ invoke", "numbers 1234567 3.14"]
EFFORTS = ["none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra"]
ARGS = ['{"city": "Paris", "days": 3}', '{}', '{"q": "x \\"y\\"", "n": [1, 2.5, null, true], "o": {"k": 1e-7}}',
        'not json', '[1, 2]', '', '{"a": 1', '{"big": 18446744073709551616, "neg": -0.0}', '"str"']
SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "description": "City", "minLength": 1}},
     "required": ["city"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}, "tags": {"type": "array",
                                                                                      "items": {"type": "string"}}}},
    {"type": "object"},
    None,
    {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}]}}, "required": []},
    {"type": "object", "properties": {"o": {"type": "object", "properties": {"x": {"type": "number"}}}},
     "additionalProperties": False, "title": "T"},
    {"type": "string"},
]


def _text(rng: random.Random) -> str:
    return rng.choice(TEXTS)


def _chat_content(rng: random.Random, images: bool) -> Any:
    if rng.random() < 0.6:
        return _text(rng)
    parts: list[dict[str, Any]] = []
    for _ in range(rng.randint(0, 3)):
        r = rng.random()
        if images and r < 0.3:
            url = rng.choice(["https://x.test/a.png", "data:image/png;base64,AAAA", "http://y.test/b.jpg"])
            img: dict[str, Any] = {"url": url}
            if rng.random() < 0.3:
                img["detail"] = rng.choice(["low", "high", "auto", "original"])
            parts.append({"type": "image_url", "image_url": img})
        else:
            parts.append({"type": "text", "text": _text(rng)})
    return parts


def _chat_tool(rng: random.Random, name: str) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if rng.random() < 0.6:
        fn["description"] = rng.choice(["Get weather", "", "多语言"])
    if rng.random() < 0.8:
        schema = rng.choice(SCHEMAS)
        if schema is not None or rng.random() < 0.5:
            fn["parameters"] = schema
    if rng.random() < 0.3:
        fn["strict"] = rng.random() < 0.7
    return {"type": "function", "function": fn}


def random_chat(rng: random.Random) -> dict[str, Any]:
    """A random Chat Completions body (mostly valid)."""
    body: dict[str, Any] = {"model": rng.choice(MODELS) if rng.random() > 0.03 else "deepseek-flash"}
    msgs: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": _chat_content(rng, images=rng.random() < 0.2)})
    names = ["get_weather", "search", "noop"]
    n_turns = rng.randint(1, 4)
    call_no = 0
    for turn in range(n_turns):
        msgs.append({"role": "user", "content": _chat_content(rng, images=True)})
        if rng.random() < 0.1:
            msgs.append({"role": "latest_reminder", "content": _text(rng)})
        if turn == n_turns - 1 and rng.random() < 0.6:
            break
        a: dict[str, Any] = {"role": "assistant", "content": _chat_content(rng, images=False)}
        if rng.random() < 0.5:
            a["reasoning_content"] = rng.choice(["thought", "", "multi\nline"])
        ids: list[str] = []
        if rng.random() < 0.5:
            k = rng.randint(1, 3)
            ids = [f"call_{call_no + j}" for j in range(k)]
            call_no += k
            a["tool_calls"] = [{"id": i, "type": "function", "function": {"name": rng.choice(names),
                                                                          "arguments": rng.choice(ARGS)}} for i in ids]
            if rng.random() < 0.3:
                a["content"] = None
        msgs.append(a)
        order = ids[:]
        rng.shuffle(order)
        for i in order:
            msgs.append({"role": "tool", "tool_call_id": i, "content": _chat_content(rng, images=rng.random() < 0.2)})
        if ids and rng.random() < 0.3:
            a2: dict[str, Any] = {"role": "assistant", "content": _text(rng)}
            if rng.random() < 0.5:
                a2["reasoning_content"] = "after tools"
            msgs.append(a2)
    if rng.random() < 0.15:
        p: dict[str, Any] = {"role": "assistant", "content": rng.choice(["", "Sure, ", "{\"a\":"]), "prefix": True}
        if rng.random() < 0.5:
            p["reasoning_content"] = rng.choice(["", "partial thought"])
        if msgs[-1]["role"] != "assistant":
            msgs.append(p)
    _break_chat(rng, msgs)
    body["messages"] = msgs
    _chat_settings(rng, body, names)
    return body


def _break_chat(rng: random.Random, msgs: list[dict[str, Any]]) -> None:
    if rng.random() > 0.12:
        return
    kind = rng.randrange(7)
    if kind == 0:
        msgs.insert(rng.randrange(len(msgs) + 1), {"role": "tool", "tool_call_id": "orphan", "content": "x"})
    elif kind == 1:
        msgs.append({"role": "assistant", "content": None})
    elif kind == 2:
        msgs.append({"role": "assistant", "content": "", "tool_calls": []})
    elif kind == 3:
        msgs.insert(0, {"role": "assistant", "content": "a", "prefix": True})
    elif kind == 4:
        msgs.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": "d", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "d", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})
    elif kind == 5:
        msgs.append({"role": "user", "content": [{"type": "file", "file": {"file_id": "x"}}]})
    else:
        msgs.clear()


def _chat_settings(rng: random.Random, body: dict[str, Any], names: list[str]) -> None:
    r = rng.random
    if r() < 0.3:
        body["thinking"] = {"type": rng.choice(["enabled", "disabled", "adaptive"])}
    if r() < 0.3:
        body["reasoning_effort"] = rng.choice(EFFORTS)
    if r() < 0.3:
        body["temperature"] = rng.choice([0, 0.3, 0.7, 1, 1.5, 2, 0.2, 1.3]) if r() < 0.9 else rng.choice([2.5, -1])
    if r() < 0.3:
        body["top_p"] = rng.choice([0.1, 0.5, 0.9, 0.95, 0.97, 1]) if r() < 0.9 else rng.choice([0, 1.2])
    if r() < 0.25:
        body["max_tokens"] = rng.choice([1, 100, 4096, 393216]) if r() < 0.9 else rng.choice([393217, 0])
    if r() < 0.05:
        body["max_completion_tokens"] = 10
    if r() < 0.05:
        body["n"] = rng.choice([1, 2])
    if r() < 0.2:
        body["stream"] = r() < 0.7
    if r() < 0.1:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    elif r() < 0.02:
        body["stream_options"] = {"include_usage": True}
    if r() < 0.2:
        good, bad = ["\n\n", ["END", "STOP"], []], [["x"] * 17, "", ["a", ""]]
        body["stop"] = rng.choice(good) if r() < 0.9 else rng.choice(bad)
    if r() < 0.1:
        body["logprobs"] = r() < 0.7
    if r() < 0.1:
        body["logprobs"] = r() < 0.9
        body["top_logprobs"] = rng.choice([0, 5, 20, 21])
    if r() < 0.1:
        body["seed"] = rng.choice([0, 42, 2**63 - 1, 2**63 - 1, 2**63])
    if r() < 0.5:
        tools = [_chat_tool(rng, n) for n in rng.sample(names, rng.randint(0, 3))]
        if r() < 0.05 and tools:
            tools.append(tools[0])
        body["tools"] = tools
        if r() < 0.5:
            choice = rng.choice(["auto", "none", "required", "named", "unknown"])
            if choice in ("required", "named") and r() < 0.7:
                body["thinking"] = {"type": "disabled"}
            if choice == "named":
                body["tool_choice"] = {"type": "function", "function": {"name": rng.choice(names)}}
            elif choice == "unknown":
                body["tool_choice"] = {"type": "function", "function": {"name": "zzz"}}
            else:
                body["tool_choice"] = choice
    if r() < 0.2:
        kind = rng.choice(["text", "json_object", "json_schema", "json_schema_strict", "regex"])
        if kind == "json_schema" or kind == "json_schema_strict":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "out", "schema": rng.choice(SCHEMAS[:2] + [{"type": "object", "properties": {
                    "v": {"type": "number", "maximum": 1.5e300}}}]), "strict": kind == "json_schema_strict"}}
        elif kind == "regex":
            body["response_format"] = {"type": "regex", "regex": "[a-z]+"}
        else:
            body["response_format"] = {"type": kind}
    if r() < 0.05:
        body["presence_penalty"] = 0.5


IMAGE_URLS = ["https://x.test/a.png", "data:image/png;base64,AAAA", "http://y.test/b.jpg",
              "data:image/webp;base64,AA==",
              "ftp://bad", "data:text/plain;base64,AA", "data:image/png;base64,A", "data:image/png,raw"]


def _resp_parts(rng: random.Random, role: str) -> Any:
    if rng.random() < 0.5:
        return _text(rng)
    parts: list[dict[str, Any]] = []
    for _ in range(rng.randint(0, 3)):
        r = rng.random()
        if role != "assistant" and r < 0.25:
            url = rng.choice(IMAGE_URLS[:4]) if rng.random() < 0.9 else rng.choice(IMAGE_URLS[4:])
            img: dict[str, Any] = {"type": "input_image", "image_url": url}
            if rng.random() < 0.3:
                img["detail"] = rng.choice(["low", "high", "auto"])
            parts.append(img)
        elif role != "assistant" and r < 0.3:
            parts.append({"type": "input_file", "file_id": "file_1"})
        else:
            kind = "output_text" if role == "assistant" and rng.random() < 0.8 else "input_text"
            parts.append({"type": kind, "text": _text(rng)})
    return parts


def _resp_tool(rng: random.Random, name: str) -> dict[str, Any]:
    t: dict[str, Any] = {"type": "function", "name": name}
    if rng.random() < 0.6:
        t["description"] = rng.choice(["Get weather", "", "多语言"])
    if rng.random() < 0.7:
        schema = rng.choice(SCHEMAS)
        if schema is not None:
            t["parameters"] = schema
    if rng.random() < 0.2:
        t["strict"] = rng.random() < 0.7
    return t


def random_responses(rng: random.Random) -> dict[str, Any]:
    """A random Responses body (mostly valid)."""
    body: dict[str, Any] = {"model": rng.choice(MODELS) if rng.random() > 0.03 else "deepseek-flash"}
    r = rng.random
    if r() < 0.3:
        body["instructions"] = rng.choice(["Be brief.", "", "Answer in json."])
    if r() < 0.2:
        body["input"] = _text(rng)
    else:
        items: list[dict[str, Any]] = []
        if r() < 0.3:
            items.append({"role": rng.choice(["system", "developer"]), "content": _resp_parts(rng, "system")})
        names = ["get_weather", "fs::read", "apply_patch"]
        call_no = 0
        for turn in range(rng.randint(1, 4)):
            msg: dict[str, Any] = {"role": "user", "content": _resp_parts(rng, "user")}
            if r() < 0.5:
                msg["type"] = "message"
            items.append(msg)
            if r() < 0.4:
                break
            if r() < 0.5:
                texts = [rng.choice(["think", "a\nb"]) for _ in range(rng.randint(0, 2))]
                items.append({"type": "reasoning", "summary": [],
                              "content": [{"type": "reasoning_text", "text": t} for t in texts]})
            if r() < 0.5:
                items.append({"role": "assistant", "content": _resp_parts(rng, "assistant")})
            if r() < 0.5:
                ids = [f"call_{call_no + j}" for j in range(rng.randint(1, 3))]
                call_no += len(ids)
                for cid in ids:
                    name = rng.choice(names)
                    if name == "apply_patch" and r() < 0.5:
                        items.append({"type": "custom_tool_call", "call_id": cid, "name": name, "input": "*** Begin"})
                    elif name == "fs::read":
                        items.append({"type": "function_call", "call_id": cid, "name": "read", "namespace": "fs",
                                      "arguments": rng.choice(ARGS)})
                    else:
                        items.append({"type": "function_call", "call_id": cid, "name": name,
                                      "arguments": rng.choice(ARGS)})
                order = ids[:]
                rng.shuffle(order)
                for cid in order:
                    kind = "function_call_output" if r() < 0.8 else "custom_tool_call_output"
                    items.append({"type": kind, "call_id": cid, "output": _resp_parts(rng, "tool")})
                if r() < 0.3:
                    items.append({"role": "assistant", "content": [{"type": "output_text", "text": "done"}]})
        if r() < 0.1:
            items.append({"type": rng.choice(["item_reference", "web_search_call", "bogus"]), "id": "x"})
        if r() < 0.08:
            kind = rng.randrange(4)
            if kind == 0:
                items.append({"type": "function_call_output", "call_id": "orphan", "output": "x"})
            elif kind == 1:
                items.append({"type": "function_call", "call_id": "dangling", "name": "f", "arguments": "{}"})
            elif kind == 2:
                items.clear()
            else:
                items.append({"role": "assistant", "content": [{"type": "input_image", "image_url": "https://x"}]})
        body["input"] = items
    if r() < 0.4:
        reasoning: dict[str, Any] = {}
        if r() < 0.8:
            reasoning["effort"] = rng.choice(EFFORTS)
        if r() < 0.3:
            reasoning["summary"] = "auto"
        body["reasoning"] = reasoning
    if r() < 0.3:
        body["temperature"] = rng.choice([0, 0.3, 1, 1.7]) if r() < 0.9 else 3
    if r() < 0.3:
        body["top_p"] = rng.choice([0.2, 0.9, 0.97, 1]) if r() < 0.9 else 0
    if r() < 0.3:
        body["max_output_tokens"] = rng.choice([16, 2048, 393216]) if r() < 0.9 else 0
    if r() < 0.2:
        body["stream"] = r() < 0.7
    if r() < 0.1:
        body["top_logprobs"] = rng.choice([0, 3, 20, 21])
    if r() < 0.1:
        body["user"] = "u-1"
    if r() < 0.5:
        tools: list[dict[str, Any]] = [_resp_tool(rng, "get_weather")]
        if r() < 0.5:
            tools.append({"type": "namespace", "name": "fs",
                          "tools": [_resp_tool(rng, "read"), _resp_tool(rng, "write")],
                          **({"description": "Files"} if r() < 0.6 else {})})
        if r() < 0.3:
            tools.append({"type": "custom", "name": "apply_patch" if r() < 0.9 else "other"})
        if r() < 0.3:
            hosted = ["web_search", "web_search_preview", "file_search", "web_search_2025_08_26"]
            tools.append({"type": rng.choice(hosted)})
        rng.shuffle(tools)
        body["tools"] = tools
        if r() < 0.5:
            c = rng.choice(["auto", "none", "required", "fn", "custom", "web_search", "unknown"])
            if c in ("required", "fn", "custom") and r() < 0.7:
                body["reasoning"] = {"effort": "none"}
            body["tool_choice"] = {"fn": {"type": "function", "name": "get_weather"},
                                   "custom": {"type": "custom", "name": "apply_patch"},
                                   "web_search": {"type": "web_search"},
                                   "unknown": {"type": "function", "name": "zzz"}}.get(c, c)
    if r() < 0.2:
        kind = rng.choice(["text", "json_object", "json_schema", "json_schema_strict"])
        if kind.startswith("json_schema"):
            body["text"] = {"format": {"type": "json_schema", "name": "out", "schema": rng.choice(SCHEMAS[:2]),
                                       "strict": kind.endswith("strict")}}
        else:
            body["text"] = {"format": {"type": kind}}
    return body


def _msg_block(rng: random.Random, role: str) -> dict[str, Any]:
    r = rng.random()
    if role == "user" and r < 0.2:
        if rng.random() < 0.5:
            src: dict[str, Any] = {"type": "base64", "media_type": rng.choice(["image/png", "image/jpeg"]),
                                   "data": rng.choice(["AAAA", "AA==", "A"] if rng.random() < 0.2 else ["AAAA"])}
        else:
            src = {"type": "url", "url": rng.choice(["https://x.test/a.png"] * 5 + ["ftp://bad"])}
        return {"type": "image", "source": src}
    if role == "user" and r < 0.25:
        return {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}}
    if role == "assistant" and r < 0.35:
        return {"type": "thinking", "thinking": rng.choice(["hmm", "step 1\nstep 2"]), "signature": "sig"}
    return {"type": "text", "text": _text(rng)}


def random_messages(rng: random.Random) -> dict[str, Any]:
    """A random Messages body (mostly valid)."""
    r = rng.random
    body: dict[str, Any] = {"model": rng.choice(MODELS) if r() > 0.03 else "deepseek-flash"}
    if r() < 0.9:
        body["max_tokens"] = rng.choice([256, 4096, 393216, 500000]) if r() < 0.95 else 0
    if r() < 0.4:
        body["system"] = rng.choice(["You are helpful.", "", [{"type": "text", "text": "a"}, {"type": "text",
                                                                                           "text": "json please"}]])
    names = ["get_weather", "search", "lookup"]
    msgs: list[dict[str, Any]] = []
    pending: list[str] = []
    call_no = 0
    for turn in range(rng.randint(1, 4)):
        blocks: list[dict[str, Any]] = []
        order = pending[:]
        rng.shuffle(order)
        for tid in order:
            res: dict[str, Any] = {"type": "tool_result", "tool_use_id": tid}
            if r() < 0.8:
                parts = [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]
                res["content"] = rng.choice(["ok", "", parts])
            if r() < 0.2:
                res["is_error"] = True
            blocks.append(res)
        pending = []
        for _ in range(rng.randint(0 if blocks else 1, 2)):
            blocks.append(_msg_block(rng, "user"))
        msgs.append({"role": "user", "content": blocks if (r() < 0.7 or len(blocks) != 1 or blocks[0]["type"] != "text")
                     else blocks[0]["text"]})
        if r() < 0.1:
            msgs.append({"role": "system", "content": rng.choice(["mid system", [{"type": "text", "text": "s"}]])})
        if r() < 0.3 and turn > 0:
            break
        ablocks: list[dict[str, Any]] = [_msg_block(rng, "assistant") for _ in range(rng.randint(0, 2))]
        if r() < 0.5:
            ids = [f"toolu_{call_no + j}" for j in range(rng.randint(1, 3))]
            call_no += len(ids)
            for tid in ids:
                ablocks.append({"type": "tool_use", "id": tid, "name": rng.choice(names),
                                "input": rng.choice([{}, {"b": 1, "a": "x y"}, {"q": [1, 2.5, None], "o": {"k": 1e-7}},
                                                     "raw", [1]])})
            pending = ids
        if not ablocks:
            ablocks = [{"type": "text", "text": "ok"}]
        msgs.append({"role": "assistant", "content": ablocks if r() < 0.8 or len(ablocks) != 1 or
                     ablocks[0]["type"] != "text" else ablocks[0]["text"]})
    if pending:
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": t, "content": "done"}
                                                 for t in pending]})
    if r() < 0.08:
        kind = rng.randrange(5)
        if kind == 0:
            msgs.append({"role": "user", "content": []})
        elif kind == 1:
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]})
        elif kind == 2:
            msgs.append({"role": "assistant", "content": [{"type": "tool_use", "id": "dangling", "name": "f",
                                                           "input": {}}]})
        elif kind == 3:
            msgs.clear()
        else:
            msgs.append({"role": "assistant", "content": [{"type": "server_tool_use", "id": "s", "name": "web_search",
                                                           "input": {}}, {"type": "text", "text": "found"}]})
    body["messages"] = msgs
    if r() < 0.3:
        body["thinking"] = {"type": rng.choice(["enabled", "disabled", "adaptive"]), "budget_tokens": 1024}
    if r() < 0.2:
        body["output_config"] = {"effort": rng.choice(EFFORTS)}
    if r() < 0.3:
        body["temperature"] = rng.choice([0, 0.5, 1, 1.9]) if r() < 0.9 else 2.5
    if r() < 0.3:
        body["top_p"] = rng.choice([0.3, 0.95, 0.99]) if r() < 0.9 else 0
    if r() < 0.1:
        body["top_k"] = 40
    if r() < 0.2:
        body["stop_sequences"] = rng.choice([["END"], [], ["a", "b"]]) if r() < 0.9 else rng.choice([[""], ["x"] * 17])
    if r() < 0.2:
        body["stream"] = r() < 0.8
    if r() < 0.5:
        tools: list[dict[str, Any]] = []
        for n in rng.sample(names, rng.randint(0, 3)):
            t: dict[str, Any] = {"name": n}
            if r() < 0.6:
                t["description"] = rng.choice(["Get weather", "多语言", ""])
            if r() < 0.95:
                t["input_schema"] = rng.choice(SCHEMAS[:3] + SCHEMAS[4:6]) if r() < 0.95 else {"type": "string"}
            if r() < 0.15:
                t["defer_loading"] = True
            tools.append(t)
        if r() < 0.15:
            tools.append(rng.choice([{"type": "web_search_20250305", "name": "web_search"},
                                     {"type": "bash_20250124", "name": "bash"}]))
        body["tools"] = tools
        if r() < 0.5:
            c = rng.choice(["auto", "any", "none", "tool", "tool_unknown"])
            if c.startswith("tool") and r() < 0.7:
                body["thinking"] = {"type": "disabled"}
            body["tool_choice"] = {"type": "tool", "name": rng.choice(names) if c == "tool" else "zzz"} \
                if c.startswith("tool") else {"type": c}
        if r() < 0.1 and tools:
            msgs.append({"role": "system", "content": [{"type": "text", "text": "more tools"}, {
                "type": "tool_addition", "tool": {"type": "tool_reference", "name": rng.choice(names)}}]})
    return body


def random_conversation(rng: random.Random, *, v4_safe: bool) -> Any:
    """A random conversation built directly (not through conversion), for the rendering tests.

    ``v4_safe``: tool results directly follow their assistant turn (the official V4 encoder regroups
    other placements by counting calls; see ``deepinfer_jax.recipe.render``).
    """
    from deepinfer_jax.recipe import conversation as c

    r = rng.random
    msgs: list[Any] = []
    if r() < 0.5:
        msgs.append(c.SystemMessage(rng.choice(["sys", "", "json sys <｜image｜>"]),
                                    [c.ImageSource.from_url("https://s")] if r() < 0.2 else ()))
    calls = 0
    for _ in range(rng.randint(0, 4)):
        k = rng.random()
        if k < 0.4:
            imgs = [c.ImageSource.from_url(f"https://i/{j}") for j in range(rng.randint(0, 2))] if r() < 0.3 else []
            text = rng.choice(TEXTS)
            if imgs:
                text = " ".join(["<｜image｜>"] * rng.randint(0, len(imgs) + 1) + [text])
            msgs.append(c.UserMessage(text, imgs))
        elif k < 0.7:
            ids = [f"c{calls + j}" for j in range(rng.randint(1, 3))] if r() < 0.5 else []
            calls += len(ids)
            tc = [c.ToolCall(i, rng.choice(["f", "g"]), rng.choice(ARGS)) for i in ids] or None
            msgs.append(c.AssistantMessage(rng.choice(TEXTS), rng.choice([None, "", "r"]), tc))
            order = ids[:]
            rng.shuffle(order)
            for i in order:
                msgs.append(c.ToolMessage(rng.choice(TEXTS), i if r() < 0.9 else "unknown"))
        elif k < 0.8:
            msgs.append(c.LatestReminderMessage(rng.choice(TEXTS)))
        elif k < 0.9 and not v4_safe:
            msgs.append(c.ToolMessage("stray", "c0"))
        else:
            msgs.append(c.SystemMessage(rng.choice(["mid", ""]),
                                        tools=[c.ToolDefinition("late", "d", {"type": "object"})]
                                        if r() < 0.2 else None))
    if r() < 0.2:
        msgs.append(c.AssistantMessage(rng.choice(["", "cont"]), rng.choice([None, "", "rea"]),
                                       [c.ToolCall("p1", "f", "{}")] if r() < 0.2 else None, prefix=True))
    tools = []
    if r() < 0.5:
        tools = [c.ToolDefinition(n, rng.choice([None, "desc"]), rng.choice(SCHEMAS[:3] + [{"x": 1e-7}]),
                                  defer_loading=r() < 0.1) for n in ("f", "g")[:rng.randint(1, 2)]]
    kw: dict[str, Any] = {}
    fmt = rng.random()
    if fmt < 0.1:
        kw["response_format"] = "json_object"
    elif fmt < 0.2:
        kw["response_schema"] = rng.choice(SCHEMAS[:2])
    elif fmt < 0.25:
        kw["response_regex"] = "[0-9]+"
    return c.Conversation(msgs, thinking_mode=r() < 0.6, tools=tools,
                          tool_choice=rng.choice(["auto", "auto", "none", "required"]),
                          reasoning_effort=rng.choice([None, "low", "high", "xhigh", "max"]), **kw)
