"""The engine core: the host loop that drives the scheduler and the model runner.

One ``step()``:

- synchronous: schedule(N) -> launch(N) -> wait -> reconcile(N);
- asynchronous (engine.md §2.2): schedule(N+1) -> launch(N+1) -> reconcile(N). Step N+1 is queued
  behind step N on the device before the host looks at N's tokens, so the device never waits for
  the host while host work fits under the device time. Sampled ids stay on the device and feed
  N+1 by slot; the host's view lags one step, and a request that finished in N (EOS, a stop string)
  simply has its extra token from N+1 dropped. Outputs are identical either way.

Each step is dispatched as two device programs, the model step and then its sampling
(``ModelRunner.forward`` / ``sample``). Structured-output requests (``engine.structured``) need a
token mask per step that depends on every token before it; the host computes those masks on a
worker thread while the device already runs the model step (in asynchronous mode right after it
has read step N's tokens), and only the small sampling program waits for them. With
``overlap=False`` the masks are computed before the model step is dispatched (the baseline the
structured-output benchmark compares against). A request whose grammar allows no next token ends
with finish reason ``"error"`` and the backend's message as ``stop_reason``.

Speculative decoding (engine.md §2.3, ``spec=SpecDecoding``, the runner holding the speculative step
``runner.spec_step``): a decoding request's row verifies drafts on the device; the verification
policy sets each row's cap and the step's budget (``engine.spec_decode``), and a row may add several
tokens, which the host takes in order, stopping at the first that ends the request. Structured-output requests verify no drafts
(their mask covers one position).

Requests are validated when added (``RequestError`` naming the field, including grammars that do
not compile); nothing invalid reaches the scheduler, so a bad request never disturbs the running ones.

Attention data parallelism (engine.md §3-4): one device is one rank; over a mesh every DP rank is its own
scheduling domain (its own ``Scheduler``: waiting queue, running list, block pool, slots over its shard of the
cache), and the same loop schedules every rank, hands the runner one chunk list per rank (all ranks step
together in one program; an idle rank runs padding) and reconciles as on one device. A new request joins the
rank ``dp_router.pick_rank`` chooses (request count and KV length) and stays there until it ends; its cache
copies (prefix-cache uploads and windows, engine roles' slot state) go to its rank's slice. Prefix caching runs
per rank over shared lower tiers (``engine.ranks.check_schedulers``); speculation plans every rank's verify rows
on their own (``SpecDecoding.plan_ranks``); structured-output masks cover every rank's rows (``Forward.chunk_rows``);
with ``chunking="cost"`` the slowest rank sets the step (``engine.ranks.merge_plans``), and with
``dp_match_floor_ns`` the ranks' chunks are matched to the smallest rank's prompt work
(``engine.ranks.matched_budget_ns``). When the runner runs the expert-parallel MoE, each reconciled step's slot
counts feed the EPLB loop, and a due rebalance moves the expert weights before the next step is dispatched (steps
in flight finish on the old placement; nothing is dropped).
"""

from __future__ import annotations


import dataclasses
import itertools
import operator
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from deepinfer_jax.engine.cost_model import CostModel
from deepinfer_jax.engine.detokenizer import IncrementalDetokenizer
from deepinfer_jax.engine.dp_router import RankLoad, pick_rank
from deepinfer_jax.engine.outputs import RequestOutput, TokenLogprobs
from deepinfer_jax.engine.ranks import check_schedulers, eplb_stats, make_rebalancer, matched_budget_ns, merge_plans
from deepinfer_jax.engine.request import AdmitState, Request
from deepinfer_jax.engine.sampling_params import RequestError, SamplingParams
from deepinfer_jax.engine.scheduler import BlockUpload, Scheduler, SchedulerOutput, SlotRestore, update_from_output
from deepinfer_jax.engine.spec_decode import SpecDecoding
from deepinfer_jax.engine.structured import StructuredOutputs
from deepinfer_jax.runner import Buckets, ChunkSpec, ModelRunner, PendingStep, SampleSpec, StepOutput

__all__ = ["EngineCore", "EngineStats"]


@dataclass
class EngineStats:
    """Counters of the host loop (seconds are host wall-clock)."""

    steps: int = 0
    scheduled_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    matched_steps: int = 0  # steps whose DP ranks chunked to a matched budget (``dp_match_floor_ns``)
    schedule_s: float = 0.0  # scheduling + building inputs + dispatching
    reconcile_s: float = 0.0  # reading results, detokenizing, stop checks
    wait_s: float = 0.0  # blocked on the device
    device_s: float = 0.0  # estimated device time of the steps
    predicted_ns: list = field(default_factory=list, repr=False)
    measured_ns: list = field(default_factory=list, repr=False)

    @property
    def host_s(self) -> float:
        return self.schedule_s + self.reconcile_s


