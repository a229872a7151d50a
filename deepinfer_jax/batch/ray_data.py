"""Ray Data scale-out (the optional ``ray`` extra): one engine per actor of ``Dataset.map_batches``.

    import ray
    from deepinfer_jax.batch import ray_map
    ds = ray.data.read_text("requests.jsonl")                  # one row per line, column "text"
    out = ray_map(ds, concurrency=2, batch_size=64, max_num_seqs=16)   # 2 actors, each with its own LLM
    with open("results.jsonl", "w") as f:
        for row in out.iter_rows():
            f.write(row["output"] + "\\n")

or directly ``ds.map_batches(BatchPredictor, concurrency=N, batch_size=B, fn_constructor_kwargs=
{"model": ..., **engine_settings})``. Input columns: ``text`` (an input line) and optionally
``line`` (its 1-based number, used for the result's ``id``; without it the position in the batch
is, so ids are then not unique over the dataset). Output columns: ``custom_id``, ``output`` (the
result line of ``records``, without its newline) and ``ok`` (a 200 response). Each batch runs
through the actor's engine as ``driver.results`` runs a file (fed as it drains, one record's
failure its own error line). Unlike the CLI: duplicate ``custom_id``s are found within a batch only,
nothing is resumed (Ray retries failed tasks itself), and rows come back in Ray's order.
"""

from __future__ import annotations

from deepinfer_jax.batch.driver import results
from deepinfer_jax.batch.records import BatchRecord, LineError, parse_line

__all__ = ["BatchPredictor", "ray_map"]


class BatchPredictor:
    """A callable class for ``map_batches``: builds one ``LLM(model, **settings)`` per actor and answers
    each batch of input lines (see the module docstring)."""

    def __init__(self, model=None, dtype: str = "float32", **settings) -> None:
        from deepinfer_jax import LLM

        self.llm = LLM(model, dtype=dtype, use_tqdm=False, **settings)

    def __call__(self, batch: dict) -> dict:
        texts = list(batch["text"])
        lines = batch.get("line")
        records, first = [], {}
        for k, text in enumerate(texts):
            number = int(lines[k]) if lines is not None else k + 1
            record = parse_line(text, number)
            cid = record.custom_id
            if cid is not None and cid in first and record.error is None:
                record = BatchRecord(number, cid, error=LineError(
                    f"custom_id {cid!r} is a duplicate of line {first[cid]}", "custom_id", "duplicate_custom_id"))
            elif cid is not None:
                first.setdefault(cid, number)
            records.append(record)
        order = {id(r): k for k, r in enumerate(records)}
        out = [None] * len(records)
        for r in results(self.llm, records):
            out[order[id(r.record)]] = r
        return {"custom_id": [r.record.custom_id for r in out], "output": [r.line.rstrip("\n") for r in out],
                "ok": [r.ok for r in out]}


def ray_map(dataset, *, model=None, concurrency: int = 2, batch_size: int = 64, num_cpus: float | None = None,
            dtype: str = "float32", **settings):
    """``dataset.map_batches(BatchPredictor, ...)`` with ``concurrency`` actors, each holding one engine
    built from ``model`` and the ``EngineConfig`` ``settings``; returns the (lazy) result dataset."""
    from deepinfer_jax.config import EngineConfig

    EngineConfig(**settings)  # a bad setting fails here, not in every actor
    extra = {} if num_cpus is None else {"num_cpus": num_cpus}
    return dataset.map_batches(BatchPredictor, fn_constructor_kwargs={"model": model, "dtype": dtype, **settings},
                               concurrency=concurrency, batch_size=batch_size, batch_format="numpy", **extra)
