"""Engine roles (issue 23 item 1): a prefill instance and a decode instance around one ``LLM``.

``PrefillInstance`` runs requests' prompts only, with everything the engine does for prompts
(chunking under its budget or cost model, prefix hits from the shared block store). Right behind
the step that computes a prompt's last chunk (``EngineCore.on_launch``) it dispatches copies of the
request's slot state and blocks; once the first token is sampled it writes every complete block to
the shared store and returns a ``cluster.handoff.Handoff`` (the partial last block and the slot
state inside). A prompt whose first token already ends it (EOS, a stop, ``max_tokens=1``) is
simply finished there.

``DecodeInstance`` admits a handoff by reading its blocks from the store and restoring the slot
state (``EngineCore.add_continuation`` with an ``AdmitState``): nothing is recomputed and it decodes
(with speculation when the engine has it) from exactly where the prefill left off. Whatever is
wrong with a handoff (``HandoffError``: corrupted, another version or model; a block missing or
failing its checksum in the store) makes it **recompute** instead, never produce other tokens:
from the prompt when the handoff itself is unusable, else from the prompt and the handed tokens.
``forward_unfinished`` turns its unfinished requests into handoffs for other decode instances
(scale-down): blocks to the store, the rest in the handoff, exactly as a prefill instance does.

Either may be a DP engine (``LLM(..., sharding=preset)``: ``EngineCore`` with a scheduler per DP rank): a request's slot
and blocks are read from, and a handoff admitted into, its rank's slice of the stacked cache
(``ModelRunner.snapshot_slot`` / ``restore_slot`` with ``rank=``); the slot state has the one-device layout, so a
one-device prefill instance hands over to a DP decode instance and back. ``DecodeInstance.add(rank=)`` runs a
handoff on the rank the cluster's decode balancer chose (``rank_loads`` is its view of the instance).

Both need prefix caching and a file block store (``block_store=dir``) shared by every instance.
Colocated mode (a plain ``LLM``) stays the default; these wrap an ``LLM`` without changing it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass

from deepinfer_jax.cluster.handoff import Handoff, HandoffError, decode_handoff, encode_handoff
from deepinfer_jax.engine import RequestOutput, SamplingParams
from deepinfer_jax.engine.core import EngineCore
from deepinfer_jax.engine.dp_router import RankLoad
from deepinfer_jax.engine.request import AdmitState

__all__ = ["DecodeInstance", "Forwarded", "PrefillInstance", "PrefillResult"]

log = logging.getLogger(__name__)


@dataclass
class PrefillResult:
    """A prompt done on a prefill instance: its output so far (the first token), and the handoff
    (``None`` when the first token already finished the request: ``output.finished``)."""

    request_id: str
    output: RequestOutput
    handoff: bytes | None
    handoff_s: float = 0.0  # copying the state off the device, writing blocks, encoding


@dataclass
class Forwarded:
    """A request a draining decode instance hands on: ``handoff`` continues it exactly; ``None``
    when it had no state there yet (the receiver recomputes ``output_ids`` after the prompt)."""

    request_id: str
    handoff: bytes | None
    output_ids: list[int]
    handoff_s: float = 0.0


def _check_engine(llm, role: str):
    engine = llm.engine
    if not isinstance(engine, EngineCore) or not hasattr(llm.runner, "snapshot_slot"):
        raise ValueError(f"{role}: engine roles need a single-mesh engine (EngineCore), not {type(engine).__name__}")
    prefix = engine.scheduler.prefix
    if prefix is None or prefix.files is None:
        raise ValueError(f"{role}: engine roles need prefix caching and a shared file block store (block_store=dir)")
    return engine, prefix


class _Role:
    def __init__(self, llm, role: str) -> None:
        self.llm = llm
        self.engine, self.prefix = _check_engine(llm, role)
        self.block_size = self.engine.scheduler.block_size
        self.model = llm.fingerprint().hex()

    def _state(self, r, length: int):
        """Dispatch copies of ``r``'s slot state and its first ``ceil(length / B)`` blocks (device arrays)."""
        nb = math.ceil(length / self.block_size)
        at = self.engine.rank_args(r)  # a DP engine: the request's rank's slice
        return self.llm.runner.snapshot_slot(r.slot, **at), self.llm.runner.read_blocks(r.blocks.block_ids[:nb], **at)

    def _handoff(self, r, output_ids, logprobs, state, source: str) -> Handoff:
        """Fetch ``state`` (from ``_state``), write the complete blocks to the store, build the handoff."""
        slot, read = state
        runner = self.llm.runner
        length = len(r.prompt_ids) + len(output_ids) - 1
        payloads = runner.block_payloads(read)
        full = length // self.block_size
        digests = self.prefix.digests(r)[:full]
        written = True
        for d, payload in zip(digests, payloads[:full]):
            try:
                self.prefix.files.put(d, payload)
            except OSError as e:  # a failed write: the receiver finds the block missing and recomputes
                log.warning("handoff: writing block %s to the store failed: %s", d.hex()[:16], e)
                written = False
        return Handoff(r.request_id, list(r.prompt_ids), list(output_ids), self.block_size, self.model,
                       [d.hex() for d in digests], runner.to_host(slot), payloads[full] if length % self.block_size
                       else None, logprobs, written, source)

    @property
    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished

    @property
    def dp_size(self) -> int:
        """The engine's attention data-parallel ranks (1: one device)."""
        return getattr(self.llm.runner, "dp_size", 1)

    def _schedulers(self) -> list:
        """Every rank's scheduler (one device: the one)."""
        return list(getattr(self.engine, "schedulers", [self.engine.scheduler]))


