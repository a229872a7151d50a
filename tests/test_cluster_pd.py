"""Prefill/decode disaggregation (issue 23 items 1, 2, 4): the handoff format, the engine roles in
one process, and ``Cluster`` on Ray (greedy outputs identical to ``LLM.generate``; faults lose nothing).

The Ray tests start a local Ray (2 CPUs) with tiny engines; they are skipped, with the reason, only
when Ray cannot start here.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.cluster.handoff import Handoff, HandoffError, decode_handoff, encode_handoff
from deepinfer_jax.cluster.roles import DecodeInstance, PrefillInstance

KW = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 16, "max_model_len": 128, "chunking": "tokens",
          "speculation": "none"}
# several prompts: shorter than a block, exactly one block, longer with a partial last block, four blocks
LENGTHS = (5, 16, 37, 50, 64)
SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(seed: int, lengths=LENGTHS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 500, n).tolist() for n in lengths]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def ref():
    return LLM("tiny", use_tqdm=False, **KW)


@pytest.fixture(scope="module")
def roles(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("store"))
    return (PrefillInstance(LLM("tiny", use_tqdm=False, block_store=store, **KW)),
            DecodeInstance(LLM("tiny", use_tqdm=False, block_store=store, **KW)))


def _reference(ref, prompts, sp=SP):
    return ref.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _prefill(p: PrefillInstance, prompts, sp=SP, tag="r") -> dict:
    for i, ids in enumerate(prompts):
        p.add(ids, sp, f"{tag}{i}")
    results = {}
    while p.has_unfinished:
        for res in p.step():
            results[res.request_id] = res
    return results


def _decode(d: DecodeInstance) -> dict:
    out = {}
    while d.has_unfinished:
        for o in d.step():
            out[o.request_id] = o
    return out


# ---- the handoff format ----
def _handoff() -> Handoff:
    return Handoff("r0", [5, 6, 7], [9, 10], 3, "ab" * 32, ["cd" * 32], {"swa": np.arange(6, dtype=np.float32)},
                   {"kv": np.ones((1, 3), np.float32)})


def test_handoff_round_trip():
    h = _handoff()
    data = encode_handoff(h)
    back = decode_handoff(data, "ab" * 32, 3)
    assert back.length == 4 and back.output_ids == [9, 10] and back.digests == h.digests and back.nbytes == len(data)
    assert np.array_equal(back.slot_state["swa"], h.slot_state["swa"]) and np.array_equal(back.tail["kv"], h.tail["kv"])


@pytest.mark.parametrize("damage, field", [
    (lambda d: d[:-1], "checksum"),
    (lambda d: d[:10], "magic"),
    (lambda d: b"NOTAHOF1" + d[8:], "magic"),
    (lambda d: d[:40] + bytes([d[40] ^ 1]) + d[41:], "checksum"),
])
def test_corrupted_handoff_is_a_typed_error_naming_the_field(damage, field):
    with pytest.raises(HandoffError) as e:
        decode_handoff(damage(encode_handoff(_handoff())))
    assert e.value.field == field and str(e.value).startswith(field)


@pytest.mark.parametrize("change, check, field", [
    ({"version": 2}, {}, "version"),
    ({}, {"model": "ef" * 32}, "model"),
    ({}, {"block_size": 16}, "block_size"),
    ({"digests": []}, {}, "digests"),
    ({"tail": None}, {}, "tail"),
])
def test_mismatched_handoff_names_the_field(change, check, field):
    with pytest.raises(HandoffError) as e:
        decode_handoff(encode_handoff(dataclasses.replace(_handoff(), **change)), **check)
    assert e.value.field == field


# ---- the roles, in one process ----
def test_roles_continue_exactly_what_colocated_computes(ref, roles):
    p, d = roles
    prompts = _prompts(0)
    results = _prefill(p, prompts)
    assert all(r.handoff is not None and not r.output.finished for r in results.values())
    for i, ids in enumerate(prompts):
        assert d.add(ids, SP, f"r{i}", results[f"r{i}"].handoff) == "exact"
    got = _decode(d)
    assert [got[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))] == _tokens(_reference(ref, prompts))


def test_the_slot_state_is_what_makes_it_exact(ref, roles):
    """Control: the same handoff with its slot state zeroed continues differently."""
    p, d = roles
    prompts = _prompts(1, (37, 50))
    results = _prefill(p, prompts, tag="z")
    for i, ids in enumerate(prompts):
        h = decode_handoff(results[f"z{i}"].handoff)
        h.slot_state = {k: np.zeros_like(v) for k, v in h.slot_state.items()}
        assert d.add(ids, SP, f"z{i}", encode_handoff(h)) == "exact"
    got = _decode(d)
    assert [got[f"z{i}"].outputs[0].token_ids for i in range(2)] != _tokens(_reference(ref, prompts))


def test_first_token_that_ends_the_request_finishes_at_prefill(ref, roles):
    p, _ = roles
    sp = SamplingParams(temperature=0, max_tokens=1)
    res = _prefill(p, _prompts(2, (20,)), sp, tag="one")["one0"]
    assert res.handoff is None and res.output.finished and res.output.outputs[0].finish_reason == "length"
    assert res.output.outputs[0].token_ids == _tokens(_reference(ref, _prompts(2, (20,)), sp))[0]


def test_bad_handoff_recomputes_the_right_tokens(ref, roles):
    p, d = roles
    prompts = _prompts(3, (37, 50, 21))
    results = _prefill(p, prompts, tag="b")
    good = results["b2"].handoff
    corrupt = bytearray(results["b0"].handoff)
    corrupt[100] ^= 0xFF
    assert d.add(prompts[0], SP, "b0", bytes(corrupt)) == "recompute:checksum"
    other = decode_handoff(results["b1"].handoff)
    other.version = 99
    assert d.add(prompts[1], SP, "b1", encode_handoff(other)) == "recompute:version"
    assert d.add(prompts[2], SP, "b2", good[:-5]) == "recompute:checksum"  # truncated in transit
    got = _decode(d)
    assert [got[f"b{i}"].outputs[0].token_ids for i in range(3)] == _tokens(_reference(ref, prompts))


def test_store_write_failure_makes_the_decode_side_recompute(ref, roles, monkeypatch):
    p, d = roles
    prompts = _prompts(4, (40, 70))

    def broken(digest, payload):
        raise OSError("disk full")

    monkeypatch.setattr(p.prefix.files, "put", broken)
    results = _prefill(p, prompts, tag="w")
    monkeypatch.undo()
    assert all(not decode_handoff(r.handoff).written for r in results.values())
    for i, ids in enumerate(prompts):
        assert d.add(ids, SP, f"w{i}", results[f"w{i}"].handoff) == "recompute:missing_block"
    got = _decode(d)
    assert [got[f"w{i}"].outputs[0].token_ids for i in range(2)] == _tokens(_reference(ref, prompts))


def test_forwarded_requests_continue_exactly(ref, roles):
    """Scale-down: a decode instance hands its unfinished requests on mid-decode (here to itself)."""
    p, d = roles
    prompts = _prompts(5, (30, 45, 64))
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    results = _prefill(p, prompts, sp, tag="f")
    for i, ids in enumerate(prompts):
        d.add(ids, sp, f"f{i}", results[f"f{i}"].handoff)
    got = {}
    for _ in range(6):
        for o in d.step():
            got[o.request_id] = o
    finished, forwards = d.forward_unfinished()
    got.update({o.request_id: o for o in finished})
    assert forwards and not d.has_unfinished
    assert all(f.handoff is not None and decode_handoff(f.handoff).source == "forward" for f in forwards)
    assert any(len(decode_handoff(f.handoff).output_ids) > 1 for f in forwards)
    for f in forwards:
        i = int(f.request_id[1:])
        assert d.add(prompts[i], sp, f.request_id, f.handoff) == "exact"
    got.update(_decode(d))
    assert [got[f"f{i}"].outputs[0].token_ids for i in range(3)] == _tokens(_reference(ref, prompts, sp))


# ---- Cluster on Ray ----
@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray", reason="Ray (the 'cluster' extra) is not installed")
    from deepinfer_jax.cluster import Cluster

    try:
        c = Cluster(prefill=1, decode=1, model="tiny", decode_grace_s=0.0, **KW)
    except (ray.exceptions.RaySystemError, ConnectionError, RuntimeError) as e:
        pytest.skip(f"Ray cannot start here: {e}")
    yield c
    c.shutdown()


def _run_until(c, rids, timeout_s=120.0, until=None):
    end = time.perf_counter() + timeout_s
    done = {}
    while len(done) < len(rids):
        assert time.perf_counter() < end, "cluster did not finish in time"
        for o in c.step():
            assert o.request_id not in done, "an output came twice"
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
    prompts = _prompts(13, (25, 45, 64))
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    rids = cluster.submit([{"prompt_token_ids": p} for p in prompts], sp)
    retired = []

    def retire_a_busy_decoder():
        busy = [i for i in cluster._live("decode") if i.rids and i.accepting and i.call is not None]
        if busy:
            cluster.retire_decode(busy[0].index, grace_s=0.2)
            retired.append(busy[0])
            return True
        return False

    got = _run_until(cluster, rids, until=retire_a_busy_decoder)
    assert retired and not retired[0].alive and cluster.stats.duplicates == 0
    assert cluster.stats.forwarded >= 1
    assert _tokens(got) == _tokens(_reference(ref, prompts, sp))
