"""The bounded-replay study: how far does a replayed window drift from the exact one?

    python examples/replay_study.py [--model DIR|tiny|small] [--hit 128] [--sequences 4] [--out DIR]

Teacher-forces real text (the Python standard library's own source, tokenized with the DeepSeek-V4
tokenizer) through the exact state and through encoder and decoder bounded replay of W, 2W and 4W
tokens (W = the sliding window) from a hit point, with ``deepinfer_jax.research.replay``; writes a
PNG (log10 KL by distance from the replay point, one line per mode and W) and a markdown table of
the summary numbers into ``--out`` (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import numpy as np

from deepinfer_jax.llm import _load_model
from deepinfer_jax.research.png import line_plot_png
from deepinfer_jax.research.replay import replay_study
from deepinfer_jax.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--hit", type=int, default=128)
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    cfg, params, ckpt = _load_model(args.model, "float32")
    tok = load_tokenizer(ckpt)
    text = inspect.getsource(json.decoder) + inspect.getsource(json.encoder)
    ids = tok.encode(text, add_special_tokens=False).ids
    n = args.hit + args.continuation + 1
    seqs = [[cfg.bos_token_id] + ids[i * n : (i + 1) * n - 1] for i in range(args.sequences)]
    w = cfg.sliding_window
    results = [(mode, r) for mode in ("encoder", "decoder")
               for r in replay_study(params, cfg, seqs, hit=args.hit, replay_lengths=[w, 2 * w, 4 * w], mode=mode)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    series = [{"x": np.arange(len(r.kl)), "y": np.log10(np.maximum(r.kl, 1e-12)), "color": COLORS[i % 3],
               "marker": mode == "decoder"} for i, (mode, r) in enumerate(results)]
    png = line_plot_png(out / "replay_study.png", series)
    rows = ["| replay | W | mean KL | top-1 agreement | mean abs dlogprob (ref token) | max SWA rel err | "
            "mean SWA rel err, first window |", "|---|---:|---:|---:|---:|---:|---:|"]
    for mode, r in results:
        s = r.summary
        rows.append(f"| {mode} | {s['replay_tokens']} | {s['mean_kl']:.3g} | {100 * s['top1_agree']:.1f}% | "
                    f"{s['mean_abs_dlogprob']:.3g} | {s['max_swa_rel_err']:.3g} | "
                    f"{s['mean_swa_rel_err_first_window']:.3g} |")
    table = "\n".join(rows)
    (out / "replay_study.md").write_text(
        f"# Encoder bounded replay vs exact\n\nmodel: {ckpt or args.model}, hit at {args.hit}, "
        f"{args.continuation} teacher-forced positions x {args.sequences} sequences of json/decoder+encoder "
        f"source; window {w}.\n\n{table}\n\nLines: W, 2W, 4W (blue, orange, green); decoder replay drawn with markers.\n\n![log10 KL by distance]({png.name})\n")
    print(table)
    print(f"wrote {png} and {out / 'replay_study.md'}")


if __name__ == "__main__":
    main()
