"""Prefill/decode disaggregation on Ray (issue 23 items 2, 4): ``Cluster`` with prefill and decode actors gives
greedy outputs identical to ``LLM.generate``; faults lose nothing; streaming per token; live decode rebalancing and
the live autoscaler. The roles it runs, in one process: ``test_cluster_roles.py``.

On a 5-layer cut of the tiny model (the ``model`` fixture). The tests start a local Ray (2 CPUs); they are skipped,
with the reason, only when Ray cannot start here.
"""

from __future__ import annotations

import math
import time

import pytest
from test_cluster_roles import KW, SP, _prompts, _reference, _tokens
from test_cluster_roles import model, ref  # noqa: F401 (module fixtures: this module gets its own instances)

from deepinfer_jax import SamplingParams


# ---- Cluster on Ray ----
@pytest.fixture(scope="module")
def cluster(model):
    ray = pytest.importorskip("ray", reason="Ray (the 'cluster' extra) is not installed")
    from deepinfer_jax.cluster import Cluster

    try:
        c = Cluster(prefill=1, decode=1, model=model, decode_grace_s=0.0, **KW)
    except (ray.exceptions.RaySystemError, ConnectionError, RuntimeError) as e:
        pytest.skip(f"Ray cannot start here: {e}")
    yield c
    c.shutdown()


def _run_until(c, rids, timeout_s=120.0, until=None):
    end = time.perf_counter() + timeout_s
    done, wanted = {}, set(rids)
    while len(done) < len(rids):
        assert time.perf_counter() < end, "cluster did not finish in time"
        for o in c.step():
            assert o.request_id not in done, "an output came twice"
            if o.request_id in wanted:  # an earlier failed test's requests may still finish on the shared cluster
                done[o.request_id] = o
        if until is not None and until():
            until = None
    return [done[r] for r in rids]


def test_cluster_greedy_equals_colocated(ref, cluster):
    prompts = _prompts(10)
    got = cluster.generate([{"prompt_token_ids": p} for p in prompts], SP, timeout_s=180)
    want = _reference(ref, prompts)
    assert _tokens(got) == _tokens(want)
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert all(o.finished and o.metrics.ttft is not None for o in got)
    assert cluster.stats.exact >= len(prompts) and cluster.stats.handoff_bytes > 0 and not cluster.stats.recomputed


def test_an_idle_cluster_step_waits_instead_of_spinning(cluster):
    """Nothing in flight: ``step`` waits its timeout (it returned at once, and a caller's loop spun a core), or
    only until a timer is due (here the rebalancing's tick)."""
    from deepinfer_jax.cluster.decode_rebalance import RebalanceSettings

    end = time.perf_counter() + 120
    while cluster.has_unfinished or any(i.call is not None for i in cluster._live()):  # an earlier test's leftovers
        assert time.perf_counter() < end, "the cluster did not become idle"
        cluster.step(timeout_s=0.1)
    wall, cpu = time.perf_counter(), time.process_time()
    assert cluster.step(timeout_s=0.2) == [] and cluster.step(timeout_s=0.2) == []
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert wall >= 0.38 and cpu < wall / 2, (wall, cpu)
    cluster.enable_rebalance(RebalanceSettings(tick_s=0.05, max_moves=4, threshold=1.05, cooldown_s=60.0))
    try:
        cluster.step(timeout_s=0.1)  # plans (nothing to move), the next tick 0.05 s on
        wall = time.perf_counter()
        cluster.step(timeout_s=30.0)
        assert time.perf_counter() - wall < 10.0  # woke for the tick, long before the timeout
    finally:
        cluster.enable_rebalance(None)


def test_cluster_decode_actor_killed_mid_request(ref, cluster):
    cluster.add_instance("decode")
    prompts = _prompts(11, (20, 40, 60, 33))
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    rids = cluster.submit([{"prompt_token_ids": p} for p in prompts], sp)
    killed = []

    def kill_a_busy_decoder():
        busy = [i for i in cluster._live("decode") if i.rids and i.call is not None]
        if busy:
            cluster.kill("decode", busy[0].index)
            killed.append(busy[0].index)
            return True
        return False

    got = _run_until(cluster, rids, until=kill_a_busy_decoder)
    assert killed and cluster.stats.resumed_decode >= 1 and cluster.stats.duplicates == 0
    assert _tokens(got) == _tokens(_reference(ref, prompts, sp))


