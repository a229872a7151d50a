"""The Ray actor that hosts one engine instance in a role (issue 23 item 2): ``EngineActor``.

A plain class; ``live.Cluster`` wraps it with ``ray.remote``. Each actor builds its own ``LLM`` (one
engine, one process; a DP engine over a device mesh is one actor too) and a ``roles.PrefillInstance``
or ``roles.DecodeInstance`` around it. The router talks to it through ``work``: hand it new requests
and let it step for up to ``budget_s`` (returning as soon as a step produced results; decode: with
every running request's KV length), so one outstanding call per actor keeps every engine busy while
the driver routes. A decode request added with ``stream`` (where the client's stream stands: tokens,
characters, logprobs) is also reported while it runs: ``work`` returns its new tokens and text since
the previous answer (``cluster.streaming.Partial``), not only finished requests. ``forward_unfinished``
hands requests on: all of them (going offline) or those a rebalancing moves.
"""

from __future__ import annotations

import time

from deepinfer_jax.engine import RequestError

__all__ = ["EngineActor"]


class EngineActor:
    """One engine instance in role ``"prefill"`` or ``"decode"`` (``settings``: ``LLM`` keywords)."""

    def __init__(self, role: str, model, settings: dict) -> None:
        from deepinfer_jax.cluster.roles import DecodeInstance, PrefillInstance
        from deepinfer_jax.llm import LLM

        if role not in ("prefill", "decode"):
            raise ValueError(f"role: 'prefill' or 'decode', got {role!r}")
        self.role = role
        self.llm = LLM(model, use_tqdm=False, **settings)
        self.inst = PrefillInstance(self.llm) if role == "prefill" else DecodeInstance(self.llm)
        self.trackers: dict = {}  # request id -> streaming.PartialTracker (decode, streamed requests)

    def info(self) -> dict:
        """What the router needs to match prefixes and charge quota like the engines do, and the instance's DP
        ranks (``dp_size``: the decode balancer routes to each rank)."""
        from deepinfer_jax.cache.block_hash import extra_keys

        llm, sched = self.llm, self.llm.engine.scheduler
        cm = sched.cost_model
        return {"fingerprint": llm.fingerprint().hex(), "extra": extra_keys(llm.fingerprint(),
                                                                          llm.engine_config.cache_salt).hex(),
                "block_size": sched.block_size, "ring_rows": sched.prefix.ring_rows,
                "max_model_len": sched.max_model_len, "cost_coef": None if cm is None else cm.coef.tolist(),
                "store": str(sched.prefix.files.root.parent), "dp_size": self.inst.dp_size}

    def prepare(self, items, params) -> list[tuple[str | None, list[int]]]:
        """(text, prompt ids) per prompt, validated as ``LLM.generate`` does (``RequestError`` naming
        ``prompts[i].field``)."""
        out = []
        for i, (item, sp) in enumerate(zip(items, params)):
            try:
                text, ids = self.llm._prompt(item)
                ids = self.llm.engine.validate(ids, sp)
            except RequestError as e:
                raise RequestError(f"prompts[{i}].{e.field}", str(e).split(": ", 1)[1]) from None
            out.append((text, ids))
        return out

    def work(self, adds: list[dict], budget_s: float = 0.05) -> dict:
        """Add ``adds`` (``Instance.add`` keywords; decode: also ``stream``, the client's position or
        None), then step until a step returns results or ``budget_s`` has passed. Returns ``results``
        (``PrefillResult`` / ``RequestOutput``), ``partial`` (decode: request id -> ``Partial`` of a
        streamed request still running), ``how`` (decode: request id -> admission) and ``errors``
        (request id -> message)."""
        from deepinfer_jax.cluster.streaming import PartialTracker

        how, errors = {}, {}
        for a in adds:
            a = dict(a)
            stream = a.pop("stream", None)
            try:
                admitted = self.inst.add(**a)
                if self.role == "decode":
                    how[a["request_id"]] = admitted
                    if stream is not None:
                        self.trackers[a["request_id"]] = PartialTracker(self.llm.engine.requests[a["request_id"]],
                                                                        tuple(stream))
            except (RequestError, ValueError) as e:
                errors[a["request_id"]] = str(e)
        results = []
        end = time.perf_counter() + budget_s
        while self.inst.has_unfinished:
            results += self.inst.step()
            if results or time.perf_counter() > end:
                break
        for out in results:
            self.trackers.pop(getattr(out, "request_id", None), None)
        partial = {}
        for rid, t in self.trackers.items():
            p = t.partial()
            if p is not None:
                partial[rid] = p
        lengths = self.inst.lengths() if self.role == "decode" else {}
        return {"results": results, "partial": partial, "how": how, "errors": errors, "lengths": lengths,
                "busy": self.inst.has_unfinished}

    def forward_unfinished(self, request_ids=None):
        """Decode role, going offline (every request) or migrating ``request_ids``: ``(finished outputs,
        roles.Forwarded list)``; the requests not named keep running here."""
        finished, forwards = self.inst.forward_unfinished(request_ids)
        for rid in [o.request_id for o in finished] + [f.request_id for f in forwards]:
            self.trackers.pop(rid, None)
        return finished, forwards

    def stats(self) -> dict:
        inst = self.inst
        return {"role": self.role, "handoffs": getattr(inst, "handoffs", 0), "admitted": getattr(inst, "admitted", 0),
                "recomputed": dict(getattr(inst, "recomputed", {})), "steps": self.llm.engine.stats.steps,
                "rank_requests": list(self.llm.engine.rank_requests)}  # per DP rank (one device: one)
