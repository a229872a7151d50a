"""A batch job: this shard's records of an input file through one ``LLM``, resumable, with progress and a summary.

``run_job(llm, input, output)`` appends one result line per record to ``output`` (in the order
records finish) and skips the input lines ``output`` already answers (a re-run after a crash
completes the job with every record exactly once). ``shard=Shard(i, n)`` takes the input lines
whose record index (non-blank lines counted from 0) is ``i`` modulo ``n``, writes them to
``<output>.part-...`` and, when it is the last shard to finish, merges every part into ``output``
in input order. Duplicate ``custom_id``s: the first line wins in every shard (each shard reads the
whole input, keeping the ids it has seen: memory grows with the number of distinct ids, not with
the prompts), later ones are error records.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, TextIO

from tqdm.auto import tqdm

from deepinfer_jax.batch import files
from deepinfer_jax.batch.driver import Result, check, results
from deepinfer_jax.batch.files import BatchError
from deepinfer_jax.batch.records import BatchRecord, LineError, parse_line

if TYPE_CHECKING:
    from deepinfer_jax.llm import LLM

__all__ = ["Shard", "Summary", "dry_run", "run_job", "shard_records"]


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (``--shard I/N``, or the ``DEEPINFER_*`` multi-host settings)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not (isinstance(self.count, int) and self.count >= 1 and isinstance(self.index, int)
                and 0 <= self.index < self.count):
            raise BatchError("--shard", f"must be I/N with 0 <= I < N, got {self.index}/{self.count}")

    @classmethod
    def parse(cls, text: str) -> Shard:
        i, sep, n = text.partition("/")
        if not sep or not i.strip().isdigit() or not n.strip().isdigit():
            raise BatchError("--shard", f"must be I/N (e.g. 0/2), got {text!r}")
        return cls(int(i), int(n))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Shard | None:
        """From ``DEEPINFER_PROCESS_ID`` / ``DEEPINFER_NUM_PROCESSES`` (the variables
        ``sharding.init_distributed`` reads); None when they are unset."""
        from deepinfer_jax.sharding import ENV_NUM_PROCESSES, ENV_PROCESS_ID

        env = os.environ if environ is None else environ
        n, i = env.get(ENV_NUM_PROCESSES), env.get(ENV_PROCESS_ID)
        if not n and not i:
            return None
        for name, value in ((ENV_NUM_PROCESSES, n), (ENV_PROCESS_ID, i)):
            if not value or not value.strip().isdigit():
                raise BatchError(name, f"must be a non-negative integer once either multi-host setting is given, "
                                       f"got {value!r}")
        if int(i) >= int(n):
            raise BatchError(ENV_PROCESS_ID, f"must be < {ENV_NUM_PROCESSES}={n}, got {i}")
        return cls(int(i), int(n))


@dataclass
class Summary:
    """What a job did. ``skipped``: records an earlier run had already answered."""

    ok: int = 0
    failed: int = 0
    skipped: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    wall_s: float = 0.0
    merged: int | None = None  # records in the merged output, when this process merged the parts

    @property
    def records(self) -> int:
        return self.ok + self.failed

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens (records run in this job)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def add(self, r: Result) -> None:
        self.ok += r.ok
        self.failed += not r.ok
        self.prompt_tokens += r.prompt_tokens
        self.completion_tokens += r.completion_tokens
        self.cached_tokens += r.cached_tokens

    def to_dict(self) -> dict:
        wall = max(self.wall_s, 1e-9)
        return {**asdict(self), "records": self.records, "records_per_s": self.records / wall,
                "output_tokens_per_s": self.completion_tokens / wall, "prefix_hit_rate": self.hit_rate}

    def text(self) -> str:
        d = self.to_dict()
        return (f"records: {self.ok} ok, {self.failed} failed, {self.skipped} skipped (already done); tokens: "
                f"{self.prompt_tokens} prompt ({self.cached_tokens} cached), {self.completion_tokens} generated; "
                f"{self.wall_s:.1f} s, {d['records_per_s']:.2f} records/s, {d['output_tokens_per_s']:.1f} output "
                f"tok/s, prefix-cache hit rate {self.hit_rate:.1%}")


def shard_records(path, shard: Shard | None = None, max_records: int | None = None,
                  done: Mapping[int, str | None] | None = None, skipped: list | None = None) -> Iterator[BatchRecord]:
    """This shard's records of the input, parsed lazily, without the lines ``done`` answers (their
    count is appended to ``skipped``); duplicates of an earlier line's ``custom_id`` become error records."""
    shard = shard or Shard(0, 1)
    done = done or {}
    first: dict[str, int] = {}
    n_skipped = 0
    try:
        for k, (number, raw) in enumerate(files.input_lines(path, max_records)):
            mine = k % shard.count == shard.index
            record = parse_line(raw, number)
            cid = record.custom_id
            if cid is not None and cid not in first:
                first[cid] = number
                dup = None
            else:
                dup = None if cid is None else first[cid]
            if not mine:
                continue
            if number in done:
                if done[number] != cid:
                    raise BatchError("--output", f"its result for input line {number} has custom_id "
                                                 f"{done[number]!r}, but that line has {cid!r}: the results belong "
                                                 "to another input file")
                n_skipped += 1
                continue
            if dup is not None and record.error is None:
                record = BatchRecord(number, cid, error=LineError(
                    f"custom_id {cid!r} is a duplicate of line {dup}", "custom_id", "duplicate_custom_id"))
            yield record
    finally:
        if skipped is not None:
            skipped.append(n_skipped)


