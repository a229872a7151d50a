"""The demo: offline batch generation through ``LLM`` on the shipped checkpoint.

    python examples/offline_inference.py [--model DIR|tiny|small] [--max-tokens 24] [--sync] [--chunking tokens]
                                         [--weights auto] [--speculation auto]

Loads the default checkpoint (checkpoints/small-trained: the `small` model trained on the Python
standard library, so expect Python-flavoured continuations from a 39M-parameter model) and
generates for a few prompts with a progress bar; each step bucket compiles on its first use (a
fresh machine: about half a minute in all; later runs load the programs from the compilation
cache) and the step-cost model is fitted online and saved. Prints the outputs and a metrics summary.

Two settings differ from the engine's defaults, chosen for a 39M-parameter model on a CPU
(docs/startup.md §8): the weights are decoded to float32 at load (``--weights float32``; the default
``auto`` keeps the checkpoint's FP8/FP4 bytes resident and decodes them inside every step, which saves
memory on a real model and costs ~20% of each step here) and speculative decoding is off
(``--speculation none``; with ``auto`` the engine keeps the DSpark drafter's features up to date in every
step, but on this machine its measured step times never favour drafting for this model, so it drafts no
token and the steps cost ~25% more). ``--weights auto --speculation auto`` gives the engine's defaults.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.checkpoint.residency import WEIGHTS
from deepinfer_jax.config.engine import SPECULATION_MODES

PROMPTS = ["import os\n", "def fibonacci(n):", "class Queue:\n", "    for i in range(", 'if __name__ == "__main__":\n']


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory or preset (default: the shipped one)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--sync", action="store_true", help="turn asynchronous scheduling off")
    parser.add_argument("--chunking", default="cost", choices=("cost", "tokens"))
    parser.add_argument("--weights", default="float32", choices=WEIGHTS, help="weight residency (default float32)")
    parser.add_argument("--speculation", default="none", choices=SPECULATION_MODES,
                        help="speculative decoding (default none)")
    args = parser.parse_args()

    t0 = time.perf_counter()
    llm = LLM(args.model, max_num_seqs=8, max_num_batched_tokens=64, block_size=32, max_model_len=256,
              chunking=args.chunking, step_budget_ns=150_000_000, async_scheduling=not args.sync,
              weights=args.weights, speculation=args.speculation)
    cfg = llm.model_config
    print(f"engine ready in {time.perf_counter() - t0:.1f} s: {cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, {cfg.num_parameters() / 1e6:.1f}M parameters, weights {llm.weights_resident}, "
          f"speculation {llm.speculation}, buckets {llm.buckets}")

    params = [SamplingParams(temperature=args.temperature, top_p=0.95, max_tokens=args.max_tokens, seed=i)
              for i in range(len(PROMPTS))]
    params[0] = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)  # one greedy request
    t0 = time.perf_counter()
    outputs = llm.generate(PROMPTS, params)
    wall = time.perf_counter() - t0
    print(f"generated in {wall:.1f} s (compiling the buckets it used included: {llm.runner.traces} programs traced)")

    for out in outputs:
        c = out.outputs[0]
        print(f"\n{out.prompt!r}\n  -> {c.text!r}\n     {len(c.token_ids)} tokens, finish={c.finish_reason}, "
              f"ttft {1e3 * out.metrics.ttft:.0f} ms, decode {out.metrics.decode_tokens_per_s or 0:.1f} tok/s")
    s = llm.stats
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts = np.array([o.metrics.ttft for o in outputs])
    print(f"\n{len(outputs)} requests, {n_out} output tokens in {wall:.2f} s ({n_out / wall:.1f} tok/s); "
          f"TTFT p50 {1e3 * np.median(ttfts):.0f} ms; {s['steps']} steps, {s['preemptions']} preemptions")
    print(f"host time {s['host_s']:.3f} s vs device {s['device_s']:.3f} s; async={not args.sync}")
    if s["cost_model_error"] is not None:
        print(f"cost model: mean relative prediction error {100 * s['cost_model_error']:.1f}% "
              f"(coefficients ns: {np.round(s['cost_model_coef_ns'], 3).tolist()})")


if __name__ == "__main__":
    main()
