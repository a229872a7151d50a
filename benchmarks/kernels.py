"""The Pallas kernels of ``deepinfer_jax.ops`` against their jnp references.

    python benchmarks/kernels.py [--repeats 20] [--size small|large]

On a CPU the kernels can only run in Pallas interpret mode, which says nothing about speed: the
script checks each kernel against its reference on fresh random inputs (ragged lengths, block
tables with holes, empty groups) and prints the max abs error. It prints no timing there, and says so.

On a GPU (or TPU) it compiles each kernel (``interpret=False``) and its reference under ``jax.jit``,
times both (median of ``--repeats`` runs, ``block_until_ready``), and reports achieved bytes/s and
FLOP/s from a per-kernel traffic/work model next to the card's ceilings measured in the same run: a
large device-to-device copy (read + write bytes) and a large bf16 matmul. A kernel that fails to
lower is reported as failed, not skipped silently. The last line is the headline ratio. Writes
benchmarks/results/kernels.json. Record GPU runs in benchmarks/kernels.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.ops.grouped_matmul import pallas as gmm_pallas
from deepinfer_jax.ops.grouped_matmul import reference as gmm_ref
from deepinfer_jax.ops.indexer_topk import pallas as ix_pallas
from deepinfer_jax.ops.indexer_topk import reference as ix_ref
from deepinfer_jax.ops.mhc import pallas as mhc_pallas
from deepinfer_jax.ops.mhc import reference as mhc_ref
from deepinfer_jax.ops.sparse_attention import pallas as sa_pallas
from deepinfer_jax.ops.sparse_attention import reference as sa_ref

ROOT = Path(__file__).resolve().parent.parent

# shapes: "small" runs in interpret mode in seconds; "large" is decode/prefill scale for one GPU
_SMALL = "req=3 dec=1 pre=5 h=4 d=32 w=8 k=6 e=4 mb=4 ih=2 ihd=32 ie=24 ik=6 m=37 kd=32 n=40 g=5 tokens=10 hc=4 hd=16"
_LARGE = ("req=32 dec=1 pre=64 h=16 d=512 w=128 k=512 e=32 mb=64 ih=64 ihd=128 ie=2048 ik=512 m=8192 kd=4096 n=2048 "
          "g=64 tokens=4096 hc=4 hd=4096")
SIZES = {name: {k: int(v) for k, v in (kv.split("=") for kv in spec.split())}
         for name, spec in (("small", _SMALL), ("large", _LARGE))}


def _attention_case(rng, s, per_req):
    lengths = [per_req] * s["req"]
    r, n_blocks = s["req"], s["req"] * s["mb"] + 3
    token_req = np.repeat(np.arange(r), lengths).astype(np.int32)
    n = len(token_req)
    tables = rng.permutation(n_blocks)[: r * s["mb"]].reshape(r, s["mb"]).astype(np.int32)
    tables[rng.random(tables.shape) < 0.2] = -1
    args = (rng.normal(size=(n, s["h"], s["d"])).astype(np.float32),
            rng.normal(size=(n, s["w"], s["d"])).astype(np.float32), rng.random((n, s["w"])) < 0.8,
            rng.normal(size=(n_blocks, s["e"], s["d"])).astype(np.float32), tables, token_req,
            rng.integers(-1, s["mb"] * s["e"], (n, s["k"])).astype(np.int32), rng.normal(size=s["h"]).astype(np.float32))
    rows = s["w"] + s["k"]
    nbytes = 4 * n * (2 * s["h"] * s["d"] + rows * s["d"] + s["w"] + s["k"])
    return args, nbytes, 4.0 * n * s["h"] * rows * s["d"]


def cases(size: str, seed: int = 0) -> dict:
    """name -> (reference fn, pallas fn taking interpret=, args, bytes moved, flops)."""
    s, rng = SIZES[size], np.random.default_rng(seed)
    out = {}
    for name, per_req in (("sparse_attention/decode", s["dec"]), ("sparse_attention/prefill", s["pre"])):
        args, nbytes, flops = _attention_case(rng, s, per_req)
        out[name] = (sa_ref.sparse_attention, sa_pallas.sparse_attention, args, nbytes, flops)

    n, r = s["req"] * s["dec"] * 2, s["req"]
    visible = np.arange(s["ie"]) < rng.integers(1, s["ie"] + 1, n)[:, None]
    args = (rng.normal(size=(n, s["ih"], s["ihd"])).astype(np.float32), rng.normal(size=(n, s["ih"])).astype(np.float32),
            rng.normal(size=(r, s["ie"], s["ihd"])).astype(np.float32), np.sort(rng.integers(0, r, n)).astype(np.int32),
            visible)
    out["indexer_scores"] = (ix_ref.indexer_scores, ix_pallas.indexer_scores, args,
                             4 * n * (s["ie"] * s["ihd"] + 2 * s["ie"]), 2.0 * n * s["ih"] * s["ie"] * s["ihd"])
    scores = np.where(visible, np.round(rng.normal(size=visible.shape), 2), -np.inf).astype(np.float32)
    nvis = visible.sum(-1).astype(np.int32)
    for mode in ("plain", "source"):
        fn_ref = lambda sc, nv, mode=mode: ix_ref.indexer_topk(sc, nv, s["ik"], mode, None, 4, 4)
        fn_pal = lambda sc, nv, interpret=False, mode=mode: ix_pallas.indexer_topk(
            sc, nv, s["ik"], mode, None, 4, 4, interpret=interpret)
        out[f"indexer_topk/{mode}"] = (fn_ref, fn_pal, (scores, nvis), 4 * n * (2 * s["ie"] + s["ik"]),
                                       float(n * s["ie"] * s["ik"]))

    sizes = rng.multinomial(s["m"] - 3, np.ones(s["g"]) / s["g"]).astype(np.int32)
    sizes[rng.random(s["g"]) < 0.2] = 0  # empty groups; rows past the sum stay zero
    args = (rng.normal(size=(s["m"], s["kd"])).astype(np.float32),
            (rng.normal(size=(s["g"], s["n"], s["kd"])) * 0.05).astype(np.float32), sizes)
    out["grouped_matmul"] = (gmm_ref.grouped_matmul, gmm_pallas.grouped_matmul, args,
                             4 * (s["m"] * s["kd"] + s["g"] * s["n"] * s["kd"] + s["m"] * s["n"]),
                             2.0 * int(sizes.sum()) * s["kd"] * s["n"])

    t, nh, dh = s["tokens"], s["hc"], s["hd"]
    streams = rng.normal(size=(t, nh, dh)).astype(np.float32)
    fn = (rng.normal(size=(nh * (nh + 2), nh * dh)) * 0.02).astype(np.float32)
    base, scale = rng.normal(size=nh * (nh + 2)).astype(np.float32), rng.normal(size=3).astype(np.float32)
    mix_ref = lambda st, f, b, sc: mhc_ref.mhc_mix(st, f, b, sc, 20, 1e-6, 1e-6)
    mix_pal = lambda st, f, b, sc, interpret=False: mhc_pallas.mhc_mix(st, f, b, sc, 20, 1e-6, 1e-6, interpret=interpret)
    out["mhc_mix"] = (mix_ref, mix_pal, (streams, fn, base, scale), 4 * (t * nh * dh + fn.size + t * nh * (nh + 2)),
                      2.0 * t * nh * dh * nh * (nh + 2))
    pre, post, comb = (np.asarray(a) for a in jax.jit(mix_ref)(streams, fn, base, scale))
    fused_ref = lambda st, f, b, sc, lag: mhc_ref.mhc_mix_collapse(st, f, b, sc, lag, 20, 1e-6, 1e-6)
    fused_pal = lambda st, f, b, sc, lag, interpret=False: mhc_pallas.mhc_mix_collapse(
        st, f, b, sc, lag, 20, 1e-6, 1e-6, interpret=interpret)
    out["mhc_mix_collapse"] = (fused_ref, fused_pal, (streams, fn, base, scale, pre),
                               4 * (t * nh * dh + fn.size + t * nh * (nh + 3) + t * dh),
                               2.0 * t * nh * dh * (nh * (nh + 2) + 1))
    out["mhc_collapse"] = (mhc_ref.mhc_collapse, mhc_pallas.mhc_collapse, (streams, pre), 4 * t * (nh + 1) * dh,
                           2.0 * t * nh * dh)
    y = rng.normal(size=(t, dh)).astype(np.float32)
    out["mhc_expand"] = (mhc_ref.mhc_expand, mhc_pallas.mhc_expand, (y, streams, post, comb),
                         4 * t * (2 * nh + 1) * dh, 2.0 * t * nh * (nh + 1) * dh)
    return out


def max_err(a, b) -> float:
    """Max abs difference over all leaves (equal infinities and NaN pairs count as equal)."""
    errs = []
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        same = (np.isinf(x) & (x == y)) | (np.isnan(x) & np.isnan(y))
        with np.errstate(invalid="ignore"):
            errs.append(float(np.max(np.where(same, 0.0, np.abs(x - y)), initial=0.0)))
    return max(errs)


def timed(fn, args, repeats: int) -> float:
    """Median seconds of ``fn(*args)`` (compiled and warmed up first)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ceilings(repeats: int) -> dict:
    """Device-to-device copy bandwidth (read + write bytes/s) and bf16 matmul FLOP/s, measured now."""
    x = jnp.ones((1 << 28,), jnp.float32)  # 1 GiB
    copy = jax.jit(lambda a: a * 1.0 + 0.0)
    bw = 2 * x.nbytes / timed(copy, (x,), repeats)
    del x
    n = 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    mm = jax.jit(lambda p, q: jnp.dot(p, q, preferred_element_type=jnp.float32))
    return {"copy_bytes_per_s": bw, "bf16_matmul_flops": 2 * n**3 / timed(mm, (a, a), repeats)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--size", choices=tuple(SIZES), default=None, help="default: small on CPU, large otherwise")
    opts = ap.parse_args()
    backend = jax.default_backend()
    on_cpu = backend == "cpu"
    size = opts.size or ("small" if on_cpu else "large")
    print(f"backend {backend} ({jax.devices()[0].device_kind}), jax {jax.__version__}, shapes '{size}'")
    rows, results = [], {"backend": backend, "device": jax.devices()[0].device_kind, "size": size, "kernels": {}}
    if on_cpu:
        print("CPU: Pallas interpret-mode CORRECTNESS ONLY -- the interpreter's speed means nothing, no timing.")
    else:
        results["ceilings"] = ceil = ceilings(opts.repeats)
        print(f"ceilings measured now: copy {ceil['copy_bytes_per_s'] / 1e9:.0f} GB/s, "
              f"bf16 matmul {ceil['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s")
    for name, (ref, pal, args, nbytes, flops) in cases(size).items():
        args = tuple(jnp.asarray(a) for a in args)
        want = jax.jit(ref)(*args)
        entry = {"bytes": nbytes, "flops": flops}
        try:
            kernel = jax.jit(lambda *a, pal=pal: pal(*a, interpret=on_cpu))
            entry["max_abs_err"] = max_err(kernel(*args), want)
            if not on_cpu:
                entry["pallas_s"] = timed(kernel, args, opts.repeats)
                entry["reference_s"] = timed(jax.jit(ref), args, opts.repeats)
        except Exception as e:  # noqa: BLE001 -- a kernel that does not lower on this backend is a result, not a crash
            entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        results["kernels"][name] = entry
        rows.append((name, entry))

    if on_cpu:
        print(f"{'kernel':28s} {'max abs err':>12s}")
        for name, e in rows:
            print(f"{name:28s} {e.get('max_abs_err', float('nan')):12.2e} {e.get('error', '')}")
        worst = max(e.get("max_abs_err", math.inf) for _, e in rows)
        print(f"all {len(rows)} kernels vs reference (interpret mode, correctness only): worst max abs err {worst:.2e}")
    else:
        print(f"{'kernel':28s} {'err':>9s} {'pallas ms':>10s} {'ref ms':>9s} {'GB/s':>8s} {'%copy':>6s} "
              f"{'TFLOP/s':>8s} {'%mm':>5s} {'speedup':>8s}")
        ratios = []
        for name, e in rows:
            if "error" in e:
                print(f"{name:28s} FAILED {e['error']}")
                continue
            gbs, tfs = e["bytes"] / e["pallas_s"] / 1e9, e["flops"] / e["pallas_s"] / 1e12
            ratios.append(e["reference_s"] / e["pallas_s"])
            print(f"{name:28s} {e['max_abs_err']:9.1e} {e['pallas_s'] * 1e3:10.3f} {e['reference_s'] * 1e3:9.3f} "
                  f"{gbs:8.1f} {100 * gbs * 1e9 / ceil['copy_bytes_per_s']:6.1f} {tfs:8.2f} "
                  f"{100 * tfs * 1e12 / ceil['bf16_matmul_flops']:5.1f} {ratios[-1]:8.2f}")
        geo = math.exp(statistics.mean(math.log(r) for r in ratios)) if ratios else float("nan")
        print(f"geomean speedup of the Pallas kernels over their jnp references: {geo:.2f}x "
              f"({len(ratios)}/{len(rows)} kernels ran)")
    out = ROOT / "benchmarks" / "results" / "kernels.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
