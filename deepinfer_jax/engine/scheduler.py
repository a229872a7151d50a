"""Continuous batching over the paged cache with chunked prefill (engine.md §2.1, §2.2).

Every step the scheduler walks the running requests in admission order, then admits waiting
ones in arrival order, and gives each a chunk: a decode token, or the next piece of its prompt
(or of a recomputed prompt + output after preemption). Chunk sizes come from

- ``chunking="tokens"``: a fixed token budget per step (``max_num_batched_tokens``);
- ``chunking="cost"``: a time budget per step in ns and the fitted ``CostModel``; each chunk takes
  the largest q whose predicted cost fits what is left (decode tokens are always scheduled, and a
  step that would otherwise be empty gets at least one token of progress).

When a running request needs a block and none is free, the most recently admitted request is
preempted: its blocks and slot go back and it returns to the head of the waiting queue, to be
recomputed from its tokens (deterministic sampling makes the result identical). Admission is
strictly first come first served: when the oldest waiting request does not fit, nothing behind it
is admitted, so no request starves.

Asynchronous scheduling: a request's newest token may still be on the device (``num_pending``);
its decode chunk then takes that token from the device (``feed_last``). Tokens the host counts as
computed include those of launched steps, so scheduling never waits for results.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field

from deepinfer_jax.cache import BlockPool, OutOfBlocks, RequestBlocks
from deepinfer_jax.cache.swa_snapshots import SwaSnapshotStore
from deepinfer_jax.engine.cost_model import CostModel
from deepinfer_jax.engine.cp_policy import cp_chunk_len, cp_turn_for, wants_cp
from deepinfer_jax.engine.prefix_cache import PrefixCache
from deepinfer_jax.engine.request import Request, Status
from deepinfer_jax.runner.step_output import StepOutput

__all__ = ["BlockUpload", "ScheduledChunk", "Scheduler", "SchedulerOutput", "SlotRestore", "WindowRestore",
           "update_from_output"]


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of ``request``; ``sample``: the chunk reaches the request's
    end and samples its next token; ``feed_last``: its one token is still on the device.

    ``verify`` (speculative decoding): a decoding request's verification row, built on the device
    from its slot; ``start`` is then a lower bound of its position and ``num_tokens`` the most it may
    run (1 + drafts)."""

    request: Request
    start: int
    num_tokens: int
    sample: bool
    feed_last: bool
    verify: bool = False
    context_parallel: bool = False  # a long prompt's whole prefill, alone in its step (docs/context_parallel.md)


@dataclass(frozen=True)
class BlockUpload:
    """A prefix hit's blocks from the lower tiers (host memory, files): ``payloads`` written into the device
    blocks ``block_ids`` of ``request`` before the step."""

    request: Request
    block_ids: list[int]
    payloads: list


@dataclass(frozen=True)
class SlotRestore:
    """Engine roles (``cluster.roles``): a slot's whole state computed by another engine, put into
    ``request``'s slot before the step."""

    request: Request
    state: dict


@dataclass(frozen=True)
class WindowRestore:
    """A prefix hit: the sliding-window state at ``position`` put into ``request``'s slot before the step;
    ``snapshot`` is the saved window, or None under bounded replay (the window restarts there and the
    replayed tokens rebuild it)."""

    request: Request
    position: int
    snapshot: object | None


@dataclass
class SchedulerOutput:
    """One step's plan, everything the engine core hands the runner: the chunks, and ``copies``, the cache
    contents (``BlockUpload``, ``SlotRestore``, ``WindowRestore``) the newly admitted requests need in their
    blocks and slots first, in order. ``preempted``: requests sent back to the waiting queue."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    predicted_ns: float | None = None
    copies: list[BlockUpload | SlotRestore | WindowRestore] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    def shape(self) -> list[tuple[int, int]]:
        """[(q, c)] per chunk, the cost model's view of the step."""
        return [(c.num_tokens, c.start) for c in self.chunks]