def test_cluster_prefill_actor_killed(ref, cluster):
    cluster.add_instance("prefill")
    prompts = _prompts(12, (50, 60, 70, 80))
    rids = cluster.submit([{"prompt_token_ids": p} for p in prompts], SP)
    victim = max(cluster._live("prefill"), key=lambda i: len(i.rids))
    cluster.kill("prefill", victim.index)
    got = _run_until(cluster, rids)
    assert cluster.stats.rerouted_prefill >= 1
    assert _tokens(got) == _tokens(_reference(ref, prompts))


def test_cluster_retired_decode_forwards_after_grace(ref, cluster):
    if len([i for i in cluster._live("decode") if i.accepting]) < 2:
        cluster.add_instance("decode")
    prompts = _prompts(13, (25, 33, 40))
    sp = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)  # still decoding when the grace ends
    rids = cluster.submit([{"prompt_token_ids": p} for p in prompts], sp)
    retired = []

    def retire_a_busy_decoder():
        busy = [i for i in cluster._live("decode") if i.rids and i.accepting and i.call is not None]
        if busy:
            cluster.retire_decode(busy[0].index, grace_s=0.05)
            retired.append(busy[0])
            return True
        return False

    got = _run_until(cluster, rids, until=retire_a_busy_decoder)
    assert retired and not retired[0].alive and cluster.stats.duplicates == 0
    assert cluster.stats.forwarded >= 1
    assert _tokens(got) == _tokens(_reference(ref, prompts, sp))


# ---- streaming through the cluster (issue 23 item 2) ----
def _out(ids, text, finished=False, reason=None):
    from deepinfer_jax.engine.outputs import CompletionOutput, RequestOutput

    return RequestOutput("s0", None, [1, 2], [CompletionOutput(0, text, ids, reason)], finished, 0)


class _OrderedWait:
    """``ray.wait`` as documented: the first ``num_returns`` ready refs, in the input order."""

    def __init__(self, ready):
        self.ready, self.calls = set(ready), []

    def wait(self, refs, num_returns=1, timeout=None):
        self.calls.append((list(refs), num_returns, timeout))
        ready = [r for r in refs if r in self.ready][:num_returns]
        return ready, [r for r in refs if r not in ready]


def test_router_reads_every_answered_call_each_round():
    """A busy instance listed first answers every round; the new instance behind it must still be read
    (one answer per round starved it: a scale-up or pool instance then never became ready)."""
    from deepinfer_jax.cluster.live import answered

    fake = _OrderedWait({"prefill0", "decode0", "new"})
    assert answered(fake, ["prefill0", "decode0", "slow", "new"], 0.1) == ["prefill0", "decode0", "new"]
    assert fake.calls[0] == (["prefill0", "decode0", "slow", "new"], 1, 0.1)  # blocks only for the first
    assert fake.calls[1][2] == 0  # the rest: whatever is ready now, no waiting
    assert answered(_OrderedWait({"new"}), ["busy", "new"], 0.1) == ["new"]
    assert answered(_OrderedWait(set()), ["busy", "new"], 0.1) == []
    assert answered(_OrderedWait({"only"}), ["only"], 0.1) == ["only"]


def test_stream_cursor_holds_stop_text_and_skips_what_the_client_has():
    from deepinfer_jax.cluster.streaming import Partial, StreamCursor

    cur = StreamCursor(("xyz",))  # hold back 2 characters while it runs
    first = cur.first(_out([7], "abc"), 0.0, 1.0)
    assert first.outputs[0].token_ids == [7] and first.outputs[0].text == "a" and cur.start == (1, 1, 0)
    d = cur.partial(first, Partial(1, [8, 9], 1, "bcde"), 0.0, 1.0)
    assert d.outputs[0].token_ids == [8, 9] and d.outputs[0].text == "bcde" and cur.start == (3, 5, 0)
    # an instance that took over at the same position regenerates: only the new token comes through
    again = cur.partial(first, Partial(1, [8, 9, 10], 1, "bcdefg"), 0.0, 1.0)
    assert again.outputs[0].token_ids == [10] and again.outputs[0].text == "fg"
    assert cur.partial(first, Partial(2, [9], 3, "de"), 0.0, 1.0) is None  # nothing the client lacks
    last = cur.final(_out([7, 8, 9, 10, 11], "abcdefghi", True, "length"))
    assert last.finished and last.outputs[0].token_ids == [11] and last.outputs[0].text == "hi"
    assert last.outputs[0].finish_reason == "length"
    with pytest.raises(RuntimeError):  # a report after a gap would lose tokens: refused
        StreamCursor(()).partial(first, Partial(3, [1], 0, "x"), 0.0, 1.0)


