"""The simulator's outputs: markdown tables and PNG plots (matplotlib, if installed; else skipped)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["day_table", "plot_results", "sim_table"]


def sim_table(results) -> str:
    """One row per (trace, policy): TTFT p50/p99 per bucket (ms), TPOT, balance, throughput, hits."""
    head = ("| trace | policy | TTFT p50/p99 <16K | 16-64K | 64-256K | >=256K | TPOT p50/p99 ms | prefill max/mean |"
            " decode max/mean | out tok/s | in tok/s | hit | prefill util |")
    lines = [head, "|" + "---|" * 13]
    for r in results:
        cells = [f"{p50:.0f}/{p99:.0f} (n={n})" if n else "-" for (p50, p99, n) in r.ttft_ms.values()]
        lines.append(f"| {r.trace} | {r.policy} | " + " | ".join(cells) +
                     f" | {r.tpot_ms[0]:.2f}/{r.tpot_ms[1]:.2f} | {r.prefill_balance:.3f} | {r.decode_balance:.3f} |"
                     f" {r.output_tok_s:,.0f} | {r.input_tok_s:,.0f} | {r.hit_rate:.1%} | {r.prefill_util:.2f} |")
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


def plot_results(results, out_dir: str | Path) -> list[Path]:
    """Bar charts of balance and TTFT p99 per policy; returns the files written, or [] with a message
    when matplotlib is not installed (it is not a dependency of this project)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install matplotlib to get the PNGs)")
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for trace in sorted({r.trace for r in results}):
        rs = [r for r in results if r.trace == trace]
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        names = [r.policy for r in rs]
        axes[0].bar(names, [r.prefill_balance for r in rs], label="prefill")
        axes[0].bar(names, [r.decode_balance for r in rs], alpha=0.5, label="decode")
        axes[0].axhline(1.10, color="k", ls="--")
        axes[0].set_title(f"{trace}: max/mean")
        axes[0].legend()
        axes[1].bar(names, [r.ttft_ms["<16K"][1] for r in rs])
        axes[1].set_title(f"{trace}: TTFT p99 <16K (ms)")
        path = out / f"cluster_sim_{trace}.png"
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        files.append(path)
    return files
