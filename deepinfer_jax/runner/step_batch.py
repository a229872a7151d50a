"""Host chunks -> one padded step batch: the request-chunk specs, their validation and the device inputs.

Shared by ``ModelRunner`` on one device (one cache) and over a mesh (one cache per attention data-parallel rank,
every rank's batch padded to one common bucket shape). Host only: numpy arrays out, nothing on the
device. Padding tokens have ``token_valid = False`` and padding request rows an out-of-range slot,
so they write nothing (``model.paged``); a rank with no chunks is all padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from deepinfer_jax.model.paged import StepInputs
from deepinfer_jax.model.sampler import SamplingInputs
from deepinfer_jax.runner.buckets import Buckets

__all__ = ["ChunkSpec", "SampleSpec", "StepInputError", "build_inputs", "check_chunks", "logit_rows",
           "pick_shape", "sampling_batch", "validate_chunks"]


class StepInputError(ValueError):
    """A scheduled chunk that the step cannot run; nothing was written."""


@dataclass(frozen=True)
class ChunkSpec:
    """One request's part of a step.

    slot: the request's ring/state slot (0 <= slot < max_requests); block_table: its block ids in
    order (covering at least ``ctx_len + len(token_ids)`` tokens); ctx_len: tokens already in the
    cache; token_ids: the new tokens (positions ctx_len ...); logits: offsets within token_ids whose
    logits are wanted (default: the last one; ``execute`` only). For ``launch``: ``sample`` (None =
    this chunk samples nothing, e.g. a prefill chunk short of the prompt's end) samples one token
    from the chunk's last position; ``feed_last`` replaces ``token_ids[0]`` by the token the slot
    sampled last, still on the device. ``window_floor`` / ``global_write_from``: bounded replay
    (``model.paged``): windows truncated below the floor; no block KV written below the second.
    ``decoder_from`` / ``decoder_floor``: decoder bounded replay (runners built with
    ``decoder_replay``): only tokens at or past ``decoder_from`` run the decoder layers, whose windows
    see nothing below ``decoder_floor``.

    Speculative rows (speculative step only): ``verify`` marks a decoding request whose tokens come from
    the device (its anchor and up to ``max_drafts`` drafts of its slot; ``token_ids`` is ignored and
    ``ctx_len`` is an upper bound of the anchor position, so the blocks must cover
    ``min(ctx_len + 1 + max_drafts, limit)`` tokens). ``forced``: always verify all ``max_drafts``
    (deterministic requests). ``limit``: the most tokens the sequence may reach (max_model_len).
    ``prompt_len``: the request's prompt length (verified tokens' output positions). ``ctx_from``: host
    chunks: the first position the request computed since admission (the drafter's context starts there).
    ``context_parallel``: the chunk is a long prompt's prefill that runs alone in its step, split by position
    over the ``cp`` mesh axis (``runner.cp_step``; docs/context_parallel.md).
    """

    slot: int
    block_table: Sequence[int]
    ctx_len: int
    token_ids: Sequence[int]
    logits: Sequence[int] | None = None
    sample: SampleSpec | None = None
    feed_last: bool = False
    window_floor: int = 0
    global_write_from: int = 0
    decoder_from: int = 0
    decoder_floor: int = 0
    verify: bool = False
    max_drafts: int = 0
    forced: bool = False
    limit: int = 0
    prompt_len: int = 0
    ctx_from: int = 0
    context_parallel: bool = False
    offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self):
        wanted = (len(self.token_ids) - 1,) if self.logits is None else tuple(int(i) for i in self.logits)
        object.__setattr__(self, "offsets", wanted)


@dataclass(frozen=True)
class SampleSpec:
    """How a chunk samples its next token (validated by ``engine.SamplingParams``).

    ``stream`` and ``position`` with ``seed`` make the token's PRNG key (``model.sampler.row_key``).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    stream: int = 0
    position: int = 0



def check_runner_settings(buckets: Buckets, cache_cfg, num_top_logprobs) -> None:
    """The settings a runner refuses: block buckets wider than a request's table, bad ``num_top_logprobs``."""
    if buckets.blocks[-1] > cache_cfg.max_blocks_per_request:
        raise ValueError("Buckets.blocks exceeds CacheConfig.max_blocks_per_request")
    if not isinstance(num_top_logprobs, int) or num_top_logprobs < 1:
        raise ValueError(f"num_top_logprobs must be an int >= 1, got {num_top_logprobs!r}")


def pick_shape(buckets: Buckets, chunk_lists: Sequence[Sequence[ChunkSpec]]) -> tuple[int, int, int]:
    """The smallest (tokens, requests, blocks) bucket that fits every list of chunks (one list per
    batch; a step over a mesh pads every rank to the same shape). ``StepInputError`` names what does not fit."""
    lists = [c for c in chunk_lists if c]
    try:
        n = Buckets.pick(buckets.tokens, max(sum(len(c.token_ids) for c in cs) for cs in lists), "tokens in the step")
        r = Buckets.pick(buckets.requests, max(len(cs) for cs in lists), "requests in the step")
        b = Buckets.pick(buckets.blocks, max(len(c.block_table) for cs in lists for c in cs), "block_table length")
        Buckets.pick(buckets.tokens, max(sum(len(c.offsets) for c in cs) for cs in lists), "logit rows in the step")
    except ValueError as e:
        raise StepInputError(str(e)) from None
    return n, r, b


def check_chunks(chunks: Sequence[ChunkSpec], cfg, cache_cfg) -> None:
    """``StepInputError`` naming the first chunk (and field) the step cannot run: slots, positions, blocks, ids."""
    cc, bs = cache_cfg, cache_cfg.block_size
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
        end = min(c.ctx_len + 1 + c.max_drafts, c.limit) if c.verify else c.ctx_len + len(c.token_ids)
        if end > len(c.block_table) * bs:
            raise StepInputError(f"{where}: position {end - 1} lies beyond its {len(c.block_table)} allocated "
                                 f"blocks ({len(c.block_table) * bs} tokens)")
        if any(not 0 <= blk < cc.num_blocks for blk in c.block_table):
            raise StepInputError(f"{where}: block_table entries must lie in [0, {cc.num_blocks})")
        ids = np.asarray(c.token_ids)
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise StepInputError(f"{where}: token_ids must lie in [0, {cfg.vocab_size})")
        if not 0 <= c.window_floor <= c.ctx_len or c.global_write_from < 0:
            raise StepInputError(f"{where}: window_floor must lie in [0, ctx_len], global_write_from >= 0")
        if any(not 0 <= o < len(c.token_ids) for o in c.offsets):
            raise StepInputError(f"{where}: logits offsets must lie in [0, {len(c.token_ids)})")
        if c.verify and (c.max_drafts < 0 or c.limit < 1 or c.sample is None):
            raise StepInputError(f"{where}: a verify row needs max_drafts >= 0, limit >= 1 and a sample spec")


def validate_chunks(chunks: Sequence[ChunkSpec], cfg, cache_cfg, buckets: Buckets) -> tuple[int, int, int]:
    """The bucket shape (tokens, requests, blocks) of one step, after checking every chunk."""
    if not chunks:
        raise StepInputError("a step needs at least one chunk")
    shape = pick_shape(buckets, [chunks])
    check_chunks(chunks, cfg, cache_cfg)
    return shape


def build_inputs(chunks: Sequence[ChunkSpec], n: int, r: int, b: int, max_requests: int) -> StepInputs:
    """``StepInputs`` of a validated chunk list padded to ``n`` tokens, ``r`` request rows, ``b`` table entries
    (numpy; padding rows get slot ``max_requests``, out of range, so they write nothing)."""
    tok, pos, req = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32)
    valid = np.zeros(n, bool)
    tables = np.full((r, b), -1, np.int32)
    slot = np.full(r, max_requests, np.int32)  # out of range: padding rows write nothing
    start, ctx, new = np.zeros(r, np.int32), np.zeros(r, np.int32), np.zeros(r, np.int32)
    rows = np.zeros(n, np.int32)
    floor, write_from = np.zeros(r, np.int32), np.zeros(r, np.int32)
    at = m = 0
    for i, c in enumerate(chunks):
        k = len(c.token_ids)
        tok[at : at + k] = c.token_ids
        pos[at : at + k] = np.arange(c.ctx_len, c.ctx_len + k)
        req[at : at + k] = i
        valid[at : at + k] = True
        tables[i, : len(c.block_table)] = c.block_table
        slot[i], start[i], ctx[i], new[i] = c.slot, at, c.ctx_len, c.ctx_len + k
        floor[i], write_from[i] = c.window_floor, c.global_write_from
        rows[m : m + len(c.offsets)] = [at + o for o in c.offsets]
        at += k
        m += len(c.offsets)
    return StepInputs(token_ids=tok, positions=pos, token_req=req, token_valid=valid, block_tables=tables,
                      req_slot=slot, req_start=start, ctx_len=ctx, new_len=new, logit_rows=rows,
                      window_floor=floor, global_write_from=write_from)


