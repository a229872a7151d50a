"""Judge the cluster policies against baselines in the discrete-event simulator (docs/cluster.md).

    python examples/cluster_sim.py          # small cluster (16 prefill + 16 decode ranks), short traces
    python examples/cluster_sim.py --full   # the seed's 64 prefill + 64 decode ranks (minutes)

Prints a markdown table per trace and policy, the 24 h autoscaler replay, and writes PNG plots to
``--plots`` when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import time

from deepinfer_jax.cluster.autoscale_replay import default_settings, naive_settings, replay_day
from deepinfer_jax.cluster.report import day_table, plot_results, sim_table
from deepinfer_jax.cluster.simulate import POLICIES, ClusterShape, simulate
from deepinfer_jax.cluster.traces import agent_trace, chat_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="64 prefill + 64 decode ranks, 4x the traffic")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plots", default="cluster_sim_plots")
    args = ap.parse_args()
    k = 4 if args.full else 1
    shape = ClusterShape(prefill_engines=8 * k // (2 if args.full else 1), prefill_ranks=2 * (2 if args.full else 1),
                         decode_instances=2 * (2 if args.full else 1), decode_ranks=8 * (2 if args.full else 1))
    t0 = time.time()
    traces = [chat_trace(120.0 * k, 30.0, seed=args.seed), agent_trace(4.0 * k, 30.0, seed=args.seed, gap_s=3.0)]
    print(f"traces: {', '.join(f'{t.name} {len(t.requests)} requests' for t in traces)} ({time.time() - t0:.1f} s)")
    print(f"cluster: {shape.prefill_engines} prefill engines x {shape.prefill_ranks} ranks, "
          f"{shape.decode_instances} decode instances x {shape.decode_ranks} ranks")
    results = [simulate(t, p, shape, seed=args.seed) for t in traces for p in POLICIES]
    print(sim_table(results))
    pc, dc = 4 * 80_000.0, 16 * 64.0
    days = [replay_day(default_settings(pc, dc), seed=args.seed, name="policy"),
            replay_day(naive_settings(pc, dc), seed=args.seed, name="naive (no limits)"),
            replay_day(None, seed=args.seed, static=(19, 18), name="static at peak")]
    print()
    print(day_table(days))
    for path in plot_results(results, args.plots):
        print(f"wrote {path}")
    print(f"({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
