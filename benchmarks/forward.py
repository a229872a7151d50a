"""Prefill throughput of the jitted ``forward_full`` against the NeMo AutoModel V4.1 port (eager torch).

    python benchmarks/forward.py [--configs tiny,small] [--lengths 512,2048] [--repeats 3]

Both sides run the same config and the same weights (ours seeded, exported to NeMo through the
DeepSeek-native names) on the same token ids, batch 1, fp32, on this machine's CPU, in one process.
Achieved FLOP/s uses XLA's cost analysis of our compiled forward (the same count is used for the
reference, which computes the same model) and is reported as a fraction of this machine's dense
fp32 matmul FLOP/s, measured in the same run. Prints a table; the last line is the ratio
ours/reference. Writes benchmarks/results/forward.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deepinfer_jax import ModelConfig, forward_full, init_params
from deepinfer_jax.checkpoint.hf_export import tree_to_hf_tensors
from deepinfer_jax.engram_vocab import deepseek_v4_tokenizer_path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def _time(fn, repeats: int) -> float:
    fn()  # warm-up (compile for ours)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_flops_per_s(n: int = 2048, repeats: int = 5) -> float:
    a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    return 2 * n**3 / _time(lambda: f(a).block_until_ready(), repeats)


def _benchmarks_off_path() -> None:
    """Take this folder off ``sys.path``: it holds ``kernels.py``, and transformers imports Hugging Face's
    ``kernels`` package by that name when it is installed, so it must not find our script first."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != here]
    mod = sys.modules.get("kernels")
    if mod is not None and Path(getattr(mod, "__file__", "") or "").resolve().parent == here:
        del sys.modules["kernels"]


def nemo_model(cfg: ModelConfig, params):
    _benchmarks_off_path()
    import nemo_oracle
    import torch
    from transformers import PreTrainedTokenizerFast

    torch.set_num_threads(os.cpu_count() or 1)
    hf = cfg.replace(dtype="float32").to_hf_config(vision_config={"num_hidden_layers": 0})
    if cfg.engram_compressed_vocab_size == cfg.vocab_size:
        tok = nemo_oracle.synthetic_tokenizer(cfg.vocab_size)
    else:
        tok = PreTrainedTokenizerFast(tokenizer_file=str(deepseek_v4_tokenizer_path()))
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    model = DeepseekV41ForCausalLM(
        nemo_oracle.nemo_config.DeepseekV41Config(**{**hf, "vision_config": {"num_hidden_layers": 0}}),
        backend=BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch",
                              dispatcher="torch"), tokenizer=tok)
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    tree = nnx.to_pure_dict(params)
    tree.pop("engram_token_map", None)
    nemo_oracle.load_native_state_dict(model.eval(), tree_to_hf_tensors(cfg, tree, quantize=False,
                                                                         plain_dtype=np.float32))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="tiny,small")
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import torch

    peak = matmul_flops_per_s()
    print(f"machine: {os.cpu_count()} CPU cores, jax {jax.__version__} ({jax.default_backend()}), "
          f"torch {torch.__version__}; dense fp32 matmul {peak / 1e9:.1f} GFLOP/s")
    rows = []
    fwd = jax.jit(forward_full, static_argnums=1)
    for name in args.configs.split(","):
        cfg = getattr(ModelConfig, name)()
        params = init_params(cfg, seed=0)
        ref = nemo_model(cfg, params)
        for length in (int(x) for x in args.lengths.split(",")):
            ids = np.random.default_rng(length).integers(0, cfg.vocab_size, (1, length))
            flops = fwd.lower(params, cfg, ids).compile().cost_analysis()
            flops = float((flops[0] if isinstance(flops, list) else flops)["flops"])
            ours = _time(lambda: fwd(params, cfg, ids).block_until_ready(), args.repeats)
            t_ids = torch.from_numpy(ids)

            def run_ref():
                with torch.no_grad():
                    ref(t_ids)

            theirs = _time(run_ref, args.repeats)
            row = dict(config=name, tokens=length, ours_tok_s=length / ours, ref_tok_s=length / theirs,
                       ratio=theirs / ours, gflop=flops / 1e9, ours_frac_peak=flops / ours / peak,
                       ref_frac_peak=flops / theirs / peak)
            rows.append(row)
            print(f"  measured {name} T={length}: ours {ours * 1e3:.0f} ms, reference {theirs * 1e3:.0f} ms")
    print()
    print(f"{'config':8} {'T':>6} {'ours tok/s':>11} {'NeMo tok/s':>11} {'ours/NeMo':>10} {'GFLOP':>8} "
          f"{'ours %peak':>11} {'NeMo %peak':>11}")
    for r in rows:
        print(f"{r['config']:8} {r['tokens']:6d} {r['ours_tok_s']:11.1f} {r['ref_tok_s']:11.1f} {r['ratio']:10.2f} "
              f"{r['gflop']:8.2f} {100 * r['ours_frac_peak']:10.1f}% {100 * r['ref_frac_peak']:10.1f}%")
    geo = float(np.exp(np.mean([np.log(r["ratio"]) for r in rows])))
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "forward.json").write_text(json.dumps(dict(peak_flops=peak, rows=rows, geomean_ratio=geo), indent=2))
    print(f"prefill tokens/s ours/reference (geometric mean over {len(rows)} rows): {geo:.2f}x")


if __name__ == "__main__":
    main()