class PrefillInstance(_Role):
    """Prompts only; see the module docstring."""

    def __init__(self, llm) -> None:
        super().__init__(llm, "prefill")
        self.engine.on_launch = self._capture
        self._params: dict[str, SamplingParams] = {}
        self._captured: dict[str, tuple] = {}
        self.handoffs = 0

    def add(self, prompt_ids, params: SamplingParams, request_id: str, prompt: str | None = None) -> str:
        """Queue a prompt (``RequestError`` if it cannot run); its result comes from ``step``."""
        first = dataclasses.replace(params, max_tokens=1)  # the first token only; its stop checks as usual
        rid = self.engine.add_request(prompt_ids, first, prompt=prompt, request_id=request_id)
        self._params[rid] = params
        return rid

    def _capture(self, step) -> None:
        """Right behind a model step: the state of each request whose prompt it completed."""
        for c in step.plan.chunks:
            r = c.request
            if c.sample and not c.verify and not r.output_ids and c.start + c.num_tokens == len(r.prompt_ids):
                self._captured[r.request_id] = self._state(r, len(r.prompt_ids))

    def step(self) -> list[PrefillResult]:
        """One engine step; returns the prompts it completed."""
        results = []
        for out in self.engine.step():
            rid = out.request_id
            params, state = self._params.pop(rid), self._captured.pop(rid, None)
            r = self.engine.requests.pop(rid)
            done = out.outputs[0]
            more = (done.finish_reason == "length" and (params.max_tokens is None or params.max_tokens > 1)
                    and len(r.prompt_ids) + 1 < self.engine.scheduler.max_model_len)
            if not more or state is None:
                if more:  # cannot happen: every sampled prompt end is captured
                    raise RuntimeError(f"prefill: no state captured for request {rid!r}")
                results.append(PrefillResult(rid, out, None))
                continue
            t0 = time.perf_counter()
            data = encode_handoff(self._handoff(r, done.token_ids, done.logprobs, state, "prefill"))
            self.handoffs += 1
            unfinished = dataclasses.replace(out, outputs=[dataclasses.replace(done, finish_reason=None)],
                                             finished=False)
            results.append(PrefillResult(rid, unfinished, data, time.perf_counter() - t0))
        return results

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._params.pop(request_id, None)
        self._captured.pop(request_id, None)
        self.engine.requests.pop(request_id, None)


