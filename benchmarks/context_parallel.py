"""Context-parallel prefill: TTFT of one long prompt with cp = 1, 2, 4 ranks, and the bytes the ranks exchange.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/context_parallel.py \\
        [--lengths 2048,8192] [--cps 1,2,4] [--window 128] [--repeats 1]

The model is the 5-layer test model of tests/sharded (every attention role: SWA, FULL ratio 2, REUSE, FULL
ratio 1 as the candidate source, REINDEX) plus one Engram layer, with a ``--window``-token sliding window
(128 by default, the real model's: a 127-row halo) and quantized cache storage. ``cp = 1`` is the unsharded
paged step on one device (the whole prompt as one chunk); ``cp > 1`` is ``cp_prefill`` over that many fake CPU
devices. TTFT is the warm wall time of the prefill step (best of ``--repeats``, compile excluded and reported
apart). On fake CPU devices all ranks share this machine's cores, so the times measure what CP costs, not what
it gains on real accelerators: they are correctness-cost figures.

Communication: ``measured`` sums the all-gathers of the compiled program (their result shapes in the HLO
text; one rank receives (cp - 1) / cp of each); XLA:CPU widens FP8 rows to f16 for a collective, so it is
also given with f16 counted as the FP8 it carries. Besides the CP exchange the HLO holds one small gather
XLA adds itself (the last token's streams, ``hc * (d + 1)`` floats per rank). ``analytic`` is
``context_parallel.analytic_bytes`` from the layout alone (``traced``: the same from the traced collectives'
shapes).
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "sharded"))

from deepinfer_jax.config import CacheConfig  # noqa: E402
from deepinfer_jax.model.kv_cache import init_cache  # noqa: E402
from deepinfer_jax.model.paged import paged_step  # noqa: E402
from deepinfer_jax.parallel.context_parallel import analytic_bytes, cp_inputs, cp_prefill, tail_rows_for  # noqa: E402
from deepinfer_jax.parallel.cp_layout import cp_align, cp_layout  # noqa: E402
from deepinfer_jax.runner.step_batch import ChunkSpec, build_inputs  # noqa: E402

_DT = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "u8": 1, "s8": 1, "f8e4m3fn": 1, "pred": 1}


def hlo_all_gather_bytes(text: str, shapes: list | None = None, f16_bytes: int = 2) -> tuple[int, int]:
    """(number of all-gathers, bytes of their results) in a compiled module's HLO text; ``shapes`` gets each
    one's result types. XLA:CPU widens FP8 to f16 for a collective; ``f16_bytes=1`` counts them as the FP8
    they carry (the benchmark's model is fp32: it has no f16 tensors of its own)."""
    count = total = 0
    for line in text.splitlines():
        if " all-gather(" not in line and " all-gather-start(" not in line:
            continue
        lhs = line.split(" all-gather", 1)[0].split("=", 1)[1]
        count += 1
        if shapes is not None:
            shapes.append(lhs.strip().split(" ")[0])
        for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", lhs):
            size = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
            total += (f16_bytes if dt == "f16" else _DT.get(dt, 4)) * size
    return count, total


def run(lengths, cps, window: int, repeats: int):
    from cp_check import config, params_for

    cfg = config().replace(sliding_window=window)
    params = params_for(cfg)
    rows = []
    for n in lengths:
        bs = 64
        blocks = -(-n // bs)
        cache_cfg = CacheConfig(block_size=bs, num_blocks=blocks + 1, max_requests=1, max_blocks_per_request=blocks,
                                storage="quantized")
        ids = np.random.default_rng(n).integers(3, cfg.vocab_size, n)
        chunk = ChunkSpec(slot=0, block_table=list(range(1, blocks + 1)), ctx_len=0, token_ids=ids.tolist())
        inp = build_inputs([chunk], n, 1, blocks, 1)._replace(logit_rows=np.array([n - 1], np.int32))
        for cp in cps:
            if cp > len(jax.devices()):
                print(f"skip cp={cp}: {len(jax.devices())} devices", flush=True)
                continue
            row = {"tokens": n, "cp": cp}
            if cp == 1:
                fn = jax.jit(paged_step, static_argnums=(1, 2), donate_argnums=(3,))
                args = lambda: (params, cfg, cache_cfg, init_cache(cfg, cache_cfg), inp)  # noqa: E731
                kwargs = {}
            else:
                mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))
                repl, shard = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("cp"))
                lay = cp_layout(0, n, cp, align=cp_align(cfg), tail_rows=tail_rows_for(cfg, cache_cfg), multiple=64)
                lin = cp_inputs(lay)
                lin = lin._replace(**{k: jax.device_put(getattr(lin, k), shard)
                                      for k in ("positions", "valid", "flat", "tail_at")})
                log = []
                fn = jax.jit(functools.partial(cp_prefill, mesh=mesh, comm_log=log), static_argnums=(1, 2),
                             donate_argnums=(3,))
                p_rep, i_rep = jax.device_put(params, repl), jax.device_put(inp, repl)
                args = lambda: (p_rep, cfg, cache_cfg,  # noqa: E731,B023
                                jax.device_put(init_cache(cfg, cache_cfg), repl), i_rep, lin)
                kwargs = {}
            t0 = time.perf_counter()
            compiled = fn.lower(*args(), **kwargs).compile()
            row["compile_s"] = round(time.perf_counter() - t0, 1)
            best = float("inf")
            for _ in range(repeats):
                a = args()
                jax.block_until_ready(a)
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*a, **kwargs)[0])
                best = min(best, time.perf_counter() - t0)
            row["ttft_s"] = round(best, 2)
            if cp > 1:
                count, out_bytes = hlo_all_gather_bytes(compiled.as_text())
                _, fp8_bytes = hlo_all_gather_bytes(compiled.as_text(), f16_bytes=1)
                ana = analytic_bytes(cfg, cache_cfg, lay)
                traced = sum(r.bytes_received for r in log)
                row.update(all_gathers=count, measured_bytes=out_bytes * (cp - 1) // cp,
                           measured_fp8_bytes=fp8_bytes * (cp - 1) // cp, traced_bytes=traced,
                           analytic_bytes=sum(ana.values()), analytic_by_kind=ana,
                           per_layer_kib=round(sum(ana.values()) / cfg.num_hidden_layers / 1024, 1),
                           piece_len=lay.piece_len, halo_rows=lay.tail_rows)
            rows.append(row)
            print(row, flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    a = ap.parse_args(argv)
    rows = run([int(x) for x in a.lengths.split(",")], [int(x) for x in a.cps.split(",")], a.window, a.repeats)
    print("| tokens | cp | TTFT s (CPU, fake devices) | compile s | HLO all-gather B/rank | same, f16 as fp8 | "
          "analytic B/rank | analytic per layer KiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['cp']} | {r['ttft_s']} | {r['compile_s']} | {r.get('measured_bytes', '-')} | "
              f"{r.get('measured_fp8_bytes', '-')} | "
              f"{r.get('analytic_bytes', '-')} | {r.get('per_layer_kib', '-')} |")


if __name__ == "__main__":
    main()
