"""Seeded synthetic traces for the simulator: long-tail chat, multi-turn agent, a diurnal day.

Every prompt is real token ids hashed into the engine's block chain (``cache.block_hash``), so
prefix hits come from the store index as the router would see them, not from a hit-rate knob:

* **chat**: single-turn requests, Poisson arrivals; a shared system prompt (one of a few) then a
  long-tail user part (lognormal, clipped to 256K: most prompts < 16K, a tail of documents);
  lognormal output lengths.
* **agent**: conversations that re-send their whole history at every tool call: a shared system
  prompt + task, then turns each adding the previous reply and a tool result; a conversation
  grows to a final context drawn log-uniformly in 16K-256K. Conversations are in progress at
  time 0 (steady state): the turns before the window are not simulated but their blocks are in
  ``warm_blocks`` (the store keeps agent traffic for days), so hits at the start are real too.
* **diurnal**: ``rate(t) = mean * (1 + amplitude * sin(2 pi (t - peak + 6h) / 24h))`` with a few
  bursts (rate times ``burst_factor`` for minutes) over 24 h; per-tick signals for the autoscaler
  replay (``autoscale_replay``), drawn from a per-request sample of the agent trace.

A trace depends only on its arguments and seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from deepinfer_jax.cache.block_hash import ROOT_DIGEST, block_digests, extra_keys
from deepinfer_jax.cluster.errors import check_int, check_number
from deepinfer_jax.cluster.prefix_index import BLOCK_SIZE

__all__ = ["SimRequest", "Trace", "agent_trace", "chat_trace", "diurnal_rate"]

EXTRA = extra_keys(b"cluster-sim-model".ljust(32, b"\0"))
VOCAB = 100_000


class _Chain:
    """A growing token sequence's block digests (the hash chain), extended incrementally."""

    __slots__ = ("digests", "length", "tail")

    def __init__(self) -> None:
        self.digests: list[bytes] = []
        self.tail = np.zeros(0, np.uint32)
        self.length = 0

    def copy(self) -> _Chain:
        c = _Chain()
        c.digests, c.tail, c.length = list(self.digests), self.tail, self.length
        return c

    def extend(self, tokens: np.ndarray) -> None:
        ids = np.concatenate([self.tail, tokens])
        full = len(ids) // BLOCK_SIZE * BLOCK_SIZE
        if full:
            parent = self.digests[-1] if self.digests else ROOT_DIGEST
            self.digests.extend(block_digests(ids[:full], BLOCK_SIZE, EXTRA, parent))
        self.tail = ids[full:]
        self.length += len(tokens)


@dataclass
class SimRequest:
    """One request: ``chain[:prompt_blocks]`` are its prompt's block digests; the decode side writes
    ``chain[prompt_blocks:done_blocks]`` (blocks completed by its output) when it finishes."""

    rid: int
    arrival: float
    num_tokens: int
    output_tokens: int
    chain: list
    prompt_blocks: int
    done_blocks: int
    kind: str


@dataclass
class Trace:
    name: str
    requests: list[SimRequest]
    duration_s: float
    warm_blocks: set = field(default_factory=set)


def _lognormal(rng, median, sigma, lo, hi, size=None):
    return np.clip(rng.lognormal(math.log(median), sigma, size), lo, hi).astype(np.int64)


def _system_prompts(rng, lengths) -> list[_Chain]:
    out = []
    for n in lengths:
        c = _Chain()
        c.extend(rng.integers(0, VOCAB, int(n), dtype=np.uint32))
        out.append(c)
    return out