class DecodeInstance(_Role):
    """Continues handoffs; see the module docstring. ``admitted`` counts exact admissions,
    ``recomputed`` the fallbacks by reason (the ``HandoffError`` field, or ``missing_block``)."""

    def __init__(self, llm) -> None:
        super().__init__(llm, "decode")
        self._slot_names = llm.runner.slot_state_names()
        self.admitted = 0
        self.recomputed: dict[str, int] = {}

    def _admit_state(self, h: Handoff) -> AdmitState | None:
        """The blocks (from the store) and slot state of a verified handoff; None if a block is unusable."""
        names = self._slot_names
        got = {k: (tuple(v.shape), str(v.dtype)) for k, v in h.slot_state.items()}
        if got != names:
            raise HandoffError("slot_state", f"leaves {sorted(got)} do not match this engine's slot layout")
        payloads = []
        for d in h.digests:
            payload = self.prefix.files.get(bytes.fromhex(d))
            if payload is None:
                return None
            payloads.append(payload)
        if h.tail is not None:
            payloads.append(h.tail)
        return AdmitState(h.length, payloads, h.slot_state)

    def add(self, prompt_ids, params: SamplingParams, request_id: str, data: bytes | None,
            prompt: str | None = None, num_cached_tokens: int = 0, output_ids=None, rank: int | None = None) -> str:
        """Admit a handoff for ``request_id`` (the router's own copy of its prompt and parameters);
        ``data=None``: no state anywhere, recompute the prompt and ``output_ids`` (if any) here.
        ``rank``: the DP rank of a DP engine to run it on (the cluster's decode balancer; None: the engine's
        DP router picks; ``RequestError("rank")`` out of range). Returns how: ``"exact"``, or
        ``"recompute:<reason>"``."""
        self.engine.check_rank(rank)
        kw = {"prompt": prompt, "request_id": request_id, "num_cached_tokens": num_cached_tokens, "rank": rank}
        if data is None:
            return self._recompute("no_state", prompt_ids, params, output_ids, **kw)
        try:
            h = decode_handoff(data, self.model, self.block_size)
            if h.request_id != request_id:
                raise HandoffError("request_id", f"handoff of {h.request_id!r}, routed as {request_id!r}")
            if list(h.prompt_ids) != list(prompt_ids):
                raise HandoffError("prompt_ids", "the handoff's prompt is not the request's")
            admit = self._admit_state(h)
        except HandoffError as e:  # nothing in it can be trusted: from the prompt
            log.warning("decode: unusable handoff for %s (%s); recomputing", request_id, e)
            return self._recompute(e.field, prompt_ids, params, None, **kw)
        if admit is None:  # a block is not (or no longer) in the store: the tokens are right, recompute the KV
            return self._recompute("missing_block", prompt_ids, params, h.output_ids, logprobs=h.logprobs, **kw)
        self.engine.add_continuation(prompt_ids, h.output_ids, params, admit=admit, logprobs=h.logprobs, **kw)
        self.admitted += 1
        return "exact"

    def _recompute(self, reason: str, prompt_ids, params, output_ids, prompt=None, request_id=None,
                   num_cached_tokens=0, logprobs=None, rank=None) -> str:
        self.recomputed[reason] = self.recomputed.get(reason, 0) + 1
        if output_ids:
            self.engine.add_continuation(prompt_ids, output_ids, params, prompt=prompt, request_id=request_id,
                                         logprobs=logprobs, num_cached_tokens=num_cached_tokens, rank=rank)
        else:
            self.engine.add_request(prompt_ids, params, prompt=prompt, request_id=request_id)
        return f"recompute:{reason}"

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests it finished (and forgets them)."""
        outs = self.engine.step()
        for out in outs:
            self.engine.requests.pop(out.request_id, None)
        return outs

    def load(self) -> tuple[int, int]:
        """(unfinished requests, their tokens) over every rank."""
        loads = self.rank_loads()
        return sum(ld.num_requests for ld in loads), sum(ld.kv_tokens for ld in loads)

    def rank_loads(self) -> list[RankLoad]:
        """Each DP rank's unfinished requests and their tokens (one device: one rank): the decode balancer's
        view of this instance (``DecodeInstanceView.ranks``)."""
        return [RankLoad(len(s.running) + len(s.waiting), sum(r.num_tokens for r in (*s.running, *s.waiting)))
                for s in self._schedulers()]

    def lengths(self) -> dict[str, int]:
        """Every unfinished request's tokens (prompt + output so far: its KV length), by request id."""
        return {r.request_id: r.num_tokens for s in self._schedulers() for r in (*s.running, *s.waiting)}

    def forward_unfinished(self, request_ids=None) -> tuple[list[RequestOutput], list[Forwarded]]:
        """Going offline (``request_ids=None``) or migrating some requests (those ids; ids not here are
        ignored): finish the step in flight, then hand those unfinished requests on (blocks to the store,
        slot state in the handoff) and drop them here; the others keep running from the next step.
        Returns (requests that finished while draining, the forwards)."""
        finished = self.engine.drain()
        for out in finished:
            self.engine.requests.pop(out.request_id, None)
        wanted = None if request_ids is None else set(request_ids)
        forwards = []
        for r in [r for s in self._schedulers() for r in (*s.running, *s.waiting)
                  if wanted is None or r.request_id in wanted]:
            t0 = time.perf_counter()
            data = None
            if r.output_ids and r.slot is not None and r.num_computed == r.num_tokens - 1 and not r.num_pending:
                state = self._state(r, r.num_computed)
                data = encode_handoff(self._handoff(r, r.output_ids, r.logprobs, state, "forward"))
            elif (a := r.cache.admit_state) is not None and a.length == r.num_tokens - 1:  # admitted, not run yet
                full = a.length // self.block_size
                data = encode_handoff(Handoff(
                    r.request_id, list(r.prompt_ids), list(r.output_ids), self.block_size, self.model,
                    [d.hex() for d in self.prefix.digests(r)[:full]], a.slot_state,
                    a.payloads[full] if a.length % self.block_size else None, r.logprobs, True, "forward"))
            forwards.append(Forwarded(r.request_id, data, list(r.output_ids), time.perf_counter() - t0))
            self.engine.abort(r.request_id)
            self.engine.requests.pop(r.request_id, None)
        return finished, forwards
