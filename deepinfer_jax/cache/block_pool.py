"""Host-side bookkeeping of the paged block KV (engine.md §1.1): which device blocks are free,
how many holders each used block has, and each request's block table.

Plain Python + numpy; the device arrays the block ids index live elsewhere. Every operation
validates all of its input before changing anything, so a rejected call leaves the pool exactly
as it was.
"""

from __future__ import annotations

import collections
import math
import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np

__all__ = ["BlockPool", "OutOfBlocks", "RequestBlocks"]


class OutOfBlocks(RuntimeError):
    """Fewer free blocks than an allocation asked for; nothing was allocated.

    Attributes:
        requested: blocks asked for.
        free: blocks free at the time.
    """

    def __init__(self, requested: int, free: int) -> None:
        super().__init__(f"requested {requested} blocks, only {free} free")
        self.requested = requested
        self.free = free


def _count(name: str, value: Any, low: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


class BlockPool:
    """A fixed set of ``num_blocks`` block ids ``0 .. num_blocks - 1`` with reference counts.

    A block is *free* (refcount 0, on the free list) or *used* (refcount >= 1, held by one or more
    request tables or caches). The free list is **FIFO**: ``allocate`` hands out the block that
    has been free the longest, so a freed block's device contents survive as long as possible.
    Initially blocks come out in id order.

    Prefix cache (device tier, engine.md §1.1): a full block whose contents are final can be
    ``register``-ed under its content digest. It stays indexed while used and after it is freed,
    until ``allocate`` hands it out again (then it is evicted from the index): eviction is LRU over
    unreferenced blocks only, and never touches a block in use. ``lookup`` finds the indexed blocks
    of a digest chain; ``acquire`` takes a hold on one (reviving it from the free list if needed).
    """

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = _count("num_blocks", num_blocks, 1)
        self._refcount = [0] * self._num_blocks
        self._free: dict[int, None] = dict.fromkeys(range(self._num_blocks))  # insertion order = FIFO
        self._by_digest: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self.evictions = 0

    def __repr__(self) -> str:
        return f"BlockPool(num_blocks={self._num_blocks}, free={self.free_count})"

    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool."""
        return self._num_blocks

    @property
    def free_count(self) -> int:
        """Blocks with refcount 0."""
        return len(self._free)

    @property
    def used_count(self) -> int:
        """Blocks with refcount >= 1 (``free_count + used_count == num_blocks``)."""
        return self._num_blocks - len(self._free)

    def refcount(self, block_id: int) -> int:
        """Holders of ``block_id`` (0 when free); ValueError for an unknown id."""
        return self._refcount[self._check_id(block_id)]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (refcount 1 each), all or nothing.

        Raises OutOfBlocks, changing nothing, when fewer than ``n`` are free.
        """
        n = _count("n", n, 0)
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free))
        out = []
        for _ in range(n):
            b = next(iter(self._free))
            del self._free[b]
            self._refcount[b] = 1
            digest = self._digest_of.pop(b, None)
            if digest is not None:  # its old contents are about to be overwritten
                del self._by_digest[digest]
                self.evictions += 1
            out.append(b)
        return out

    # ---- the prefix-cache index ----
    @property
    def num_cached(self) -> int:
        """Blocks indexed by digest (used or free)."""
        return len(self._by_digest)

    def register(self, block_id: int, digest: bytes) -> bool:
        """Index a used block's final contents under ``digest``; False (nothing changes) when the
        digest is already indexed (another block holds the same contents) or the block has one."""
        b = self._check_id(block_id)
        if self._refcount[b] == 0:
            raise ValueError(f"block_id: cannot register free block {b}")
        if digest in self._by_digest or b in self._digest_of:
            return False
        self._by_digest[digest] = b
        self._digest_of[b] = digest
        return True

    def lookup(self, digests: Iterable[bytes]) -> list[int]:
        """The indexed blocks of the longest prefix of ``digests`` that is fully indexed."""
        out = []
        for d in digests:
            b = self._by_digest.get(d)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Take one hold on each indexed block, reviving free ones (they leave the free list)."""
        ids = [self._check_id(b) for b in block_ids]
        missing = [b for b in ids if b not in self._digest_of]
        if missing:
            raise ValueError(f"block_ids: blocks {missing} are not indexed")
        for b in ids:
            if self._refcount[b] == 0:
                del self._free[b]
            self._refcount[b] += 1

    def digest_of(self, block_id: int) -> bytes | None:
        return self._digest_of.get(self._check_id(block_id))

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each listed block (a repeated id counts once per occurrence).

        Every block must be in use: a free block is revived only through ``allocate``.
        ValueError, changing nothing, otherwise.
        """
        ids = [self._check_id(b) for b in block_ids]
        free = sorted({b for b in ids if self._refcount[b] == 0})
        if free:
            raise ValueError(f"block_ids: cannot incref free blocks {free}")
        for b in ids:
            self._refcount[b] += 1

    def decref(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one holder from each listed block; return the blocks that became free, in order.

        ValueError, changing nothing, for an unknown id or a block that would drop below zero
        (a free block, or one listed more times than it has holders).
        """
        ids = [self._check_id(b) for b in block_ids]
        counts = collections.Counter(ids)
        over = sorted(b for b, k in counts.items() if k > self._refcount[b])
        if over:
            raise ValueError(f"block_ids: decref below zero for blocks {over} "
                             f"(refcounts {[self._refcount[b] for b in over]})")
        freed = []
        for b in ids:
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                freed.append(b)
        self._free.update(dict.fromkeys(freed))
        return freed

    def _check_id(self, block_id: Any) -> int:
        if (not isinstance(block_id, numbers.Integral) or isinstance(block_id, bool)
                or not 0 <= block_id < self._num_blocks):
            raise ValueError(f"block_id must be an integer in [0, {self._num_blocks}), got {block_id!r}")
        return int(block_id)


class RequestBlocks:
    """One request's block table: the blocks holding its tokens ``[0, num_tokens_capacity)``,
    block ``k`` covering tokens ``[k * block_size, (k + 1) * block_size)``."""

    def __init__(self, pool: BlockPool, max_blocks_per_request: int, block_size: int) -> None:
        self._pool = pool
        self._max_blocks = _count("max_blocks_per_request", max_blocks_per_request, 1)
        self._block_size = _count("block_size", block_size, 1)
        self._blocks: list[int] = []

    def __repr__(self) -> str:
        return f"RequestBlocks(blocks={self._blocks}, block_size={self._block_size})"

    @property
    def block_ids(self) -> list[int]:
        """The table's block ids, in token order (a copy)."""
        return list(self._blocks)

    @property
    def num_blocks(self) -> int:
        """Blocks held."""
        return len(self._blocks)

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def max_tokens(self) -> int:
        """Most tokens the table can ever hold: ``max_blocks_per_request * block_size``."""
        return self._max_blocks * self._block_size

    @property
    def num_tokens_capacity(self) -> int:
        """Tokens the held blocks cover."""
        return len(self._blocks) * self._block_size

    def ensure_capacity(self, num_tokens: int) -> list[int]:
        """Grow the table to cover ``num_tokens`` tokens; return the newly allocated blocks.

        All or nothing: raises OutOfBlocks (table and pool unchanged) when the pool is short,
        ValueError naming ``num_tokens`` past ``max_blocks_per_request * block_size``.
        Never shrinks the table.
        """
        num_tokens = _count("num_tokens", num_tokens, 0)
        if num_tokens > self.max_tokens:
            raise ValueError(f"num_tokens must be <= max_blocks_per_request * block_size = "
                             f"{self.max_tokens}, got {num_tokens}")
        missing = math.ceil(num_tokens / self._block_size) - len(self._blocks)
        if missing <= 0:
            return []
        new = self._pool.allocate(missing)
        self._blocks.extend(new)
        return new

    def adopt(self, block_ids: Iterable[int]) -> None:
        """Append blocks the caller already holds (prefix-cache hits taken with ``BlockPool.acquire``);
        the table takes over that hold. ValueError naming ``block_ids`` past the table's width."""
        ids = list(block_ids)
        if len(self._blocks) + len(ids) > self._max_blocks:
            raise ValueError(f"block_ids: {len(self._blocks) + len(ids)} blocks exceed max_blocks_per_request "
                             f"{self._max_blocks}")
        self._blocks.extend(ids)

    def release(self) -> list[int]:
        """Drop this table's hold on all its blocks (idempotent); return the blocks that became
        free. The table is empty afterwards and may grow again."""
        blocks, self._blocks = self._blocks, []
        return self._pool.decref(blocks) if blocks else []

    def table(self, width: int) -> np.ndarray:
        """The block ids as int32 ``[width]``, padded with -1; ValueError naming ``width`` when
        it is shorter than the table."""
        width = _count("width", width, 0)
        if width < len(self._blocks):
            raise ValueError(f"width must be >= the {len(self._blocks)} blocks held, got {width}")
        out = np.full(width, -1, dtype=np.int32)
        out[: len(self._blocks)] = self._blocks
        return out
