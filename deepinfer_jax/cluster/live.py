"""``Cluster``: prefill and decode instances as Ray actors, routed from the driver (issue 23 item 2).

    from deepinfer_jax.cluster import Cluster
    with Cluster(prefill=1, decode=1, model="tiny", block_size=16, max_model_len=128) as c:
        outs = c.generate(prompts, SamplingParams(temperature=0, max_tokens=16))  # == LLM.generate

Each instance is an ``actors.EngineActor`` (one engine, one process); every instance shares one
file block store (``block_store``, a temporary directory by default). The driver-side router uses the
cluster policies: the entry prefix match (``prefix_index.match_tokens`` against the store's files),
the prefill balancer (``PrefillBalancer``: quota ``cost(q, c)`` of the uncached part, one round per
``submit``) and the decode balancer (``pick_decode_rank`` on request count and KV tokens).

A request goes ``prefill -> handoff -> decode``; the driver keeps its latest handoff until it
finishes, which makes the faults cheap to survive:

- a **decode actor dies** (``RayActorError``): its requests go, with their handoffs, to the other
  decode instances and continue from there (the blocks are in the store, the rest in the handoff);
- a **prefill actor dies**: its requests are routed again, to the other prefill instances;
- a **handoff is unusable** or a block is missing from the store (a write failed): the decode
  instance recomputes (``roles.DecodeInstance``);
- **going offline** (``retire_decode``): the instance takes no new requests, finishes what it can
  within the grace period (``decode_grace_s``, 60 s as in production by default), then forwards the
  rest (blocks to the store + state) to the other decode instances, which continue them exactly.

Outputs are recorded once per request id (a late duplicate is dropped and counted).

``generate_stream`` streams per token as ``LLM.generate_stream`` does (deltas; ``cluster.streaming``):
the first token once the prefill instance has it, then the decode instance's new tokens with each of
its answers (at most ``budget_s`` apart), then the rest with the finished output. After a fault the
instance that continues a request reports from where the client's stream stands, so nothing is
streamed twice or skipped (greedy decoding regenerates the same tokens).

``autoscaler=AutoscalerSettings(...)``: every ``tick_s`` the router measures the uncached prompt
tokens/s and the running decode requests, calls ``Autoscaler.tick`` and adds instances (started
without blocking, routed to once ready) or takes them out of service (``cluster.scaling``); the
changes are ``ClusterStats.scale_events``.

``rebalance=RebalanceSettings(...)``: every ``tick_s`` (and with ``on_admit``, the default, at the first
step after a request was admitted to decode, then with ``only_if_reachable``) the router runs
``decode_rebalance.plan_moves`` over every rank of the decode instances in service, each request
weighed by its KV length (what the decode actors report with each answer), and migrates the planned
requests: the source actor hands them on exactly as a retiring one does (``forward_unfinished`` with
their ids; the rest keep decoding there) and the router admits each on the rank the plan chose.
Counted in ``ClusterStats.migrated``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from deepinfer_jax.cluster.autoscaler import AutoscalerSettings
from deepinfer_jax.cluster.decode_balancer import DecodeInstanceView, pick_decode_rank
from deepinfer_jax.cluster.decode_rebalance import RebalanceSettings, plan_moves
from deepinfer_jax.cluster.errors import PolicyInputError, check_int, check_number
from deepinfer_jax.cluster.prefill_balancer import PrefillBalancer, SlotRule, request_quota
from deepinfer_jax.cluster.prefix_index import PrefixIndex, match_tokens
from deepinfer_jax.cluster.scaling import LiveScaler, check_settings
from deepinfer_jax.cluster.streaming import StreamCursor
from deepinfer_jax.engine import RequestError, RequestOutput, SamplingParams
from deepinfer_jax.engine.cost_model import CostModel
from deepinfer_jax.engine.dp_router import RankLoad
from deepinfer_jax.engine.outputs import RequestMetrics

__all__ = ["Cluster", "ClusterStats", "dp_role_env", "ray_init_options"]

log = logging.getLogger(__name__)
_ENV_PASSED = ("JAX_COMPILATION_CACHE_DIR", "JAX_PLATFORMS", "XLA_FLAGS", "DEEPINFER_PROGRAM_STORE")


def dp_role_env(role: str, settings: dict) -> dict:
    """The environment of a role whose engine runs over a device mesh (``sharding`` in its settings, a DP engine;
    one device: ``{}``): this checkout's ``ray_init_options`` environment, with ``XLA_FLAGS`` making the preset's
    device count of host (CPU) devices, which only a CPU run uses. An unknown preset is a ``PolicyInputError`` naming
    ``<role>_settings.sharding``. A DP decode role speculates as a one-device one does (each rank verifies its own
    requests' drafts; a handed-over request starts without drafts and drafts again from its next step)."""
    from deepinfer_jax.config.sharding import resolve_preset

    sharding = settings.get("sharding")
    if sharding is None:
        return {}
    try:
        preset = resolve_preset(sharding)
    except ValueError as e:
        raise PolicyInputError(f"{role}_settings.sharding", str(e)) from None
    env = dict(ray_init_options()["runtime_env"]["env_vars"])
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={preset.num_devices}"])
    return env


def ray_init_options(**overrides) -> dict:
    """``ray.init`` keywords for a local run: 2 CPUs, no dashboard, and workers that import this
    checkout (``PYTHONPATH``) with the driver's JAX settings."""
    root = str(Path(__file__).resolve().parents[2])
    env = {k: os.environ[k] for k in _ENV_PASSED if k in os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {"num_cpus": 2, "include_dashboard": False, "log_to_driver": False, "runtime_env": {"env_vars": env},
            **overrides}


@dataclass
class ClusterStats:
    """Router counters: handoffs and their bytes and time, admissions, faults survived."""

    handoffs: int = 0
    handoff_bytes: int = 0
    handoff_s: float = 0.0  # on the instances: state copies, block writes, encoding
    exact: int = 0  # decode admissions from the handoff, nothing recomputed
    recomputed: dict = field(default_factory=dict)  # decode admissions that recomputed, by reason
    rerouted_prefill: int = 0  # requests routed again after their prefill actor died
    resumed_decode: int = 0  # requests continued elsewhere after their decode actor died
    forwarded: int = 0  # requests a retiring decode instance handed on
    migrated: int = 0  # requests the decode rebalancing moved to another rank (``rebalance``)
    duplicates: int = 0  # outputs for an already finished request (dropped)
    finished_at_prefill: int = 0  # requests the first token already ended
    scale_events: list = field(default_factory=list)  # scaling.ScaleEvent, one per autoscaler change


@dataclass
class _Req:
    rid: str
    text: str | None
    ids: list[int]
    params: SamplingParams
    arrival: float
    where: tuple[str, int] | None = None
    rank: int | None = None  # on a decode instance: the DP rank the decode balancer picked
    quota: float = 0.0
    kv: int | None = None  # on decode: its tokens (KV length) as the instance last reported them
    handoff: bytes | None = None
    output_ids: list[int] | None = None  # known generated tokens when there is no handoff (forwarding)
    first: RequestOutput | None = None
    first_time: float | None = None
    done: RequestOutput | None = None
    cursor: StreamCursor | None = None  # streamed: what the client has
    deltas: list = field(default_factory=list)  # streamed: deltas not yet handed out
    orphan: bool = False  # its stream was closed: forget it once it finishes


@dataclass
class _Instance:
    role: str
    index: int
    actor: object
    alive: bool = True
    accepting: bool = True
    retire_at: float | None = None  # going offline: forward what is left at this time
    call: object = None  # the outstanding ObjectRef
    adds: list = field(default_factory=list)
    busy: bool = False
    rids: set = field(default_factory=set)
    ready: bool = True  # False while a non-blocking start waits for the engine (not routed to)
    draining: bool = False  # prefill going offline: no new requests, stopped once it has none
    dp_size: int = 1  # the engine's DP ranks (``EngineActor.info``)
    pooled: bool = False  # in the autoscaler's ready pool: booted, not in service (``cluster.scaling``)
    migrate: dict = field(default_factory=dict)  # decode: request id -> (instance, rank) to move it to


def answered(ray, refs: list, timeout_s: float) -> list:
    """Every call of ``refs`` that has answered: waits up to ``timeout_s`` for the first, then takes all
    the others that are ready too. One answer per round (``ray.wait``'s ``num_returns=1``) would starve
    the instances listed last: ``ray.wait`` keeps the input order, so a busy instance early in the
    list that answers every round would always be the one returned, and a new instance's start-up
    answer behind it would never be read."""
    ready, rest = ray.wait(refs, num_returns=1, timeout=timeout_s)
    if ready and rest:
        more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
        ready = ready + more
    return ready


def _number(rid: str) -> int:
    """The router's request ids are ``c<n>``: ``n``, the id ``plan_moves`` takes."""
    return int(rid[1:])


def _check_rebalance(settings):
    if settings is not None and not isinstance(settings, RebalanceSettings):
        raise PolicyInputError("rebalance", f"a RebalanceSettings or None, got {type(settings).__name__}")
    return settings


class Cluster:
    """``prefill`` + ``decode`` engine instances on Ray; see the module docstring.

    ``model`` and ``**settings``: as for ``LLM`` (every instance); ``prefill_settings`` /
    ``decode_settings`` override per role. ``ray_init``: keywords for ``ray.init`` when Ray is not
    initialised yet (local: ``num_cpus=2``, no dashboard); the workers import this checkout.
    ``autoscaler``: ``AutoscalerSettings`` to scale both roles live (``enable_autoscaler``), or None.
    ``rebalance``: ``RebalanceSettings`` to migrate decode requests between ranks (``enable_rebalance``), or None.
    """

    def __init__(self, prefill: int = 1, decode: int = 1, model=None, *, block_store: str | os.PathLike | None = None,
                 prefill_settings: dict | None = None, decode_settings: dict | None = None,
                 decode_grace_s: float = 60.0, budget_s: float = 0.05, ray_init: dict | None = None,
                 actor_options: dict | None = None, autoscaler: AutoscalerSettings | None = None,
                 rebalance: RebalanceSettings | None = None, **settings) -> None:
        import ray

        check_int("prefill", prefill, 1)
        check_int("decode", decode, 1)
        check_number("decode_grace_s", decode_grace_s)
        check_number("budget_s", budget_s)
        check_settings(autoscaler)
        _check_rebalance(rebalance)
        self._settings = {"prefill": {**settings, **(prefill_settings or {})},
                          "decode": {**settings, **(decode_settings or {})}}
        self._settings["prefill"].setdefault("speculation", "none")  # a prefill instance never decodes
        self._env = {role: dp_role_env(role, self._settings[role]) for role in self._settings}
        self._tmp = None
        if block_store is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="deepinfer-store-")
            block_store = self._tmp.name
        self.block_store = str(block_store)
        for role_settings in self._settings.values():
            role_settings["block_store"] = self.block_store
        self.model, self.decode_grace_s, self.budget_s = model, decode_grace_s, budget_s
        self._ray = ray
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            ray.init(**ray_init_options(**(ray_init or {})))
        from deepinfer_jax.cluster.actors import EngineActor

        self._actor_cls = ray.remote(**{"num_cpus": 0, "max_restarts": 0, **(actor_options or {})})(EngineActor)
        self.instances: dict[str, list[_Instance]] = {"prefill": [], "decode": []}
        for _ in range(prefill):
            self._start("prefill")
        for _ in range(decode):
            self._start("decode")
        self.info = ray.get(self.instances["prefill"][0].actor.info.remote())
        for inst, info in zip(self._live(), ray.get([i.actor.info.remote() for i in self._live()])):
            inst.dp_size = info["dp_size"]  # every engine has started
        coef = self.info["cost_coef"] or (0.0, 1.0, 0.0, 0.0)  # no cost model: tokens as quota
        self._cost = CostModel(coef)
        from deepinfer_jax.cache.block_store import FileBlockStore

        self._index = PrefixIndex(container=FileBlockStore(self.block_store, bytes.fromhex(self.info["fingerprint"])))
        self._balancer = None
        self.requests: dict[str, _Req] = {}
        self._numbers = 0
        self.stats = ClusterStats()
        self.scaler: LiveScaler | None = None
        self.enable_autoscaler(autoscaler)
        self.rebalance: RebalanceSettings | None = None
        self._moved_at: dict[int, float] = {}  # request number -> when it was last moved (or placed, ``settle``)
        self._next_rebalance = 0.0
        self._admitted = False  # a request was admitted to decode since the last plan (``on_admit``)
        self.enable_rebalance(rebalance)

    def enable_autoscaler(self, settings: AutoscalerSettings | None) -> None:
        """Scale live with ``settings`` from now on (the policy starts from the instances in service),
        or stop scaling (None)."""
        settings = check_settings(settings)
        if self.scaler is not None:
            self.scaler.close()  # its ready pool's idle instances stop
        self.scaler = None if settings is None else LiveScaler(self, settings, time.perf_counter())

    def enable_rebalance(self, settings: RebalanceSettings | None) -> None:
        """Migrate decode requests between ranks with ``settings`` from now on (first plan at the next
        ``step``), or stop (None). ``PolicyInputError`` naming ``rebalance`` for anything else."""
        self.rebalance = _check_rebalance(settings)
        self._next_rebalance = 0.0

    # ---- instances ----
    def _start(self, role: str) -> _Instance:
        cls = self._actor_cls
        if self._env[role]:  # a DP role: its process sees the preset's (fake CPU) devices
            cls = cls.options(runtime_env={"env_vars": self._env[role]})
        inst = _Instance(role, len(self.instances[role]), cls.remote(role, self.model, self._settings[role]))
        self.instances[role].append(inst)
        self._balancer = None  # re-made for the new count at the next submit
        return inst

    def add_instance(self, role: str, wait: bool = True) -> int:
        """Start one more instance of ``role`` (scale-up); returns its index, once it is ready
        (``wait``), else at once: ``step`` routes to it after its engine has started."""
        if role not in self.instances:
            raise ValueError(f"role: 'prefill' or 'decode', got {role!r}")
        inst = self._start(role)
        if wait:
            inst.dp_size = self._ray.get(inst.actor.info.remote())["dp_size"]
        else:
            inst.ready = inst.accepting = False
            inst.call = ("info", inst.actor.info.remote())
        return inst.index

    def stop_instance(self, inst: _Instance) -> None:
        """Kill ``inst``'s actor now and forget it (an instance that has no requests)."""
        inst.alive = inst.accepting = False
        inst.call = None
        try:
            self._ray.kill(inst.actor, no_restart=True)
        except (ValueError, self._ray.exceptions.RayError) as e:  # already gone
            log.debug("cluster: %s %d already stopped: %s", inst.role, inst.index, e)

    def _live(self, role: str | None = None) -> list[_Instance]:
        roles = [role] if role else ["prefill", "decode"]
        return [i for r in roles for i in self.instances[r] if i.alive]

    def kill(self, role: str, index: int) -> None:
        """Kill an instance's actor at once (a crash, for fault tests); the router notices on its next call."""
        self._ray.kill(self.instances[role][index].actor, no_restart=True)

    def retire_decode(self, index: int, grace_s: float | None = None) -> None:
        """Take decode instance ``index`` offline: no new requests; after ``grace_s`` (default
        ``decode_grace_s``) its unfinished requests are forwarded to the other decode instances."""
        inst = self.instances["decode"][index]
        others = [i for i in self._live("decode") if i is not inst and i.accepting]
        if not others:
            raise ValueError("index: no other decode instance to take its requests")
        inst.accepting = False
        inst.retire_at = time.perf_counter() + (self.decode_grace_s if grace_s is None else grace_s)

    # ---- requests ----
    def submit(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
               stream: bool = False) -> list[str]:
        """Validate and route prompts (as ``LLM.generate`` takes them); returns their request ids.
        ``stream``: also keep their deltas (what ``generate_stream`` hands out)."""
        from deepinfer_jax.llm import LLM

        items = LLM._prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise RequestError("sampling_params", f"{len(params)} given for {len(items)} prompts")
        prepared = self._ray.get(self._live("prefill")[0].actor.prepare.remote(items, params))
        rids = []
        now = time.perf_counter()
        for (text, ids), sp in zip(prepared, params):
            rid = f"c{self._numbers}"
            self._numbers += 1
            self.requests[rid] = _Req(rid, text, ids, sp, now, cursor=StreamCursor(sp.stop_strings) if stream else None)
            self._route_prefill(self.requests[rid])
            rids.append(rid)
        if self._balancer is not None:
            self._balancer.end_round()
        return rids

    def _route_prefill(self, req: _Req) -> None:
        """Entry prefix match, then the prefill balancer over the live prefill instances."""
        live = self._live("prefill")
        if not live:
            raise RuntimeError("no prefill instance left")
        if self._balancer is None or self._balancer.num_engines != len(self.instances["prefill"]):
            self._balancer = PrefillBalancer(len(self.instances["prefill"]), round_quota_ns=1e9,
                                             slot=SlotRule(max(0.0, float(self._cost.coef[0])), tie_ns=0.0))
        m, _ = match_tokens(req.ids, bytes.fromhex(self.info["extra"]), self._index, None,
                            self.info["block_size"], self.info["ring_rows"])
        req.quota = request_quota(self._cost, m.uncached_tokens, m.hit_tokens, m.replay_tokens)
        if self.scaler is not None:
            self.scaler.count_uncached(m.uncached_tokens)
        backlogs = [[sum(self.requests[r].quota for r in i.rids)] for i in self.instances["prefill"]]
        accepting = [i.alive and i.accepting for i in self.instances["prefill"]]
        e, _rank = self._balancer.route(len(req.ids), req.quota, backlogs, accepting)
        inst = self.instances["prefill"][e]
        req.where = ("prefill", e)
        inst.rids.add(req.rid)
        inst.adds.append({"prompt_ids": req.ids, "params": req.params, "request_id": req.rid, "prompt": req.text})

    def _rank_loads(self, inst: _Instance) -> tuple[RankLoad, ...]:
        """Each DP rank's load on decode instance ``inst`` as the router routed it (one device: one rank)."""
        loads = [[0, 0] for _ in range(inst.dp_size)]
        for rid in inst.rids:
            req = self.requests[rid]
            ld = loads[req.rank if req.rank is not None and req.rank < inst.dp_size else 0]
            ld[0] += 1
            ld[1] += self._tokens(req)
        return tuple(RankLoad(n, t) for n, t in loads)

    def _route_decode(self, req: _Req, to: tuple[int, int] | None = None) -> None:
        """The decode balancer over every rank of every accepting decode instance; a DP instance runs the request
        on the rank it picked. ``to``: (instance, rank) the rebalancing planned, if that instance still accepts."""
        cands = self.instances["decode"]
        if to is not None and cands[to[0]].alive and cands[to[0]].accepting:
            e, rank = to
        else:
            views = [DecodeInstanceView(self._rank_loads(i), i.alive and i.accepting) for i in cands]
            if not any(v.accepting for v in views):
                raise RuntimeError("no decode instance left to take requests")
            e, rank = pick_decode_rank(views, self._tokens(req))
        if self.rebalance is not None and to is None:
            if self.rebalance.settle:
                self._moved_at.setdefault(_number(req.rid), time.perf_counter())  # not moved within cooldown_s of it
            if self.rebalance.on_admit:
                self._admitted = True  # plan at the next step, once the request is on its instance
        inst = cands[e]
        req.where, req.rank = ("decode", e), rank
        inst.rids.add(req.rid)
        inst.adds.append({"prompt_ids": req.ids, "params": req.params, "request_id": req.rid, "data": req.handoff,
                          "prompt": req.text, "num_cached_tokens": req.first.num_cached_tokens if req.first else 0,
                          "output_ids": req.output_ids, "stream": req.cursor and req.cursor.start,
                          "rank": rank if inst.dp_size > 1 else None})

    @staticmethod
    def _tokens(req: _Req) -> int:
        if req.kv is not None:
            return req.kv
        return len(req.ids) + (len(req.output_ids) if req.output_ids else 1)

    def _plan_migrations(self, now: float, tick: bool = True) -> None:
        """The rebalancing tick: ``plan_moves`` over every rank of the decode instances in service (requests
        the actor already has, weighed by KV length); each planned request is marked on its instance, whose
        next call hands it on (``step``)."""
        s = self.rebalance
        if tick:
            self._next_rebalance = now + s.tick_s
        self._admitted = False
        flat, ranks = [], []
        for inst in self.instances["decode"]:
            if not (inst.alive and inst.ready and inst.accepting and inst.retire_at is None):
                continue
            unsent = {a["request_id"] for a in inst.adds} | set(inst.migrate)
            rows = [[] for _ in range(inst.dp_size)]
            for rid in sorted(inst.rids):
                req = self.requests[rid]
                if req.done is None and rid not in unsent:
                    rows[min(req.rank or 0, inst.dp_size - 1)].append((_number(rid), self._tokens(req)))
            for k, row in enumerate(rows):
                flat.append((inst.index, k))
                ranks.append(row)
        if len(ranks) < 2:
            return
        for m in plan_moves(ranks, s.max_moves, s.threshold, now, self._moved_at, s.cooldown_s, s.keep_rows,
                            only_if_reachable=not tick):
            src = self.instances["decode"][flat[m.src][0]]
            src.migrate[f"c{m.rid}"] = flat[m.dst]
            self._moved_at[m.rid] = now

    # ---- the loop ----
    @property
    def has_unfinished(self) -> bool:
        return any(r.done is None for r in self.requests.values())

    def step(self, timeout_s: float = 1.0) -> list[RequestOutput]:
        """One router round: start a call on every instance with work, take the results of those that
        answered within ``timeout_s``; returns the requests that finished."""
        now = time.perf_counter()
        if self.scaler is not None:
            self.scaler.tick(now)
        if self.rebalance is not None and (now >= self._next_rebalance or self._admitted):
            self._plan_migrations(now, tick=now >= self._next_rebalance)
        for inst in self._live("prefill"):
            if inst.draining and inst.call is None and not inst.rids and not inst.adds:
                self.stop_instance(inst)
        for inst in self._live("decode"):
            if inst.retire_at is not None and inst.call is None and (now >= inst.retire_at or not inst.rids):
                inst.migrate = {}  # every request goes
                inst.call = ("forward", inst.actor.forward_unfinished.remote())
            elif inst.migrate and inst.call is None:
                moves, inst.migrate = inst.migrate, {}
                inst.call = ("migrate", inst.actor.forward_unfinished.remote(sorted(moves)), moves)
        for inst in self._live():
            if inst.call is None and (inst.adds or inst.busy):
                adds, inst.adds = inst.adds, []
                inst.call = ("work", inst.actor.work.remote(adds, self.budget_s), adds)
        calls = {inst.call[1]: inst for inst in self._live() if inst.call is not None}
        if not calls:
            self._idle(now, timeout_s)
            return []
        finished = []
        for ref in answered(self._ray, list(calls), timeout_s):
            inst = calls[ref]
            kind, *rest = inst.call
            inst.call = None
            try:
                answer = self._ray.get(ref)
            except self._ray.exceptions.RayActorError:
                self._lost(inst)
                continue
            if kind == "info":
                inst.ready, inst.accepting = True, not inst.pooled
                inst.dp_size = answer["dp_size"]
            elif kind == "forward":
                finished += self._forwarded(inst, *answer)
            elif kind == "migrate":
                finished += self._handed_on(inst, *answer, rest[1])  # it keeps running
            else:
                finished += self._answer(inst, answer)
        return finished

    def _idle(self, now: float, timeout_s: float) -> None:
        """Nothing in flight: wait ``timeout_s``, or less when a timer is due sooner (the autoscaler's tick, the
        rebalancing's, a retiring instance's grace), as ``ray.wait`` would with calls. Returning at once made a
        caller's ``while ...: step()`` loop spin a whole core while the cluster was idle."""
        due = [now + timeout_s]
        if self.scaler is not None:
            due.append(self.scaler.last + self.scaler.settings.tick_s)
        if self.rebalance is not None:
            due.append(self._next_rebalance)
        due += [i.retire_at for i in self._live("decode") if i.retire_at is not None]
        delay = min(due) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def _answer(self, inst: _Instance, answer: dict) -> list[RequestOutput]:
        inst.busy = answer["busy"]
        for rid, message in answer["errors"].items():
            raise RequestError("request", f"{rid}: {message}")
        for rid, how in answer["how"].items():
            if how == "exact":
                self.stats.exact += 1
            else:
                reason = how.split(":", 1)[1]
                self.stats.recomputed[reason] = self.stats.recomputed.get(reason, 0) + 1
        finished = []
        now = time.perf_counter()
        for res in answer["results"]:
            if inst.role == "prefill":
                req = self.requests[res.request_id]
                inst.rids.discard(req.rid)
                if req.done is not None or req.where != ("prefill", inst.index):
                    continue
                req.first, req.first_time = res.output, now
                if req.cursor is not None and res.handoff is not None:
                    self._push(req, req.cursor.first(res.output, req.arrival, now))
                if res.handoff is None:
                    self.stats.finished_at_prefill += 1
                    finished += self._finish(req, res.output, now)
                    continue
                req.handoff = res.handoff
                self.stats.handoffs += 1
                self.stats.handoff_bytes += len(res.handoff)
                self.stats.handoff_s += res.handoff_s
                self._route_decode(req)
            else:
                req = self.requests[res.request_id]
                inst.rids.discard(req.rid)
                finished += self._finish(req, res, now)
        for rid, n in answer.get("lengths", {}).items():
            req = self.requests.get(rid)
            if req is not None and req.done is None and req.where == ("decode", inst.index):
                req.kv = n
        for rid, part in answer.get("partial", {}).items():
            req = self.requests.get(rid)
            if req is not None and req.cursor is not None and req.done is None and req.where == ("decode", inst.index):
                self._push(req, req.cursor.partial(req.first, part, req.arrival, req.first_time))
        return finished

    @staticmethod
    def _push(req: _Req, delta: RequestOutput | None) -> None:
        if delta is not None:
            req.deltas.append(delta)

    def _finish(self, req: _Req, out: RequestOutput, now: float) -> list[RequestOutput]:
        if req.done is not None:
            self.stats.duplicates += 1
            return []
        first = req.first or out
        metrics = RequestMetrics(req.arrival, req.first_time or now, now, len(out.outputs[0].token_ids))
        req.done = dataclasses.replace(out, num_cached_tokens=first.num_cached_tokens, metrics=metrics,
                                       prompt_logprobs=first.prompt_logprobs, prompt=req.text)
        req.where = None
        self._moved_at.pop(_number(req.rid), None)
        if req.cursor is not None:
            self._push(req, req.cursor.final(req.done))
        if req.orphan:
            self.requests.pop(req.rid, None)
        return [req.done]

    def _lost(self, inst: _Instance) -> None:
        """An actor died: route its requests again (prefill) or continue them elsewhere (decode)."""
        inst.alive, inst.accepting, inst.call, inst.busy, inst.migrate = False, False, None, False, {}
        rids, inst.rids, inst.adds = sorted(inst.rids), set(), []
        for rid in rids:
            req = self.requests[rid]
            if req.done is not None:
                continue
            if inst.role == "prefill":
                self.stats.rerouted_prefill += 1
                self._route_prefill(req)
            else:
                self.stats.resumed_decode += 1
                self._route_decode(req)

    def _handed_on(self, inst: _Instance, outputs: list, forwards: list, moves: dict | None = None
                   ) -> list[RequestOutput]:
        """A decode instance answered ``forward_unfinished``: record what finished while it drained, then route
        each forward (``roles.Forwarded``) on from its handoff, else its tokens. ``moves`` (a rebalancing: id ->
        (instance, rank)) puts each where the plan chose; None (going offline): the decode balancer does."""
        now = time.perf_counter()
        finished = []
        for out in outputs:
            inst.rids.discard(out.request_id)
            finished += self._finish(self.requests[out.request_id], out, now)
        for f in forwards:
            req = self.requests[f.request_id]
            inst.rids.discard(req.rid)
            if req.done is not None:
                continue
            if moves is None:
                self.stats.forwarded += 1
            else:
                self.stats.migrated += 1
            if f.handoff is not None:
                req.handoff, req.output_ids = f.handoff, None
                self.stats.handoff_bytes += len(f.handoff)
                self.stats.handoff_s += f.handoff_s
            else:
                req.output_ids = f.output_ids or None
                req.handoff = None if req.output_ids else req.handoff
            self._route_decode(req, to=None if moves is None else moves.get(req.rid))
        return finished

    def _forwarded(self, inst: _Instance, outputs: list, forwards: list) -> list[RequestOutput]:
        """A retiring decode instance answered: record what it finished, route the rest, stop it."""
        finished = self._handed_on(inst, outputs, forwards)
        leftover = sorted(inst.rids)  # requests routed to it after the forward started: route them again
        inst.rids, inst.adds = set(), []
        inst.alive = inst.accepting = False
        self._ray.kill(inst.actor, no_restart=True)
        for rid in leftover:
            if self.requests[rid].done is None:
                self._route_decode(self.requests[rid])
        return finished

    def generate(self, prompts, sampling_params=None, timeout_s: float | None = None) -> list[RequestOutput]:
        """Like ``LLM.generate``: the outputs in the order of ``prompts``."""
        rids = self.submit(prompts, sampling_params)
        end = None if timeout_s is None else time.perf_counter() + timeout_s
        while any(self.requests[r].done is None for r in rids):
            if end is not None and time.perf_counter() > end:
                raise TimeoutError(f"generate: unfinished after {timeout_s} s")
            self.step()
        return [self.requests.pop(r).done for r in rids]

    def generate_stream(self, prompts, sampling_params=None):
        """Like ``LLM.generate_stream``: ``RequestOutput`` deltas (new tokens and text, the last one
        ``finished``) of all prompts, interleaved; match them by ``request_id``. The deltas of a
        request concatenate to its ``generate`` output. Closing the iterator early stops streaming
        (its requests still finish on the instances and are then dropped)."""
        rids = self.submit(prompts, sampling_params, stream=True)
        left = set(rids)
        try:
            while left:
                self.step()
                for rid in rids:
                    req = self.requests.get(rid)
                    if req is None or not req.deltas:
                        continue
                    deltas, req.deltas = req.deltas, []
                    for d in deltas:
                        if d.finished:
                            left.discard(rid)
                            self.requests.pop(rid, None)
                        yield d
        finally:
            for rid in left:
                req = self.requests.get(rid)
                if req is not None and req.done is not None:
                    self.requests.pop(rid)
                elif req is not None:
                    req.cursor, req.deltas, req.orphan = None, [], True

    def instance_stats(self) -> list[dict]:
        return self._ray.get([i.actor.stats.remote() for i in self._live()])

    def shutdown(self) -> None:
        """Stop every actor (and Ray, if this cluster started it); remove a temporary store."""
        for inst in self._live():
            try:
                self._ray.kill(inst.actor, no_restart=True)
            except (ValueError, self._ray.exceptions.RayError) as e:  # already gone
                log.debug("cluster: %s %d already stopped: %s", inst.role, inst.index, e)
            inst.alive = False
        if self._own_ray:
            self._ray.shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
