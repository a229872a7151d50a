"""When the scheduler prefills a prompt by context parallelism (docs/context_parallel.md).

With ``Scheduler.cp_threshold`` > 0 (an engine on a ``cp`` preset), the oldest waiting request whose prompt
still has at least ``cp_threshold`` tokens to compute takes a *CP turn*: that step holds only its whole
remaining prompt, as one ``context_parallel`` chunk (the running requests skip that one step), which the
runner splits by position over the ``cp`` ranks. Everything else is scheduled as ordinary chunks.

A request that wants a CP turn is not admitted as ordinary chunks behind other requests of a step (FCFS:
the queue waits for its turn). A CP turn is taken only when the request can be admitted at once (a free
slot, nothing of it still on the device, free blocks for the whole prompt), so a turn is never spent on an
empty step. The CP chunk ends at the request's first prefix-cache snapshot point (``cp_chunk_len``); after
the prefix-cache lookup it stays an ordinary chunk when it would fall below the threshold, or when the
request needs bounded replay (an approximate window) or decoder replay: CP runs plain prefills only.
"""

from __future__ import annotations

__all__ = ["cp_chunk_len", "cp_turn_for", "wants_cp"]


def wants_cp(sched, r) -> bool:
    """Whether waiting request ``r`` waits for a CP turn (it is not admitted as ordinary chunks behind others)."""
    t = sched.cp_threshold
    return bool(t) and sched.decoder_keep is None and r.num_tokens - r.num_computed >= t


def cp_turn_for(sched) -> bool:
    """Whether this step is a CP turn for the head of ``sched.waiting``."""
    if not sched.waiting or not sched.free_slots or not wants_cp(sched, sched.waiting[0]):
        return False
    r = sched.waiting[0]
    return not r.inflight and sched.pool.free_count * sched.block_size >= r.num_tokens


def cp_chunk_len(sched, r) -> int:
    """After admission's prefix lookup: the tokens of request ``r`` that run as one CP chunk (0 = none: an
    ordinary chunk). The chunk stops at the request's first prefix-cache snapshot point (the window is saved
    there, so a repeat of the prompt hits; the few tokens after it run as ordinary chunks)."""
    if r.replay.approximate:
        return 0
    q = r.num_tokens - r.num_computed
    nxt = next((p for p in r.cache.snapshot_points if p > r.num_computed), 0)
    if nxt:
        q = min(q, nxt - r.num_computed)
    return q if q >= sched.cp_threshold else 0
