"""The output parser: pushed text or token ids in, internal events out (recipe.md §8).

Each push is cut into *chunks*: the whole text in text mode; in token mode one chunk per run of BPE
tokens and one per added token (:mod:`.utf8`). The label matcher (:mod:`.matcher`) resolves the
characters into segments, which are laid over the chunks. Within a chunk, pieces with equal actions form one
run and one event; a run is released when a piece of another action follows it or when its chunk
is complete (every character resolved). So ``"abc\\n<"`` comes out whole with the next push (its
run of content may still grow), while ``"Hi\\n\\n<｜DSML｜ …"`` releases ``Hi`` at once. Per-push
deltas follow the input chunking; their concatenation does not (except JSON mode, where text
around the JSON becomes one space per chunk). These are the official wheel's emission rules; the
differential tests pin them.

An empty chunk (text mode only) takes an empty piece of the segment covering its position: at once
when nothing is pending, else with the next segment. It yields an empty delta for text actions.
"""

from __future__ import annotations

import secrets
import string
from collections import deque
from collections.abc import Callable

from deepinfer_jax.recipe.stream import stages as st
from deepinfer_jax.recipe.stream.events import (
    ContentDelta,
    Event,
    Finish,
    ReasoningDelta,
    Start,
    ToolArgsDelta,
    ToolCallStart,
    Usage,
)
from deepinfer_jax.recipe.stream.json_fragments import escape_piece
from deepinfer_jax.recipe.stream.markers import TEXT_LABELS, TOKEN_LABELS
from deepinfer_jax.recipe.stream.matcher import Machine
from deepinfer_jax.recipe.stream.options import ParseOptions
from deepinfer_jax.recipe.stream.utf8 import TokenDecoder, TokenTable

BACKEND_REASONS = ("stop", "length", "content_filter")

_ALNUM = string.ascii_letters + string.digits


def random_tool_call_id(index: int, empty_thinking: bool = False) -> str:
    """The official format: ``call_`` + two-digit index + ``_`` + 20 random alphanumerics + 4 random
    digits. ``empty_thinking`` (a thinking-mode turn whose reasoning so far is empty) inserts ``ET_``
    after the index, as the official library does."""
    tail = "".join(secrets.choice(_ALNUM) for _ in range(20)) + f"{secrets.randbelow(10000):04d}"
    return f"call_{index:02d}_{'ET_' if empty_thinking else ''}{tail}"


class _Chunk:
    __slots__ = ("rem",)

    def __init__(self, rem: int) -> None:
        self.rem = rem  # characters not yet resolved


class StreamClosedError(RuntimeError):
    """A push after the stream finished or was closed, or a stream error (the processor closes)."""


