"""ModelRunner: turns scheduled request chunks into padded device inputs and runs the jitted step.

The only place that converts between host data (lists of ids, block tables) and device arrays.
``execute`` validates the whole batch before anything reaches the device, so a bad chunk raises
``StepInputError`` and leaves the cache (and every other request's state) untouched. The cache is
donated to the step; shapes are bucketed and all buckets compile in ``precompile``; ``traces``
counts compilations so tests can assert that a long mixed run never recompiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from deepinfer_jax.model.kv_cache import init_cache
from deepinfer_jax.model.paged import StepInputs, paged_step
from deepinfer_jax.runner.buckets import Buckets


class StepInputError(ValueError):
    """A scheduled chunk that the step cannot run; nothing was written."""


@dataclass(frozen=True)
class ChunkSpec:
    """One request's part of a step.

    slot: the request's ring/state slot (0 <= slot < max_requests); block_table: its block ids in
    order (covering at least ``ctx_len + len(token_ids)`` tokens); ctx_len: tokens already in the
    cache; token_ids: the new tokens (positions ctx_len ...); logits: offsets within token_ids whose
    logits are wanted (default: the last one).
    """

    slot: int
    block_table: Sequence[int]
    ctx_len: int
    token_ids: Sequence[int]
    logits: Sequence[int] | None = None
    offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self):
        wanted = (len(self.token_ids) - 1,) if self.logits is None else tuple(int(i) for i in self.logits)
        object.__setattr__(self, "offsets", wanted)


_TRACES = [0]


def _step(params, cfg, cache_cfg, cache, inputs):
    _TRACES[0] += 1  # runs only while tracing
    return paged_step(params, cfg, cache_cfg, cache, inputs)


class ModelRunner:
    """Owns the device cache and the compiled step for one model and cache layout."""

    def __init__(self, cfg, params, cache_cfg, buckets: Buckets | None = None):
        cache_cfg.validate_for(cfg)
        self.cfg, self.params, self.cache_cfg = cfg, params, cache_cfg
        self.buckets = buckets or Buckets()
        if self.buckets.blocks[-1] > cache_cfg.max_blocks_per_request:
            raise ValueError("Buckets.blocks exceeds CacheConfig.max_blocks_per_request")
        self.cache = init_cache(cfg, cache_cfg)
        self._fn = jax.jit(_step, static_argnums=(1, 2), donate_argnums=(3,))

    @property
    def traces(self) -> int:
        """How many times the step has been traced (compiled) in this process."""
        return _TRACES[0]

    def precompile(self) -> None:
        """Compile every bucket with all-padding inputs (they write nothing)."""
        for n, r, b in self.buckets.shapes():
            self._run(self._inputs([], n, r, b))

    def execute(self, chunks: Sequence[ChunkSpec]) -> list[np.ndarray]:
        """Run one step; returns, per chunk, its wanted logits [len(offsets), vocab] (fp32)."""
        n, r, b = self._validate(chunks)
        logits = self._run(self._inputs(chunks, n, r, b))
        out, at = [], 0
        for c in chunks:
            out.append(logits[at : at + len(c.offsets)])
            at += len(c.offsets)
        return out

    # -- internals ---------------------------------------------------------------------------
    def _run(self, inputs: StepInputs) -> np.ndarray:
        logits, self.cache = self._fn(self.params, self.cfg, self.cache_cfg, self.cache, inputs)
        return np.asarray(logits)

    def _validate(self, chunks: Sequence[ChunkSpec]) -> tuple[int, int, int]:
        cc, bs = self.cache_cfg, self.cache_cfg.block_size
        if not chunks:
            raise StepInputError("a step needs at least one chunk")
        try:
            n = Buckets.pick(self.buckets.tokens, sum(len(c.token_ids) for c in chunks), "tokens in the step")
            r = Buckets.pick(self.buckets.requests, len(chunks), "requests in the step")
            b = Buckets.pick(self.buckets.blocks, max(len(c.block_table) for c in chunks), "block_table length")
            Buckets.pick(self.buckets.tokens, sum(len(c.offsets) for c in chunks), "logit rows in the step")
        except ValueError as e:
            raise StepInputError(str(e)) from None
        seen = set()
        for i, c in enumerate(chunks):
            where = f"chunk {i} (slot {c.slot})"
            if not 0 <= c.slot < cc.max_requests:
                raise StepInputError(f"{where}: slot must lie in [0, {cc.max_requests})")
            if c.slot in seen:
                raise StepInputError(f"{where}: the slot appears twice in one step")
            seen.add(c.slot)
            if len(c.token_ids) == 0:
                raise StepInputError(f"{where}: token_ids is empty")
            if c.ctx_len < 0:
                raise StepInputError(f"{where}: ctx_len must be >= 0")
            if len(c.block_table) == 0:
                raise StepInputError(f"{where}: the request has no blocks")
            end = c.ctx_len + len(c.token_ids)
            if end > len(c.block_table) * bs:
                raise StepInputError(f"{where}: position {end - 1} lies beyond its {len(c.block_table)} allocated "
                                     f"blocks ({len(c.block_table) * bs} tokens)")
            if any(not 0 <= blk < cc.num_blocks for blk in c.block_table):
                raise StepInputError(f"{where}: block_table entries must lie in [0, {cc.num_blocks})")
            ids = np.asarray(c.token_ids)
            if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
                raise StepInputError(f"{where}: token_ids must lie in [0, {self.cfg.vocab_size})")
            if any(not 0 <= o < len(c.token_ids) for o in c.offsets):
                raise StepInputError(f"{where}: logits offsets must lie in [0, {len(c.token_ids)})")
        return n, r, b

    def _inputs(self, chunks: Sequence[ChunkSpec], n: int, r: int, b: int) -> StepInputs:
        cc = self.cache_cfg
        tok, pos, req = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32)
        valid = np.zeros(n, bool)
        tables = np.full((r, b), -1, np.int32)
        slot = np.full(r, cc.max_requests, np.int32)  # out of range: padding rows write nothing
        start, ctx, new = np.zeros(r, np.int32), np.zeros(r, np.int32), np.zeros(r, np.int32)
        rows = np.zeros(n, np.int32)
        at = m = 0
        for i, c in enumerate(chunks):
            k = len(c.token_ids)
            tok[at : at + k] = c.token_ids
            pos[at : at + k] = np.arange(c.ctx_len, c.ctx_len + k)
            req[at : at + k] = i
            valid[at : at + k] = True
            tables[i, : len(c.block_table)] = c.block_table
            slot[i], start[i], ctx[i], new[i] = c.slot, at, c.ctx_len, c.ctx_len + k
            rows[m : m + len(c.offsets)] = [at + o for o in c.offsets]
            at += k
            m += len(c.offsets)
        return StepInputs(token_ids=tok, positions=pos, token_req=req, token_valid=valid, block_tables=tables,
                          req_slot=slot, req_start=start, ctx_len=ctx, new_len=new, logit_rows=rows)
