"""Prompt rendering for DeepSeek V4.1 and V4 (recipe.md §4).

:func:`render` turns a :class:`~deepinfer_jax.recipe.conversation.Conversation` into a
:class:`RenderedPrompt`: the prompt text, the code-point ranges of the template's special tokens
(the only text that encoding maps to added-vocabulary ids) and the image sources in placeholder order.

Layout (``⟨X⟩`` = special token), V4.1::

    ⟨BOS⟩ [⟨System⟩ effort-header]  message*  [⟨Assistant⟩ (⟨think⟩ | ⟨/think⟩)] [required-tools opener]

- tools (when active) and the json response format are appended to the first message if it is a
  system message, else to a new empty system message inserted first;
- user/tool messages directly after user/tool messages merge (``\\n\\n``, no new token); within each
  such run, tool results are stably sorted by the position of their call id in the latest
  assistant's tool calls (an unknown id sorts as position 0);
- assistant: ``⟨Assistant⟩`` THINK content [DSML block] ``⟨EOS⟩`` (no EOS for a final prefix turn);
  earlier reasoning is kept (``⟨think⟩r⟨/think⟩``) only when tools are active, else ``⟨/think⟩``;
  a final prefix turn keeps (or leaves open) its reasoning;
- the generation header is left out after a final prefix turn, but the ``required`` tool-call opener
  is always appended.

V4 differs: no ``⟨System⟩`` token; all system messages are hoisted after BOS and the effort text
(joined with ``\\n\\n``, empty ones skipped, system tool lists dropped); other DSML tag names; its own
effort and json_object texts; JSON floats written Rust-style (``1e-7``); consecutive user messages
are first merged (empty ones add nothing); a tool message after a user message opens a new
``⟨User⟩``; tool results are sorted within runs of tool messages (unknown ids last); earlier
reasoning is kept whenever tools are active and the turn has reasoning (``None`` renders
``⟨/think⟩``), in or out of thinking mode. Both versions cost O(prompt length).

Official quirks reproduced (they look like bugs; matched on purpose, recipe.md §0):

- V4.1 keeps only the first of consecutive latest-reminder messages;
- V4.1 treats a prefix turn that opens the conversation like an earlier turn (``⟨/think⟩content``),
  while conversion still reports a reasoning/content continuation for it;
- V4 leaves a final prefix turn's reasoning open even when tool calls follow it;
- with every tool deferred the schema list is empty and V4.1 / V4 differ by one newline.

Known deviation (V4 only, never produced by conversion): when tool results do not directly follow
their assistant turn, the official V4 encoder regroups messages by counting the assistant's tool calls
(e.g. ``[A(calls 1,2,3), U x, T1, T2, T3]`` renders ``T1 T2 x`` then a new ``⟨User⟩ T3``). We render
such malformed histories in message order instead; every conversation that conversion builds (tool
results right after their assistant turn) renders identically.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer_jax.recipe import prompts
from deepinfer_jax.recipe.conversation import (
    AssistantMessage,
    Conversation,
    ImageSource,
    Message,
    SystemMessage,
    ToolDefinition,
    UserMessage,
)
from deepinfer_jax.recipe.dsml import tool_calls_block
from deepinfer_jax.recipe.pyjson import dumps_py, dumps_v4
from deepinfer_jax.recipe.special_tokens import DEFAULT_SPECIAL_TOKENS, SpecialToken, SpecialTokens

__all__ = ["ModelVersion", "RenderedPrompt", "render"]

ST = SpecialToken


class ModelVersion(enum.Enum):
    """The model a request targets; it selects the template (``DEEPSEEK_V4_PRO`` renders with V4)."""

    DEEPSEEK_V4_PRO = "DeepseekV4Pro"
    DEEPSEEK_V41_FLASH = "DeepseekV41Flash"

    @property
    def is_v41(self) -> bool:
        return self is ModelVersion.DEEPSEEK_V41_FLASH

    @classmethod
    def parse(cls, value: ModelVersion | str) -> ModelVersion:
        """Accept the enum, its value, or ``"v4"`` / ``"v4.1"``."""
        if isinstance(value, ModelVersion):
            return value
        key = str(value).lower().replace("-", "").replace("_", "")
        if key in ("v4", "deepseekv4pro", "v4pro"):
            return cls.DEEPSEEK_V4_PRO
        if key in ("v4.1", "v41", "deepseekv41flash", "v4.1flash", "deepseekv4.1flash"):
            return cls.DEEPSEEK_V41_FLASH
        raise ValueError(f"unknown model version {value!r}; expected 'v4' or 'v4.1'")


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A rendered prompt.

    Attributes:
        prompt: the prompt text.
        special_ranges: ascending, disjoint half-open ``(start, end)`` code-point ranges of ``prompt``,
            one per special token; the text between them is plain.
        image_sources: the images of the rendered messages, in placeholder order.
    """

    prompt: str
    special_ranges: tuple[tuple[int, int], ...]
    image_sources: tuple[ImageSource, ...]