def logit_rows(chunks: Sequence[ChunkSpec], inputs: StepInputs, r: int) -> np.ndarray:
    """[r] int32: one logit row per request row, its chunk's last token (0 for padding rows)."""
    return np.array([inputs.req_start[i] + len(c.token_ids) - 1 for i, c in enumerate(chunks)] + [0] * (r - len(chunks)),
                    np.int32)


def sampling_batch(chunks: Sequence[ChunkSpec], inputs: StepInputs, n: int, r: int,
                   max_requests: int) -> tuple[np.ndarray, SamplingInputs, np.ndarray]:
    """(feed [n] bool: tokens taken from the slot's last sampled id on the device, ``SamplingInputs`` of
    the r request rows, sample_slot [r] int32: where each row's token is stored, ``max_requests`` = nowhere)."""
    feed = np.zeros(n, bool)
    specs = [c.sample or SampleSpec() for c in chunks] + [SampleSpec()] * (r - len(chunks))
    sample_slot = np.full(r, max_requests, np.int32)
    for i, c in enumerate(chunks):
        feed[inputs.req_start[i]] = c.feed_last
        if c.sample is not None:
            sample_slot[i] = c.slot
    sampling = SamplingInputs(
        temperature=np.array([s.temperature for s in specs], np.float32),
        top_k=np.array([s.top_k for s in specs], np.int32),
        top_p=np.array([s.top_p for s in specs], np.float32),
        min_p=np.array([s.min_p for s in specs], np.float32),
        seed=np.array([s.seed for s in specs], np.uint32),
        stream=np.array([s.stream for s in specs], np.uint32),
        position=np.array([s.position for s in specs], np.int32))
    return feed, sampling, sample_slot
