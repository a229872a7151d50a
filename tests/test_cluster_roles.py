"""Prefill/decode disaggregation (issue 23 item 1): the engine roles in one process, and a decode instance that is a
DP engine on 8 fake devices (``tests/sharded/dp_roles_check.py``, a subprocess). A prefill instance's handoff lets
the decode instance continue exactly what colocated ``LLM.generate`` computes; bad or lost handoffs recompute;
forwarding moves running requests. ``Cluster`` on Ray, which runs these roles as actors: ``test_cluster_pd.py``.

On a 5-layer cut of the tiny model (the ``model`` fixture).
"""

from __future__ import annotations

import numpy as np
import pytest
from cut_model import write_tiny_cut

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.cluster.handoff import decode_handoff, encode_handoff
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
def model(tmp_path_factory) -> str:
    """A checkpoint directory of the test model cut to 5 layers (``tests/cut_model.py``): every kind of per-request
    state a handoff carries is kept, and its programs compile and load in about half the time of the 12-layer
    ``"tiny"`` (what these tests are about is the handoff and the cluster, not the depth)."""
    return write_tiny_cut(tmp_path_factory.mktemp("tiny-5-layers"))


@pytest.fixture(scope="module")
def ref(model):
    return LLM(model, use_tqdm=False, **KW)


@pytest.fixture(scope="module")
def roles(model, tmp_path_factory):
    store = str(tmp_path_factory.mktemp("store"))
    return (PrefillInstance(LLM(model, use_tqdm=False, block_store=store, **KW)),
            DecodeInstance(LLM(model, use_tqdm=False, block_store=store, **KW)))


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


def _decoding(roles, prompts, sp, tag, steps):
    """``prompts`` prefilled and handed to the decode instance, which runs ``steps`` steps: (it, outputs so far)."""
    p, d = roles
    results = _prefill(p, prompts, sp, tag=tag)
    for i, ids in enumerate(prompts):
        d.add(ids, sp, f"{tag}{i}", results[f"{tag}{i}"].handoff)
    got = {}
    for _ in range(steps):
        for o in d.step():
            got[o.request_id] = o
    return d, got


def test_forwarded_requests_continue_exactly(ref, roles):
    """Scale-down: a decode instance hands its unfinished requests on mid-decode (here to itself)."""
    prompts = _prompts(5, (30, 45, 64))
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    d, got = _decoding(roles, prompts, sp, "f", 6)
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


def test_forwarding_some_requests_leaves_the_others_running(ref, roles):
    """Rebalancing: the instance hands on only the requests named (ids it does not have are ignored); the
    others keep decoding there from the next step, and everything continues exactly."""
    prompts = _prompts(6, (28, 47, 60))
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    d, got = _decoding(roles, prompts, sp, "m", 5)
    lengths = d.lengths()
    assert set(lengths) == {"m0", "m1", "m2"} and all(lengths[f"m{i}"] > len(prompts[i]) + 1 for i in range(3))
    finished, forwards = d.forward_unfinished(["m1", "not-here"])
    got.update({o.request_id: o for o in finished})
    assert [f.request_id for f in forwards] == ["m1"] and set(d.lengths()) == {"m0", "m2"}
    assert decode_handoff(forwards[0].handoff).source == "forward"
    for _ in range(3):  # the two left behind decode on before the moved one arrives back
        for o in d.step():
            got[o.request_id] = o
    assert d.add(prompts[1], sp, "m1", forwards[0].handoff) == "exact"
    got.update(_decode(d))
    assert [got[f"m{i}"].outputs[0].token_ids for i in range(3)] == _tokens(_reference(ref, prompts, sp))


# ---- a DP engine as an instance (8 fake devices; a subprocess: tests/sharded/dp_roles_check.py) ----
@pytest.fixture(scope="module")
def dp_roles():
    from sharded import run_checks

    return run_checks("dp_roles_check.py", "cpu-dp2-ep4", timeout=600)


