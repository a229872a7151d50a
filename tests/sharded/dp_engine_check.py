"""The attention data-parallel engine (``LLM(..., sharding=...)``) against the one-device engine on 8 fake CPU devices.

Run from the repository root with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``:
``python tests/sharded/dp_engine_check.py [--reference OUT.json] PRESET [PRESET ...]``. Generates the same mixed batch
(greedy, seeded and engine-seeded sampling, prompts of 3-40 tokens, more requests than DP ranks)
with the one-device ``LLM`` and with each preset, and prints one JSON line per preset: whether every
output's token ids and finish reasons are equal, the largest logprob difference, how the router spread
the requests over the ranks, per-rank tokens and idle steps, and whether anything recompiled after
start-up. With ``cpu-dp2-ep4`` among them, EPLB rows follow (``eplb_rows``: rebalances forced mid-run vs none vs
one device, pair conservation, exact weight moves), a ``chunking="cost"`` row and structured-output rows. Then one JSON line per bad preset (the ``ShardingError``
field and message) and ``{"check": "done"}``. ``--reference`` writes the one-device outputs to OUT.json.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time

import jax
import numpy as np
from shard_common import model_and_inputs
from span_grammars import SpanGrammars

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax import sharding as sh
from deepinfer_jax.engine.structured import StructuredOutputs
from deepinfer_jax.parallel.weight_moves import physical_params
from deepinfer_jax.runner import ChunkSpec, StepInputError
from deepinfer_jax.sharding import ShardingError, ShardingPreset, resolve_preset

#: Per-rank engine settings; one bucket of each kind keeps compile time down.
SETTINGS = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "token_buckets": (32,), "request_buckets": (4,),
            "block_size": 16, "max_model_len": 64, "chunking": "tokens", "enable_prefix_caching": False,
            "max_logprobs": 2, "use_tqdm": False, "precompile": "all"}
NUM_REQUESTS = 11
EPLB_PRESET = "cpu-dp2-ep4"  # also run with EPLB rebalances forced mid-run (``eplb_rows``)


def workload(vocab: int):
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, int(n)).tolist()}
               for n in rng.integers(3, 41, NUM_REQUESTS)]
    params = []
    for i in range(NUM_REQUESTS):
        n = int(rng.integers(3, 11))
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=n, ignore_eos=True))
        else:  # the engine's seed and the request's number make the key
            params.append(SamplingParams(temperature=1.0, top_k=50, max_tokens=n, ignore_eos=True, logprobs=1))
    return prompts, params


def summary(outs) -> list[dict]:
    return [{"ids": o.outputs[0].token_ids, "reason": o.outputs[0].finish_reason,
             "lp": [t.logprob for t in o.outputs[0].logprobs or []]} for o in outs]


def compare(want: list[dict], got: list[dict]) -> dict:
    lp = [abs(a - b) for w, g in zip(want, got) for a, b in zip(w["lp"], g["lp"])]
    return {"ids_equal": all(w["ids"] == g["ids"] for w, g in zip(want, got)),
            "reasons_equal": all(w["reason"] == g["reason"] for w, g in zip(want, got)),
            "num_tokens": sum(len(g["ids"]) for g in got), "max_logprob_diff": max(lp, default=0.0),
            "num_logprobs": len(lp)}


def runner_errors(runner) -> dict:
    """``ModelRunner.forward`` (over a mesh)'s messages for a wrong rank count, a step with no chunk, a bad slot on the last rank
    (all raised before anything is dispatched)."""
    dp, slots = runner.dp_size, runner.cache_cfg.max_requests
    bad_slot = [[] for _ in range(dp)]
    bad_slot[-1] = [ChunkSpec(slot=slots, block_table=[0], ctx_len=0, token_ids=[1])]
    out = {}
    for what, arg in (("ranks", [[]] * (dp + 1)), ("empty", [[]] * dp), ("slot", bad_slot)):
        try:
            runner.forward(arg)
            out[what] = None
        except StepInputError as e:
            out[what] = str(e)
    return out


def eplb_rows(cfg, params, prompts, sps, want, want_again) -> None:
    """EPLB in the running engine on ``EPLB_PRESET``: rebalances forced every 3 steps (window 2) against the same
    layout with no rebalance (period 10**6) and against one device (``want``, ``want_again``: the first and second
    batch of the one-device engine). Both engines reuse the preset row's compiled programs (same layout)."""
    base = resolve_preset(EPLB_PRESET)
    rows = {}
    for check, period in (("eplb_forced", 3), ("eplb_never", 10**6)):
        start = time.perf_counter()
        preset = base.replace(eplb=dataclasses.replace(base.eplb, window_steps=2, rebalance_period=period))
        llm = LLM(config=cfg, params=params, sharding=preset, **SETTINGS)
        runner, reb = llm.runner, llm.engine.eplb
        start_placement, traces = runner.placement, runner.traces
        got = summary(llm.generate(prompts, sps, use_tqdm=False))
        llm.engine.async_scheduling = False  # the second batch through the synchronous loop
        got_again = summary(llm.generate(prompts, sps, use_tqdm=False))
        stats = llm.stats
        # the moved weights are exactly the logical experts taken into the current placement's slots
        want_params = physical_params(params, runner.placement)
        moved_exact = all(np.array_equal(sh.gather_to_host(runner.params["layers"][i]["ffn"]["experts"][k][...]),
                                         np.asarray(want_params["layers"][i]["ffn"]["experts"][k][...]))
                          for i in range(cfg.num_hidden_layers) for k in ("w1", "w3", "w2"))
        rows[check] = {"got": got, "got_again": got_again, "total_load": reb.total_load}
        print(json.dumps({
            "check": check, **compare(want, got), **{f"sync_{k}": v for k, v in compare(want_again, got_again).items()},
            "recompiled": runner.traces != traces, "rebalances": stats["eplb_rebalances"],
            "eplb_steps": stats["eplb_steps"], "steps": stats["steps"],
            "placement_changed": runner.placement != start_placement,
            "max_replicas": stats["eplb_max_replicas"], "moe_lb": stats["eplb_moe_lb"],
            "moe_lb_before": stats["eplb_moe_lb_before"], "moe_lb_after": stats["eplb_moe_lb_after"],
            # every (token, expert) pair of every layer counted once: top_k pairs per scheduled token
            "pairs_per_layer": reb.total_load.sum(1).tolist(),
            "expected_pairs": cfg.num_experts_per_tok * stats["scheduled_tokens"],
            "slots_per_rank": runner.placement.slots_per_rank, "n_experts": runner.placement.n_experts,
            "ep_size": runner.placement.n_ranks, "moved_weights_exact": moved_exact,
            "seconds": round(time.perf_counter() - start, 2)}), flush=True)
    forced, never = rows["eplb_forced"], rows["eplb_never"]
    print(json.dumps({"check": "eplb_vs_no_rebalance", **compare(never["got"], forced["got"]),
                      "sync_max_logprob_diff": compare(never["got_again"], forced["got_again"])["max_logprob_diff"],
                      "same_expert_load": bool(np.array_equal(forced["total_load"], never["total_load"]))}),
          flush=True)


