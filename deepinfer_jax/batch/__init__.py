"""Offline batch jobs in the OpenAI batch-file format: ``python -m deepinfer_jax.batch -i in.jsonl -o out.jsonl``.

- ``records``: the input line and output line formats (``custom_id``, ``method``, ``url``, ``body`` in;
  ``id``, ``custom_id``, ``response`` {``status_code``, ``request_id``, ``body``} or ``error`` out).
- ``driver.results``: records through one engine, fed as it drains, as ``LLM.chat`` would answer them.
- ``files``: streaming input, whole-line appends that survive ``kill -9``, part files, ``merge``.
- ``job.run_job`` / ``job.dry_run``: a resumable, optionally sharded job with progress and a summary.
- ``settings``: every ``EngineConfig`` field as a ``--field-name`` option; ``cli``: the command.
- ``ray_data``: ``ray_map(dataset)`` / ``BatchPredictor`` for Ray Data's ``map_batches`` (optional
  ``ray`` extra; imported only when used).

Not supported: ``stream: true`` bodies (an error record), ``n`` > 1 (refused by the protocols, as
``LLM.chat`` refuses it), a mesh spanning several processes (each process is its own data shard),
the Batch API's batch objects (cancellation, expiry windows, file ids): this is the file format only.
"""

from deepinfer_jax.batch.driver import Result, results
from deepinfer_jax.batch.files import BatchError, merge
from deepinfer_jax.batch.job import Shard, Summary, dry_run, run_job
from deepinfer_jax.batch.records import URLS, BatchRecord, LineError, parse_line

__all__ = ["URLS", "BatchError", "BatchPredictor", "BatchRecord", "LineError", "Result", "Shard", "Summary",
           "dry_run", "merge", "parse_line", "ray_map", "results", "run_job"]


def __getattr__(name):  # Ray Data pieces only when asked for: ray is an optional extra
    if name in ("ray_map", "BatchPredictor"):
        from deepinfer_jax.batch import ray_data

        return getattr(ray_data, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