def _count(path, shard: Shard, max_records: int | None) -> int:
    return sum(1 for k, _ in enumerate(files.input_lines(path, max_records)) if k % shard.count == shard.index)


def _log(msg: str, stream: TextIO | None) -> None:
    if stream is not None:
        print(msg, file=stream, flush=True)


def run_job(llm: LLM, input, output, *, shard: Shard | None = None, max_records: int | None = None,
            progress: bool = True, log: TextIO | None | str = "stderr") -> Summary:
    """Run a batch file (see the module docstring); returns the ``Summary`` (also printed to ``log``:
    a stream, None for silence, default ``sys.stderr`` as it is at the call)."""
    log = sys.stderr if log == "stderr" else log
    if not os.path.isfile(input):
        raise BatchError("--input", f"{input} is not a file")
    sharded = shard is not None and shard.count > 1
    target = files.part_path(output, shard.index, shard.count) if sharded else output
    t0 = time.perf_counter()
    summary = Summary()
    skipped: list[int] = []
    with files.ResultWriter(target) as writer:
        if writer.dropped:
            _log(f"{target}: cut off a torn last line ({writer.dropped} bytes) left by a crash", log)
        done = files.answered(target)
        todo = _count(input, shard or Shard(0, 1), max_records) - len(done)
        if done:
            _log(f"resuming: {len(done)} records already in {target} are skipped", log)
        bar = tqdm(total=max(todo, 0), desc="batch", unit="rec", disable=not progress, file=log)
        for r in results(llm, shard_records(input, shard, max_records, done, skipped)):
            writer.write(r.line)
            summary.add(r)
            bar.update(1)
            elapsed = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(f"ok={summary.ok} failed={summary.failed} "
                                f"{summary.completion_tokens / elapsed:.1f} tok/s hit={summary.hit_rate:.0%}",
                                refresh=False)
        bar.close()
    if getattr(llm, "_online_saves", None):  # what the engine fitted online (cost model, step times), as generate
        llm.save_profiles()
    summary.skipped = skipped[0] if skipped else 0
    if sharded:
        files.done_marker(output, shard.index, shard.count).write_text(json.dumps({"max_records": max_records}))
        markers = [files.done_marker(output, i, shard.count) for i in range(shard.count)]
        if all(m.is_file() and json.loads(m.read_text() or "{}").get("max_records", -1) == max_records
               for m in markers):  # the last shard to finish joins the parts
            summary.merged = files.merge(output, shard.count)
            _log(f"merged {shard.count} parts into {output} ({summary.merged} records, input order)", log)
    summary.wall_s = time.perf_counter() - t0
    _log(summary.text(), log)
    return summary


def dry_run(llm: LLM, input, *, shard: Shard | None = None, max_records: int | None = None,
            out: TextIO | None | str = "stdout", log: TextIO | None | str = "stderr") -> Summary:
    """Validate every record of this shard (parsing, conversion, encoding, the engine's checks,
    grammars compiled) without running any; each invalid record's error line goes to ``out``
    (default ``sys.stdout``), the count to ``log`` (default ``sys.stderr``)."""
    out = sys.stdout if out == "stdout" else out
    log = sys.stderr if log == "stderr" else log
    if not os.path.isfile(input):
        raise BatchError("--input", f"{input} is not a file")
    t0 = time.perf_counter()
    summary = Summary()
    for record in shard_records(input, shard, max_records):
        failed = check(llm, record)
        if failed is None:
            summary.ok += 1
        else:
            summary.failed += 1
            if out is not None:
                out.write(failed.line)
    summary.wall_s = time.perf_counter() - t0
    _log(f"dry run: {summary.ok} records valid, {summary.failed} invalid", log)
    return summary
