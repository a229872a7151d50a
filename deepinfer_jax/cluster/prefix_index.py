"""Prefix match at the entry (engine.md §1.1, §1.3): a request's hit length, known before routing.

The router hashes the prompt into the chain of 128-token block digests (``cache.block_hash``: each
digest covers its parent, the block's token ids and the model/salt extra keys) and walks it against
the block store's index (the set of digests the store holds; every engine reads the same store, so
the hit does not depend on where the request goes). The number of leading digests present is the
block-KV candidate; the hit rule (``cache.swa_snapshots.hit_length``) then turns it into the tokens
reused: ``L1 <= L - 134`` (window + speculative slack always recomputed), and for the last block
either the exact SWA window (the engine that holds it) or, at the entry where windows are not
visible, encoder bounded replay (hit ``L1``, 128 tokens replayed; engine.md §1.4). The router then
knows ``uncached_tokens`` (q) and ``hit_tokens`` (c) of the request: what the prefill balancer
charges as compute quota ``cost(q, c)`` and what the autoscaler counts as missed tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from deepinfer_jax.cache.block_hash import ROOT_DIGEST, block_digests
from deepinfer_jax.cache.swa_snapshots import hit_length
from deepinfer_jax.cluster.errors import PolicyInputError, check_int

__all__ = ["BLOCK_SIZE", "RING_ROWS", "PrefixIndex", "PrefixMatch", "match_digests", "match_tokens"]

BLOCK_SIZE = 128  # engine.md §1.1
RING_ROWS = 134  # engine.md §1.2: 128-token window + 6 speculative slots
REPLAY_TOKENS = 128  # engine.md §1.4: encoder bounded replay recomputes the last block


class PrefixIndex:
    """The store's index as the router sees it: which block digests the shared store holds.

    Wraps any container supporting ``in`` (a ``set``, or a ``cache.block_store`` store); ``add``
    records blocks a prefill or decode instance has written.
    """

    def __init__(self, digests: Iterable[bytes] | None = None, container=None) -> None:
        self._items = container if container is not None else set(digests or ())

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._items

    def __len__(self) -> int:
        return len(self._items)

    def add(self, digests: Iterable[bytes]) -> None:
        if not hasattr(self._items, "add"):
            raise PolicyInputError("container", "this index is read-only (the store adds blocks itself)")
        for d in digests:
            self._items.add(d)

    def leading(self, digests: Sequence[bytes]) -> int:
        """How many of ``digests`` (a chain, first block first) the index holds before the first miss."""
        n = 0
        for d in digests:
            if d not in self._items:
                break
            n += 1
        return n


@dataclass(frozen=True)
class PrefixMatch:
    """The entry's answer for one request of ``num_tokens`` prompt tokens.

    ``cached_blocks``: leading blocks in the store; ``hit_tokens``: tokens reused by the hit rule;
    ``replay_tokens``: tokens recomputed by bounded replay (0 for an exact window);
    ``uncached_tokens``: prompt tokens to compute, ``num_tokens - hit_tokens``.
    """

    num_tokens: int
    cached_blocks: int
    hit_tokens: int
    replay_tokens: int = 0

    @property
    def uncached_tokens(self) -> int:
        return self.num_tokens - self.hit_tokens


def match_digests(digests: Sequence[bytes], num_tokens: int, index: PrefixIndex,
                  has_swa: Callable[[int], bool] | None = None, block_size: int = BLOCK_SIZE,
                  ring_rows: int = RING_ROWS) -> PrefixMatch:
    """The hit for a prompt whose block digests are ``digests`` (its full blocks, in order).

    ``has_swa(p)``: whether an exact SWA window is known at block boundary ``p``; ``None`` (the
    entry's usual case: windows live on the machines) means encoder bounded replay at ``L1``.
    """
    check_int("num_tokens", num_tokens)
    check_int("block_size", block_size, 1)
    check_int("ring_rows", ring_rows, 0)
    if len(digests) > num_tokens // block_size:
        raise PolicyInputError("digests", f"{len(digests)} blocks cannot come from {num_tokens} tokens")
    cached = index.leading(digests)
    decision = hit_length(num_tokens, block_size, ring_rows, cached, has_swa or (lambda p: False),
                          encoder_replay=has_swa is None)
    replay = min(REPLAY_TOKENS, block_size, decision.length) if decision.approximate else 0
    return PrefixMatch(num_tokens, cached, decision.length, replay)


def match_tokens(token_ids: Sequence[int], extra: bytes, index: PrefixIndex,
                 has_swa: Callable[[int], bool] | None = None, block_size: int = BLOCK_SIZE,
                 ring_rows: int = RING_ROWS) -> tuple[PrefixMatch, list[bytes]]:
    """Hash ``token_ids`` into the block chain (``extra``: ``block_hash.extra_keys``) and match it;
    returns the match and the digests (the prefill instance writes these blocks afterwards)."""
    if any(t < 0 for t in token_ids):
        raise PolicyInputError("token_ids", "token ids must be >= 0")
    digests = block_digests(token_ids, block_size, extra, ROOT_DIGEST)
    return match_digests(digests, len(token_ids), index, has_swa, block_size, ring_rows), digests