class OutputParser:
    """Parses one response's output into internal events (see the module docstring).

    ``table`` decodes token ids; without it only :meth:`push_text` works. ``tool_call_id(index)``
    names tool calls (default :func:`random_tool_call_id`, whose form depends on ``thinking``, the
    conversation's thinking mode, by default that of ``opts``).
    """

    def __init__(self, opts: ParseOptions, table: TokenTable | None = None,
                 tool_call_id: Callable[[int], str] | None = None, thinking: bool | None = None) -> None:
        self.opts = opts
        self.table = table
        self.thinking = opts.thinking if thinking is None else thinking
        self.tool_call_id = tool_call_id or self._random_id
        self.machine: Machine | None = None
        self.labels = TEXT_LABELS
        self.decoder = TokenDecoder(table) if table is not None else None
        self.queue: deque[_Chunk] = deque()
        self.last_action: tuple | None = None
        self.run_action: tuple | None = None  # the run of equal actions being collected for the head chunk
        self.run_parts: list[str] = []
        self.run_first = False
        self.out: list[Event] = []
        self.reasoning: list[str] = []
        self.completion_tokens = 0
        self.prompt_tokens = 0
        self.cache_hit_tokens = 0
        self.tool_calls = 0
        self.tool_name = ""
        self.stopped: str | None = None  # the stop sequence that ended the stream
        self.finished = False
        self.closed = False
        self.started = False

    def _random_id(self, index: int) -> str:
        return random_tool_call_id(index, self.thinking and not any(self.reasoning))

    # ---------------------------------------------------------------- inputs

    def ready(self, prompt_tokens: int = 0, cache_hit_tokens: int = 0,
              system_fingerprint: str | None = None) -> list[Event]:
        """The backend's ready chunk: prompt usage and fingerprint. Output pushed before it starts the
        stream with zero usage, and a ready chunk after that start is ignored (as the official library)."""
        self._check_open(start=False)
        if self.started:
            return []
        self.started = True
        self.prompt_tokens, self.cache_hit_tokens = prompt_tokens, cache_hit_tokens
        return [Start(prompt_tokens, cache_hit_tokens, system_fingerprint)]

    def push_text(self, text: str, token_count: int = 0) -> list[Event]:
        """One text chunk (text mode: labels match by spelling) accounting for ``token_count`` tokens."""
        self._check_open()
        self.completion_tokens += token_count
        self._machine(False)
        self._chunk(text)
        return self._take()

    def push_ids(self, ids: list[int]) -> list[Event]:
        """One chunk of generated token ids (token mode: markers only as their special ids)."""
        self._check_open()
        if self.decoder is None:
            self.closed = True
            raise StreamClosedError("token ids were pushed but the stream parser has no tokenizer")
        self._machine(True)
        for piece, count, special in self.decoder.push(ids):
            if self.stopped is not None:
                break
            self.completion_tokens += count
            self._chunk(piece, special)
        return self._take()

    def finish(self, reason: str | None = None) -> list[Event]:
        """End of output: ``reason`` is the backend's (``stop``/``length``/``content_filter``), or None
        when the stream ended without one. Flushes held text and emits :class:`Finish`."""
        if self.finished:
            return []
        self._check_open()
        if reason is not None and reason not in BACKEND_REASONS:
            raise ValueError(f"finish reason must be one of {BACKEND_REASONS}, got {reason!r}")
        if self.machine is not None:
            for action, text in self.machine.finish():
                self._distribute(action, text)
                if self.stopped is not None:
                    break
        if reason is None:
            final = "stop"  # the official library reports stop here, even after tool calls
        else:
            final = "tool_calls" if self.tool_calls and reason == "stop" else reason
        self._finish(final)
        return self._take()

    def close(self) -> None:
        """Release the stream without a successful end; later pushes raise."""
        self.closed = True

    # ---------------------------------------------------------------- internals

    def _check_open(self, start: bool = True) -> None:
        if self.closed:
            raise StreamClosedError("stream processor is closed")
        if self.finished:
            raise StreamClosedError("stream processor has finished")
        if start and not self.started:
            self.out.extend(self.ready())

    def _machine(self, token_mode: bool) -> None:
        if self.machine is None:
            self.labels = TOKEN_LABELS if token_mode else TEXT_LABELS
            g = st.grammar(self.opts, token_mode)
            self.machine = Machine(g.stage, st.initial_stage(self.opts))

    def _chunk(self, text: str, special: bool = False) -> None:
        if not text:
            if not self.queue and self.last_action is not None:
                self._piece(self.last_action, "", False)
                self._flush()
            else:
                self.queue.append(_Chunk(0))
            return
        segments = self.machine.feed(text, special)  # stop sequences never match an added token's text
        if len(segments) == 1 and not self.queue and self.run_action is None:
            action, seg = segments[0]  # fast path: one segment that is exactly this chunk
            if len(seg) == len(text) and action[0] != st.A_STOP:
                self.run_action, self.run_parts, self.run_first = action, [seg], True
                self._flush()
                self.last_action = action
                return
        self.queue.append(_Chunk(len(text)))
        for action, seg in segments:
            self._distribute(action, seg)
            if self.stopped is not None:
                return

    def _distribute(self, action: tuple, text: str) -> None:
        """Lay one resolved segment over the pending chunks, head first. A fixed output (a label, a
        tool-call start, a stop) belongs to the chunk where its segment begins."""
        q = self.queue
        total = len(text)
        pos = 0
        while q:
            head = q[0]
            take = total - pos
            take = min(take, head.rem)
            end = pos + take
            self._piece(action, text[pos:end] if take != total else text, take > 0 and pos == 0)
            if self.stopped is not None:
                q.clear()
                return
            head.rem -= take
            pos = end
            if head.rem:
                break
            q.popleft()
            self._flush()  # the chunk is complete: release its last run
            if pos == total and (not q or q[0].rem):
                break
        self.last_action = action

    def _piece(self, action: tuple, text: str, first: bool) -> None:
        """Add a piece to the current run of equal actions; a new action releases the run before it.
        A stop sequence ends the stream as soon as it is complete."""
        if action == self.run_action:
            self.run_parts.append(text)
            self.run_first = self.run_first or first
        else:
            if self.run_action is not None:
                self._flush()
            self.run_action, self.run_parts, self.run_first = action, [text], first
        if first and action[0] == st.A_STOP:
            self._flush()

    def _flush(self) -> None:
        """Turn the current run into events."""
        action = self.run_action
        if action is None:
            return
        parts, first = self.run_parts, self.run_first
        self.run_action, self.run_parts, self.run_first = None, [], False
        text = parts[0] if len(parts) == 1 else "".join(parts)
        out = self.out
        restore = self.labels.restore
        kind = action[0]
        if kind == st.A_CONTENT:
            out.append(ContentDelta(restore(text)))
        elif kind == st.A_REASONING:
            text = restore(text)
            self.reasoning.append(text)
            out.append(ReasoningDelta(text))
        elif kind == st.A_ARGS_STRING:
            out.append(ToolArgsDelta(self.tool_calls - 1, escape_piece(restore(text))))
        elif kind == st.A_ARGS_RAW:
            out.append(ToolArgsDelta(self.tool_calls - 1, restore(text)))
        elif kind == st.A_ARGS_LABEL:
            if first:
                out.append(ToolArgsDelta(self.tool_calls - 1, action[1]))
        elif kind == st.A_TO_SPACE:
            out.append(ContentDelta(" "))
        elif kind == st.A_TOOL_NAME:
            self.tool_name += text
        elif kind == st.A_TOOL_BEGIN:
            self.tool_name = ""
        elif kind == st.A_TOOL_NAME_END:
            if first:
                index = self.tool_calls
                self.tool_calls += 1
                out.append(ToolCallStart(index, self.tool_call_id(index), restore(self.tool_name)))
        elif kind == st.A_CONTENT_LABEL:
            if first:
                out.append(ContentDelta(action[1]))
        elif kind == st.A_STOP and first:
            self.stopped = action[1]
            self._finish("stop")
        # A_SKIP, A_INVALID: swallowed

    def _finish(self, reason: str) -> None:
        """Emit :class:`Finish`. ``reasoning_tokens`` re-encodes the reasoning text, as the official
        library does, rather than counting the generated reasoning ids."""
        reasoning_tokens = None
        if self.opts.thinking and self.table is not None:
            reasoning_tokens = self.table.count("".join(self.reasoning))
        usage = Usage(self.prompt_tokens, self.cache_hit_tokens, self.completion_tokens, reasoning_tokens)
        self.out.append(Finish(reason, usage, self.stopped))
        self.finished = True
        self.queue.clear()

    def _take(self) -> list[Event]:
        out, self.out = self.out, []
        return out
