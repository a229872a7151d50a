"""Sharded ``forward_full`` against the unsharded one on 8 fake CPU devices.

Run from the repository root with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``:
``python tests/sharded/shard_forward.py OUT.npz PRESET [PRESET ...]``. Prints one JSON line per
preset (errors against the one-device logits of ``shard_common.model_and_inputs``, shard shapes of a few parameters, the logits' and
cache's partition specs) and saves the one-device logits and token ids to OUT.npz.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import numpy as np
from shard_common import model_and_inputs

from deepinfer_jax import forward_full
from deepinfer_jax import sharding as sh
from deepinfer_jax.config import CacheConfig
from deepinfer_jax.model.kv_cache import init_cache

EXPERT_PARALLEL = ("cpu-dp2-ep4", "cpu-dp1-ep8")  # presets also run with the shard_map expert-parallel MoE


def shard_rows(x: jax.Array) -> list[int]:
    return list(x.addressable_shards[0].data.shape)


def main(out: str, presets: list[str]) -> None:
    start = time.perf_counter()
    assert jax.device_count() == 8, f"expected 8 fake devices, got {jax.device_count()}"
    cfg, params, ids = model_and_inputs()
    want = np.asarray(jax.jit(forward_full, static_argnums=1)(params, cfg, ids))
    np.savez(out, logits=want, ids=ids)
    print(json.dumps({"reference_s": round(time.perf_counter() - start, 2)}), flush=True)
    cache_cfg = CacheConfig(block_size=16, num_blocks=16, max_requests=8, max_blocks_per_request=4)
    for name in presets:
        start = time.perf_counter()
        preset = sh.resolve_preset(name)
        mesh = sh.make_mesh(preset)
        placed = sh.shard_params(params, mesh, preset)
        got = sh.sharded_forward_full(placed, cfg, ids, mesh, preset)
        host = sh.gather_to_host(got)
        padded_err = None
        if preset.dp_size == len(ids):  # 5 rows padded to the compiled 8: no new compile
            part = sh.gather_to_host(sh.sharded_forward_full(placed, cfg, ids[:5], mesh, preset))
            padded_err = float(np.abs(part - want[:5]).max())
        ep_err = None
        if name in EXPERT_PARALLEL:  # the MoE layers through shard_map (parallel.ep_model) instead of GSPMD
            ep = sh.sharded_forward_full(placed, cfg, ids, mesh, preset, expert_parallel=True)
            ep_err = float(np.abs(sh.gather_to_host(ep) - want).max())
        cache = sh.shard_cache(init_cache(cfg, cache_cfg), mesh, preset)
        layer = placed["layers"][0]
        print(json.dumps({
            "preset": name,
            "shape": list(host.shape),
            "max_abs_err": float(np.abs(host - want).max()),
            "max_abs_err_padded": padded_err,
            "max_abs_err_expert_parallel": ep_err,
            "logit_scale": float(np.abs(want).max()),
            "logits_spec": str(got.sharding.spec),
            "logits_shard": shard_rows(got),
            "experts_w1_shard": shard_rows(layer["ffn"]["experts"]["w1"][...]),
            "gate_shard": shard_rows(layer["ffn"]["gate"]["weight"][...]),
            "head_shard": shard_rows(placed["head"]["weight"][...]),
            "wq_b_shard": shard_rows(layer["attn"]["wq_b"]["weight"][...]),
            "swa_q_shard": shard_rows(cache["swa"]["q"]),
            "global_kv_q_shard": shard_rows(cache["global"][1]["kv"]["q"]),
            "comp_v_shard": shard_rows(cache["comp"][1]["v"]),
            "seconds": round(time.perf_counter() - start, 2),
        }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