def _stream(c, prompts, sp, on_delta=None, budget_s=0.0):
    """Run ``c.generate_stream``, one decode step per actor answer (``budget_s``); deltas by request."""
    old, c.budget_s = c.budget_s, budget_s
    try:
        by_rid: dict[str, list] = {}
        for d in c.generate_stream([{"prompt_token_ids": p} for p in prompts], sp):
            assert not (by_rid.get(d.request_id) and by_rid[d.request_id][-1].finished), "a delta after the last"
            by_rid.setdefault(d.request_id, []).append(d)
            if on_delta is not None:
                on_delta(d, by_rid[d.request_id])
    finally:
        c.budget_s = old
    return [by_rid[r] for r in sorted(by_rid, key=lambda r: int(r[1:]))]


def _joined(deltas):
    return ([t for d in deltas for t in d.outputs[0].token_ids], "".join(d.outputs[0].text for d in deltas))


def _check_stream(streams, want):
    assert len(streams) == len(want)
    for deltas, w in zip(streams, want):
        assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
        assert all(d.outputs[0].token_ids for d in deltas[:-1])  # no empty delta while it runs
        assert _joined(deltas) == (w.outputs[0].token_ids, w.outputs[0].text)
        assert deltas[-1].outputs[0].finish_reason == w.outputs[0].finish_reason


def test_cluster_stream_is_per_token_and_concatenates_to_colocated(ref, cluster):
    prompts = _prompts(20, (9, 30, 47))
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    streams = _stream(cluster, prompts, sp)
    _check_stream(streams, _reference(ref, prompts, sp))
    for deltas in streams:
        assert len(deltas[0].outputs[0].token_ids) == 1  # the prefill instance's first token, on its own
        # it really streams: deltas from the decode instance before the request finished
        assert len(deltas) >= 3 and sum(len(d.outputs[0].token_ids) for d in deltas[1:-1]) >= 1
    assert not any(r in cluster.requests for r in (d[0].request_id for d in streams))


def test_cluster_stream_request_finished_by_its_first_token(ref, cluster):
    prompts = _prompts(21, (12,))
    sp = SamplingParams(temperature=0, max_tokens=1)
    streams = _stream(cluster, prompts, sp)
    assert len(streams[0]) == 1
    _check_stream(streams, _reference(ref, prompts, sp))


def test_cluster_stream_closed_early_forgets_its_requests(cluster):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    it = cluster.generate_stream([{"prompt_token_ids": p} for p in _prompts(24, (15, 26))], sp)
    first = next(it)
    it.close()
    assert first.request_id in cluster.requests and cluster.requests[first.request_id].orphan
    end = time.perf_counter() + 120
    while cluster.has_unfinished:  # they still finish on the instances, then are dropped
        assert time.perf_counter() < end, "the closed stream's requests did not finish"
        cluster.step(timeout_s=0.1)
    assert first.request_id not in cluster.requests and not any(r.orphan for r in cluster.requests.values())


def _two_accepting_decoders(c):
    if len([i for i in c._live("decode") if i.accepting]) < 2:
        c.add_instance("decode")


def test_cluster_stream_survives_a_decode_actor_killed_mid_stream(ref, cluster):
    _two_accepting_decoders(cluster)
    prompts = _prompts(22, (20, 41, 58))
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    killed, before = [], cluster.stats.resumed_decode

    def kill_when_streamed(d, deltas):
        where = cluster.requests[d.request_id].where if d.request_id in cluster.requests else None
        if not killed and not d.finished and sum(len(x.outputs[0].token_ids) for x in deltas) >= 6 and where \
                and where[0] == "decode":
            cluster.kill("decode", where[1])
            killed.append(where[1])

    streams = _stream(cluster, prompts, sp, kill_when_streamed)
    assert killed and cluster.stats.resumed_decode > before and cluster.stats.duplicates == 0
    _check_stream(streams, _reference(ref, prompts, sp))


