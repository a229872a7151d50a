"""Bucketed step shapes: every step is padded up to one of a few precompiled sizes."""

from __future__ import annotations

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
