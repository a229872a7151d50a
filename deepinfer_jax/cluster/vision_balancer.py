"""The vision-encoder balancer (engine.md §3; seed §1.3).

Images are routed per machine: the prefill side picks a machine at random among those running
vision encoders (one per card), and on it the card with the fewest patches in flight encodes the
image (lowest card index on ties). An image of ``width x height`` pixels has
``ceil(width / patch) * ceil(height / patch)`` patches (the seed's ``(w / patch) x (h / patch)``;
a partial patch is padded, so it counts). No vision tower exists in this project yet: this is the
policy a router would call.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from deepinfer_jax.cluster.errors import PolicyInputError, check_int, check_nonempty

__all__ = ["num_patches", "pick_vision_card"]


def num_patches(width: int, height: int, patch_size: int) -> int:
    """Patches of one image: ``ceil(width / patch_size) * ceil(height / patch_size)``."""
    check_int("width", width, 1)
    check_int("height", height, 1)
    check_int("patch_size", patch_size, 1)
    return -(-width // patch_size) * -(-height // patch_size)


def pick_vision_card(machines: Sequence[Sequence[int]], rng: random.Random) -> tuple[int, int]:
    """``(machine, card)`` for a new image; ``machines[m][k]``: patches in flight on card k of machine m.

    The machine is drawn uniformly (``rng``, so a seeded router is reproducible) among machines with
    at least one card; then the card with the fewest patches in flight."""
    check_nonempty("machines", machines)
    live = [m for m, cards in enumerate(machines) if len(cards) > 0]
    if not live:
        raise PolicyInputError("machines", "no machine has a vision-encoder card")
    for m in live:
        for k, p in enumerate(machines[m]):
            check_int(f"machines[{m}][{k}]", p)
    m = live[rng.randrange(len(live))]
    cards = machines[m]
    return m, min(range(len(cards)), key=lambda k: (cards[k], k))
