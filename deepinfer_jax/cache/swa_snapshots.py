"""SWA window snapshots in host memory (engine.md §1.2) and the hit rule (§1.3).

A snapshot is every layer's SWA ring of one request at a block boundary ``P`` (a multiple of the
block size), keyed by the digest of the block that ends at ``P``. It lives only in this engine's
host memory (never in the block store), bounded by ``max_entries`` with LRU eviction.
Deviation, for exactness: the rings of *all* layers are kept, decoder layers included, so that a
hit restores the exact state; the spec rebuilds the decoder's windows per request (YOCO), which
is what decoder bounded replay approximates.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["HitDecision", "SwaSnapshotStore", "hit_length", "prefill_snapshot_position"]


class SwaSnapshotStore:
    """digest -> snapshot (an opaque pytree of host arrays), LRU-bounded."""

    def __init__(self, max_entries: int = 256) -> None:
        if not isinstance(max_entries, int) or max_entries < 0:
            raise ValueError(f"max_entries must be an integer >= 0, got {max_entries!r}")
        self.max_entries = max_entries
        self._items: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        self.saved = self.evicted = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._items

    def put(self, digest: bytes, snapshot: Any) -> None:
        if self.max_entries == 0:
            return
        self._items[digest] = snapshot
        self._items.move_to_end(digest)
        self.saved += 1
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)
            self.evicted += 1

    def get(self, digest: bytes) -> Any | None:
        snap = self._items.get(digest)
        if snap is not None:
            self._items.move_to_end(digest)
        return snap


def prefill_snapshot_position(length: int, block_size: int) -> int:
    """Where prefill saves the window: ``P = floor((L - 1) / B) * B`` (one token kept back)."""
    return (length - 1) // block_size * block_size


@dataclass(frozen=True)
class HitDecision:
    """``length``: tokens reused; ``approximate``: the SWA state must come from bounded replay."""

    length: int
    approximate: bool = False
    candidate: int = 0  # L1, the block-KV candidate


def hit_length(length: int, block_size: int, ring_rows: int, cached_blocks: int, has_swa: Callable[[int], bool],
               encoder_replay: bool = False) -> HitDecision:
    """The hit rule of engine.md §1.3 for an input of ``length`` tokens.

    1. ``L1``: the longest cached block prefix, a multiple of ``block_size`` with
       ``L1 <= length - ring_rows`` (the window + speculative slack is recomputed anyway).
    2. SWA state at ``L1`` -> ``L1``. Otherwise, with encoder bounded replay, ``L1`` approximate;
       else ``L1 - block_size`` (the last block recomputed), which needs the state there (or
       position 0). Extension for exactness: when that is missing too, the largest lower block
       boundary that has a state (or 0).
    """
    limit = (length - ring_rows) // block_size * block_size
    l1 = max(0, min(cached_blocks * block_size, limit))
    if l1 == 0:
        return HitDecision(0, False, 0)
    if has_swa(l1):
        return HitDecision(l1, False, l1)
    if encoder_replay:
        return HitDecision(l1, True, l1)
    p = l1 - block_size
    while p > 0 and not has_swa(p):
        p -= block_size
    return HitDecision(p, False, l1)
