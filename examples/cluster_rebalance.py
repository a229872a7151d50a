"""Decode rebalancing per seed: routing alone, the rebalancer on its tick only, and with its plans after each
admission (the default), against round robin, on the traces where round robin exceeds 1.5 (docs/cluster.md,
"Decode rebalancing").

    python examples/cluster_rebalance.py               # seeds 0 1 2, about a minute here
    python examples/cluster_rebalance.py --seeds 3 4

Prints one markdown row per trace and seed: decode max/mean attention for each policy, the bound no placement
of whole requests goes below, the step cost balance and TPOT p99 (the pauses' price), and the migrations.
"""

from __future__ import annotations

import argparse
import time

from deepinfer_jax.cluster.decode_rebalance import RebalanceSettings
from deepinfer_jax.cluster.simulate import ClusterShape, simulate
from deepinfer_jax.cluster.traces import agent_trace, chat_trace

TICK_ONLY = RebalanceSettings(on_admit=False, threshold=1.02)  # the setting before plans after admissions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    t0 = time.time()
    print("| trace | seed | round robin | routing | + tick | + admit | bound | step cost max/mean routing / tick / "
          "admit | TPOT p99 ms round robin / routing / tick / admit | migrations tick / admit |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seed in args.seeds:
        agent = agent_trace(4.0, 30.0, seed=seed, gap_s=3.0)  # the traces of examples/cluster_sim.py
        chat = chat_trace(120.0, 30.0, seed=seed)
        for label, trace, shape in [("agent, 2 x 8", agent, ClusterShape(8, 2, 2, 8)),
                                    ("chat, op. point (1 x 8)", chat, ClusterShape(8, 2, 1, 8)),
                                    ("chat, 2 x 8", chat, ClusterShape(8, 2, 2, 8))]:
            rr = simulate(trace, "round_robin", shape, seed=seed)
            base = simulate(trace, "deepinfer", shape, seed=seed)
            tick = simulate(trace, "deepinfer_migrate", shape, seed=seed, rebalance=TICK_ONLY)
            admit = simulate(trace, "deepinfer_migrate", shape, seed=seed)
            steps = " / ".join(f"{r.decode_step_balance:.3f}" for r in (base, tick, admit))
            tpot = " / ".join(f"{r.tpot_ms[1]:.2f}" for r in (rr, base, tick, admit))
            attn = " | ".join(f"{r.decode_balance:.3f}" for r in (rr, base, tick))
            print(f"| {label} | {seed} | {attn} | **{admit.decode_balance:.3f}** | {admit.decode_bound:.3f} | {steps} "
                  f"| {tpot} | {tick.migrations} / {admit.migrations} |", flush=True)
    print(f"({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
