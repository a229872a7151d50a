"""A discrete-event simulator of the disaggregated cluster (issue 23 item 6; docs/cluster.md).

Events (a ``heapq`` of ``(time, seq, kind, payload)``): request arrivals, prefill engine steps,
decode instance events, metric samples, bucket re-size rounds. What happens:

* **Entry**: the request's block chain is matched against the store index (``prefix_index``):
  hit and uncached tokens are known before routing; quota = ``cost(q, c)``.
* **Prefill** engines of ``prefill_ranks`` DP ranks step in lockstep: each rank fills the step
  budget from its FIFO queue with the cost model's chunking (``CostModel.largest_q``, layer 4; for
  ``deepinfer*`` the budget of a step where two or more ranks have work is ``matched_step_budget``), a
  step lasts ``a0 + max over ranks`` of the chunk costs. A finished prompt writes its blocks to
  the index and is handed to decode at once (TTFT = prefill end - arrival). ``gather_ns`` (off by
  default, every policy): an idle engine given fewer requests than ranks waits for more first.
* **Decode** instances of ``decode_ranks`` ranks step in lockstep with ``DecodeStepModel``; every
  running request gains ``tokens_per_step`` tokens per step. The simulation is exact between
  events for the step count and re-reads the step time at every event (arrival, finish, and a
  refresh every ``decode_refresh_s``, since KV grows between them). A finished request writes the
  blocks its output completed (TPOT = decode time / output tokens).
* **Policies**: ``deepinfer`` (the prefill balancer's four layers with a ``SlotRule`` fed each rank's
  waiting work and the time left of each engine's running step, ``pick_decode_rank``) against
  ``round_robin``, ``request_count`` (vLLM-router style: fewest outstanding requests) and
  ``random``, each over all ranks, flat; ``deepinfer_migrate``: ``deepinfer`` plus a rebalance every
  ``RebalanceSettings.tick_s`` and after each decode admission (``on_admit``, unless one request keeps
  the threshold out of reach; ``decode_rebalance.plan_moves`` over all decode ranks): a moved
  request leaves its rank, is in flight for ``migration_pause_s`` (its KV counted on the
  destination rank in every reading meanwhile, though it does not decode) and resumes there; the
  pause is in its TPOT.

Balance readings, each ``sum of the max / sum of the mean`` over samples in the measured window (a
ratio of averages, so idle moments never divide by zero; docs/cluster.md): ``prefill_balance``,
every lockstep step of every engine, its ranks' chunk costs (the step lasts as long as the slowest
rank, the others pad: the ``moe_lb`` reading of engine.md §3 for attention ranks), with
``prefill_bound`` (the max replaced by the step's work over ``min(requests the engine holds,
ranks)``: an engine holding fewer requests than ranks pads whatever the rank placement) and
``prefill_bound_tier`` (the same with the requests all prefill engines hold: what gathering them
could reach, by making requests wait for a partner);
``prefill_window_balance``, every ``window_s`` the quota each of all prefill ranks ran;
``decode_balance``, every ``sample_s`` the attention cost ``d2 * kv`` of every rank of every
instance, with ``decode_bound`` (the max replaced by ``max(largest running request, mean)``: no
placement does better) and ``decode_step_balance`` (the whole ``d1 rows + d2 kv``). Deterministic
for a given trace, shape and seed.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass

import numpy as np

from deepinfer_jax.cluster.decode_balancer import DecodeInstanceView, pick_decode_rank
from deepinfer_jax.cluster.decode_rebalance import RebalanceSettings, migration_pause_s, plan_moves
from deepinfer_jax.cluster.errors import PolicyInputError, check_int, check_number
from deepinfer_jax.cluster.prefill_balancer import (PrefillBalancer, SlotRule, length_bucket, matched_step_budget,
                                                    request_quota)
from deepinfer_jax.cluster.prefix_index import PrefixIndex, match_digests
from deepinfer_jax.cluster.step_models import DecodeStepModel, production_prefill_model
from deepinfer_jax.cluster.traces import Trace
from deepinfer_jax.engine.dp_router import RankLoad

__all__ = ["POLICIES", "ClusterShape", "SimResult", "simulate"]

POLICIES = ("deepinfer", "deepinfer_migrate", "round_robin", "request_count", "random")
BUCKET_NAMES = ("<16K", "16-64K", "64-256K", ">=256K")


@dataclass(frozen=True)
class ClusterShape:
    """Instances and their DP ranks (default: the seed's 64 prefill + 64 decode ranks)."""

    prefill_engines: int = 16
    prefill_ranks: int = 4
    decode_instances: int = 4
    decode_ranks: int = 16
    step_budget_ns: float = 250e6
    round_s: float = 5.0
    sample_s: float = 0.25
    decode_refresh_s: float = 0.5
    window_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("prefill_engines", "prefill_ranks", "decode_instances", "decode_ranks"):
            check_int(name, getattr(self, name), 1)
        for name in ("step_budget_ns", "round_s", "sample_s", "decode_refresh_s", "window_s"):
            check_number(name, getattr(self, name), 0.0, strict=True)


@dataclass
class SimResult:
    policy: str
    trace: str
    ttft_ms: dict          # bucket name -> (p50, p99, count)
    tpot_ms: tuple         # (p50, p99)
    prefill_balance: float
    decode_balance: float
    output_tok_s: float
    input_tok_s: float
    hit_rate: float
    finished: int
    measured: int
    prefill_util: float    # quota arrived / prefill capacity over the measured window
    decode_rows: float     # mean running requests per decode rank
    prefill_window_balance: float  # max/mean over all prefill ranks of the quota each ran per window_s
    decode_bound: float    # the least decode max/mean any placement could reach (largest request / mean)
    decode_step_balance: float     # max/mean of the whole rank step cost d1 * rows + d2 * kv
    migrations: int = 0            # decode requests moved by the rebalancer (deepinfer_migrate)
    prefill_bound: float = float("nan")  # per step: the work over min(requests the engine holds, ranks)
    prefill_bound_tier: float = float("nan")  # the same over the requests all prefill engines hold


class _Job:
    __slots__ = ("bucket", "c", "q", "req")

    def __init__(self, req, q, c, bucket):
        self.req, self.q, self.c, self.bucket = req, q, c, bucket


def simulate(trace: Trace, policy: str, shape: ClusterShape = ClusterShape(), cost_model=None,
             decode_model: DecodeStepModel | None = None, seed: int = 0, warmup_s: float | None = None,
             drain_s: float = 120.0, rebalance: RebalanceSettings = RebalanceSettings(),
             pairing: float | None = 4.0, tie_ns: float = 20e6, match_floor_ns: float | None = 10e6,
             bucket_penalty_ns: float | None = 20e6, gather_ns: float = 0.0) -> SimResult:
    """Run ``trace`` under ``policy``; metrics cover requests arriving after ``warmup_s``
    (default 20% of the trace). ``rebalance`` only matters for ``deepinfer_migrate``; ``pairing``,
    ``tie_ns``, ``match_floor_ns`` and ``bucket_penalty_ns`` are the prefill balancer's ``SlotRule`` for
    ``deepinfer*`` (``pairing=None``: the rule before it, hard buckets, most remaining quota then least
    backlog, whole-budget chunks). ``gather_ns`` is an engine setting for
    every policy (0: off): an idle prefill engine that gets fewer requests than ranks waits up to
    that long, or until every rank has one, before its first step."""
    if policy not in POLICIES:
        raise PolicyInputError("policy", f"must be one of {POLICIES}, got {policy!r}")
    if not trace.requests:
        raise PolicyInputError("trace", "has no requests")
    check_number("gather_ns", gather_ns)
    cm = cost_model or production_prefill_model()
    a0 = float(cm.coef[0])
    slot = None if pairing is None else SlotRule(a0, shape.step_budget_ns, pairing, tie_ns, match_floor_ns,
                                                  bucket_penalty_ns)
    dm = decode_model or DecodeStepModel()
    tps = dm.tokens_per_step
    warm = trace.duration_s * 0.2 if warmup_s is None else warmup_s
    rng = random.Random(seed)
    index = PrefixIndex(set(trace.warm_blocks))
    E, R, D, DR = shape.prefill_engines, shape.prefill_ranks, shape.decode_instances, shape.decode_ranks
    # prefill state
    queues = [[deque() for _ in range(R)] for _ in range(E)]
    backlog = [[0.0] * R for _ in range(E)]
    stepping = [False] * E
    running_cost = [[0.0] * R for _ in range(E)]  # each rank's chunk cost in the step now running
    step_end = [0.0] * E  # the end of the running step (or of an idle engine's gather wait)
    gathering = [False] * E
    ours = policy in ("deepinfer", "deepinfer_migrate")
    balancer = PrefillBalancer(E, shape.round_s * 1e9, slot=slot) if ours else None
    match_floor = slot.match_floor_ns if ours and slot is not None else None  # layer 4, ours only
    # decode state
    rows = [[0] * DR for _ in range(D)]
    base = [[0.0] * DR for _ in range(D)]
    progress = [0.0] * D
    step_ns = [dm.d0] * D
    last_t = [0.0] * D
    version = [0] * D
    running: list[list] = [[] for _ in range(D)]  # heaps of (finish_step, rid, rank, join, req, admit_t)
    counters = {"rr_p": 0, "rr_d": 0, "moves": 0}
    pending = [[0.0] * DR for _ in range(D)]  # KV of migrating requests, counted on their destination
    last_moved: dict[int, float] = {}
    events: list = []
    seq = 0

    def push(t, kind, payload):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    ttft: dict[int, list] = {b: [] for b in range(4)}
    tpot: list = []
    samples_p: list = []
    samples_pb: list = []  # the step's work over min(requests the engine holds, ranks): the prefill bound
    samples_pc: list = []  # the same with the requests the whole prefill tier holds
    samples_d: list = []
    out_tokens = in_tokens = hit_tokens = 0
    quota_in = 0.0
    rows_samples: list = []
    measured = finished = 0
    t_end = trace.duration_s
    n_windows = max(int((t_end - warm) / shape.window_s), 1)
    windows = [[0.0] * (E * R) for _ in range(n_windows)]
    samples_bound: list = []
    samples_step: list = []

    def kv_of(i, r):
        return base[i][r] + rows[i][r] * progress[i] * tps

    def advance(i, now):
        if step_ns[i] > 0 and now > last_t[i]:
            progress[i] += (now - last_t[i]) * 1e9 / step_ns[i]
        last_t[i] = now

    def retime(i, now):
        worst = max(dm.rank_ns(rows[i][r], kv_of(i, r)) for r in range(DR))
        step_ns[i] = dm.d0 + worst
        version[i] += 1
        if running[i]:
            steps_left = max(0.0, running[i][0][0] - progress[i])
            dt = min(steps_left * step_ns[i] / 1e9, shape.decode_refresh_s)
            push(now + dt, "decode", (i, version[i]))

    def route_prefill(req, quota, now):
        if ours:
            waiting = [[max(0.0, backlog[e][r] - running_cost[e][r]) if stepping[e] else backlog[e][r]
                        for r in range(R)] for e in range(E)]
            busy = [max(0.0, step_end[e] - now) * 1e9 if stepping[e] or gathering[e] else 0.0 for e in range(E)]
            return balancer.route(req.num_tokens, quota, backlog, None, waiting, busy)
        n = E * R
        if policy == "round_robin":
            k = counters["rr_p"] % n
            counters["rr_p"] += 1
        elif policy == "random":
            k = rng.randrange(n)
        else:
            k = min(range(n), key=lambda j: (len(queues[j // R][j % R]), j))
        return k // R, k % R

    def route_decode(num_tokens):
        if ours:
            views = [DecodeInstanceView(tuple(RankLoad(rows[i][r], int(kv_of(i, r) + pending[i][r]))
                                              for r in range(DR)))
                     for i in range(D)]
            return pick_decode_rank(views, num_tokens)
        n = D * DR
        if policy == "round_robin":
            k = counters["rr_d"] % n
            counters["rr_d"] += 1
        elif policy == "random":
            k = rng.randrange(n)
        else:
            k = min(range(n), key=lambda j: (rows[j // DR][j % DR], j))
        return k // DR, k % DR

    def chunk(queue, budget, done=None):
        """The chunks one rank runs in a step within ``budget`` (layer 4); their cost. With ``done``
        (a list) the jobs advance and the finished ones are appended, else nothing changes."""
        spent_all, left = 0.0, budget
        for job in queue:
            q = cm.largest_q(left, job.c, job.q)
            if q <= 0:
                if spent_all > 0:
                    break
                q = min(job.q, 128)  # a step always advances its first chunk
            spent = cm.chunk_cost(q, job.c)
            spent_all += spent
            left -= spent
            rest = job.q - q
            if done is not None:
                job.q, job.c = rest, job.c + q
                if rest == 0:
                    done.append(job)
            if left <= 0 or rest > 0:
                break
        return spent_all

    def start_step(e, now):
        held = sum(map(len, queues[e]))
        budget = shape.step_budget_ns
        if match_floor is not None:
            budget = matched_step_budget([chunk(queues[e][r], budget) for r in range(R)], budget, match_floor)
        cost = [0.0] * R
        done = []
        for r in range(R):
            finished = []
            cost[r] = chunk(queues[e][r], budget, finished)
            done.extend((r, job) for job in finished)
        stepping[e] = True
        if warm <= now < t_end:
            samples_p.append((max(cost), sum(cost) / R))
            held_all = sum(len(q) for qs in queues for q in qs)
            samples_pb.append((sum(cost) / min(held, R), sum(cost) / R))
            samples_pc.append((sum(cost) / min(held_all, R), sum(cost) / R))
            w = int((now - warm) / shape.window_s)
            if w < n_windows:
                row = windows[w]
                for r in range(R):
                    row[e * R + r] += cost[r]
        running_cost[e] = cost
        step_end[e] = now + (a0 + max(cost)) / 1e9
        push(step_end[e], "pstep", (e, done))

    def admit_decode(req, now):
        i, r = route_decode(req.num_tokens)
        advance(i, now)
        steps = math.ceil(req.output_tokens / tps)
        rows[i][r] += 1
        base[i][r] += req.num_tokens - progress[i] * tps
        heapq.heappush(running[i], (progress[i] + steps, req.rid, r, progress[i], req, now))
        retime(i, now)
        if policy == "deepinfer_migrate" and rebalance.on_admit:
            rebalance_tick(now, admission=True)

    def rebalance_tick(now, admission=False):
        placed = {}  # with ``settle``: admission counts as a placement for the cooldown
        for i in range(D):
            advance(i, now)
        loads = [kv_of(i, r) + pending[i][r] for i in range(D) for r in range(DR)]
        if max(loads) * len(loads) <= rebalance.threshold * sum(loads) * (1 - 1e-6):
            return  # balanced with a margin for rounding: plan_moves would plan nothing (skips listing requests)
        ranks = [[] for _ in range(D * DR)]
        where = {}
        for i in range(D):
            for entry in running[i]:
                _, rid, r, join, req, admit_t = entry
                ranks[i * DR + r].append((rid, req.num_tokens + (progress[i] - join) * tps))
                where[rid] = (i, entry)
                if rebalance.settle and rid not in last_moved:
                    placed[rid] = admit_t
        locked = {**placed, **last_moved}
        for k in range(D * DR):  # in flight: counted on the destination, and never moved again
            if pending[k // DR][k % DR] > 0:
                ranks[k].append((-1 - k, pending[k // DR][k % DR]))
                locked[-1 - k] = now
        moves = plan_moves(ranks, rebalance.max_moves, rebalance.threshold, now, locked, rebalance.cooldown_s,
                           rebalance.keep_rows, only_if_reachable=admission)
        touched = set()
        for mv in moves:
            if mv.rid < 0:
                continue
            i, entry = where[mv.rid]
            finish, rid, r, join, req, admit_t = entry
            running[i].remove(entry)
            heapq.heapify(running[i])
            rows[i][r] -= 1
            base[i][r] -= req.num_tokens - join * tps
            j, r2 = divmod(mv.dst, DR)
            pending[j][r2] += mv.kv
            pause = migration_pause_s(mv.kv, rebalance.bandwidth_gb_s)
            last_moved[rid] = now + pause
            counters["moves"] += 1
            push(now + pause, "land", (j, r2, mv.kv, finish - progress[i], req, admit_t))
            touched.add(i)
        for i in touched:
            retime(i, now)

    def land(payload, now):
        j, r, kv, steps_left, req, admit_t = payload
        advance(j, now)
        pending[j][r] -= kv
        join = progress[j] - (kv - req.num_tokens) / tps
        rows[j][r] += 1
        base[j][r] += req.num_tokens - join * tps
        heapq.heappush(running[j], (progress[j] + steps_left, req.rid, r, join, req, admit_t))
        retime(j, now)

    for req in trace.requests:
        push(req.arrival, "arrive", req)
    t = 0.0
    while t < t_end:
        push(t, "sample", None)
        t += shape.sample_s
    if balancer is not None:
        t = shape.round_s
        while t < t_end + drain_s:
            push(t, "round", None)
            t += shape.round_s
    if policy == "deepinfer_migrate":
        t = rebalance.tick_s
        while t < t_end + drain_s:
            push(t, "rebalance", None)
            t += rebalance.tick_s
    limit = t_end + drain_s
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if now > limit:
            break
        if kind == "arrive":
            req = payload
            m = match_digests(req.chain[: req.prompt_blocks], req.num_tokens, index)
            q, c = m.uncached_tokens + m.replay_tokens, m.hit_tokens - m.replay_tokens
            quota = request_quota(cm, m.uncached_tokens, m.hit_tokens, m.replay_tokens)
            if req.arrival >= warm:
                hit_tokens += m.hit_tokens
                in_tokens += req.num_tokens
                quota_in += quota
            e, r = route_prefill(req, quota, now)
            queues[e][r].append(_Job(req, q, c, length_bucket(req.num_tokens)))
            backlog[e][r] += quota
            if gathering[e] and all(queues[e]):
                gathering[e] = False  # every rank has work: no reason to wait longer
                start_step(e, now)
            elif not stepping[e] and not gathering[e]:
                if gather_ns > 0 and not all(queues[e]):
                    gathering[e] = True
                    step_end[e] = now + gather_ns / 1e9
                    push(step_end[e], "gather", e)
                else:
                    start_step(e, now)
        elif kind == "gather":
            if gathering[payload]:
                gathering[payload] = False
                start_step(payload, now)
        elif kind == "pstep":
            e, done = payload
            for r, job in done:
                queues[e][r].remove(job)
                req = job.req
                index.add(req.chain[: req.prompt_blocks])
                if req.arrival >= warm:
                    ttft[job.bucket].append(now - req.arrival)
                admit_decode(req, now)
            for r in range(R):
                backlog[e][r] = sum(cm.chunk_cost(j.q, j.c) for j in queues[e][r])
            stepping[e] = False
            if any(queues[e]):
                start_step(e, now)
        elif kind == "decode":
            i, ver = payload
            if ver != version[i]:
                continue
            advance(i, now)
            h = running[i]
            while h and h[0][0] <= progress[i] + 1e-9:
                _, _, r, join, req, admit_t = heapq.heappop(h)
                rows[i][r] -= 1
                base[i][r] -= req.num_tokens - join * tps
                index.add(req.chain[req.prompt_blocks: req.done_blocks])
                finished += 1
                if req.arrival >= warm:
                    measured += 1
                    tpot.append((now - admit_t) / req.output_tokens)
                    if now <= t_end:
                        out_tokens += req.output_tokens
            retime(i, now)
        elif kind == "sample":
            if now >= warm:
                for i in range(D):
                    advance(i, now)
                att = [dm.attention_ns(kv_of(i, r) + pending[i][r]) for i in range(D) for r in range(DR)]
                mean = sum(att) / len(att)
                samples_d.append((max(att), mean))
                biggest = max((req.num_tokens + (progress[i] - join) * tps for i in range(D)
                               for (_, _, _, join, req, _) in running[i]), default=0.0)
                biggest = max(biggest, max(map(max, pending)))  # a migrating request (upper bound)
                samples_bound.append((max(dm.attention_ns(biggest), mean), mean))
                cost = [dm.rank_ns(rows[i][r], kv_of(i, r) + pending[i][r]) for i in range(D) for r in range(DR)]
                samples_step.append((max(cost), sum(cost) / len(cost)))
                rows_samples.append(sum(map(sum, rows)) / (D * DR))
        elif kind == "rebalance":
            rebalance_tick(now)
        elif kind == "land":
            land(payload, now)
        elif kind == "round":
            balancer.end_round([sum(b) for b in backlog])

    def ratio(samples):
        mean = sum(s[1] for s in samples)
        return sum(s[0] for s in samples) / mean if mean > 0 else float("nan")

    def pct(xs, p):
        return float(np.percentile(xs, p)) * 1e3 if xs else float("nan")

    span = max(t_end - warm, 1e-9)
    return SimResult(
        policy, trace.name,
        {BUCKET_NAMES[b]: (pct(ttft[b], 50), pct(ttft[b], 99), len(ttft[b])) for b in range(4)},
        (pct(tpot, 50), pct(tpot, 99)), ratio(samples_p), ratio(samples_d), out_tokens / span, in_tokens / span,
        hit_tokens / in_tokens if in_tokens else 0.0, finished, measured, quota_in / (E * R * span * 1e9),
        sum(rows_samples) / max(len(rows_samples), 1),
        ratio([(max(w), sum(w) / len(w)) for w in windows]), ratio(samples_bound), ratio(samples_step),
        counters["moves"], ratio(samples_pb), ratio(samples_pc))