class Scheduler:
    """Host-only scheduling state: waiting queue, running list, block pool, slots."""

    def __init__(self, *, num_blocks: int, block_size: int, max_blocks_per_request: int, max_num_seqs: int,
                 max_model_len: int, max_num_batched_tokens: int, chunking: str = "tokens",
                 cost_model: CostModel | None = None, step_budget_ns: int | None = None,
                 prefix_extra: bytes | None = None, ring_rows: int = 0, swa_snapshot_entries: int = 256,
                 encoder_replay: bool = False, replay_tokens: int = 0, host_store=None, file_store=None,
                 decoder_keep: int | None = None, spec_tokens: int = 0, cp_threshold: int = 0) -> None:
        if chunking == "cost" and (cost_model is None or step_budget_ns is None):
            raise ValueError("chunking='cost' needs a cost_model and step_budget_ns")
        self.pool = BlockPool(num_blocks)
        self.block_size, self.max_blocks_per_request = block_size, max_blocks_per_request
        # a request can never hold more than the whole pool (nor more than its table)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = min(max_model_len, num_blocks * block_size, max_blocks_per_request * block_size)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunking, self.cost_model, self.step_budget_ns = chunking, cost_model, step_budget_ns
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.free_slots = collections.deque(range(max_num_seqs))
        self.num_preemptions = 0
        self.decoder_keep = decoder_keep  # decoder bounded replay: prompt tokens that run the decoder
        self.spec_tokens = spec_tokens  # speculative decoding: most drafts a verify row may take (0 = off)
        self.cp_threshold = cp_threshold  # context parallelism: prompts this long prefill alone, whole (0 = off)
        #: None = no prefix caching; else the digest/hit bookkeeping (``prefix_extra`` = model + salt keys)
        self.prefix = None if prefix_extra is None else PrefixCache(
            self.pool, block_size, ring_rows, prefix_extra, SwaSnapshotStore(swa_snapshot_entries),
            encoder_replay=encoder_replay, replay_tokens=replay_tokens, host=host_store, files=file_store)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step plan ----
    def _limit_reached(self, r: Request) -> bool:
        """max_tokens or the context limit is reached, counting tokens still on the device."""
        p = r.params
        return (p.max_tokens is not None and r.num_generated >= p.max_tokens) or r.num_tokens >= self.max_model_len

    def _wants(self, r: Request) -> int:
        """Tokens the request could compute now (0 while its limit is reached and it awaits its finish);
        a decoding request under speculation wants one verify row: 1 + spec_tokens tokens at most when
        its slot holds fresh drafts, else 1 (a plain decode token: the step budget stays with prefill)."""
        if self._limit_reached(r):
            return 0
        if r.spec.decoding:
            return 1 + self.spec_tokens if r.spec.has_drafts else 1
        return r.num_tokens - r.num_computed

    def _verify_capacity(self, r: Request) -> int:
        """Tokens a verify row's blocks must cover: every position the device may write this step."""
        return min(r.max_tokens_on_device + self.spec_tokens, self.max_model_len)

    def _chunk_len(self, r: Request, want: int, start: int, tokens_left: int, time_left: float, first: bool) -> int:
        """The chunk ``schedule()`` gives ``r`` computing from ``start``: at most ``want`` tokens and
        ``tokens_left``, up to its next snapshot point, and with ``chunking="cost"`` the largest that fits
        ``time_left``; ``first``: the step has no chunk yet (then at least one token, else no progress)."""
        if r.spec.decoding:  # a verify row runs like a decode token, with as many drafts as the budget holds
            return min(want, tokens_left)
        cap = min(want, tokens_left)
        nxt = next((p for p in r.cache.snapshot_points if p > start), 0)
        if nxt:  # prefill stops at each snapshot point to save the window there
            cap = min(cap, nxt - start)
        if want == 1 or self.chunking != "cost":
            return cap
        q = self.cost_model.largest_q(time_left, start, cap)
        return q if q > 0 or not first else min(cap, 1)

    def planned_cost_ns(self) -> tuple[float, bool]:
        """What ``schedule()`` would plan now with the whole ``step_budget_ns`` (``chunking="cost"``), without
        planning it: (the predicted cost of its chunks, step overhead excluded; whether one is prompt work).
        ``engine.ranks.matched_budget_ns`` matches the DP ranks' budgets on it. An estimate: blocks are assumed
        to suffice (no preemption; every admission fits), and a waiting request's prefix hit is looked up as
        admission looks it up (its effects on the request undone), so only the uncached part is costed."""
        tokens_left = self.max_num_batched_tokens
        time_left = self.step_budget_ns - self.cost_model.coef[0]
        spent, prompt, chunks = 0.0, False, 0

        def add(r: Request, start: int, want: int) -> int:
            nonlocal tokens_left, time_left, spent, prompt, chunks
            q = self._chunk_len(r, want, start, tokens_left, time_left, not chunks)
            if q:
                c = self.cost_model.chunk_cost(q, start)
                tokens_left, time_left, spent, chunks = tokens_left - q, time_left - c, spent + c, chunks + 1
                prompt = prompt or (want > 1 and not r.spec.decoding)
            return q

        for r in self.running:
            want = self._wants(r)
            if want:
                add(r, r.num_computed, want)
        slots = len(self.free_slots)
        for r in self.waiting:
            if not slots or tokens_left <= 0 or r.inflight or wants_cp(self, r):
                break
            kept = r.replay.approximate, r.cache.snapshot_points, None if self.prefix is None else self.prefix._pending
            try:
                hit = self._match(r)[0]
                start = hit or r.num_computed
                if hit and r.replay.approximate:  # bounded replay recomputes the hit's last tokens
                    start = max(0, hit - self.prefix.replay_tokens)
                if not add(r, start, r.num_tokens - start):
                    break
            finally:
                r.replay.approximate, r.cache.snapshot_points = kept[:2]
                if self.prefix is not None:
                    self.prefix._pending = kept[2]
            slots -= 1
        return spent, prompt

    def schedule(self, budget_ns: float | None = None) -> SchedulerOutput:
        """The next step's plan; ``budget_ns`` replaces ``step_budget_ns`` for this step (``chunking="cost"``:
        a DP step's matched budget, ``engine.ranks.matched_budget_ns``)."""
        out = SchedulerOutput()
        tokens_left = self.max_num_batched_tokens
        cost = self.chunking == "cost"
        budget = self.step_budget_ns if budget_ns is None else budget_ns
        time_left = (budget - self.cost_model.coef[0]) if cost else 0.0

        def chunk_size(r: Request, want: int) -> int:
            return self._chunk_len(r, want, r.num_computed, tokens_left, time_left, not out.chunks)

        def take(r: Request, q: int) -> None:
            nonlocal tokens_left, time_left
            tokens_left -= q
            if cost:
                time_left -= self.cost_model.chunk_cost(q, r.num_computed)
            r.inflight += 1
            if r.spec.decoding:  # verify row: adds 1 .. q tokens, learnt when reconciled
                out.chunks.append(ScheduledChunk(r, r.num_computed, q, True, True, verify=True))
                r.num_pending += 1
                r.spec.pending_max += q
                return
            sample = r.num_computed + q == r.num_tokens
            out.chunks.append(ScheduledChunk(r, r.num_computed, q, sample, r.num_pending > 0))
            r.num_computed += q
            r.num_pending += sample
            r.spec.pending_max += sample
            r.spec.decoding = sample and self.spec_tokens > 0

        for r in [r for r in self.running if r.num_pending and self._limit_reached(r)]:
            # certain to finish once its last token is reconciled: free its slot and blocks now (the device
            # runs later steps after the one still writing them); blocks that the steps in flight may still
            # complete stay until the finish, which indexes them in the prefix cache (``_completes_a_block``)
            self.running.remove(r)
            self._release(r, keep_blocks=self._completes_a_block(r))
        cp_turn = cp_turn_for(self)  # a long prompt's CP prefill runs alone: running requests wait one step
        i = 0
        while not cp_turn and i < len(self.running):
            r = self.running[i]
            want = self._wants(r)
            q = chunk_size(r, want) if want else 0
            if q == 0:
                i += 1
                continue
            while True:
                try:
                    r.blocks.ensure_capacity(self._verify_capacity(r) if r.spec.decoding else r.num_computed + q)
                    break
                except OutOfBlocks:
                    victim = self.running[-1]
                    self._preempt(victim, out)
                    if victim is r:
                        break
            if r.status is Status.RUNNING:
                take(r, q)
                i += 1
        while self.waiting and self.free_slots and tokens_left > 0:
            r = self.waiting[0]
            if r.inflight:  # preempted with a token still on the device: admit it after the result
                break
            if not cp_turn and wants_cp(self, r):  # a long prompt waits for its own CP step
                break
            blocks = RequestBlocks(self.pool, self.max_blocks_per_request, self.block_size)
            hit, cached, uploads = self._match(r)  # also sets the prefill snapshot points, which cut chunks
            if hit:
                self.pool.acquire(cached)
                blocks.adopt(cached)
                r.num_computed, r.cache.registered = hit, len(cached)
                if r.replay.approximate:  # bounded replay of the hit's last tokens rebuilds the window
                    r.num_computed = r.replay.window_floor = max(0, hit - self.prefix.replay_tokens)
                    r.replay.write_from = hit
            cp = cp_chunk_len(self, r) if cp_turn else 0
            q = cp or chunk_size(r, r.num_tokens - r.num_computed)
            if q == 0:
                blocks.release()
                r.num_computed = r.cache.registered = r.replay.window_floor = r.replay.write_from = 0
                r.replay.approximate = False
                break
            try:
                blocks.ensure_capacity(max(hit, r.num_computed + q))
            except OutOfBlocks:
                blocks.release()
                r.num_computed = r.cache.registered = r.replay.window_floor = r.replay.write_from = 0
                r.replay.approximate = False
                break  # FCFS: nothing behind the oldest request jumps the queue
            self.waiting.popleft()
            if self.prefix is not None:
                self.prefix.record_admitted()
            if uploads:  # blocks from the host / file tiers: fresh device blocks, filled before the step
                ids = blocks.block_ids[len(cached) : len(cached) + len(uploads)]
                digests = self.prefix.digests(r) if self.prefix is not None else []
                for b, d in zip(ids, digests[len(cached) : hit // self.block_size]):
                    self.pool.register(b, d)
                out.copies.append(BlockUpload(r, list(ids), list(uploads)))
            if r.cache.admit_state is not None:  # state computed elsewhere: restored whole, no window lookup
                out.copies.append(SlotRestore(r, r.cache.admit_state.slot_state))
            elif hit:
                snapshot = None if r.replay.approximate else self.prefix.snapshot_for(r, hit)
                out.copies.append(WindowRestore(r, r.num_computed, snapshot))
                r.num_cached_tokens = r.num_cached_tokens or hit
            if self.decoder_keep is not None:  # the decoder runs on the last decoder_keep tokens only
                r.replay.decoder_from = max(0, r.num_tokens - self.decoder_keep)
            r.spec.ctx_from = max(r.num_computed, r.replay.decoder_from)
            r.blocks, r.slot, r.status = blocks, self.free_slots.popleft(), Status.RUNNING
            self.running.append(r)
            take(r, q)
            if cp_turn:
                if cp:
                    out.chunks[-1] = dataclasses.replace(out.chunks[-1], context_parallel=True)
                break
        if cost and out.chunks:
            out.predicted_ns = self.cost_model.predict(out.shape())
        if self.prefix is not None:
            for c in out.chunks:
                self.prefix.register(c.request)
        return out

    def _match(self, r: Request) -> tuple[int, list[int], list]:
        """(hit length, cached device blocks, lower-tier payloads) for a request starting from
        scratch; sets its snapshot points."""
        if r.cache.admit_state is not None:  # engine roles: every block and the slot state come with it
            r.replay.approximate, r.cache.snapshot_points = False, []
            if self.prefix is not None:
                self.prefix._pending = None
            return r.cache.admit_state.length, [], list(r.cache.admit_state.payloads)
        if self.prefix is None:
            return 0, [], []
        decision, cached, uploads = self.prefix.match(r)
        r.replay.approximate = decision.approximate
        decoder_replayed = self.decoder_keep is not None and r.num_tokens > self.decoder_keep
        r.cache.snapshot_points = [] if r.replay.approximate or decoder_replayed else [
            p for p in self.prefix.snapshot_positions(r)
            if p > decision.length and self.prefix.digest_at(r, p) not in self.prefix.snapshots]
        return decision.length, cached, uploads

    def _preempt(self, r: Request, out: SchedulerOutput) -> None:
        self.running.remove(r)
        self._release(r)
        r.status, r.num_computed, r.cache.registered = Status.WAITING, 0, 0
        r.replay.approximate, r.replay.window_floor, r.replay.write_from = False, 0, 0
        r.spec.decoding, r.spec.next_conf = False, None
        r.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(r)
        out.preempted.append(r)

    def _completes_a_block(self, r: Request) -> bool:
        """Whether ``r``, at its limit with tokens still on the device, may end with a full block of known tokens
        that the prefix cache has not indexed yet (it is indexed when the request finishes). Without this, a
        request whose last block fills in its last steps (a length of ``k * block_size + 1``, or a verify row
        crossing the boundary) left that block out of the cache, and the next turn of the conversation hit
        one block or more short."""
        if self.prefix is None or r.blocks is None or r.replay.approximate:
            return False
        limit = self.max_model_len
        if r.params.max_tokens is not None:
            limit = min(limit, len(r.prompt_ids) + r.params.max_tokens)
        return limit // self.block_size > r.cache.registered

    def _release(self, r: Request, keep_blocks: bool = False) -> None:
        """Blocks and slot go back at once: later steps run after the in-flight ones on the device. With
        ``keep_blocks`` only the slot does (the blocks go at ``finish``)."""
        if r.blocks is not None and not keep_blocks:
            r.blocks.release()
            r.blocks = None
        if r.slot is not None:
            self.free_slots.append(r.slot)
            r.slot = None

    def finish(self, r: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """Mark ``r`` finished, free its resources, drop anything it still has on the device."""
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        self._release(r)
        r.status, r.finish_reason, r.stop_reason = Status.FINISHED, reason, stop_reason
        r.num_pending = r.spec.pending_max = 0


def update_from_output(plan: SchedulerOutput, out: StepOutput) -> None:
    """Take a reconciled step's output back into its requests' scheduling state (any DP rank's: it is the
    requests' own): the step is no longer in flight; a chunk that sampled has its token off the device;
    a verify row has its anchor and accepted drafts in the cache (``num_computed``), which the plan could
    only bound. A request that ended meanwhile (``Scheduler.finish``) keeps its zeroed counts. The tokens
    themselves go to the engine core (stop rules, detokenizing, the output)."""
    for i, (chunk, res) in enumerate(zip(plan.chunks, out.tokens)):
        r = chunk.request
        r.inflight -= 1
        if res is None or r.finished:
            continue
        r.num_pending -= 1
        r.spec.pending_max -= chunk.num_tokens if chunk.verify else 1
        if chunk.verify and r.spec.decoding:
            r.num_computed = max(r.num_computed, out.anchors[i] + len(res))
