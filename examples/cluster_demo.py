"""Prefill/decode disaggregation locally on Ray, in one command (``make cluster-demo``).

Starts ``Cluster(prefill=1, decode=1)`` (two engines, one Ray actor each, a temporary shared block
store), generates for a few prompts, checks the greedy tokens against a colocated ``LLM`` and
prints the router's counters (handoffs, bytes, exact admissions). docs/cluster.md explains it.
"""

from __future__ import annotations

import sys

import numpy as np

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.cluster import Cluster

SETTINGS = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "block_size": 16, "max_model_len": 128, "chunking": "tokens",
                "speculation": "none"}


def main() -> int:
    model = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, n).tolist()} for n in (7, 16, 37, 64)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with Cluster(prefill=1, decode=1, model=model, **SETTINGS) as cluster:
        outs = cluster.generate(prompts, sp, timeout_s=300)
        stats = cluster.stats
    want = LLM(model, use_tqdm=False, **SETTINGS).generate(prompts, sp, use_tqdm=False)
    for o, w in zip(outs, want):
        same = o.outputs[0].token_ids == w.outputs[0].token_ids
        print(f"{o.request_id}: {len(o.prompt_token_ids):3d} prompt tokens -> {o.outputs[0].token_ids}  "
              f"ttft {o.metrics.ttft * 1e3:.0f} ms  {'== colocated' if same else '!= colocated'}")
    print(f"handoffs {stats.handoffs}, {stats.handoff_bytes} bytes, exact admissions {stats.exact}, "
          f"recomputed {stats.recomputed or 0}")
    return 0 if all(o.outputs[0].token_ids == w.outputs[0].token_ids for o, w in zip(outs, want)) else 1


if __name__ == "__main__":
    sys.exit(main())
