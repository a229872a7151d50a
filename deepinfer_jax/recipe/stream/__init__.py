"""Streaming parser of model output into reasoning, content and tool-call events (recipe.md §8).

Pure host code. :class:`StreamParser` takes token ids (or text) one push at a time and returns the
protocol's stream events (Chat Completions chunks, Responses events, Messages events, each with its
SSE name); the accumulators build the final non-streaming response from those events. Behaviour
matches the official ``deepseek-recipe==0.2.0`` wheel, quirks included (see the module docstrings).

Official behaviours matched on purpose although they look like bugs (tests/recipe pins each one):

* a DSML parameter name runs to the next *space*, quotes included and unescaped
  (``name="shipping address"`` gives the key ``"shipping``), and names are never escaped;
* a stream that ends without a backend finish chunk reports ``stop`` even after tool calls; a
  backend ``length`` / ``content_filter`` wins over ``tool_calls``;
* ``reasoning_tokens`` is the reasoning *text* re-encoded with the tokenizer (so chunking and
  stripped newlines change it), and is absent without a tokenizer;
* tool-call ids get an ``ET_`` infix in a thinking-mode turn whose reasoning so far is empty;
* per-push deltas depend on the chunking (a push is held whole while its tail may start a
  label); in JSON mode even the merged text does (one space per chunk around the JSON);
* an empty text push yields an empty delta; a ready chunk after output is ignored;
* a Chat request with ``stream_options.include_usage`` (or not streamed) sends ``"usage": null``
  in every chunk but the last.
"""

from deepinfer_jax.recipe.stream.accumulate import ChatAccumulator, accumulator
from deepinfer_jax.recipe.stream.messages_events import MessagesAccumulator
from deepinfer_jax.recipe.stream.options import ParseOptions, StreamOptions
from deepinfer_jax.recipe.stream.parser import OutputParser, StreamClosedError, random_tool_call_id
from deepinfer_jax.recipe.stream.protocol import StreamEvent
from deepinfer_jax.recipe.stream.responses_echo import responses_echo
from deepinfer_jax.recipe.stream.responses_events import ResponsesAccumulator
from deepinfer_jax.recipe.stream.stream_parser import StreamParser, token_table
from deepinfer_jax.recipe.stream.utf8 import TokenTable

__all__ = [
    "ChatAccumulator",
    "MessagesAccumulator",
    "OutputParser",
    "ParseOptions",
    "ResponsesAccumulator",
    "StreamClosedError",
    "StreamEvent",
    "StreamOptions",
    "StreamParser",
    "TokenTable",
    "accumulator",
    "random_tool_call_id",
    "responses_echo",
    "token_table",
]