def test_dp_decode_instance_continues_exactly_what_colocated_computes(dp_roles):
    row = dp_roles["roles"]
    assert row["dp_size"] == 2 and row["hows"] == ["exact"] * 5
    assert row["ranks"][:2] == [0, 1] and set(row["ranks"]) == {0, 1}  # a named rank is honoured; both ranks run
    assert [n for n, _ in row["loads"]] == [3, 2] and all(t > 0 for _, t in row["loads"])
    assert row["got"] == row["want"] and row["ids_equal"] and all(len(g) == 12 for g in row["got"])
    assert dp_roles["zeroed"]["differs"]  # control: the restored slot state (on its rank) is what makes it exact


def test_dp_decode_instance_forwards_from_its_ranks_exactly(dp_roles):
    row = dp_roles["forward"]
    assert set(row["ranks"]) == {0, 1} and row["forwarded"] == row["with_state"] == 3
    assert row["hows"] == ["exact"] * 3 and row["ids_equal"] and not row["unfinished"]


def test_dp_decode_instance_speculates_and_forwards_exactly(dp_roles):
    row = dp_roles["spec"]
    assert row["speculation"] == "dspark" and row["hows"] == ["exact"] * 4 and not row["unfinished"], row
    assert row["ids_equal"], row  # lossless after the handoff, across the forwarding to one device
    assert sorted(set(row["ranks"])) == [0, 1] and row["forwarded"] >= 1, row  # both ranks, some forwarded
    assert row["verified"] > 0 and sum(row["rank_verified"]) == row["verified"], row
    assert sum(1 for v in row["rank_verified"] if v) == 2, row  # drafts verified on both ranks


def test_dp_slot_copies_read_one_rank_with_one_collective(dp_roles):
    row = dp_roles["collectives"]
    assert row["names_equal"]  # the one-device slot layout: a slot moves between the two kinds of engine
    assert row["read"] == [["all-reduce", row["state_bytes"]]]  # one collective, the size of what it reads
    assert row["state_bytes"] * 2 < row["cache_bytes"] and row["write"] == []


def test_dp_roles_bad_rank_is_a_typed_error_naming_the_field(dp_roles):
    row = dp_roles["errors"]
    assert row["add_rank"] == ["RequestError", "rank"] and row["continuation_rank"] == ["RequestError", "rank"]
    assert row["snapshot_rank"][0] == "ValueError" and row["snapshot_rank"][1].startswith("rank")
    assert row["restore_rank"][0] == "ValueError" and row["restore_rank"][1].startswith("rank")
    assert not row["registered"]  # refused before anything was registered


def test_one_device_roles_refuse_a_rank_other_than_0(roles):
    from deepinfer_jax.engine import RequestError

    p, d = roles
    results = _prefill(p, _prompts(4, (20,)), tag="k")
    with pytest.raises(RequestError) as e:
        d.add(_prompts(4, (20,))[0], SP, "k0", results["k0"].handoff, rank=1)
    assert e.value.field == "rank" and "k0" not in d.engine.requests
    with pytest.raises(ValueError, match="rank"):
        d.llm.runner.snapshot_slot(0, rank=1)
    assert d.add(_prompts(4, (20,))[0], SP, "k0", results["k0"].handoff, rank=0) == "exact"
    (ld,) = d.rank_loads()  # one device: one rank, the whole instance's load
    assert d.dp_size == 1 and ld.num_requests == 1 and ld.kv_tokens == 21 and d.load() == (1, 21)
    _decode(d)


def test_dp_role_env_gives_the_actor_the_preset_devices_and_keeps_speculation():
    from deepinfer_jax.cluster.errors import PolicyInputError
    from deepinfer_jax.cluster.live import dp_role_env

    assert dp_role_env("decode", {"speculation": "mtp"}) == {}  # one device: the job's environment
    settings = {"sharding": "cpu-dp2-ep4", "speculation": "dspark"}  # a DP decode role speculates (issue 22)
    env = dp_role_env("decode", settings)
    assert "--xla_force_host_platform_device_count=8" in env["XLA_FLAGS"].split() and "PYTHONPATH" in env
    assert settings == {"sharding": "cpu-dp2-ep4", "speculation": "dspark"}
    with pytest.raises(PolicyInputError) as e:
        dp_role_env("decode", {"sharding": "no-such-preset"})
    assert e.value.field == "decode_settings.sharding"
