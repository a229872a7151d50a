"""The prefix cache as the scheduler sees it: digests, hits, registration, SWA snapshot keys.

Block KV of full blocks is indexed in the device pool by its chained digest (``cache.block_hash``)
as soon as the step writing it is launched and its tokens are known; SWA snapshots are taken at
the prefill position ``P`` and at every block boundary a decode crosses (the latest one is kept
and saved when the request ends), keyed by the digest of the block ending there. A new request
reuses the longest prefix the hit rule allows (``cache.swa_snapshots.hit_length``): its blocks
are shared (reference counted), the snapshot is restored into its slot, and only the rest runs.

Counters (``stats()``, in ``LLM.stats["prefix"]``), counted once per admitted request: ``hits`` /
``hit_tokens``; ``tier_hits``, the reused blocks by the tier they came from (``device``, ``host``,
``file``: a block the background prefetch brought from the file store into host memory counts as
``file``); ``miss_reasons``, why a request reused nothing: ``no_cached_blocks`` (no block of its
prefix in any tier), ``corrupt_block`` (the first missing block's file failed verification),
``prompt_too_short`` (blocks cached, but the window + slack before the end leaves no full block),
``no_swa_window`` (blocks cached but no SWA window at any usable boundary, e.g. after a restart:
windows live in memory only; ``encoder_replay=True`` turns this into an approximate hit).
"""

from __future__ import annotations

from deepinfer_jax.cache import BlockPool
from deepinfer_jax.cache.block_hash import ROOT_DIGEST, block_digests
from deepinfer_jax.cache.block_store import FileBlockStore, HostBlockStore
from deepinfer_jax.cache.swa_snapshots import HitDecision, SwaSnapshotStore, hit_length, prefill_snapshot_position
from deepinfer_jax.engine.request import Request

__all__ = ["MISS_REASONS", "PrefixCache"]

MISS_REASONS = ("no_cached_blocks", "corrupt_block", "prompt_too_short", "no_swa_window")


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
        self.tier_hits = {"device": 0, "host": 0, "file": 0}  # blocks reused, by the tier they came from
        self.miss_reasons = dict.fromkeys(MISS_REASONS, 0)
        self.snapshots = snapshots if snapshots is not None else SwaSnapshotStore()
        self.hits = self.hit_tokens = self.queried_tokens = 0
        self._from_files: set[bytes] = set()  # host entries loaded from the file store, not yet reused
        self._pending: tuple | None = None  # the last match's counts, recorded when its request is admitted

    def digests(self, r: Request) -> list[bytes]:
        """The digests of ``r``'s full blocks of known tokens (extended incrementally)."""
        known = len(r.prompt_ids) + len(r.output_ids)
        full = known // self.block_size
        if len(r.cache.digests) < full:
            parent = r.cache.digests[-1] if r.cache.digests else ROOT_DIGEST
            tokens = r.known_tokens(len(r.cache.digests) * self.block_size, full * self.block_size)
            r.cache.digests += block_digests(tokens, self.block_size, self.extra, parent)
        return r.cache.digests

    def digest_at(self, r: Request, position: int) -> bytes | None:
        """The digest of the block ending at ``position`` (a block boundary > 0) if its tokens are known."""
        k = position // self.block_size
        d = self.digests(r)
        return d[k - 1] if 0 < k <= len(d) else None

    def lower_tier(self, digest: bytes):
        """A block's payload from host memory, else from the file store (then kept in host memory)."""
        return self._lower(digest)[0]

    def _lower(self, digest: bytes) -> tuple[dict | None, str | None]:
        """(payload, the tier it came from: "host" / "file", or the miss: None / "corrupt")."""
        if self.host is None:
            return None, None
        payload = self.host.get(digest)
        if payload is not None:
            return payload, "file" if digest in self._from_files else "host"
        if self.files is None:
            return None, None
        payload = self.files.get(digest)
        if payload is None:  # the prefetch may have found (and quarantined) a damaged file first
            return None, "corrupt" if self.files.failed(digest) else None
        self.host.put(digest, payload)
        if len(self._from_files) > 1 << 16:  # prefetched and never reused: forget the oldest attributions
            self._from_files.clear()
        self._from_files.add(digest)
        return payload, "file"

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
        payloads, tiers, ended = [], [], None
        for d in digests[len(cached):]:
            payload, tier = self._lower(d)
            if payload is None:
                ended = tier
                break
            payloads.append(payload)
            tiers.append((d, tier))

        def has_swa(p: int) -> bool:
            return digests[p // self.block_size - 1] in self.snapshots

        decision = hit_length(r.num_tokens, self.block_size, self.ring_rows, len(cached) + len(payloads), has_swa,
                              encoder_replay=self.encoder_replay)
        n = decision.length // self.block_size
        if decision.length:
            reason = None
        elif decision.candidate:
            reason = "no_swa_window"
        elif cached or payloads:
            reason = "prompt_too_short"
        else:
            reason = "corrupt_block" if ended == "corrupt" else "no_cached_blocks"
        self._pending = (r.num_tokens, decision.length, min(n, len(cached)), tiers[: max(0, n - len(cached))], reason)
        return decision, cached[:n], payloads[: max(0, n - len(cached))]

    def record_admitted(self) -> None:
        """Count the last :meth:`match` (its request was admitted; a request that waits is matched again)."""
        if self._pending is None:
            return
        tokens, hit, device, lower, reason = self._pending
        self._pending = None
        self.queried_tokens += tokens
        if hit:
            self.hits += 1
            self.hit_tokens += hit
        self.tier_hits["device"] += device
        for d, tier in lower:
            self.tier_hits[tier] += 1
            self._from_files.discard(d)
        if reason is not None:
            self.miss_reasons[reason] += 1

    def stats(self) -> dict:
        """The counters of the module docstring (and the file store's verification failures)."""
        files = self.files
        return {"hits": self.hits, "hit_tokens": self.hit_tokens, "queried_tokens": self.queried_tokens,
                "tier_hits": dict(self.tier_hits), "miss_reasons": dict(self.miss_reasons),
                "corrupt_files": 0 if files is None else files.misses_corrupt,
                "quarantined_files": 0 if files is None else files.quarantined}

    def snapshot_for(self, r: Request, position: int):
        return self.snapshots.get(self.digest_at(r, position))

    def register(self, r: Request) -> None:
        """Index ``r``'s blocks whose KV is written (or being written) and whose tokens are known."""
        if r.blocks is None or r.replay.approximate:  # approximate states never enter the cache
            return
        known = len(r.prompt_ids) + len(r.output_ids)
        full = min(r.num_computed, known) // self.block_size
        if full <= r.cache.registered:
            return
        digests = self.digests(r)
        blocks = r.blocks.block_ids
        for k in range(r.cache.registered, full):
            if self.pool.register(blocks[k], digests[k]) and self.host is not None:
                self.new_blocks.append((blocks[k], digests[k]))
        r.cache.registered = full

    def snapshot_positions(self, r: Request) -> list[int]:
        """Where prefill saves windows: ``P = floor((L - 1) / B) * B`` (engine.md §1.2: what a longer
        follow-up prompt hits), and, our addition, ``R = floor((L - ring) / B) * B``, the hit point of
        a repeat of the same prompt, which would otherwise never find an exact window."""
        n = r.num_tokens
        points = {prefill_snapshot_position(n, self.block_size), (n - self.ring_rows) // self.block_size * self.block_size}
        return sorted(p for p in points if p > 0)