@dataclass
class _InFlight:
    plan: SchedulerOutput
    pending: PendingStep | None  # set once the sampling is dispatched
    launched: float
    snapshots: list = field(default_factory=list)  # (request, position, device arrays) to save
    writebacks: list = field(default_factory=list)  # (digests, device rows) of newly cached blocks for the lower tiers
    spec: object = None  # speculative decoding: what the step's plan assumed
    crossings: dict = field(default_factory=dict)  # verify chunk index -> window copy if it crossed a block
    started: float = 0.0  # when the step() that scheduled it began
    compiled: bool = False  # a compilation ran while it was in flight: its time says nothing of the step
    forward: object = None  # the runner's Forward, when the EPLB loop reads its slot counts
    ranks: list = field(default_factory=list)  # each chunk's DP rank


class EngineCore:
    """Owns the schedulers (one per DP rank), the runner and the requests of one engine instance.

    ``scheduler``: one ``Scheduler`` (one device), or one per DP rank of the runner's mesh (``runner.dp_size``),
    all with the same settings. ``schedulers[d]`` schedules rank d; ``scheduler`` is rank 0's, read for what every
    rank shares (``max_model_len``, ``block_size``). Per rank: ``rank_requests[d]`` requests routed to it,
    ``rank_tokens[d]`` tokens it computed, ``rank_idle_steps[d]`` steps it ran only padding, and with ``spec``
    ``rank_spec_verified[d]`` / ``rank_spec_accepted[d]`` the drafts its verify rows verified and accepted.
    ``eplb``: the EPLB loop (None without the EP MoE); its ``placement`` is the one the next step runs with.
    """

    def __init__(self, runner: ModelRunner, scheduler: Scheduler | Sequence[Scheduler], *,
                 tokenizer: Tokenizer | None, eos_token_id: int, seed: int = 0, async_scheduling: bool = True,
                 max_logprobs: int = 5, structured: StructuredOutputs | None = None,
                 spec: SpecDecoding | None = None, dp_match_floor_ns: float | None = None) -> None:
        dp = getattr(runner, "dp_size", 1)
        self.schedulers = check_schedulers([scheduler] if isinstance(scheduler, Scheduler) else scheduler, dp)
        scheduler = self.schedulers[0]
        if dp_match_floor_ns is not None:
            if isinstance(dp_match_floor_ns, bool) or not isinstance(dp_match_floor_ns, (int, float)) \
                    or not 0 <= dp_match_floor_ns < float("inf"):
                raise ValueError(f"dp_match_floor_ns must be None or a number of ns >= 0, got {dp_match_floor_ns!r}")
            if any(s.chunking != "cost" for s in self.schedulers):
                raise ValueError("dp_match_floor_ns: matching the DP ranks' chunks needs chunking='cost'")
        #: layer 4 of the prefill balancer over the DP ranks (``engine.ranks.matched_budget_ns``); None = off
        self.dp_match_floor_ns = dp_match_floor_ns
        # over a mesh (even of one DP rank) the runner takes one chunk list per rank; one device: the list itself
        self._per_rank = getattr(runner, "mesh", None) is not None or dp > 1
        self._rank: dict[str, int] = {}  # unfinished request id -> its DP rank
        self.rank_requests, self.rank_tokens, self.rank_idle_steps = [0] * dp, [0] * dp, [0] * dp
        self.rank_spec_verified, self.rank_spec_accepted = [0] * dp, [0] * dp
        self.eplb = make_rebalancer(runner)
        self.runner, self.scheduler, self.tokenizer = runner, scheduler, tokenizer
        self.structured = structured
        self.spec = spec
        self.eos_token_id, self.seed, self.async_scheduling = eos_token_id, seed, async_scheduling
        self.max_logprobs = max_logprobs
        self._scorer = None  # runner.prompt_scores.PromptScorer, made when a request first asks
        self.vocab_size = runner.cfg.vocab_size
        self.stats = EngineStats()
        self.requests: dict[str, Request] = {}
        self._numbers = itertools.count()
        self._inflight: _InFlight | None = None
        self._last_ready = 0.0
        prefix = scheduler.prefix
        # file-store writes and prefetches run on one background thread, overlapped with the steps
        self._io = ThreadPoolExecutor(1, "block-store") if prefix is not None and prefix.files else None
        self._io_futures: list[Future] = []
        self._late_writeback: list = []  # (digests, device rows) read when a request ended, written back later
        #: called with each launched step right behind its model step (``cluster.roles``: a prefill
        #: instance dispatches copies of the state a finished prompt leaves); None = nothing
        self.on_launch = None

    @property
    def cost_model(self) -> CostModel | None:
        return self.scheduler.cost_model

    # ---- requests ----
    def validate(self, prompt_ids, params: SamplingParams, request_id: str | None = None) -> list[int]:
        """Raise ``RequestError`` unless the request can run; returns the prompt ids as ints."""
        if not isinstance(params, SamplingParams):
            raise RequestError("sampling_params", f"must be a SamplingParams, got {type(params).__name__}")
        if request_id is not None and request_id in self.requests and not self.requests[request_id].finished:
            raise RequestError("request_id", f"{request_id!r} is already running")
        try:
            ids = [operator.index(i) for i in prompt_ids]  # ints (numpy's too), never a float truncated
        except TypeError:
            bad = next((i for i in prompt_ids if isinstance(i, bool) or not hasattr(i, "__index__")), None)
            raise RequestError("prompt_token_ids", f"must be a sequence of integers, got {bad!r}") from None
        if any(isinstance(i, bool) for i in prompt_ids):
            raise RequestError("prompt_token_ids", "must be a sequence of integers, got a bool")
        if not ids:
            raise RequestError("prompt", "the prompt is empty")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise RequestError("prompt_token_ids", f"ids must lie in [0, {self.vocab_size}), got {bad[:5]}")
        limit = self.scheduler.max_model_len
        if len(ids) >= limit:
            raise RequestError("prompt", f"{len(ids)} prompt tokens leave no room to generate within "
                                         f"max_model_len={limit}")
        if params.logprobs is not None and params.logprobs > self.max_logprobs:
            raise RequestError("logprobs", f"at most {self.max_logprobs} (the engine's max_logprobs), "
                                           f"got {params.logprobs}")
        if params.prompt_logprobs is not None:
            if params.prompt_logprobs > self.max_logprobs:
                raise RequestError("prompt_logprobs", f"at most {self.max_logprobs} (the engine's max_logprobs), "
                                                      f"got {params.prompt_logprobs}")
            if getattr(self.runner, "params", None) is None:
                raise RequestError("prompt_logprobs", "this engine's runner cannot score prompts")
        if params.top_k > self.vocab_size:
            raise RequestError("top_k", f"at most the vocabulary size {self.vocab_size}, got {params.top_k}")
        if params.stop_token_ids and any(i >= self.vocab_size for i in params.stop_token_ids):
            raise RequestError("stop_token_ids", f"ids must lie in [0, {self.vocab_size})")
        if params.constraint is not None:
            if self.structured is None:
                raise RequestError("structured_output", "this engine has no structured-output backend")
            self.structured.matcher(params.constraint)  # compiled (and cached) now: errors before anything runs
        return ids

    def add_request(self, prompt_ids, params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None, arrival: float | None = None) -> str:
        req = self._new_request(self.validate(prompt_ids, params, request_id), params, prompt, request_id, arrival)
        self._enqueue(req, None)
        self._prefetch(req, self._scheduler_of(req))
        return req.request_id

    def loads(self) -> list[RankLoad]:
        """Every rank's unfinished requests and their total tokens (the DP router's view)."""
        return [RankLoad(len(s.waiting) + len(s.running), sum(r.num_tokens for r in (*s.waiting, *s.running)))
                for s in self.schedulers]

    def rank_of(self, request_id: str) -> int | None:
        """The DP rank of an unfinished request (one device: 0; None once it ended)."""
        return self._rank.get(request_id)

    def eplb_stats(self) -> dict:
        """EPLB counters (``engine.ranks.eplb_stats``; empty without the EP MoE)."""
        return eplb_stats(self.eplb)

    def _prefetch(self, req: Request, scheduler: Scheduler) -> None:
        """Start reading a new request's blocks from the file store while earlier work runs."""
        prefix = scheduler.prefix
        if self._io is not None and prefix is not None and prefix.files is not None:
            self._io_futures.append(self._io.submit(prefix.prefetch, list(prefix.digests(req))))

    def _scheduler_of(self, r: Request) -> Scheduler:
        """The scheduler an unfinished request runs under: its DP rank's."""
        return self.schedulers[self._rank.get(r.request_id, 0)]

    def rank_args(self, r: Request) -> dict:
        """The runner's cache-copy arguments naming an unfinished request's DP rank (one device: none)."""
        return {"rank": self._rank.get(r.request_id, 0)} if self._per_rank else {}

    def _ranks(self) -> list[tuple[Scheduler, dict]]:
        """(scheduler, the runner's cache-copy arguments) of every rank."""
        return [(s, {"rank": d} if self._per_rank else {}) for d, s in enumerate(self.schedulers)]

    def add_continuation(self, prompt_ids, output_ids, params: SamplingParams, *, prompt: str | None = None,
                         request_id: str | None = None, admit: AdmitState | None = None,
                         logprobs: list[TokenLogprobs] | None = None, prompt_logprobs=None,
                         num_cached_tokens: int = 0, arrival: float | None = None, rank: int | None = None) -> str:
        """A request that already has ``output_ids`` (engine roles, ``cluster.roles``): the first token a
        prefill instance sampled, or the tokens a draining decode instance forwarded. With ``admit``
        (its KV and slot state up to ``admit.length = len(prompt) + len(output) - 1``) it is admitted
        there and computes nothing before; without, it recomputes its tokens (the prefix cache may
        hit). ``logprobs`` / ``prompt_logprobs``: what the earlier engine reported for them. ``rank``: the DP
        rank to run it on (None: the DP router picks; one device: None or 0)."""
        self.check_rank(rank)
        if not output_ids:
            raise RequestError("output_ids", "a continuation needs at least one generated token")
        if admit is not None and admit.length != len(prompt_ids) + len(output_ids) - 1:
            raise RequestError("admit", f"state of {admit.length} tokens for {len(prompt_ids)} prompt + "
                                        f"{len(output_ids)} generated")
        base = dataclasses.replace(params, prompt_logprobs=None)  # scored where the prompt ran
        ids = self.validate(prompt_ids, base, request_id)
        req = self._new_request(ids, base, prompt, request_id, arrival)
        req.params = params
        for t in output_ids:
            t = operator.index(t)
            if not 0 <= t < self.vocab_size:
                raise RequestError("output_ids", f"ids must lie in [0, {self.vocab_size}), got {t}")
            req.output_ids.append(t)
            req.detok.push(t)
            if req.grammar.matcher is not None:
                req.grammar.matcher.consume(t)
        if req.logprobs is not None and logprobs is not None:
            req.logprobs = list(logprobs)
        req.prompt_logprobs, req.num_cached_tokens, req.cache.admit_state = prompt_logprobs, num_cached_tokens, admit
        self._enqueue(req, rank)
        return req.request_id

    def check_rank(self, rank: int | None) -> None:
        """``RequestError("rank")`` unless ``rank`` is None or one of this engine's DP ranks (one device: 0)."""
        ranks = getattr(self.runner, "dp_size", 1)
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ranks):
            raise RequestError("rank", f"a DP rank in [0, {ranks}) or None, got {rank!r}")

    def _enqueue(self, req: Request, rank: int | None) -> None:
        """Schedule a new request on ``rank``, or on the rank the DP router picks (one device: rank 0)."""
        if rank is None:
            rank = pick_rank(self.loads(), req.num_tokens) if len(self.schedulers) > 1 else 0
        self._rank[req.request_id] = rank
        self.rank_requests[rank] += 1
        self.schedulers[rank].add(req)

    def _new_request(self, ids: list[int], params: SamplingParams, prompt: str | None, request_id: str | None,
                     arrival: float | None) -> Request:
        """A validated request, numbered and registered (not yet scheduled)."""
        number = next(self._numbers)
        rid = str(number) if request_id is None else request_id
        req = Request(rid, number, prompt, ids, params, IncrementalDetokenizer(self.tokenizer, params.stop_strings),
                      arrival)
        if params.constraint is not None:
            req.grammar.matcher = self.structured.matcher(params.constraint)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = self._prompt_scorer()(ids, params.prompt_logprobs)
        self.requests[rid] = req
        return req

    def _prompt_scorer(self):
        """The full-sequence scorer over the runner's parameters in the model's layout (remade when an EPLB rebalance
        has moved the experts since)."""
        params = self.runner.logical_params()
        if self._scorer is None or self._scorer.params is not params:
            from deepinfer_jax.runner.prompt_scores import PromptScorer

            self._scorer = PromptScorer(self.runner.cfg, params, self.max_logprobs)
        return self._scorer

    def _write_back(self, reads: list) -> None:
        """Newly cached blocks read off the device (and those read when requests ended) -> the lower tiers."""
        prefix = self.scheduler.prefix
        reads = reads + self._late_writeback
        self._late_writeback = []
        if reads and prefix is not None:
            for digests, read in reads:
                for d, payload in zip(digests, self.runner.block_payloads(read)):
                    prefix.host.put(d, payload)
                    if self._io is not None:
                        self._io_futures.append(self._io.submit(prefix.files.put, d, payload))
            self._io_futures = [f for f in self._io_futures if not f.done() or f.exception()]

    def flush(self) -> None:
        """Wait for the background block-store writes and prefetches (errors re-raised)."""
        self._write_back([])
        futures, self._io_futures = self._io_futures, []
        for f in futures:
            f.result()

    def abort(self, request_id: str) -> None:
        """End a request now (finish reason "abort"); a token still on the device is dropped."""
        r = self.requests.get(request_id)
        if r is not None and not r.finished:
            r.finished_time = time.perf_counter()
            self._finish(r, "abort")

    @property
    def has_unfinished(self) -> bool:
        return any(s.has_unfinished for s in self.schedulers) or self._inflight is not None

    # ---- the loop ----
    def step(self) -> list[RequestOutput]:
        """One iteration over every rank; returns the requests that finished in it."""
        t0 = time.perf_counter()
        host0 = self.stats.reconcile_s + self.stats.wait_s
        traces0 = getattr(self.runner, "traces", 0)
        budget = matched_budget_ns(self.schedulers, self.dp_match_floor_ns)
        if budget is not None:
            self.stats.matched_steps += 1
        plans = [s.schedule(budget) for s in self.schedulers]
        plan = merge_plans(plans)
        prev = self._inflight if self.async_scheduling else None
        self._inflight = None
        finished: list[RequestOutput] = []
        launched = None
        if plan.chunks:
            self._restore_states(plan.copies)  # prefix-cache hits: uploads and windows into their rank's slots
            budgets = drafts = planned = None
            caps = [{} for _ in plans]
            if self.spec is not None:  # every rank's verification planned on its own
                budgets, caps, planned, drafts = self.spec.plan_ranks([p.chunks for p in plans], fresh=prev is None)
            specs = [[self._spec(c, caps[d].get(i)) for i, c in enumerate(p.chunks)] for d, p in enumerate(plans)]
            rows = [(c.request.grammar.matcher, i) for i, c in enumerate(plan.chunks)
                    if c.sample and c.request.grammar.matcher is not None]  # (matcher, chunk index)
            masks = None
            if rows and not self.structured.overlap:  # the baseline: masks first, the device waits
                if prev is not None:  # the masks need the previous step's tokens
                    finished += self._reconcile(prev)
                    prev = None
                height, at = self._mask_rows(specs)
                masks = self.structured.masks(height, [(m, at[i]) for m, i in rows])
            fwd = self._dispatch(specs, budgets, drafts, plan)
            if planned is not None:  # ran padded in a larger (compiled) bucket: its time is that bucket's
                planned.tokens = max(planned.tokens, getattr(fwd, "tokens", 0))
            launched = _InFlight(plan, None, time.perf_counter(), spec=planned, started=t0,
                                 forward=fwd if self.eplb is not None else None,
                                 ranks=[d for d, p in enumerate(plans) for _ in p.chunks])
            if getattr(self.runner, "traces", 0) != traces0 and prev is not None:  # a lazy bucket compiled beside it
                prev.compiled = True
            if self.on_launch is not None:  # engine roles: the prefill instance copies final states here
                self.on_launch(launched)
            self._copies_behind(launched)  # window copies and block reads right behind the model step
            row_of = (fwd.chunk_rows if self._per_rank else range(len(plan.chunks))) if rows else ()  # chunk -> row
            if rows and masks is None:
                masks, done = self._masks_beside_reconcile(
                    prev, lambda: self.structured.submit(fwd.rows, [(m, row_of[i]) for m, i in rows]))
                finished += done
                prev = None
            mask = None
            if rows:
                mask, dead = masks
                chunk_of_row = {row_of[i]: i for _, i in rows}
                for row, reason in dead.items():
                    r = plan.chunks[chunk_of_row[row]].request
                    if not r.finished:
                        r.finished_time = time.perf_counter()
                        self._finish(r, "error", reason)
                        finished.append(r.to_output())
            launched.pending = self.runner.sample(fwd, mask)
            if getattr(self.runner, "traces", 0) != traces0:
                launched.compiled = True
                if prev is not None:
                    prev.compiled = True
            self.stats.steps += 1
            self.stats.scheduled_tokens += plan.num_tokens
            for d, p in enumerate(plans):
                self.rank_tokens[d] += p.num_tokens
                self.rank_idle_steps[d] += not p.chunks
        return self._close_step(plan, t0, host0, prev, launched, finished)

    def _mask_rows(self, specs: list[list[ChunkSpec]]) -> tuple[int, list[int]]:
        """(rows of the step's sampling program, each chunk's row in it) before the model step is dispatched."""
        if self._per_rank:
            return self.runner.sample_rows(specs)
        return Buckets.pick(self.runner.buckets.requests, len(specs[0]), "requests"), list(range(len(specs[0])))

    def _dispatch(self, specs: list[list[ChunkSpec]], budgets, drafts, plan: SchedulerOutput):
        """The model step of every rank's chunks (one device: rank 0's list); with speculation each rank's budget
        and drafting switch."""
        chunks = specs if self._per_rank else specs[0]
        if budgets is None:
            return self.runner.forward(chunks)
        logprobs = any(c.request.logprobs is not None for c in plan.chunks)
        if self._per_rank:
            return self.runner.forward(chunks, budgets, drafts, logprobs)
        return self.runner.forward(chunks, budgets[0], drafts[0], logprobs)

    def _close_step(self, plan: SchedulerOutput, t0: float, host0: float, prev: _InFlight | None,
                    launched: _InFlight | None, finished: list[RequestOutput]) -> list[RequestOutput]:
        """The end of ``step``: counters, then the tokens of the previous step (asynchronous) or of
        this one (synchronous); the step just launched stays in flight in asynchronous mode."""
        self.stats.preemptions += len(plan.preempted)
        self.stats.schedule_s += time.perf_counter() - t0 - (self.stats.reconcile_s + self.stats.wait_s - host0)
        if prev is not None:
            finished += self._reconcile(prev)
        if self.async_scheduling:
            self._inflight = launched
        elif launched is not None:
            finished += self._reconcile(launched)
        return finished

    def drain(self) -> list[RequestOutput]:
        """Finish the step still in flight (asynchronous mode) without scheduling a new one."""
        step, self._inflight = self._inflight, None
        return self._reconcile(step) if step is not None else []

    def _restore_states(self, copies) -> None:
        """The plan's cache copies, in order, into the admitted requests' blocks and slots (on their DP rank):
        prefix-cache hits' uploaded blocks and saved windows; engine roles' whole slots from another engine."""
        for copy in copies:
            r = copy.request
            at = self.rank_args(r)
            if isinstance(copy, BlockUpload):
                self.runner.write_blocks(copy.block_ids, copy.payloads, **at)
            elif isinstance(copy, SlotRestore):
                self.runner.restore_slot(r.slot, copy.state, **at)
            else:
                pos = copy.position
                self.runner.restore_swa(r.slot, copy.snapshot, r.known_tokens(max(0, pos - 8), pos), pos, **at)

    def _copies_behind(self, step: _InFlight) -> None:
        """Prefix caching: window copies and every rank's newly cached block reads right behind the model step."""
        if self.scheduler.prefix is None:
            return
        self._take_snapshots(step)
        for scheduler, at in self._ranks():
            prefix = scheduler.prefix
            if prefix.new_blocks:
                new, prefix.new_blocks = prefix.new_blocks, []
                step.writebacks.append(([d for _, d in new], self.runner.read_blocks([b for b, _ in new], **at)))

    def _take_snapshots(self, step: _InFlight) -> None:
        """Copy windows on the device right behind the step: at the prefill point P (saved when the
        step is reconciled) and at each block boundary a request reaches (the latest kept per
        request, saved when it ends)."""
        bs = self.scheduler.block_size
        for i, c in enumerate(step.plan.chunks):
            r, end = c.request, c.start + c.num_tokens
            if r.finished:  # ended by the previous step's tokens (asynchronous mode): nothing to keep
                continue
            if c.verify:  # it may cross a block boundary: copy now, keep it if it did (``_crossed``)
                hi = r.max_tokens_on_device - 1  # the latest boundary this step can reach
                if hi // bs * bs > c.start and not r.replay.approximate and not r.replay.decoder_from:
                    step.crossings[i] = self.runner.snapshot_swa(r.slot, **self.rank_args(r))
            elif end in r.cache.snapshot_points:
                step.snapshots.append((r, end, self.runner.snapshot_swa(r.slot, **self.rank_args(r))))
                r.cache.snapshot_points.remove(end)
            elif (end % bs == 0 and c.start >= len(r.prompt_ids) and not r.replay.approximate
                  and not r.replay.decoder_from):
                r.cache.swa_copy = (end, self.runner.snapshot_swa(r.slot, **self.rank_args(r)))

    def _save_snapshot(self, r: Request, position: int, arrays) -> None:
        # digests and the window store are every rank's (``engine.ranks.check_schedulers`` shares rank 0's)
        prefix = self.scheduler.prefix
        digest = prefix.digest_at(r, position)
        if digest is not None and digest not in prefix.snapshots:
            prefix.snapshots.put(digest, self.runner.to_host(arrays))

    def _spec(self, c, verify: tuple[int, bool] | None = None) -> ChunkSpec:
        """The runner's view of a scheduled chunk; ``verify`` = (cap, forced) of a verify row."""
        r, p = c.request, c.request.params
        sample = None
        if c.sample:
            seeded = p.seed is not None
            sample = SampleSpec(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                                seed=p.seed if seeded else self.seed, stream=0 if seeded else r.number,
                                position=c.start + c.num_tokens - len(r.prompt_ids))
        common = dict(slot=r.slot, block_table=r.blocks.block_ids, sample=sample, window_floor=r.replay.window_floor,
                      global_write_from=r.replay.write_from, decoder_from=r.replay.decoder_from,
                      decoder_floor=r.replay.decoder_from)
        if c.verify:  # the anchor's position is known only on the device: pass its upper bound
            cap, forced = verify
            return ChunkSpec(ctx_len=r.max_tokens_on_device - c.num_tokens - 1, token_ids=[0], verify=True,
                             max_drafts=cap, forced=forced, limit=self.scheduler.max_model_len,
                             prompt_len=len(r.prompt_ids), **common)
        ids = [0] if c.feed_last else r.known_tokens(c.start, c.start + c.num_tokens)
        extra = {} if self.spec is None else dict(prompt_len=len(r.prompt_ids), ctx_from=r.spec.ctx_from)
        return ChunkSpec(ctx_len=c.start, token_ids=ids, feed_last=c.feed_last, context_parallel=c.context_parallel,
                         **common, **extra)

    def _masks_beside_reconcile(self, prev: _InFlight | None, submit) -> tuple[object, list[RequestOutput]]:
        """Token masks computed on the worker while the device runs the model step.

        ``submit()`` queues the mask job; with a previous step still in flight it is queued as soon as
        that step's tokens reached the matchers (the rest of its reconcile runs beside the job).
        Returns ``(masks, requests finished by reconciling prev)``.
        """
        job = []
        finished = []
        if prev is not None:
            finished = self._reconcile(prev, on_tokens=lambda: job.append(submit()))
        else:
            job.append(submit())
        return job[0].result(), finished

    def _reconcile(self, step: _InFlight, on_tokens=None) -> list[RequestOutput]:
        """Take a step's tokens into its requests. ``on_tokens`` is called once the grammar matchers
        have taken the new tokens, before the rest of the host work (it starts the next masks)."""
        t0 = time.perf_counter()
        out = step.pending.output()
        ready = time.perf_counter()
        results = out.tokens  # per chunk: its tokens, or None
        for chunk, res in zip(step.plan.chunks, results):
            r = chunk.request
            if res and not r.finished and r.grammar.matcher is not None and not r.grammar.matcher.consume(res[0][0]):
                r.grammar.error = r.grammar.matcher.error() or f"token {res[0][0]} is not allowed by the grammar"
        if on_tokens is not None:
            on_tokens()
        self.stats.wait_s += ready - t0
        device_ns = (ready - max(step.launched, self._last_ready)) * 1e9
        # the step's share of wall time: since the previous result (or since it was scheduled, after a pause),
        # host work that did not overlap the device included
        period_ns = (ready - max(step.started, self._last_ready)) * 1e9
        self._last_ready = ready
        self.stats.device_s += device_ns / 1e9
        if step.plan.predicted_ns is not None:
            self.stats.predicted_ns.append(step.plan.predicted_ns)
            self.stats.measured_ns.append(device_ns)
        if self.cost_model is not None and not step.compiled:
            self.cost_model.observe(self._observed_shape(step, out), device_ns)
        if step.spec is not None:
            self.spec.observe(step.plan.chunks, out, step.spec, None if step.compiled else period_ns)
        for r, pos, arrays in step.snapshots:
            self._save_snapshot(r, pos, arrays)
        self._write_back(step.writebacks)
        finished = []
        update_from_output(step.plan, out)  # the requests' progress through the cache
        for i, (chunk, res) in enumerate(zip(step.plan.chunks, results)):
            r = chunk.request
            if res is None or r.finished:
                continue
            if chunk.verify and r.spec.decoding and i in step.crossings:
                self._crossed(r, out.anchors[i], len(res), step.crossings[i])
            for token in res:
                if self._accept(r, *token, ready):
                    finished.append(r.to_output())
                    break
        self.stats.reconcile_s += time.perf_counter() - ready
        if step.spec is not None:  # per rank, the drafts its verify rows verified and accepted (as ``observe``)
            for i, (c, res) in enumerate(zip(step.plan.chunks, results)):
                if c.verify and res:
                    self.rank_spec_verified[step.ranks[i]] += out.verified[i]
                    self.rank_spec_accepted[step.ranks[i]] += len(res) - 1
        if self.eplb is not None and step.forward is not None:  # the step's expert load; maybe a rebalance
            new = self.eplb.record_slots(self.runner.slot_counts(step.forward), step.forward.placement)
            if new is not None:
                self.runner.set_placement(new)
        return finished

    def _crossed(self, r: Request, anchor: int, produced: int, arrays) -> None:
        """A verify row ran at ``anchor`` and produced ``produced`` tokens: the positions ``anchor ..
        anchor + produced - 1`` are now in the cache; if a block boundary lies in ``(anchor, anchor +
        produced]``, the window copied behind the step is the window at that boundary."""
        bs = self.scheduler.block_size
        b = (anchor + produced) // bs * bs
        if produced and b > anchor:
            r.cache.swa_copy = (b, arrays)

    @staticmethod
    def _observed_shape(step: _InFlight, out: StepOutput) -> list[tuple[int, int]]:
        """[(q, c)] per chunk as the step really ran (verify rows: 1 + the drafts they verified)."""
        if step.spec is None:
            return step.plan.shape()
        return [(1 + out.verified[i], out.anchors[i]) if c.verify else (c.num_tokens, c.start)
                for i, c in enumerate(step.plan.chunks)]

    def _accept(self, r: Request, token: int, logprob: float, top_ids, top_lps, now: float) -> bool:
        """Append one sampled token; True when it finished the request."""
        p = r.params
        r.output_ids.append(token)
        self.stats.generated_tokens += 1
        if r.first_token_time is None:
            r.first_token_time = now
        if r.logprobs is not None:
            k = p.logprobs
            r.logprobs.append(TokenLogprobs(token, logprob, {int(i): float(v) for i, v in zip(top_ids[:k], top_lps[:k])}))
        stop_str = r.detok.push(token)
        reason = stop_reason = None
        if r.grammar.error is not None:
            reason, stop_reason = "error", r.grammar.error
        elif p.stop_token_ids and token in p.stop_token_ids:
            reason, stop_reason = "stop", token
        elif token == self.eos_token_id and not p.ignore_eos:
            reason = "stop"
        elif stop_str is not None:
            reason, stop_reason = "stop", stop_str
        elif (p.max_tokens is not None and len(r.output_ids) >= p.max_tokens) or \
                len(r.prompt_ids) + len(r.output_ids) >= self.scheduler.max_model_len:
            reason = "length"
        if reason is None:
            return False
        r.finished_time = now
        self._finish(r, reason, stop_reason)
        return True

    def _finish(self, r: Request, reason: str, stop_reason=None) -> None:
        scheduler = self._scheduler_of(r)
        prefix = scheduler.prefix
        if prefix is not None:  # blocks completed by the last reconciled step (speculative rows learn it here)
            prefix.register(r)
            if prefix.new_blocks:  # copy them off the device now, before a later step may reuse the blocks
                new, prefix.new_blocks = prefix.new_blocks, []
                self._late_writeback.append(([d for _, d in new],
                                             self.runner.read_blocks([b for b, _ in new], **self.rank_args(r))))
        if r.cache.swa_copy is not None and prefix is not None:
            self._save_snapshot(r, *r.cache.swa_copy)
        r.cache.swa_copy = None
        scheduler.finish(r, reason, stop_reason)
        self._rank.pop(r.request_id, None)