def record_plans(llm) -> list[list[int]]:
    """Tokens each rank's scheduler plans per step (appended as the engine runs; one list per rank)."""
    planned = [[] for _ in llm.engine.schedulers]
    for log, sched in zip(planned, llm.engine.schedulers):
        def schedule(*budget, plan=sched.schedule, log=log):
            out = plan(*budget)
            log.append(out.num_tokens)
            return out
        sched.schedule = schedule
    return planned


def cost_row(cfg, params, prompts, sps, want, want_again, token_plans) -> None:
    """``chunking="cost"`` on ``EPLB_PRESET``: the step-time model profiled through the DP runner (every rank runs
    the profiled chunks), then a budget of one fresh 8-token chunk so the cost model, not the token budget, sizes
    the prefill chunks (the first step's plans, before any online refit, against ``token_plans``: the token-chunked
    run's); outputs against one device (token chunking: the paged step is chunking-invariant). Then the same batch
    with the ranks' prompt chunks matched (``dp_match_floor_ns=0``, given to ``LLM``, off for the first run), against
    the one device's second batch (``want_again``)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache_dir:
        llm = LLM(config=cfg, params=params, sharding=EPLB_PRESET, **{**SETTINGS, "chunking": "cost"},
                  cost_model_dir=cache_dir, dp_match_floor_ns=0)
    floor, llm.engine.dp_match_floor_ns = llm.engine.dp_match_floor_ns, None
    model = llm.engine.cost_model
    budget = int(model.predict([(8, 0)]))
    for s in llm.engine.schedulers:
        s.step_budget_ns = budget
    traces = llm.runner.traces
    planned = record_plans(llm)
    got = summary(llm.generate(prompts, sps, use_tqdm=False))
    row = {"check": "cost_chunking", **compare(want, got), "steps": llm.stats["steps"],
           "first_step_tokens": [p[0] for p in planned], "budget_ns": budget,
           "token_chunking_first_step_tokens": [p[0] for p in token_plans],
           "coef_ns": model.coef.tolist(), "shared_model": all(s.cost_model is model for s in llm.engine.schedulers),
           "observed": model.num_observed, "predicted": len(llm.engine.stats.predicted_ns), "floor_from_llm": floor,
           "first_matched_steps": llm.stats["matched_steps"]}
    llm.engine.dp_match_floor_ns = floor
    matched = summary(llm.generate(prompts, sps, use_tqdm=False))
    print(json.dumps({**row, "matched": compare(want_again, matched), "matched_steps": llm.stats["matched_steps"],
                      "recompiled": llm.runner.traces != traces, "seconds": round(time.perf_counter() - start, 2)}),
          flush=True)


def structured_rows(cfg, params, ref, prompts) -> None:
    """Structured output on ``EPLB_PRESET`` against the one-device engine ``ref``, both with ``SpanGrammars``:
    constrained (greedy and seeded) and free requests mixed, one grammar that dies; the asynchronous loop with
    the masks on the worker thread, then the synchronous one with the masks first (``overlap=False``)."""
    grammars = ["10-40:4", "dead 100-120:3", None, "200-300:6", None, "5-9:2", "300-500:5"]
    sps = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=7 + i, max_tokens=12, logprobs=1,
                          **({} if g is None else {"structured_output": {"grammar": g}}))
           for i, g in enumerate(grammars)]
    batch = prompts[:len(grammars)]
    eos = cfg.eos_token_id
    start = time.perf_counter()
    ref.engine.structured = StructuredOutputs(SpanGrammars(cfg.vocab_size, eos))
    want = summary(ref.generate(batch, sps, use_tqdm=False))
    llm = LLM(config=cfg, params=params, sharding=EPLB_PRESET, **SETTINGS)
    traces = llm.runner.traces
    rows = {}
    for name, overlap, async_scheduling in (("structured", True, True), ("structured_masks_first", False, False)):
        llm.engine.structured = StructuredOutputs(SpanGrammars(cfg.vocab_size, eos), overlap=overlap)
        llm.engine.async_scheduling = async_scheduling
        got = summary(llm.generate(batch, sps, use_tqdm=False))
        follows = []
        for g, out in zip(grammars, got):
            if g is not None and not g.startswith("dead"):
                lo, hi, n = (int(x) for x in g.replace(":", "-").split("-"))
                follows.append(all(lo <= t <= hi for t in out["ids"][:n]) and out["ids"][n:] == [eos])
        rows[name] = {**compare(want, got), "follows_grammar": follows, "reasons": [o["reason"] for o in got],
                      "mask_rows": llm.engine.structured.mask_rows}
    for name, row in rows.items():
        print(json.dumps({"check": name, **row, "recompiled": llm.runner.traces != traces,
                          "seconds": round(time.perf_counter() - start, 2)}), flush=True)


def main(presets: list[str]) -> None:
    reference_out = None
    if presets[:1] == ["--reference"]:  # where to write the one-device outputs (the two-process test reads them)
        reference_out, presets = presets[1], presets[2:]
    assert jax.device_count() == 8, f"expected 8 fake devices, got {jax.device_count()}"
    cfg, params, _ = model_and_inputs()
    prompts, sps = workload(cfg.vocab_size)
    start = time.perf_counter()
    ref = LLM(config=cfg, params=params, **SETTINGS)
    want = summary(ref.generate(prompts, sps, use_tqdm=False))
    if reference_out is not None:
        with open(reference_out, "w") as f:
            json.dump(want, f)
    # a second batch: requests without a seed now have numbers 11..21, so their tokens differ from the first
    want_again = summary(ref.generate(prompts, sps, use_tqdm=False))
    print(json.dumps({"check": "reference", "seconds": round(time.perf_counter() - start, 2),
                      "num_tokens": sum(len(w["ids"]) for w in want),
                      "second_batch_differs": want != want_again}), flush=True)
    for name in presets:
        start = time.perf_counter()
        llm = LLM(config=cfg, params=params, sharding=name, **SETTINGS)
        traces = llm.runner.traces
        planned = record_plans(llm)
        got = summary(llm.generate(prompts, sps, use_tqdm=False))
        if name == EPLB_PRESET:
            token_plans = [list(p) for p in planned]
        row = {"check": name, **compare(want, got), "rank_requests": list(llm.engine.rank_requests),
               "unfinished": llm.engine.has_unfinished}
        llm.engine.async_scheduling = False  # the synchronous loop on the same engine, the second batch
        sync = compare(want_again, summary(llm.generate(prompts, sps, use_tqdm=False)))
        stats = llm.stats
        w1 = llm.runner.params["layers"][0]["ffn"]["experts"]["w1"][...]
        leaf = jax.tree.leaves(llm.runner.cache)[0]
        row.update(sync_ids_equal=sync["ids_equal"], sync_max_logprob_diff=sync["max_logprob_diff"],
                   recompiled=llm.runner.traces != traces,
                   dp_size=llm.runner.dp_size, manual_axes=list(llm.runner.manual_axes),
                   ep_moe=llm.runner.placement is not None, rank_tokens=stats["dp_rank_tokens"],
                   rank_idle_steps=stats["dp_rank_idle_steps"], steps=stats["steps"],
                   experts_w1_shard=list(w1.addressable_shards[0].data.shape), experts_w1_shape=list(w1.shape),
                   cache_spec=str(leaf.sharding.spec), cache_shard=list(leaf.addressable_shards[0].data.shape),
                   cache_shape=list(leaf.shape), seconds=round(time.perf_counter() - start, 2))
        row["runner_errors"] = runner_errors(llm.runner)
        print(json.dumps(row), flush=True)
    if EPLB_PRESET in presets:
        eplb_rows(cfg, params, prompts, sps, want, want_again)
        cost_row(cfg, params, prompts, sps, want, want_again, token_plans)
        structured_rows(cfg, params, ref, prompts)
    tp = resolve_preset("cpu-dp2-ep2-tp2")
    bad = {"too_many_devices": ShardingPreset(name="dp2-ep8", axes=("dp", "ep"), shape=(2, 8), dp_size=2, ep_size=8),
           "experts_not_divisible": ShardingPreset(name="dp1-ep3", axes=("dp", "ep"), shape=(1, 3), dp_size=1,
                                                   ep_size=3),
           "eplb_with_tp": tp.replace(eplb=dataclasses.replace(tp.eplb, enabled=True)),
           "ragged_on_cpu": resolve_preset("prefill-ep8-dp8")}  # dispatch = "ragged_all_to_all"
    for check, preset in bad.items():
        try:
            LLM(config=cfg, params=params, sharding=preset, **SETTINGS)
            row = {"check": check, "error": None}
        except ShardingError as e:
            row = {"check": check, "error": type(e).__name__, "field": e.field, "message": str(e)}
        print(json.dumps(row), flush=True)
    print(json.dumps({"check": "done"}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
