"""``python -m deepinfer_jax.batch`` (console script ``deepinfer-batch``).

    deepinfer-batch -i requests.jsonl -o results.jsonl [--model DIR] [--shard I/N] [--max-records N]
                    [--dry-run] [--no-progress] [--max-num-seqs 16 ... any EngineConfig field]
    deepinfer-batch merge -o results.jsonl --num-shards N [-i requests.jsonl]

Exit status: 0 when the job ran (failed records are error lines, not a failed job), 1 when
``--dry-run`` found invalid records or ``merge`` found input lines without a result, 2 for a usage
error (a bad option or setting, a missing file, results that belong to another input).

Shards: ``--shard I/N``, else ``DEEPINFER_PROCESS_ID`` / ``DEEPINFER_NUM_PROCESSES`` when set (the
multi-host launch settings; each process is then an independent data shard with its own engine:
``jax.distributed`` is not started, the processes share only the file system). A ``--sharding``
preset spanning several processes (a model too big for one host) is not supported by batch jobs
yet: with those variables set and ``--sharding`` given the job refuses to start.
"""

from __future__ import annotations

import argparse
import sys

from deepinfer_jax.batch import files
from deepinfer_jax.batch.files import BatchError
from deepinfer_jax.batch.job import Shard, dry_run, run_job
from deepinfer_jax.batch.settings import add_engine_options, engine_settings

__all__ = ["main"]


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer-batch", description="Run an OpenAI batch file (JSONL requests to "
                                "/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages) through an "
                                "offline engine; resumable. 'deepinfer-batch merge -h' for joining shard parts.")
    p.add_argument("-i", "--input", required=True, help="the requests file (JSONL)")
    p.add_argument("-o", "--output", default=None, help="the results file (JSONL; appended, resumed on re-run); "
                                                         "required unless --dry-run")
    p.add_argument("--model", default=None, help="a checkpoint directory or a preset name (default: the shipped "
                                                 "checkpoint)")
    p.add_argument("--dtype", default="float32", help="parameter dtype (LLM's dtype)")
    p.add_argument("--shard", default=None, help="I/N: run the I-th of N slices (0-based) into a part file")
    p.add_argument("--max-records", type=int, default=None, help="only the first N records of the input")
    p.add_argument("--dry-run", action="store_true", help="validate every record, run nothing; invalid records' "
                                                          "error lines go to stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_options(p)
    return p


def _merge_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepinfer-batch merge", description="Join the part files of a sharded job "
                                "into the results file, in input order.")
    p.add_argument("-o", "--output", required=True, help="the results file the shards were given")
    p.add_argument("--num-shards", type=int, required=True, help="N of --shard I/N")
    p.add_argument("-i", "--input", default=None, help="the requests file: check every record has a result")
    p.add_argument("--max-records", type=int, default=None, help="as the shards were given it")
    return p


def _merge(argv: list[str]) -> int:
    args = _merge_parser().parse_args(argv)
    if args.num_shards < 1:
        raise BatchError("--num-shards", f"must be >= 1, got {args.num_shards}")
    n = files.merge(args.output, args.num_shards)
    print(f"merged {args.num_shards} parts into {args.output}: {n} records", file=sys.stderr)
    if args.input is not None:
        have = files.answered(args.output)
        missing = [number for number, _ in files.input_lines(args.input, args.max_records) if number not in have]
        if missing:
            print(f"{len(missing)} input lines have no result yet (first: line {missing[0]}); re-run their shards",
                  file=sys.stderr)
            return 1
    return 0


def _shard(args) -> Shard | None:
    if args.shard is not None:
        return Shard.parse(args.shard)
    shard = Shard.from_env()
    if shard is not None and shard.count > 1 and "engine.sharding" in vars(args):
        raise BatchError("--sharding", "with DEEPINFER_NUM_PROCESSES > 1 each process is a data shard; a mesh over "
                                       "several processes is not supported by batch jobs yet (use a preset within "
                                       "one host per process, and --shard I/N or the variables for the slices)")
    return shard


def _run(argv: list[str]) -> int:
    args = _run_parser().parse_args(argv)
    if args.output is None and not args.dry_run:
        raise BatchError("--output", "is required (the results file) unless --dry-run")
    shard = _shard(args)
    settings = engine_settings(args)
    if args.max_records is not None and args.max_records < 0:
        raise BatchError("--max-records", f"must be >= 0, got {args.max_records}")
    from deepinfer_jax import LLM

    llm = LLM(args.model, dtype=args.dtype, use_tqdm=not args.no_progress, **settings)
    if args.dry_run:
        summary = dry_run(llm, args.input, shard=shard, max_records=args.max_records)
        return 1 if summary.failed else 0
    run_job(llm, args.input, args.output, shard=shard, max_records=args.max_records, progress=not args.no_progress)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["merge"]:
            return _merge(argv[1:])
        return _run(argv)
    except (BatchError, ValueError, FileNotFoundError) as e:
        print(f"deepinfer-batch: error: {e}", file=sys.stderr)
        return 2
