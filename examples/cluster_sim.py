"""Judge the cluster policies against baselines in the discrete-event simulator (docs/cluster.md).

    python examples/cluster_sim.py          # small cluster (16 prefill + 16 decode ranks), short traces
    python examples/cluster_sim.py --full   # the seed's 64 prefill + 64 decode ranks (minutes)
    python examples/cluster_sim.py --gather-ms 50 --pairing 10   # engines that wait for a partner

Prints a markdown table per trace and policy (the traces on the default shape, then at the
autoscaler's operating point: one decode instance, agent traffic x2.25), the 24 h autoscaler replay,
and writes PNG plots to ``--plots`` when matplotlib is installed (``pip install .[sim]``).
"""

from __future__ import annotations

import argparse
import time

from deepinfer_jax.cluster.autoscale_replay import default_settings, naive_settings, replay_day
from deepinfer_jax.cluster.report import day_table, plot_results, sim_table
from deepinfer_jax.cluster.simulate import POLICIES, ClusterShape, simulate
from deepinfer_jax.cluster.traces import Trace, agent_trace, chat_trace


def _named(trace: Trace, name: str) -> Trace:
    return Trace(name, trace.requests, trace.duration_s, trace.warm_blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="64 prefill + 64 decode ranks, 4x the traffic")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plots", default="cluster_sim_plots")
    ap.add_argument("--pairing", type=float, default=4.0, help="the prefill slot rule's padding weight")
    ap.add_argument("--gather-ms", type=float, default=0.0,
                    help="engine setting, every policy: an idle prefill engine waits up to this for a request per rank")
    args = ap.parse_args()
    k = 4 if args.full else 1
    # (engines, ranks) prefill, (instances, ranks) decode
    shape = ClusterShape(16, 4, 4, 16) if args.full else ClusterShape(8, 2, 2, 8)
    # the autoscaler's operating point: prefill near its 0.7 target, decode at production occupancy
    op_shape = ClusterShape(16, 4, 1, 16) if args.full else ClusterShape(8, 2, 1, 8)
    # (one 16-rank instance would hold ~570 agent requests per rank at --full: overloaded; two)
    op_agent = ClusterShape(16, 4, 2, 16) if args.full else op_shape
    t0 = time.time()
    chat, agent = chat_trace(120.0 * k, 30.0, seed=args.seed), agent_trace(4.0 * k, 30.0, seed=args.seed, gap_s=3.0)
    busy_agent = agent_trace(9.0 * k, 30.0, seed=args.seed, gap_s=3.0)
    runs = [(chat, shape), (agent, shape), (_named(chat, "chat, op. point"), op_shape),
            (_named(busy_agent, "agent x2.25, op. point"), op_agent)]
    print(f"traces: {', '.join(f'{t.name} {len(t.requests)} requests' for t, _ in runs)} ({time.time() - t0:.1f} s)")
    for s in dict.fromkeys((shape, op_shape, op_agent)):
        print(f"cluster: {s.prefill_engines} prefill engines x {s.prefill_ranks} ranks, "
              f"{s.decode_instances} decode instances x {s.decode_ranks} ranks")
    results = [simulate(t, p, s, seed=args.seed, pairing=args.pairing, gather_ns=args.gather_ms * 1e6)
               for t, s in runs for p in POLICIES]
    print(sim_table(results))
    pc, dc = 4 * 80_000.0, 16 * 64.0
    days = [replay_day(default_settings(pc, dc), seed=args.seed, name="policy"),
            replay_day(naive_settings(pc, dc), seed=args.seed, name="naive (no limits)"),
            replay_day(None, seed=args.seed, static=(19, 18), name="static at peak")]
    print()
    print(day_table(days))
    for path in plot_results(results, args.plots, days):
        print(f"wrote {path}")
    print(f"({time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