def test_cluster_stream_survives_retire_and_forwarding(ref, cluster):
    _two_accepting_decoders(cluster)
    prompts = _prompts(23, (25, 44, 61))
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    retired, before = [], cluster.stats.forwarded

    def retire_when_streamed(d, deltas):
        req = cluster.requests.get(d.request_id)
        if not retired and req is not None and not d.finished and req.where and req.where[0] == "decode" \
                and sum(len(x.outputs[0].token_ids) for x in deltas) >= 4:
            cluster.retire_decode(req.where[1], grace_s=0.0)
            retired.append(cluster.instances["decode"][req.where[1]])

    streams = _stream(cluster, prompts, sp, retire_when_streamed)
    assert retired and not retired[0].alive and cluster.stats.forwarded > before and cluster.stats.duplicates == 0
    _check_stream(streams, _reference(ref, prompts, sp))


# ---- live decode rebalancing (issue 23) ----
def test_cluster_rebalances_decode_onto_a_new_instance_mid_stream(ref, cluster):
    """A decode instance starts while every request runs on the others (a scale-up): the rebalancing
    migrates some to it mid-decode; streams and tokens equal colocated, nothing lost or sent twice."""
    from deepinfer_jax.cluster.decode_rebalance import RebalanceSettings

    prompts = _prompts(25, (22, 39, 52, 61))
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    before, exact, added, seen = cluster.stats.migrated, cluster.stats.exact, [], {}

    def add_an_instance_once_all_decode(d, deltas):
        seen[d.request_id] = sum(len(x.outputs[0].token_ids) for x in deltas)
        if not added and len(seen) == len(prompts) and min(seen.values()) >= 2 and not d.finished:
            added.append(cluster.add_instance("decode"))
            cluster.enable_rebalance(RebalanceSettings(tick_s=0.05, max_moves=4, threshold=1.05, cooldown_s=60.0))

    try:
        streams = _stream(cluster, prompts, sp, add_an_instance_once_all_decode)
    finally:
        cluster.enable_rebalance(None)
    assert added and cluster.stats.duplicates == 0
    moved = cluster.stats.migrated - before
    assert moved >= 1 and cluster.stats.exact - exact >= len(prompts) + moved  # every move admitted exactly
    new = cluster.instances["decode"][added[0]]
    assert cluster._ray.get(new.actor.stats.remote())["admitted"] >= 1  # the new instance decoded moved requests
    _check_stream(streams, _reference(ref, prompts, sp))


def test_cluster_plans_a_rebalance_right_after_each_decode_admission(ref, cluster, monkeypatch):
    """``RebalanceSettings.on_admit`` (the default): with the tick 1,000 s away, the plans after the enable's
    first one are the ones decode admissions asked for (``only_if_reachable``), and they see the admitted
    requests; without it, none."""
    from deepinfer_jax.cluster import live
    from deepinfer_jax.cluster.decode_rebalance import RebalanceSettings

    seen, reachable_only = [], []  # the requests per decode rank of every plan, and whether it was an admission's
    monkeypatch.setattr(live, "plan_moves", lambda ranks, *a, only_if_reachable=False, **k:
                        seen.append([len(r) for r in ranks]) or reachable_only.append(only_if_reachable) or [])
    prompts = _prompts(26, (21, 45, 30))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for on_admit in (True, False):
        _two_accepting_decoders(cluster)  # a plan needs two decode ranks in service
        seen.clear()
        reachable_only.clear()
        cluster.enable_rebalance(RebalanceSettings(tick_s=1000.0, on_admit=on_admit))
        try:
            got = cluster.generate([{"prompt_token_ids": p} for p in prompts], sp, timeout_s=180)
        finally:
            cluster.enable_rebalance(None)
        assert _tokens(got) == _tokens(_reference(ref, prompts, sp))
        if on_admit:
            assert len(seen) >= 2 and any(sum(r) > 0 for r in seen), seen
            assert reachable_only == [False] + [True] * (len(seen) - 1)  # the enable's tick, then admissions
        else:  # at most the enable's plan, at the first step, before any request reached decode
            assert len(seen) <= 1 and not any(sum(r) for r in seen), seen


