"""The start-up profiling pass that fits the step-time ``CostModel`` (engine.md §2.1).

Runs a short grid of synthetic steps (prefill chunks of several sizes after several cached
lengths, and decode batches) on the real runner before any request arrives, times each, and fits
the model. The synthetic steps write garbage into free blocks and slots; that is harmless because
a request only ever reads cache rows it wrote itself.
"""

from __future__ import annotations

import math
import time

from deepinfer_jax.engine.cost_model import CostModel
from deepinfer_jax.runner import ChunkSpec, ModelRunner, SampleSpec

__all__ = ["profile_cost_model", "profile_grid", "profile_step_times"]


def profile_grid(max_tokens: int, max_model_len: int, max_seqs: int) -> list[list[tuple[int, int]]]:
    """Step shapes [(q, c) per chunk] to time: prefill chunks and decode batches."""
    qs = sorted({1, max(1, max_tokens // 8), max(1, max_tokens // 4), max(1, max_tokens // 2), max_tokens})
    cs = sorted({0, max_model_len // 4, max_model_len // 2, max(0, max_model_len - max_tokens - 1)})
    steps = [[(q, c)] for q in qs for c in cs if c + q < max_model_len]
    for k in sorted({2, max(2, max_seqs // 2), max_seqs}):
        if k <= max_seqs:
            for c in cs[:3]:
                steps.append([(1, c)] * k)
                steps.append([(1, c)] * (k - 1) + [(max(1, (max_tokens - k) // 2), c)])
    return [s for s in steps if sum(q for q, _ in s) <= max_tokens and len(s) <= max_seqs]


def profile_cost_model(runner: ModelRunner, *, max_tokens: int, max_model_len: int, max_seqs: int,
                       repeats: int = 2, progress=None) -> tuple[CostModel, list, list]:
    """Time every ``profile_grid`` step (best of ``repeats``) and fit a ``CostModel``.

    Returns (model, steps, times_ns); ``progress(i, total)`` is called per step shape.
    """
    cc = runner.cache_cfg
    steps = profile_grid(max_tokens, max_model_len, max_seqs)
    times = []
    if progress is not None:
        progress(0, len(steps))
    for n, shape in enumerate(steps):
        chunks = []
        for slot, (q, c) in enumerate(shape):
            nb = math.ceil((c + q) / cc.block_size)
            table = [(slot * nb + b) % cc.num_blocks for b in range(nb)]
            chunks.append(ChunkSpec(slot=slot, block_table=table, ctx_len=c, token_ids=[1] * q, sample=SampleSpec()))
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.launch(chunks).result()
            best = min(best, time.perf_counter() - t0)
        times.append(best * 1e9)
        if progress is not None:
            progress(n + 1, len(steps))
    model = CostModel()
    model.fit(steps, times, base=True)
    return model, steps, times


def profile_step_times(runner, repeats: int = 2, progress=None, draft: bool = True,
                       sample: SampleSpec | None = None) -> list[float]:
    """Device time (ns, best of ``repeats``) of a full step per token bucket, for the speculative
    budget (``engine.spec_policy.StepTimes``): the largest request bucket's rows, each a chunk that
    samples with ``sample`` (default greedy; a top-p one makes every logit row run the filter search),
    so the step also runs the drafter unless ``draft`` is False, splitting the bucket's tokens between
    them. ``runner`` holds the speculative step (``runner.speculation``)."""
    sample = sample or SampleSpec()
    cc = runner.cache_cfg
    r = min(runner.buckets.requests[-1], cc.max_requests)
    out = []
    for n in runner.buckets.tokens:
        rows = min(r, n)
        sizes = [n // rows + (i < n % rows) for i in range(rows)]
        chunks = []
        for slot, q in enumerate(sizes):
            nb = math.ceil(q / cc.block_size)
            table = [(slot * nb + b) % cc.num_blocks for b in range(nb)]
            chunks.append(ChunkSpec(slot=slot, block_table=table, ctx_len=0, token_ids=[1] * q, sample=sample,
                                    prompt_len=q))
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.launch(chunks, draft=draft, logprobs=False).result()
            best = min(best, time.perf_counter() - t0)
        out.append(best * 1e9)
        if progress is not None:
            progress(len(out), len(runner.buckets.tokens))
    return out
