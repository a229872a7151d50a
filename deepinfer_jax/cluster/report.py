"""The simulator's outputs: markdown tables and PNG plots (matplotlib, if installed; else skipped)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["day_table", "plot_results", "sim_table"]


def sim_table(results) -> str:
    """One row per (trace, policy): TTFT p50/p99 per bucket (ms), TPOT, the balance readings and
    bounds (``SimResult``), occupancy, throughput, hits, decode migrations. ``trace`` is the result's trace name."""
    head = ("| trace | policy | TTFT p50/p99 ms <16K | 16-64K | 64-256K | >=256K | TPOT p50/p99 ms |"
            " prefill max/mean step | prefill bound | prefill max/mean window | decode max/mean attn | decode bound |"
            " decode max/mean step cost | rows/rank | out tok/s | hit | prefill util | migrations |")
    lines = [head, "|" + "---|" * 18]
    for r in results:
        cells = [f"{p50:.0f}/{p99:.0f}" if n else "-" for (p50, p99, n) in r.ttft_ms.values()]
        lines.append(f"| {r.trace} | {r.policy} | " + " | ".join(cells) +
                     f" | {r.tpot_ms[0]:.2f}/{r.tpot_ms[1]:.2f} | {r.prefill_balance:.3f} | {r.prefill_bound:.3f} |"
                     f" {r.prefill_window_balance:.3f} | {r.decode_balance:.3f} | {r.decode_bound:.3f} |"
                     f" {r.decode_step_balance:.3f} | {r.decode_rows:.1f} | {r.output_tok_s:,.0f} | {r.hit_rate:.1%} |"
                     f" {r.prefill_util:.2f} | {r.migrations} |")
    return "\n".join(lines)


def day_table(days) -> str:
    head = ("| autoscaler (24 h) | instance-hours | ready-pool hours | scale events | oscillations |"
            " prefill overload s | decode overload s | prefill range | decode range |")
    lines = [head, "|" + "---|" * 9]
    for d in days:
        lines.append(f"| {d.name} | {d.instance_hours:.1f} | {d.ready_pool_hours:.1f} | {d.scale_events} |"
                     f" {d.oscillations} | {d.prefill_overload_s:.0f} | {d.decode_overload_s:.0f} |"
                     f" {d.prefill_range[0]}-{d.prefill_range[1]} | {d.decode_range[0]}-{d.decode_range[1]} |")
    return "\n".join(lines)


def plot_results(results, out_dir: str | Path, days=()) -> list[Path]:
    """PNG plots: per trace, the balance readings and TTFT p99 per bucket for every policy; the 24 h
    replays' instance counts when ``days`` carry a timeline. Returns the files written, or [] with a
    message when matplotlib is not installed (an optional extra: ``pip install .[sim]``)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install 'deepinfer-jax[sim]' or pip install matplotlib)")
        return []
    import numpy as np
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for trace in dict.fromkeys(r.trace for r in results):
        rs = [r for r in results if r.trace == trace]
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        names = [r.policy for r in rs]
        x = np.arange(len(rs))
        readings = (("prefill step", "prefill_balance"), ("prefill window", "prefill_window_balance"),
                    ("decode attn", "decode_balance"), ("decode step cost", "decode_step_balance"))
        w = 0.8 / len(readings)
        for k, (label, attr) in enumerate(readings):
            axes[0].bar(x + (k - 1.5) * w, [getattr(r, attr) for r in rs], w, label=label)
        axes[0].plot(x - 1.5 * w, [r.prefill_bound for r in rs], "b_", ms=12, label="prefill bound")
        axes[0].plot(x, [r.decode_bound for r in rs], "k_", ms=20, label="decode bound")
        axes[0].axhline(1.10, color="k", ls="--", lw=0.8)
        axes[0].axhline(1.5, color="r", ls=":", lw=0.8)
        axes[0].set_xticks(x, names)
        axes[0].set_ylabel("max / mean")
        axes[0].set_title(f"{trace}: balance (dashed 1.10 target, dotted 1.5)")
        axes[0].legend(fontsize=7, loc="lower center", ncol=3)  # over the bars' feet, not their tops
        buckets = list(rs[0].ttft_ms)
        wb = 0.8 / len(buckets)
        for k, b in enumerate(buckets):
            axes[1].bar(x + (k - 1.5) * wb, [r.ttft_ms[b][1] / 1e3 if r.ttft_ms[b][2] else 0.0 for r in rs], wb, label=b)
        axes[1].set_xticks(x, names)
        axes[1].set_ylabel("TTFT p99 (s)")
        axes[1].set_title(f"{trace}: TTFT p99 by prompt length")
        axes[1].legend(fontsize=7)
        path = out / f"cluster_sim_{''.join(c if c.isalnum() else '_' for c in trace)}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    timed = [d for d in days if getattr(d, "timeline", None)]
    if timed:
        fig, axes = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
        for d in timed:
            t = [p[0] / 3600.0 for p in d.timeline]
            axes[0].step(t, [p[1] for p in d.timeline], where="post", label=f"{d.name}")
            axes[1].step(t, [p[2] for p in d.timeline], where="post", label=f"{d.name}")
        axes[0].set_ylabel("prefill instances")
        axes[1].set_ylabel("decode instances")
        axes[1].set_xlabel("hour")
        axes[0].legend(fontsize=7)
        axes[0].set_title("24 h diurnal replay with bursts: active instances")
        path = out / "cluster_autoscale_day.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files
