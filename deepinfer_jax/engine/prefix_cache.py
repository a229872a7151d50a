"""The prefix cache as the scheduler sees it: digests, hits, registration, SWA snapshot keys.

Block KV of full blocks is indexed in the device pool by its chained digest (``cache.block_hash``)
as soon as the step writing it is launched and its tokens are known; SWA snapshots are taken at
the prefill position ``P`` and at every block boundary a decode crosses (the latest one is kept
and saved when the request ends), keyed by the digest of the block ending there. A new request
reuses the longest prefix the hit rule allows (``cache.swa_snapshots.hit_length``): its blocks
are shared (reference counted), the snapshot is restored into its slot, and only the rest runs.
"""

from __future__ import annotations

from deepinfer_jax.cache import BlockPool
from deepinfer_jax.cache.block_hash import ROOT_DIGEST, block_digests
from deepinfer_jax.cache.block_store import FileBlockStore, HostBlockStore
from deepinfer_jax.cache.swa_snapshots import HitDecision, SwaSnapshotStore, hit_length, prefill_snapshot_position
from deepinfer_jax.engine.request import Request

__all__ = ["PrefixCache"]


class PrefixCache:
    """Digest bookkeeping over a ``BlockPool`` and a ``SwaSnapshotStore``."""

    def __init__(self, pool: BlockPool, block_size: int, ring_rows: int, extra: bytes,
                 snapshots: SwaSnapshotStore | None = None, encoder_replay: bool = False,
                 replay_tokens: int = 0, host: HostBlockStore | None = None,
                 files: FileBlockStore | None = None) -> None:
        self.pool, self.block_size, self.ring_rows, self.extra = pool, block_size, ring_rows, extra
        self.encoder_replay, self.replay_tokens = encoder_replay, replay_tokens
        self.host, self.files = host, files  # lower tiers (None = device only); files needs host
        self.new_blocks: list[tuple[int, bytes]] = []  # registered since the engine last wrote them back
        self.tier_hits = {"device": 0, "host": 0, "file": 0}
        self.snapshots = snapshots if snapshots is not None else SwaSnapshotStore()
        self.hits = self.hit_tokens = self.queried_tokens = 0

    def digests(self, r: Request) -> list[bytes]:
        """The digests of ``r``'s full blocks of known tokens (extended incrementally)."""
        known = len(r.prompt_ids) + len(r.output_ids)
        full = known // self.block_size
        if len(r.digests) < full:
            parent = r.digests[-1] if r.digests else ROOT_DIGEST
            tokens = r.known_tokens(len(r.digests) * self.block_size, full * self.block_size)
            r.digests += block_digests(tokens, self.block_size, self.extra, parent)
        return r.digests

    def digest_at(self, r: Request, position: int) -> bytes | None:
        """The digest of the block ending at ``position`` (a block boundary > 0) if its tokens are known."""
        k = position // self.block_size
        d = self.digests(r)
        return d[k - 1] if 0 < k <= len(d) else None

    def lower_tier(self, digest: bytes):
        """A block's payload from host memory, else from the file store (then kept in host memory)."""
        if self.host is None:
            return None
        payload = self.host.get(digest)
        if payload is None and self.files is not None:
            payload = self.files.get(digest)
            if payload is not None:
                self.host.put(digest, payload)
        return payload

    def prefetch(self, digests: list[bytes]) -> None:
        """Bring a request's blocks from the file store into host memory (run in the background)."""
        for d in digests:
            if not self.pool.lookup([d]) and self.lower_tier(d) is None:
                break

    def match(self, r: Request) -> tuple[HitDecision, list[int], list[dict]]:
        """The hit for a request about to start from scratch: the cached device blocks it reuses and
        the payloads of the further blocks to upload from the lower tiers."""
        digests = self.digests(r)
        cached = self.pool.lookup(digests)
        payloads = []
        for d in digests[len(cached):]:
            payload = self.lower_tier(d)
            if payload is None:
                break
            payloads.append(payload)

        def has_swa(p: int) -> bool:
            return digests[p // self.block_size - 1] in self.snapshots

        decision = hit_length(r.num_tokens, self.block_size, self.ring_rows, len(cached) + len(payloads), has_swa,
                              encoder_replay=self.encoder_replay)
        self.queried_tokens += r.num_tokens
        n = decision.length // self.block_size
        return decision, cached[:n], payloads[: max(0, n - len(cached))]

    def snapshot_for(self, r: Request, position: int):
        return self.snapshots.get(self.digest_at(r, position))

    def register(self, r: Request) -> None:
        """Index ``r``'s blocks whose KV is written (or being written) and whose tokens are known."""
        if r.blocks is None or r.approximate:  # approximate states never enter the cache
            return
        known = len(r.prompt_ids) + len(r.output_ids)
        full = min(r.num_computed, known) // self.block_size
        if full <= r.registered:
            return
        digests = self.digests(r)
        blocks = r.blocks.block_ids
        for k in range(r.registered, full):
            if self.pool.register(blocks[k], digests[k]) and self.host is not None:
                self.new_blocks.append((blocks[k], digests[k]))
        r.registered = full

    def snapshot_positions(self, r: Request) -> list[int]:
        """Where prefill saves windows: ``P = floor((L - 1) / B) * B`` (engine.md §1.2: what a longer
        follow-up prompt hits), and, our addition, ``R = floor((L - ring) / B) * B``, the hit point of
        a repeat of the same prompt, which would otherwise never find an exact window."""
        n = r.num_tokens
        points = {prefill_snapshot_position(n, self.block_size), (n - self.ring_rows) // self.block_size * self.block_size}
        return sorted(p for p in points if p > 0)
