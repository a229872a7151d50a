"""Bucketed step shapes: every step is padded up to one of a few precompiled sizes."""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Buckets:
    """Allowed sizes of the flat token axis, the request axis and the block-table width.

    Each tuple is sorted ascending; a step uses the smallest entry of each that fits. All
    combinations compile at start-up (``ModelRunner.precompile``), so keep the tuples short.
    """

    tokens: tuple[int, ...] = (16, 64, 256)
    requests: tuple[int, ...] = (1, 4, 16)
    blocks: tuple[int, ...] = (8, 32)

    def __post_init__(self):
        for name in ("tokens", "requests", "blocks"):
            values = getattr(self, name)
            if not values or any(type(v) is not int or v < 1 for v in values) or list(values) != sorted(set(values)):
                raise ValueError(f"Buckets.{name} must be a non-empty, strictly increasing tuple of positive ints")

    @staticmethod
    def pick(sizes: tuple[int, ...], need: int, what: str) -> int:
        """The smallest size >= need; ``StepInputError``-worthy ValueError naming ``what`` otherwise."""
        for size in sizes:
            if size >= need:
                return size
        raise ValueError(f"{what}: {need} exceeds the largest bucket {sizes[-1]}")

    def shapes(self) -> list[tuple[int, int, int]]:
        return [(n, r, b) for n in self.tokens for r in self.requests for b in self.blocks]


def block_buckets(max_blocks: int, block_size: int, ratio: int = 4, shortest_tokens: int = 512) -> tuple[int, ...]:
    """The engine's default block-table widths: ``max_blocks``, then each about ``1/ratio`` of the
    last, down to the width holding ``shortest_tokens`` tokens.

    A step reads its block table as wide as its bucket: the indexer scores every entry the table can
    hold (masked past the context), so one bucket of ``max_blocks`` makes a short request pay the
    scan of a ``max_model_len`` one. With this ladder a batch pays at most ``ratio`` times its longest
    table (or the ``shortest_tokens`` floor), for ``log_ratio(max_model_len / shortest_tokens)`` more
    buckets; e.g. ``max_blocks=32, block_size=64`` (2,048 tokens) gives (8, 32)."""
    floor = min(max_blocks, math.ceil(shortest_tokens / block_size))
    widths = [max_blocks]
    while widths[-1] > floor:
        widths.append(max(floor, math.ceil(widths[-1] / ratio)))
    return tuple(sorted(set(widths)))


class BucketUse:
    """Which step shapes this runner has run (so compiled), and the lazy engine's choice of a step's
    token and block-table buckets.

    Eager (``lazy=False``): a step always runs in the smallest token and block buckets that fit it.
    Lazy: a step whose smallest shape has not compiled yet runs padded in a *compiled* shape of the
    same request width that fits it (the fewest tokens first, then the narrowest block table; when
    none has compiled yet: in the largest token and block buckets, which then serve every later
    step), until that smaller shape has been wanted ``compile_after`` times; then it compiles. A short run
    (a demo, a notebook cell) thus compiles one bucket instead of every one its steps touch, and a long one
    still converges to the tight buckets (256 steps: on this CPU a 64-token speculative step cost about
    15 ms more than a 4-token one when measured, and a bucket takes about 11 s to compile, so a padded
    bucket pays for its compilation after several hundred steps; a 64-token step that verifies nothing
    later measured about 16 ms less with one logit row per request, ``SpeculativeStep.logit_rows``).
    Results do not depend on the bucket (padding writes and changes nothing; tested).
    """

    def __init__(self, tokens: tuple[int, ...] = (), lazy: bool = False, compile_after: int = 256,
                 blocks: tuple[int, ...] = ()) -> None:
        self.tokens, self.blocks, self.lazy, self.compile_after = tuple(tokens), tuple(blocks), lazy, compile_after
        self.compiled: set[tuple[int, int, int]] = set()
        self.wants: collections.Counter = collections.Counter()

    def choose(self, n: int, r: int, b: int) -> tuple[int, int]:
        """(token bucket, block bucket) to run a step whose smallest fitting shape is (n, r, b)."""
        shape = (n, r, b)
        if not self.lazy or shape in self.compiled:
            self.compiled.add(shape)
            return n, b
        self.wants[shape] += 1
        if self.wants[shape] < self.compile_after:
            fits = sorted((t, bb) for t, rr, bb in self.compiled if rr == r and t >= n and bb >= b)
            # nothing compiled fits: compile the largest buckets, which every later step fits
            n, b = fits[0] if fits else (max(self.tokens, default=n), max(self.blocks, default=b))
        self.compiled.add((n, r, b))
        return n, b
