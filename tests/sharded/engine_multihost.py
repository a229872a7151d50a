"""One process of a two-process engine run: ``LLM(..., sharding=PRESET)`` under ``jax.distributed``.

The test starts two of these on localhost, each with 4 fake CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``) and ``DEEPINFER_COORDINATOR``,
``DEEPINFER_NUM_PROCESSES``, ``DEEPINFER_PROCESS_ID`` set (``init_distributed`` reads them, before the model is
built: ``LLM`` could start it itself only if nothing had run on JAX yet):
``python tests/sharded/engine_multihost.py PRESET OUT_PREFIX``. Both processes run the same host loop over
the same requests (``dp_engine_check.workload``) with EPLB rebalances forced every 3 steps (window 2), as
``dp_engine_check.eplb_rows`` does in one process; each writes its outputs (token ids, finish reasons,
logprobs) and engine counters to ``OUT_PREFIX<process>.json`` and prints one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from deepinfer_jax import sharding as sh

assert sh.init_distributed(timeout_s=60), "DEEPINFER_* multi-host settings are missing"

import jax
from dp_engine_check import SETTINGS, summary, workload
from shard_common import model_and_inputs

from deepinfer_jax import LLM
from deepinfer_jax.sharding import resolve_preset


def main(preset_name: str, out_prefix: str) -> None:
    start = time.perf_counter()
    cfg, params, _ = model_and_inputs()
    prompts, sps = workload(cfg.vocab_size)
    base = resolve_preset(preset_name)
    # CPU collectives: the capacity all_to_all (a design preset may name ragged_all_to_all, GPU/TPU only)
    preset = base.replace(eplb=dataclasses.replace(base.eplb, window_steps=2, rebalance_period=3,
                                                   dispatch="all_to_all"))
    llm = LLM(config=cfg, params=params, sharding=preset, **SETTINGS)
    traces = llm.runner.traces
    outs = summary(llm.generate(prompts, sps, use_tqdm=False))
    stats, reb = llm.stats, llm.engine.eplb
    row = {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
           "local_devices": jax.local_device_count(), "steps": stats["steps"],
           "rebalances": stats.get("eplb_rebalances"), "total_load": None if reb is None else reb.total_load.tolist(),
           "recompiled": llm.runner.traces != traces, "outputs": outs,
           "seconds": round(time.perf_counter() - start, 2)}
    with open(f"{out_prefix}{jax.process_index()}.json", "w") as f:
        json.dump(row, f)
    print(json.dumps({k: v for k, v in row.items() if k not in ("outputs", "total_load")}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
