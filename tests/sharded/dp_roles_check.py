"""The engine roles with a DP engine (issue 23: a DP engine is one instance), on 8 fake CPU devices.

Run from the repository root with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``:
``python tests/sharded/dp_roles_check.py PRESET``. Prints JSON rows:

- ``roles``: a one-device prefill instance hands greedy prompts to a decode instance that is a DP engine
  (``sharding=PRESET``; some handoffs on a rank the caller names, the rest routed by the DP router): the
  admissions, the ranks they ran on, and the tokens against the colocated one-device ``LLM.generate``;
- ``zeroed``: control, the same handoffs with their slot state zeroed continue differently;
- ``forward``: the DP decode instance forwards its requests mid-decode (``snapshot_slot`` / ``read_blocks`` on
  their ranks) to a one-device decode instance, which finishes them: tokens against the colocated engine;
- ``collectives``: the compiled over-the-mesh ``snapshot_slot`` / ``restore_slot`` programs' collectives
  (kind, bytes) and the slot state's bytes;
- ``spec``: a DP decode instance with speculation (``dspark``, a drafter that often agrees with the model)
  admits handoffs, verifies drafts on their ranks, and forwards the unfinished ones mid-decode to the
  one-device decode instance: tokens against the colocated engine, drafts verified per rank;
- ``errors``: bad input (a rank out of range) and the fields the typed errors name;

then ``{"check": "done"}``.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time

import jax
import numpy as np
from dp_engine_check import SETTINGS
from dp_prefix_check import agreeing_drafter
from shard_common import model_and_inputs

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.cluster.handoff import decode_handoff, encode_handoff
from deepinfer_jax.cluster.roles import DecodeInstance, PrefillInstance
from deepinfer_jax.engine import RequestError

KW = {**SETTINGS, "enable_prefix_caching": True, "precompile": "lazy", "speculation": "none"}
LENGTHS = (5, 16, 37, 30, 21)  # shorter than a block, one block, partial last blocks
SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
_COLLECTIVE = re.compile(r"= (.*?) (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "f16": 2, "s8": 1, "u8": 1, "pred": 1, "f8e4m3fn": 1}


def prompts(vocab: int, seed: int, lengths=LENGTHS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def prefill(p: PrefillInstance, batch, tag: str, sp: SamplingParams = SP) -> dict:
    for i, ids in enumerate(batch):
        p.add(ids, sp, f"{tag}{i}")
    out = {}
    while p.has_unfinished:
        for res in p.step():
            out[res.request_id] = res
    return out


def decode(d: DecodeInstance, steps: int | None = None) -> dict:
    out = {}
    while d.has_unfinished and (steps is None or steps > 0):
        for o in d.step():
            out[o.request_id] = o.outputs[0].token_ids
        steps = None if steps is None else steps - 1
    return out


def collectives(text: str) -> list[tuple[str, int]]:
    """(kind, bytes) of every collective in a compiled HLO module's text."""
    out = []
    for result, kind in _COLLECTIVE.findall(text):
        n = sum(int(np.prod([int(x) for x in dims.split(",") if x])) * _BYTES.get(dtype, 4)
                for dtype, dims in _SHAPE.findall(result))
        out.append((kind, n))
    return out