class _Raw(str):
    """A special token spelled as written in message content (a real image placeholder)."""

    __slots__ = ()


Piece = str | SpecialToken  # plain text, or a template special token


class _Builder:
    """Accumulates prompt text and special ranges; ``pos`` counts code points."""

    __slots__ = ("images", "parts", "pos", "ranges", "spell")

    def __init__(self, st: SpecialTokens) -> None:
        self.parts: list[str] = []
        self.ranges: list[tuple[int, int]] = []
        self.pos = 0
        self.spell = {kind: st[kind] for kind in SpecialToken}
        self.images: list[ImageSource] = []

    def text(self, s: str) -> None:
        if s:
            self.parts.append(s)
            self.pos += len(s)

    def special(self, kind: SpecialToken) -> None:
        s = self.spell[kind]
        end = self.pos + len(s)
        self.parts.append(s)
        self.ranges.append((self.pos, end))
        self.pos = end

    def _special(self, s: str) -> None:
        end = self.pos + len(s)
        self.parts.append(s)
        self.ranges.append((self.pos, end))
        self.pos = end

    def pieces(self, pieces: Sequence[Piece]) -> None:
        for p in pieces:
            if isinstance(p, SpecialToken):
                self.special(p)
            elif isinstance(p, _Raw):
                self._special(p)
            else:
                self.text(p)

    def build(self) -> RenderedPrompt:
        return RenderedPrompt("".join(self.parts), tuple(self.ranges), tuple(self.images))


def _content_pieces(msg: Message) -> list[Piece]:
    """The content of ``msg`` split at its real image placeholders."""
    text = msg.content
    if not msg.image_offsets:
        return [text]
    out: list[Piece] = []
    n = len(msg.image_token)
    pos = 0
    for off in msg.image_offsets:
        out.append(text[pos:off])
        out.append(_Raw(text[off:off + n]))
        pos = off + n
    out.append(text[pos:])
    return out


def _dumps(v41: bool):
    return dumps_py if v41 else dumps_v4


def _schema_lines(tools: Sequence[ToolDefinition], v41: bool) -> str:
    """The tool schemas, one JSON line each, as the tool prompt embeds them: V4.1 joins the lines and
    adds one newline, V4 ends every line with one (they differ only when the list is empty)."""
    dumps = _dumps(v41)
    lines = [dumps({"name": t.name, "description": t.description or "", "parameters": t.parameters}) for t in tools]
    return "\n".join(lines) + "\n" if v41 else "".join(line + "\n" for line in lines)


def _system_extra(conv: Conversation, v41: bool) -> list[Piece]:
    """Tool prompt and response-format text appended to the first system content."""
    out: list[Piece] = []
    if conv.tools_active:
        tags = prompts.V41_TAGS if v41 else prompts.V4_TAGS
        out += prompts.tool_prompt_template(tags, _schema_lines([t for t in conv.tools if not t.defer_loading], v41))
    if conv.response_format == "json_object":
        out.append(prompts.json_object_text(v41))
    elif conv.response_format == "json_schema":
        out.append(prompts.json_schema_text(_dumps(v41)(conv.response_schema)))
    return out