# ---- the live autoscaler (issue 23) ----
def test_cluster_bad_settings_are_typed_errors_naming_the_field():
    pytest.importorskip("ray", reason="Ray (the 'cluster' extra) is not installed")
    from deepinfer_jax.cluster import Cluster
    from deepinfer_jax.cluster.autoscaler import AutoscalerSettings, RoleSettings
    from deepinfer_jax.cluster.errors import PolicyInputError

    with pytest.raises(PolicyInputError) as e:
        AutoscalerSettings(RoleSettings(1.0), RoleSettings(1.0), tick_s=-1.0)
    assert e.value.field == "tick_s"
    cases = [({"autoscaler": {"tick_s": 1.0}}, "autoscaler"),
             ({"autoscaler": AutoscalerSettings(RoleSettings(1.0), RoleSettings(1.0, min_instances=0))},
              "autoscaler.decode.min_instances"),
             ({"budget_s": -0.1}, "budget_s"), ({"decode_grace_s": "60"}, "decode_grace_s"),
             ({"prefill": 0}, "prefill"), ({"decode": 1.5}, "decode"),
             ({"decode_settings": {"sharding": "no-such-preset"}}, "decode_settings.sharding"),
             ({"rebalance": {"tick_s": 0.1}}, "rebalance")]
    for kw, field in cases:
        with pytest.raises(PolicyInputError) as e:
            Cluster(model="tiny", **kw)
        assert e.value.field == field and isinstance(e.value, ValueError)


def _fast_role(capacity, min_instances, max_instances):
    from deepinfer_jax.cluster.autoscaler import RoleSettings

    return RoleSettings(capacity, min_instances=min_instances, max_instances=max_instances, target_utilization=1.0,
                        margin_instances=0, margin_fraction=0.0, max_step_up=1, max_step_down=1, up_cooldown_s=0.0,
                        down_after_up_s=0.0, down_after_down_s=0.0, up_window_s=0.0, down_window_s=3.0,
                        sustain_window_s=0.0, down_hysteresis=0)


def _in_service(c, role):
    return len([i for i in c._live(role) if i.retire_at is None and not i.draining and not i.pooled])


def _scale_up_then_down(ref, c, role, settings, seed):
    """Keep ``c`` loaded until the autoscaler has added one ``role`` instance and it has served a
    request, then idle until it is scaled down again; returns (up events, down events) of ``role``.
    Every output must equal colocated, none lost or duplicated; no other role may change."""
    n = _in_service(c, role)
    c.enable_autoscaler(settings)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    events, sent, outs = c.stats.scale_events, [], {}
    start = len(events)
    try:
        end = time.perf_counter() + 600
        new, used, last_sent = None, False, -math.inf
        while True:  # four requests in flight (prefill: and two arriving every second) until the new one served
            assert time.perf_counter() < end, (
                f"the autoscaler did not scale up in time: {len(sent)} sent, {len(outs)} done, cached tokens "
                f"{sorted({o.num_cached_tokens for o in outs.values()})}, events {events[start:]}, new "
                f"{None if new is None else (new.ready, new.accepting, len(new.rids))}")
            # prefill: a closed loop alone stops sending while decode is slow (a loaded machine): no arrivals for
            # seconds read as an idle prefill role, and the scale-down would take the new instance before it served
            due = role == "prefill" and time.perf_counter() - last_sent > 1.0
            if not used and (sum(1 for r, _ in sent if r not in outs) < 4 or due):
                last_sent = time.perf_counter()
                # seeds of their own per test (seed * 1000 + n): a prompt another test already sent would be a
                # prefix hit in the shared store, no uncached tokens, and so no prefill scale-up
                prompts = _prompts(seed * 1000 + len(sent), (18, 33))
                sent += zip(c.submit([{"prompt_token_ids": p} for p in prompts], sp), prompts)
            if new is not None and new.rids:  # routed to it (a prefill instance answers within a step)
                used = True
            for o in c.step(timeout_s=0.1):
                assert o.request_id not in outs, "an output came twice"
                outs[o.request_id] = o
            if new is None and any(e.role == role for e in events[start:]):
                new = c.instances[role][-1]
                assert not new.ready and not new.accepting  # started without blocking, not routed to yet
            if new is not None and new.rids:
                assert new.ready
                used = True
            if used and all(r in outs for r, _ in sent):
                break
        while True:  # idle: back down, the instance that went out of service stopped
            assert time.perf_counter() < end, "the autoscaler did not scale down in time"
            c.step(timeout_s=0.1)
            time.sleep(0.05)
            down = [e for e in events[start:] if e.role == role and e.after < e.before]
            if down and not any(i.alive and (i.retire_at is not None or i.draining) for i in c.instances[role]):
                break
        assert all(e.role == role for e in events[start:])  # the other role stayed within its bounds
        up = [e for e in events[start:] if e.after > e.before]
    finally:
        c.enable_autoscaler(None)
    assert [(e.before, e.after) for e in up] == [(n, n + 1)] and up[0].reason
    assert [(e.before, e.after) for e in down] == [(n + 1, n)] and down[0].time > up[0].time
    assert len([i for i in c._live(role) if i.accepting]) == n == _in_service(c, role)
    assert c.stats.duplicates == 0 and set(outs) == {r for r, _ in sent}
    want = _reference(ref, [p for _, p in sent], sp)
    assert [outs[r].outputs[0].token_ids for r, _ in sent] == _tokens(want)
    for r, _ in sent:
        c.requests.pop(r, None)
    return up, down


