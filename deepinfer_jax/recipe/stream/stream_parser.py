"""The public streaming facade: one response's output in, one protocol's stream events out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deepinfer_jax.recipe.stream.chat_events import ChatProjection
from deepinfer_jax.recipe.stream.events import Event
from deepinfer_jax.recipe.stream.options import StreamOptions
from deepinfer_jax.recipe.stream.parser import OutputParser
from deepinfer_jax.recipe.stream.protocol import StreamEvent
from deepinfer_jax.recipe.stream.utf8 import TokenTable

_TABLES: dict[int, tuple[Any, TokenTable]] = {}


def token_table(tokenizer: Any) -> TokenTable:
    """A :class:`TokenTable` for a ``tokenizers.Tokenizer``, a ``tokenizer.json`` path or a table;
    built once per tokenizer object or path."""
    if isinstance(tokenizer, TokenTable):
        return tokenizer
    key = id(tokenizer) if not isinstance(tokenizer, (str, Path)) else hash(str(tokenizer))
    hit = _TABLES.get(key)
    if hit is None or (not isinstance(tokenizer, (str, Path)) and hit[0] is not tokenizer):
        table = TokenTable.from_file(tokenizer) if isinstance(tokenizer, (str, Path)) else TokenTable(tokenizer)
        hit = _TABLES[key] = (tokenizer, table)
    return hit[1]


def projection(options: StreamOptions):
    """The protocol projection for ``options.protocol``."""
    if options.protocol == "chat":
        return ChatProjection(options)
    if options.protocol == "responses":
        from deepinfer_jax.recipe.stream.responses_events import ResponsesProjection

        return ResponsesProjection(options)
    from deepinfer_jax.recipe.stream.messages_events import MessagesProjection

    return MessagesProjection(options)


class StreamParser:
    """Parses one response's generated output into a protocol's stream events.

    Call :meth:`ready` once, then :meth:`push_ids` (token mode; the engine pushes each step's ids)
    or :meth:`push_text` (text mode), then :meth:`finish` with the backend's finish reason (or
    None). Every call returns the protocol events it produced. After a stop sequence the parser is
    :attr:`finished` at once and further pushes raise ``RuntimeError``. ``tokenizer`` (needed for
    token mode and for ``reasoning_tokens``) is a ``tokenizers.Tokenizer``, a ``tokenizer.json``
    path or a :class:`TokenTable`. With ``accumulate=True`` the events are also folded into the final
    non-streaming response, read with :meth:`response`.
    """

    def __init__(self, options: StreamOptions, tokenizer: Any = None, accumulate: bool = False) -> None:
        self.options = options
        table = token_table(tokenizer) if tokenizer is not None else None
        self.parser = OutputParser(options.parse, table, options.tool_call_id, options.thinking)
        self.projection = projection(options)
        self._accumulate = accumulate
        self._acc: Any = None

    @property
    def finished(self) -> bool:
        """Whether the response has ended (finish reason sent) and the parser is not closed."""
        return self.parser.finished and not self.parser.closed

    @property
    def sse_done_data(self) -> str | None:
        """The data of the final SSE message (``[DONE]`` for Chat, none for the others)."""
        return self.projection.sse_done_data

    def _project(self, events: list[Event]) -> list[StreamEvent]:
        project = self.projection.project
        if len(events) == 1:
            out = project(events[0])
        else:
            out = []
            for ev in events:
                out += project(ev)
        if self._accumulate:
            if self._acc is None:
                from deepinfer_jax.recipe.stream.accumulate import accumulator

                self._acc = accumulator(self.options, self.parser.prompt_tokens, self.parser.cache_hit_tokens)
            for e in out:
                self._acc.accumulate(e)
        return out

    def response(self) -> dict[str, Any]:
        """The final non-streaming response object (needs ``accumulate=True``), as the official
        ``ChatCompletionResponse`` / ``ResponsesResponse`` / ``MessagesResponse`` ``to_json()``."""
        if not self._accumulate:
            raise ValueError("construct the StreamParser with accumulate=True to build the response")
        if self._acc is None:
            from deepinfer_jax.recipe.stream.accumulate import accumulator

            self._acc = accumulator(self.options, self.parser.prompt_tokens, self.parser.cache_hit_tokens)
        return self._acc.response()

    def sse_done(self) -> str | None:
        """The closing SSE message (``data: [DONE]`` for Chat), or None."""
        done = self.sse_done_data
        return f"data: {done}\n\n" if done is not None else None

    def ready(self, prompt_tokens: int = 0, cache_hit_tokens: int = 0,
              system_fingerprint: str | None = None) -> list[StreamEvent]:
        return self._project(self.parser.ready(prompt_tokens, cache_hit_tokens, system_fingerprint))

    def push_ids(self, ids: list[int]) -> list[StreamEvent]:
        return self._project(self.parser.push_ids(ids))

    def push_text(self, text: str, token_count: int = 0) -> list[StreamEvent]:
        return self._project(self.parser.push_text(text, token_count))

    def finish(self, reason: str | None = None) -> list[StreamEvent]:
        return self._project(self.parser.finish(reason))

    def close(self) -> None:
        self.parser.close()