def _reorder_tool_results(msgs: list[Message], sortable: tuple[str, ...], unknown_last: bool) -> list[Message]:
    """Stable-sort tool messages inside each run of ``sortable`` roles by their call's position.

    The key is the position of the tool's ``tool_call_id`` among the latest assistant's calls. An id
    that is not there sorts as position 0 in V4.1 and after all known ids in V4 (``unknown_last``),
    as the official encoders do. V4.1 runs are user/tool runs, V4 runs are runs of tool messages.
    """
    out = list(msgs)
    order: dict[str, int] = {}
    i = 0
    n = len(out)
    while i < n:
        m = out[i]
        if m.role == "assistant":
            order = {}
            for k, call in enumerate(m.tool_calls or ()):
                order.setdefault(call.id, k)
        if m.role not in sortable:
            i += 1
            continue
        j = i
        while j < n and out[j].role in sortable:
            j += 1
        slots = [k for k in range(i, j) if out[k].role == "tool"]
        if len(slots) > 1 and order:
            missing = len(order) if unknown_last else 0
            tools = sorted((out[k] for k in slots), key=lambda t: order.get(t.tool_call_id or "", missing))
            for k, t in zip(slots, tools, strict=True):
                out[k] = t
        i = j
    return out


def _think_v4(b: _Builder, m: AssistantMessage, conv: Conversation, final_prefix: bool) -> None:
    """V4 thinking part: kept reasoning needs a value (None renders ``⟨/think⟩``), even outside thinking.

    A final prefix turn in thinking mode with empty content leaves its reasoning open (or writes
    nothing when the reasoning is None), even when tool calls follow: the official V4 behaviour.
    """
    r = m.reasoning_content
    if final_prefix and conv.thinking_mode and not m.content:
        if r is not None:
            b.special(ST.THINKING_START)
            b.text(r)
        return
    if r is not None and (final_prefix or conv.tools_active):
        b.special(ST.THINKING_START)
        b.text(r)
    b.special(ST.THINKING_END)


def _assistant(b: _Builder, m: AssistantMessage, conv: Conversation, final_prefix: bool, v41: bool,
               first: bool) -> None:
    """``first``: the message opens the conversation (V4.1 then treats a prefix turn's reasoning like an
    earlier turn's, as the official encoder does)."""
    b.special(ST.ASSISTANT)
    continuing = final_prefix and not first
    if not v41:
        _think_v4(b, m, conv, final_prefix)
    elif not conv.thinking_mode:
        b.special(ST.THINKING_END)
    elif continuing and not m.content and not m.tool_calls:
        b.special(ST.THINKING_START)  # reasoning left open (or a fresh start when empty)
        b.text(m.reasoning_content or "")
        return
    elif conv.tools_active or continuing:
        b.special(ST.THINKING_START)
        b.text(m.reasoning_content or "")
        b.special(ST.THINKING_END)
    else:
        b.special(ST.THINKING_END)
    b.text(m.content)
    if m.tool_calls:
        b.pieces(tool_calls_block(m.tool_calls, prompts.V41_TAGS if v41 else prompts.V4_TAGS, _dumps(v41)))
    if not final_prefix:
        b.special(ST.EOS)


def _user_like(b: _Builder, m: Message, merged: bool) -> None:
    if merged:
        b.text("\n\n")
    else:
        b.special(ST.USER)
    b.images.extend(m.image_sources)
    if m.role == "tool":
        b.text("<tool_result>")
        b.pieces(_content_pieces(m))
        b.text("</tool_result>")
    else:
        b.pieces(_content_pieces(m))


def _messages(b: _Builder, msgs: Sequence[Message], conv: Conversation, v41: bool,
              first_extra: list[Piece] | None, header: str) -> None:
    """Render messages; ``header`` opens the first one (V4.1 effort), ``first_extra`` ends msgs[0]."""
    prev = ""
    last = len(msgs) - 1
    for i, m in enumerate(msgs):
        role = m.role
        if i == 0 and header:
            b.special(ST.SYSTEM)
            b.text(header)
        if role in ("user", "tool"):
            merged = prev in ("user", "tool") if v41 or role == "user" else prev == "tool"
            _user_like(b, m, merged)
        elif role == "assistant":
            _assistant(b, m, conv, i == last and m.prefix, v41, i == 0)  # type: ignore[arg-type]
        elif role == "system":
            if not (i == 0 and header):
                b.special(ST.SYSTEM)
            b.images.extend(m.image_sources)
            b.pieces(_content_pieces(m))
            if i == 0 and first_extra:
                b.pieces(first_extra)
            tools = m.tools if isinstance(m, SystemMessage) else None
            if tools:
                b.text(prompts.updated_tools_header() + _schema_lines(tools, True)[:-1])
        elif role == "latest_reminder":
            if v41 and prev == "latest_reminder":
                continue  # V4.1 keeps only the first of consecutive reminders (official behaviour)
            b.special(ST.LATEST_REMINDER)
            b.text(m.content)
        else:  # pragma: no cover - the model has no other roles
            raise ValueError(f"unknown role {role!r}")
        prev = role


