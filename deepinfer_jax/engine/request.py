"""One request's host-side state: tokens, progress through the cache, lifetime, output."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from deepinfer_jax.cache import RequestBlocks
from deepinfer_jax.engine.detokenizer import IncrementalDetokenizer
from deepinfer_jax.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from deepinfer_jax.engine.sampling_params import SamplingParams

__all__ = ["AdmitState", "Request", "Status"]


@dataclass
class AdmitState:
    """A request's cache state computed elsewhere (engine roles, ``cluster.roles``): the KV of its
    first ``length`` tokens as block payloads (``ceil(length / block_size)`` of them, the last one
    possibly partial) and its slot's state there (``ModelRunner.snapshot_slot``). The scheduler
    admits it with these uploaded and restored, and computes nothing before ``length``."""

    length: int
    payloads: list
    slot_state: dict


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """A request as the scheduler sees it.

    ``num_computed`` counts tokens whose KV is in the cache *or being written by a launched step*;
    ``num_pending`` counts sampled tokens still on the device (asynchronous scheduling: the host
    learns them one step late), so the request's length is ``len(prompt) + len(output) + pending``.

    Speculative decoding: once ``decoding``, each step the request is in verifies drafts on the device
    and adds between 1 and ``1 + drafts`` tokens the host learns only when it reconciles the step;
    ``num_pending`` then counts one token per such step (a lower bound) and ``pending_max`` the most
    they may add, and ``num_computed`` is a lower bound (``len(prompt) + len(output) - 1`` once
    reconciled: everything before the newest token).
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
        # prefix cache
        self.digests: list[bytes] = []  # of full blocks of known tokens
        self.registered = 0  # blocks indexed in the pool
        self.snapshot_points: list[int] = []  # prefill positions whose windows are still to be saved
        self.swa_copy = None  # (position, device arrays): the latest decode boundary's window
        self.restore = None  # (position, snapshot) to put into the slot before the next step
        self.uploads = None  # [(device block, payload)] from the lower tiers, written before the next step
        self.admit_state: AdmitState | None = None  # computed elsewhere: admitted at its length, nothing recomputed
        self.slot_state = None  # an AdmitState's slot state, restored into the slot before the next step
        self.approximate = False  # hit through bounded replay: nothing it computes is cached
        self.window_floor = 0  # bounded replay: windows see no position below this
        self.write_from = 0  # bounded replay: block KV below this is reused, never rewritten
        self.matcher = None  # structured output: the grammar's state (``engine.structured.Matcher``)
        self.grammar_error: str | None = None  # set when a generated token broke the grammar
        self.decoder_from = 0  # decoder bounded replay: earlier positions run the encoder only
        # speculative decoding
        self.decoding = False  # its last prefill chunk sampled: later steps verify drafts on the device
        self.pending_max = 0  # most tokens the launched, unreconciled steps may still add
        self.ctx_from = 0  # first position computed since admission (the drafter's context starts there)
        self.next_conf = None  # confidences of the drafts its next verification will see (host copy, stale)
        self.has_drafts = False  # the step that produced its newest token also drafted the next block

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
        return len(self.prompt_ids) + len(self.output_ids) + self.pending_max

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