def chat_trace(rate: float, duration_s: float, seed: int = 0, max_tokens: int = 262_144) -> Trace:
    """Long-tail chat: ``rate`` requests/s for ``duration_s`` s."""
    check_number("rate", rate, 0.0, strict=True)
    check_number("duration_s", duration_s, 0.0, strict=True)
    rng = np.random.default_rng([seed, 1])
    systems = _system_prompts(rng, [1024, 2048, 4096])
    t, reqs = 0.0, []
    while True:
        t += rng.exponential(1.0 / rate)
        if t >= duration_s:
            break
        c = systems[int(rng.integers(len(systems)))].copy()
        c.extend(rng.integers(0, VOCAB, int(_lognormal(rng, 3000, 1.4, 16, max_tokens - c.length)), dtype=np.uint32))
        out = int(_lognormal(rng, 400, 0.9, 8, 8192))
        n, pb = c.length, len(c.digests)
        c.extend(rng.integers(0, VOCAB, out, dtype=np.uint32))
        reqs.append(SimRequest(len(reqs), t, n, out, c.digests, pb, len(c.digests), "chat"))
    return Trace("chat", reqs, duration_s)


def agent_trace(conversations_per_s: float, duration_s: float, seed: int = 0, min_context: int = 16_384,
                max_context: int = 262_144, gap_s: float = 6.0) -> Trace:
    """Multi-turn agent traffic: conversations start at ``conversations_per_s`` (also before time 0,
    so the window is in steady state); a turn follows the previous one after its expected response
    time plus a tool call (exponential, mean ``gap_s``)."""
    check_number("conversations_per_s", conversations_per_s, 0.0, strict=True)
    check_number("duration_s", duration_s, 0.0, strict=True)
    check_int("min_context", min_context, 1)
    check_int("max_context", max_context, min_context)
    rng = np.random.default_rng([seed, 2])
    systems = _system_prompts(rng, [6144, 8192, 12288])
    reqs: list[SimRequest] = []
    warm: set = set()
    lookback = 200 * (gap_s + 4.0)  # longer than any conversation's span, so t=0 is steady state
    t, conv = -lookback, 0
    while True:
        t += rng.exponential(1.0 / conversations_per_s)
        if t >= duration_s:
            break
        conv += 1
        # the plan first (lengths and times), tokens only for conversations that reach the window
        final = int(math.exp(rng.uniform(math.log(min_context), math.log(max_context))))
        system = int(rng.integers(len(systems)))
        length = systems[system].length + int(_lognormal(rng, 2000, 0.8, 64, 16384))
        first = length - systems[system].length
        turns, at = [], t
        while length < final and at < duration_s:
            out, tool = int(_lognormal(rng, 250, 0.8, 16, 4096)), int(_lognormal(rng, 1500, 0.9, 32, 16384))
            turns.append((at, out, tool))
            length += out + tool
            at += 2.0 + out / 100.0 + rng.exponential(gap_s)
        if not turns or turns[-1][0] < 0:
            continue  # over before the window: its blocks would be in the store, but no turn asks for them
        trng = np.random.default_rng([seed, 3, conv])
        c = systems[system].copy()
        c.extend(trng.integers(0, VOCAB, first, dtype=np.uint32))
        done_before = 0
        for at, out, tool in turns:
            n, pb = c.length, len(c.digests)
            c.extend(trng.integers(0, VOCAB, out, dtype=np.uint32))
            if at < 0:
                done_before = len(c.digests)  # finished before the window: its blocks are in the store
            else:
                reqs.append(SimRequest(-1, at, n, out, c.digests, pb, len(c.digests), "agent"))
            c.extend(trng.integers(0, VOCAB, tool, dtype=np.uint32))
        warm.update(c.digests[:done_before])
        warm.update(systems[system].digests)
    reqs.sort(key=lambda r: r.arrival)
    for i, r in enumerate(reqs):
        r.rid = i
    return Trace("agent", reqs, duration_s, warm)


def diurnal_rate(t: float, mean: float, amplitude: float = 0.6, peak_hour: float = 14.0,
                 bursts: tuple[tuple[float, float, float], ...] = ()) -> float:
    """Requests/s at time ``t`` (s): a 24 h sine peaking at ``peak_hour``, times ``factor`` inside each
    burst ``(start_s, length_s, factor)``."""
    r = mean * (1.0 + amplitude * math.sin(2 * math.pi * (t / 3600.0 - peak_hour + 6.0) / 24.0))
    for start, length, factor in bursts:
        if start <= t < start + length:
            r *= factor
    return max(r, 0.0)