def test_cluster_autoscaler_scales_decode_up_under_load_and_down_when_idle(ref, cluster):
    """Decode capacity: one running request per instance, so four running requests scale decode up
    (by one, to its bound); once idle it is retired (grace, forwarding) again."""
    from deepinfer_jax.cluster.autoscaler import AutoscalerSettings

    n_p, n_d = _in_service(cluster, "prefill"), _in_service(cluster, "decode")
    settings = AutoscalerSettings(_fast_role(1e9, n_p, n_p), _fast_role(1.0, n_d, n_d + 1), ready_pool=0, tick_s=0.2)
    up, _ = _scale_up_then_down(ref, cluster, "decode", settings, 30)
    assert "needs" in up[0].reason


def test_cluster_autoscaler_scales_prefill_with_the_uncached_token_rate(ref, cluster):
    """Prefill capacity: one uncached token/s per instance, so routed prompts scale prefill up (by
    one, to its bound); once idle the instance is drained (no new requests) and stopped."""
    from deepinfer_jax.cluster.autoscaler import AutoscalerSettings

    n_p, n_d = _in_service(cluster, "prefill"), _in_service(cluster, "decode")
    settings = AutoscalerSettings(_fast_role(1.0, n_p, n_p + 1), _fast_role(1e9, n_d, n_d), ready_pool=0, tick_s=0.2)
    drained = {i.index for i in cluster.instances["prefill"] if i.draining}
    _scale_up_then_down(ref, cluster, "prefill", settings, 60)
    now_drained = [i for i in cluster.instances["prefill"] if i.draining and i.index not in drained]
    assert len(now_drained) == 1 and not now_drained[0].alive and not now_drained[0].rids


def test_cluster_autoscaler_replaces_a_dead_decode_instance(ref, cluster):
    """Recovery: a decode actor dies; its requests are rerouted to the spare instance, and the
    autoscaler (below ``min_instances``) starts a replacement."""
    from deepinfer_jax.cluster.autoscaler import AutoscalerSettings

    _two_accepting_decoders(cluster)
    n_p, n_d = _in_service(cluster, "prefill"), _in_service(cluster, "decode")
    cluster.enable_autoscaler(AutoscalerSettings(_fast_role(1e9, n_p, n_p), _fast_role(1e9, n_d, n_d), ready_pool=0,
                                                 tick_s=0.2))
    try:
        victim, before = cluster._live("decode")[-1], len(cluster.instances["decode"])
        cluster.kill("decode", victim.index)
        prompts = _prompts(90, (20, 30, 40, 50))
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        rids = cluster.submit([{"prompt_token_ids": p} for p in prompts], sp)
        got = _run_until(cluster, rids, timeout_s=300)
        end = time.perf_counter() + 300
        while not any(i.alive and i.ready for i in cluster.instances["decode"][before:]):  # the replacement
            assert time.perf_counter() < end, "no replacement started"
            cluster.step(timeout_s=0.1)
            time.sleep(0.05)
    finally:
        cluster.enable_autoscaler(None)
    assert not victim.alive
    ups = [e for e in cluster.stats.scale_events if e.role == "decode" and e.reason == "below min_instances"]
    assert ups and (ups[-1].before, ups[-1].after) == (n_d - 1, n_d) and _in_service(cluster, "decode") == n_d
    assert _tokens(got) == _tokens(_reference(ref, prompts, sp))
    for r in rids:
        cluster.requests.pop(r, None)


