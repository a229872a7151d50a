"""One request's host-side state: tokens, progress through the cache, lifetime, output, and one small
record per feature (prefix cache, bounded replay, structured output, speculative decoding)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from deepinfer_jax.cache import RequestBlocks
from deepinfer_jax.engine.detokenizer import IncrementalDetokenizer
from deepinfer_jax.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from deepinfer_jax.engine.sampling_params import SamplingParams

__all__ = ["AdmitState", "CacheState", "GrammarState", "ReplayState", "Request", "SpecState", "Status"]


@dataclass
class AdmitState:
    """A request's cache state computed elsewhere (engine roles, ``cluster.roles``): the KV of its
    first ``length`` tokens as block payloads (``ceil(length / block_size)`` of them, the last one
    possibly partial) and its slot's state there (``ModelRunner.snapshot_slot``). The scheduler
    admits it with these uploaded and restored, and computes nothing before ``length``."""

    length: int
    payloads: list
    slot_state: dict


@dataclass(slots=True)
class CacheState:
    """What the prefix cache knows of a request (the contents to load into its blocks and slot when it is
    admitted travel in the step's plan: ``SchedulerOutput.copies``)."""

    digests: list[bytes] = field(default_factory=list)
    """Chained hashes of the full blocks of its known tokens, extended lazily (``PrefixCache.digests``)."""
    registered: int = 0
    """How many of its leading blocks are indexed in the block pool (shareable by other requests)."""
    snapshot_points: list[int] = field(default_factory=list)
    """Prefill positions whose sliding-window state is still to be saved once a step reaches them."""
    swa_copy: tuple | None = None
    """``(position, device arrays)``: the window at its latest decode block boundary, saved when it ends."""
    admit_state: AdmitState | None = None
    """State computed elsewhere (engine roles): it is admitted at that length and nothing before is recomputed."""


@dataclass(slots=True)
class ReplayState:
    """Bounded replay: a cache hit whose window state is rebuilt by rerunning only the hit's last
    tokens (approximate), and the decoder replay that runs earlier positions through the encoder only."""

    approximate: bool = False
    """Its hit came through bounded replay: its state is approximate, so nothing it computes is cached."""
    window_floor: int = 0
    """Sliding windows see no position below this (the start of the replayed tokens)."""
    write_from: int = 0
    """Block KV below this position is reused from the cache and never rewritten."""
    decoder_from: int = 0
    """Decoder bounded replay: positions before this run the encoder only."""


@dataclass(slots=True)
class GrammarState:
    """Structured output: the grammar its sampled tokens must follow."""

    matcher: object | None = None
    """The grammar's state (an ``engine.structured.Matcher``), advanced by each reconciled token;
    ``None`` when the request has no constraint."""
    error: str | None = None
    """Why a generated token broke the grammar; set, the request finishes with reason ``"error"``."""


@dataclass(slots=True)
class SpecState:
    """Speculative decoding: its drafts on the device and how far its launched steps may reach."""

    decoding: bool = False
    """Its last prefill chunk sampled: each later step verifies drafts on the device."""
    pending_max: int = 0
    """The most tokens its launched, not yet reconciled steps may still add (``num_pending`` counts the fewest)."""
    ctx_from: int = 0
    """The first position computed since admission: the drafter's context starts there."""
    next_conf: object | None = None
    """The confidences of the drafts its next verification will see (a stale host copy)."""
    has_drafts: bool = False
    """The step that produced its newest token also drafted the block after it."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """A request as the scheduler sees it.

    ``num_computed`` counts tokens whose KV is in the cache *or being written by a launched step*;
    ``num_pending`` counts sampled tokens still on the device (asynchronous scheduling: the host
    learns them one step late), so the request's length is ``len(prompt) + len(output) + pending``.

    Speculative decoding: once ``spec.decoding``, each step the request is in verifies drafts on the
    device and adds between 1 and ``1 + drafts`` tokens the host learns only when it reconciles the
    step; ``num_pending`` then counts one token per such step (a lower bound) and ``spec.pending_max``
    the most they may add, and ``num_computed`` is a lower bound (``len(prompt) + len(output) - 1``
    once reconciled: everything before the newest token).

    The fields every part of the engine reads (identity, tokens, parameters, status, progress, slot,
    blocks, lifetime and output) are on the request itself; the state one feature keeps is in a
    record of its own: ``cache`` (:class:`CacheState`: prefix cache and state loaded from elsewhere),
    ``replay`` (:class:`ReplayState`: bounded replay), ``grammar`` (:class:`GrammarState`: structured
    output) and ``spec`` (:class:`SpecState`: speculative decoding).
    """

    def __init__(self, request_id: str, number: int, prompt: str | None, prompt_ids: list[int],
                 params: SamplingParams, detok: IncrementalDetokenizer, arrival: float | None = None) -> None:
        self.request_id, self.number = request_id, number
        self.prompt, self.prompt_ids, self.params = prompt, list(prompt_ids), params
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None  # SamplingParams.prompt_logprobs
        self.detok = detok
        self.status = Status.WAITING
        self.num_computed = 0
        self.num_pending = 0
        self.inflight = 0  # launched steps not yet reconciled that include this request
        self.slot: int | None = None
        self.blocks: RequestBlocks | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0
        self.cache = CacheState()
        self.replay = ReplayState()
        self.grammar = GrammarState()
        self.spec = SpecState()

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={len(self.prompt_ids)}, "
                f"out={len(self.output_ids)}+{self.num_pending}, computed={self.num_computed})")

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens, including those still on the device."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_generated(self) -> int:
        return len(self.output_ids) + self.num_pending

    @property
    def max_tokens_on_device(self) -> int:
        """The most tokens the device may hold for this request once its launched steps finish."""
        return len(self.prompt_ids) + len(self.output_ids) + self.spec.pending_max

    def known_tokens(self, start: int, stop: int) -> list[int]:
        """Token ids [start, stop) of prompt + reconciled output."""
        p = len(self.prompt_ids)
        return (self.prompt_ids[start:stop] if stop <= p
                else self.prompt_ids[start:p] + self.output_ids[max(0, start - p) : stop - p])

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(index=0, text=self.detok.text, token_ids=list(self.output_ids),
                                      finish_reason=self.finish_reason, stop_reason=self.stop_reason,
                                      logprobs=None if self.logprobs is None else list(self.logprobs),
                                      cumulative_logprob=None if self.logprobs is None else
                                      float(sum(lp.logprob for lp in self.logprobs)))
        metrics = RequestMetrics(self.arrival, self.first_token_time, self.finished_time, len(self.output_ids),
                                 self.num_preemptions)
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_ids), [completion], self.finished,
                             self.num_cached_tokens, metrics, self.prompt_logprobs)