def _suffix(b: _Builder, conv: Conversation, msgs: Sequence[Message], v41: bool) -> None:
    """Generation header (none after a final prefix turn), then the tool-call opener for ``required``
    (appended even after a prefix turn, as the official encoders do)."""
    if not (msgs and msgs[-1].role == "assistant" and msgs[-1].prefix):
        b.special(ST.ASSISTANT)
        b.special(ST.THINKING_START if conv.thinking_mode else ST.THINKING_END)
    if conv.tools_active and conv.tool_choice == "required":
        tags = prompts.V41_TAGS if v41 else prompts.V4_TAGS
        b.pieces(["\n\n<", ST.DSML, f"{tags.calls}>\n"])


def _render_v41(b: _Builder, conv: Conversation) -> None:
    msgs = _reorder_tool_results(list(conv.messages), ("user", "tool"), unknown_last=False)
    extra = _system_extra(conv, True)
    if extra and not (msgs and msgs[0].role == "system"):
        msgs.insert(0, SystemMessage(""))
    header = prompts.v41_effort_header(conv.reasoning_effort) if conv.thinking_mode and msgs else ""
    _messages(b, msgs, conv, True, extra, header)
    _suffix(b, conv, msgs, True)


def _merge_users_v4(msgs: list[Message]) -> list[Message]:
    """V4 first merges each run of consecutive user messages into one, joining the non-empty contents
    with ``\\n\\n`` (so an empty user message adds nothing), as the official V4 encoder does."""
    out: list[Message] = []
    for m in msgs:
        prev = out[-1] if out else None
        if m.role != "user" or prev is None or prev.role != "user":
            out.append(m)
            continue
        sep = "\n\n" if prev.content and m.content else ""
        shift = len(prev.content) + len(sep)
        out[-1] = UserMessage(prev.content + sep + m.content, prev.image_sources + m.image_sources,
                              image_offsets=prev.image_offsets + tuple(o + shift for o in m.image_offsets),
                              image_token=prev.image_token)
    return out


def _render_v4(b: _Builder, conv: Conversation) -> None:
    systems = [m for m in conv.messages if m.role == "system"]
    msgs = _merge_users_v4([m for m in conv.messages if m.role != "system"])
    msgs = _reorder_tool_results(msgs, ("tool",), unknown_last=True)
    if conv.thinking_mode:
        b.text(prompts.v4_effort_text(conv.reasoning_effort))
    first = True
    for s in systems:
        if not s.content:
            continue
        b.images.extend(s.image_sources)
        if not first:
            b.text("\n\n")
        b.pieces(_content_pieces(s))
        first = False
    b.pieces(_system_extra(conv, False))
    _messages(b, msgs, conv, False, None, "")
    _suffix(b, conv, msgs, False)


def render(conversation: Conversation, version: ModelVersion | str = ModelVersion.DEEPSEEK_V41_FLASH,
           special_tokens: SpecialTokens | None = None) -> RenderedPrompt:
    """Render ``conversation`` with the V4.1 or V4 template (``version``: ModelVersion, "v4.1" or "v4").

    ``special_tokens`` changes the spellings of the template's special tokens (default spellings
    otherwise). Returns the prompt, its special-token ranges and the image sources.
    """
    b = _Builder(special_tokens or DEFAULT_SPECIAL_TOKENS)
    b.special(ST.BOS)
    if ModelVersion.parse(version).is_v41:
        _render_v41(b, conversation)
    else:
        _render_v4(b, conversation)
    return b.build()