def main(preset: str) -> None:
    cfg, params, _ = model_and_inputs()
    start = time.perf_counter()
    store = tempfile.mkdtemp(prefix="dp-roles-")
    ref = LLM(config=cfg, params=params, **KW)
    p = PrefillInstance(LLM(config=cfg, params=params, block_store=store, **KW))
    dp_llm = LLM(config=cfg, params=params, block_store=store, sharding=preset, **KW)
    d = DecodeInstance(dp_llm)
    engine = dp_llm.engine

    batch = prompts(cfg.vocab_size, 0)
    want = [o.outputs[0].token_ids for o in ref.generate([{"prompt_token_ids": b} for b in batch], SP)]
    res = prefill(p, batch, "r")
    hows, ranks = [], []
    for i, ids in enumerate(batch):
        rank = (i % d.dp_size) if i < 2 else None  # the first two on a named rank (the cluster's balancer)
        hows.append(d.add(ids, SP, f"r{i}", res[f"r{i}"].handoff, rank=rank))
        ranks.append(engine.rank_of(f"r{i}"))
    loads = [[ld.num_requests, ld.kv_tokens] for ld in d.rank_loads()]
    got = decode(d)
    print(json.dumps({"check": "roles", "hows": hows, "ranks": ranks, "loads": loads, "dp_size": d.dp_size,
                      "ids_equal": [got[f"r{i}"] for i in range(len(batch))] == want, "want": want,
                      "got": [got[f"r{i}"] for i in range(len(batch))], "ref_first": [w[0] for w in want],
                      "prefill_first": [res[f"r{i}"].output.outputs[0].token_ids for i in range(len(batch))],
                      "seconds": round(time.perf_counter() - start, 2)}), flush=True)

    # control: the slot state is restored where the request runs (zeroed, it continues differently)
    zb = prompts(cfg.vocab_size, 1, (37, 30))
    zwant = [o.outputs[0].token_ids for o in ref.generate([{"prompt_token_ids": b} for b in zb], SP)]
    zres = prefill(p, zb, "z")
    for i, ids in enumerate(zb):
        h = decode_handoff(zres[f"z{i}"].handoff)
        h.slot_state = {k: np.zeros_like(v) for k, v in h.slot_state.items()}
        d.add(ids, SP, f"z{i}", encode_handoff(h), rank=i % d.dp_size)
    zgot = decode(d)
    print(json.dumps({"check": "zeroed", "differs": [zgot[f"z{i}"] for i in range(len(zb))] != zwant}), flush=True)

    # forwarding: snapshot_slot / read_blocks on each request's rank, continued on one device
    fb = prompts(cfg.vocab_size, 2, (20, 33, 9))
    fwant = [o.outputs[0].token_ids for o in ref.generate([{"prompt_token_ids": b} for b in fb], SP)]
    fres = prefill(p, fb, "f")
    for i, ids in enumerate(fb):
        d.add(ids, SP, f"f{i}", fres[f"f{i}"].handoff)
    franks = [engine.rank_of(f"f{i}") for i in range(len(fb))]
    fgot = decode(d, steps=4)
    done, forwards = d.forward_unfinished()
    fgot.update({o.request_id: o.outputs[0].token_ids for o in done})
    one = DecodeInstance(LLM(config=cfg, params=params, block_store=store, **KW))
    fhows = [one.add(fb[int(f.request_id[1:])], SP, f.request_id, f.handoff, output_ids=f.output_ids)
             for f in forwards]
    fgot.update(decode(one))
    print(json.dumps({"check": "forward", "ranks": franks, "forwarded": len(forwards), "hows": fhows,
                      "with_state": sum(f.handoff is not None for f in forwards),
                      "ids_equal": [fgot[f"f{i}"] for i in range(len(fb))] == fwant,
                      "unfinished": engine.has_unfinished}), flush=True)

    # speculation on the DP decode instance (issue 22): handoffs decode with drafts verified on their ranks, then
    # the unfinished ones are forwarded mid-decode to a one-device instance; all equal to the colocated engine
    sb = prompts(cfg.vocab_size, 3, (12, 26, 7, 40))
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)  # long enough to forward mid-decode
    swant = [o.outputs[0].token_ids for o in ref.generate([{"prompt_token_ids": b} for b in sb], sp)]
    drafter = agreeing_drafter(cfg, [{"ids": w} for w in want + swant])
    spec_llm = LLM(config=cfg, params=params, block_store=store, sharding=preset, drafter=drafter,
                   **{**KW, "speculation": "dspark", "num_speculative_tokens": 2})
    sd = DecodeInstance(spec_llm)
    sres = prefill(p, sb, "s", sp)
    shows = [sd.add(ids, sp, f"s{i}", sres[f"s{i}"].handoff) for i, ids in enumerate(sb)]
    sranks = [spec_llm.engine.rank_of(f"s{i}") for i in range(len(sb))]
    sgot = decode(sd, steps=4)
    sdone, sforwards = sd.forward_unfinished()
    sgot.update({o.request_id: o.outputs[0].token_ids for o in sdone})
    for f in sforwards:
        one.add(sb[int(f.request_id[1:])], sp, f.request_id, f.handoff, output_ids=f.output_ids)
    sgot.update(decode(one))
    stats = spec_llm.stats
    print(json.dumps({"check": "spec", "speculation": spec_llm.speculation, "hows": shows, "ranks": sranks,
                      "forwarded": len(sforwards), "ids_equal": [sgot.get(f"s{i}") for i in range(len(sb))] == swant,
                      "verified": stats.get("spec_drafts_verified"), "accepted": stats.get("spec_drafts_accepted"),
                      "rank_verified": stats.get("dp_rank_spec_drafts_verified"),
                      "unfinished": spec_llm.engine.has_unfinished}), flush=True)

    # the compiled copies: at most one collective, the size of what is read
    runner = dp_llm.runner
    at = (np.int32(1),)
    state_bytes = sum(int(np.prod(s)) * np.dtype(t).itemsize for s, t in runner.slot_state_names().values())
    read = runner._slot_state_fn.lower(runner.cache, np.int32(2), at).compile().as_text()
    rows = runner.to_host(runner.snapshot_slot(2, rank=1))
    write = runner._set_slot_state_fn.lower(
        runner.cache, np.int32(2), jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(runner._slot_shapes()),
            [rows[jax.tree_util.keystr(k)] for k, _ in jax.tree_util.tree_flatten_with_path(runner._slot_shapes())[0]]),
        at).compile().as_text()
    cache_bytes = sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(runner.cache))
    print(json.dumps({"check": "collectives", "read": collectives(read), "write": collectives(write),
                      "state_bytes": state_bytes, "cache_bytes": cache_bytes,
                      "names_equal": runner.slot_state_names() == ref.runner.slot_state_names()}), flush=True)

    errors = {}
    for name, call in {"add_rank": lambda: d.add(batch[0], SP, "bad", res["r0"].handoff, rank=d.dp_size),
                       "continuation_rank": lambda: engine.add_continuation(batch[0], [5], SP, rank=-1),
                       "snapshot_rank": lambda: runner.snapshot_slot(0, rank=d.dp_size),
                       "restore_rank": lambda: runner.restore_slot(0, rows, rank=7)}.items():
        try:
            call()
            errors[name] = None
        except RequestError as e:
            errors[name] = ["RequestError", e.field]
        except ValueError as e:
            errors[name] = ["ValueError", str(e)]
    print(json.dumps({"check": "errors", **errors, "registered": "bad" in engine.requests}), flush=True)
    print(json.dumps({"check": "done", "seconds": round(time.perf_counter() - start, 2)}), flush=True)


if __name__ == "__main__":
    main(*(sys.argv[1:] or ["cpu-dp2-ep4"]))
