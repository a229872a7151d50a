"""Batch records through one ``LLM``'s engine, fed as it drains; each finished record becomes an output line.

``results(llm, records)`` pulls records from any iterable only while fewer than ``window`` requests
are in the engine (default: twice the running slots, so freed slots refill at once), so an input
of any length streams with bounded memory. Each request goes through the same plumbing as
``LLM.chat`` (``chat.prepare`` / ``chat.final_response``: the recipe's conversion, sampling fields,
tools, ``response_format`` grammar, thinking) or, for ``/v1/completions``,
``completions.prepare_completion`` / ``completion_response``. Results come back in the order requests
finish. A record that fails (a bad line, a request the protocol or the engine refuses, a prompt
past the context, a grammar that does not compile, a generation the grammar dead-ended, or any
exception while preparing or answering it) becomes its own error line; the others are untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from deepinfer_jax.batch.records import BatchRecord, error_line, response_line
from deepinfer_jax.engine import RequestError
from deepinfer_jax.recipe import ConversionError

if TYPE_CHECKING:
    from deepinfer_jax.llm import LLM

__all__ = ["Result", "check", "results"]


@dataclass(frozen=True)
class Result:
    """A finished record: its output ``line`` (JSON text ending in a newline), whether it is a 200
    response, and its token counts (prompt, generated, prompt tokens served by the prefix cache)."""

    record: BatchRecord
    line: str
    ok: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class _Prepared:
    ids: list[int]
    params: Any
    answer: Callable  # RequestOutput -> the protocol's response body


def _prepare(llm: LLM, record: BatchRecord) -> _Prepared:
    """Raises ConversionError (400) for what the protocol or the engine refuses."""
    try:
        if record.protocol == "completions":
            from deepinfer_jax.completions import completion_response, prepare_completion

            pc = prepare_completion(llm, record.body)  # validated against the engine too
            return _Prepared(pc.ids, pc.params, lambda out: completion_response(llm, pc, out))
        from deepinfer_jax.chat import final_response, prepare

        pr = prepare(llm, record.body, record.protocol)
        ids = llm.engine.validate(pr.ids, pr.params)  # grammars compile here: errors before anything runs
        return _Prepared(ids, pr.params, lambda out: final_response(
            llm, pr, out.outputs[0].token_ids, out.outputs[0].finish_reason, out.num_cached_tokens))
    except RequestError as e:  # the engine's field names; a grammar that does not compile is the request's format
        field = e.field
        if field.startswith("structured_output") and "response_format" in (record.body or {}):
            field = "response_format"
        raise ConversionError(str(e), param=field) from None


def _failure(record: BatchRecord, e: Exception) -> Result:
    if isinstance(e, ConversionError):
        return Result(record, response_line(record, e.status_code, e.error_json()), False)
    return Result(record, error_line(record, "internal_error", f"{type(e).__name__}: {e}"), False)


def check(llm: LLM, record: BatchRecord) -> Result | None:
    """Validate one record without running it (``--dry-run``): None if it would run, else its error result."""
    if record.error is not None:
        return Result(record, error_line(record, record.error.code, record.error.message, record.error.param), False)
    try:
        _prepare(llm, record)
    except Exception as e:  # noqa: BLE001 - one record's failure is its own error line
        return _failure(record, e)
    return None


def _answer(prep: _Prepared, record: BatchRecord, out) -> Result:
    c = out.outputs[0]
    if c.finish_reason == "error":  # the grammar allowed no next token
        return Result(record, error_line(record, "generation_error", str(c.stop_reason)), False,
                      len(out.prompt_token_ids), len(c.token_ids), out.num_cached_tokens)
    try:
        body = prep.answer(out)
    except Exception as e:  # noqa: BLE001
        return _failure(record, e)
    return Result(record, response_line(record, 200, body), True, len(out.prompt_token_ids), len(c.token_ids),
                  out.num_cached_tokens)


def results(llm: LLM, records: Iterable[BatchRecord], window: int | None = None) -> Iterator[Result]:
    """Run ``records`` through ``llm``'s engine; yield one ``Result`` per record as it finishes (error
    records at once). ``window``: most requests in the engine at once (default 2 x running slots)."""
    engine = llm.engine
    if window is None:
        ranks = len(getattr(engine, "schedulers", None) or [None])
        window = 2 * llm.engine_config.max_num_seqs * ranks
    source = iter(records)
    running: dict[str, tuple[BatchRecord, _Prepared]] = {}
    exhausted = False
    try:
        while True:
            while not exhausted and len(running) < window:
                record = next(source, None)
                if record is None:
                    exhausted = True
                    break
                if record.error is not None:
                    yield check(llm, record)
                    continue
                try:
                    prep = _prepare(llm, record)
                    rid = engine.add_request(prep.ids, prep.params)
                except Exception as e:  # noqa: BLE001
                    yield _failure(record, e)
                    continue
                running[rid] = (record, prep)
            if not running:
                return
            for out in engine.step():
                if out.request_id in running:
                    record, prep = running.pop(out.request_id)
                    engine.requests.pop(out.request_id, None)
                    yield _answer(prep, record, out)
            if running and not engine.has_unfinished:  # cannot happen with a healthy engine; never hang on it
                for rid, (record, _) in list(running.items()):
                    yield Result(record, error_line(record, "internal_error", "the engine stopped before the "
                                                    "request finished"), False)
                    running.pop(rid)
    finally:  # the consumer stopped early: leave the engine clean for whoever uses it next
        for rid in running:
            engine.abort(rid)
            engine.requests.pop(rid, None)