def test_cluster_autoscaler_scales_up_from_the_ready_pool_at_once(ref, cluster):
    """A ready pool of one: the scale-up puts the pool's started decode instance in service in the same
    tick (routed to at once, no engine start to wait for) and starts a new pool instance behind it;
    switching the autoscaler off stops the pool. Outputs equal colocated."""
    from deepinfer_jax.cluster.autoscaler import AutoscalerSettings

    n_p, n_d = _in_service(cluster, "prefill"), _in_service(cluster, "decode")
    cluster.enable_autoscaler(AutoscalerSettings(_fast_role(1e9, n_p, n_p), _fast_role(1.0, n_d, n_d + 1),
                                                 ready_pool=1, tick_s=0.2))
    pooled = list(cluster.scaler.pool)
    assert [i.role for i in pooled] == ["decode"] and not pooled[0].accepting
    assert _in_service(cluster, "decode") == n_d  # a pooled instance is not in service
    events, start = cluster.stats.scale_events, len(cluster.stats.scale_events)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sent = []  # (request id, prompt)
    try:
        end = time.perf_counter() + 300
        while not pooled[0].ready:  # the pool's engine starts in the background
            assert time.perf_counter() < end, "the pool instance did not start"
            cluster.step(timeout_s=0.1)
        assert not pooled[0].accepting and not events[start:]
        got, up = {}, None
        while up is None or len(got) < len(sent):  # four requests in flight until the scale-up
            assert time.perf_counter() < end, "no scale-up" if up is None else "unfinished"
            if up is None and sum(1 for r, _ in sent if r not in got) < 4:
                batch = _prompts(70_000 + len(sent), (18, 33))  # its own seeds (see _scale_up_then_down)
                sent += zip(cluster.submit([{"prompt_token_ids": p} for p in batch], sp), batch)
            for o in cluster.step(timeout_s=0.1):
                got[o.request_id] = o
            ups = [e for e in events[start:] if e.role == "decode" and e.after > e.before]
            if up is None and ups:
                up = ups[0]
                assert up.from_pool == 1 and pooled[0].accepting and not pooled[0].pooled  # in service at once
                refill = cluster.scaler.pool
                assert len(refill) == 1 and refill[0] is not pooled[0] and refill[0].role == "decode"
    finally:
        cluster.enable_autoscaler(None)
    assert not refill[0].alive  # the pool stopped with the scaler
    rids, prompts = [r for r, _ in sent], [p for _, p in sent]
    assert _tokens([got[r] for r in rids]) == _tokens(_reference(ref, prompts, sp))
    for r in rids:
        cluster.requests.pop(r, None)


def test_cluster_with_a_dp_decode_instance_equals_colocated(ref, cluster, model):
    """A DP engine (cpu-dp2-ep4 on its actor's 8 fake devices) as one decode instance on Ray: every
    request handed over exactly (nothing recomputed), spread over its ranks, tokens equal colocated."""
    from deepinfer_jax.cluster import Cluster

    prompts = _prompts(31, (5, 16, 37, 50))
    with Cluster(prefill=1, decode=1, model=model, decode_grace_s=0.0,
                 decode_settings={"sharding": "cpu-dp2-ep4"}, **KW) as dp:
        assert [i.dp_size for i in dp.instances["decode"]] == [2]
        outs = dp.generate([{"prompt_token_ids": p} for p in prompts], SP, timeout_s=600)
        assert dp.stats.exact == len(prompts) and not dp.stats.recomputed and dp.stats.duplicates == 0
        stats = dp._ray.get(dp.instances["decode"][0].actor.stats.remote())
    assert _tokens(outs) == _tokens(_reference(ref, prompts))
    assert len(stats["rank_requests"]) == 2 and min(stats["rank_requests"]) > 0  # both ranks decoded
