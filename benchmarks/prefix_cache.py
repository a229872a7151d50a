"""Prefix-cache hits on an agent-style multi-turn trace, against the ideal and against cold runs.

    python benchmarks/prefix_cache.py [--model DIR|tiny|small] [--sessions 4] [--turns 6]

Each session's turn t sends the whole history (previous prompt + the model's answer) plus new
text. One engine serves the trace twice, interleaving sessions: with the prefix cache, and with
it switched off (cold). Reported: the tokens hit against the ideal given what was stored (the hit
rule applied to every block digest and window snapshot the engine ever stored: what an engine
that never evicted would have hit), and TTFT of turns >= 2, hit vs cold.

Restart: the traced engine also writes its blocks to a file-system store (a temporary directory);
a new Python process then starts a fresh engine on the same directory (with encoder bounded
replay, since SWA windows are never stored) and sends every session's final prompt: its hits
are the previous process's blocks.

Decoder bounded replay: prefill FLOPs and time with it on vs off for prompts of ``--yoco-lengths``
tokens (``benchmarks/yoco_prefill.py``). Last line: cold/hit TTFT ratio.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from deepinfer_jax import LLM, SamplingParams
from deepinfer_jax.cache.block_hash import block_digests
from deepinfer_jax.cache.swa_snapshots import hit_length

ROOT = Path(__file__).resolve().parent.parent


def run_trace(llm, sessions, turns, new_len, out_len, seed, cached: bool):
    rng = np.random.default_rng(seed)
    vocab = llm.model_config.vocab_size
    sched = llm.engine.scheduler
    prefix = sched.prefix
    if not cached:
        sched.prefix = None
    ever_blocks, ever_swa = set(), set()
    if cached:  # record everything ever stored, for the ideal
        reg, put = prefix.pool.register, prefix.snapshots.put
        prefix.pool.register = lambda b, d: (ever_blocks.add(d), reg(b, d))[1]
        prefix.snapshots.put = lambda d, s: (ever_swa.add(d), put(d, s))[1]
    history = [[0] + rng.integers(3, vocab, int(rng.integers(300, 600))).tolist() for _ in range(sessions)]
    rows = []
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    try:
        for t in range(turns):
            for s in range(sessions):
                prompt = history[s] + rng.integers(3, vocab, new_len).tolist()
                ideal = 0
                if cached:  # the hit rule over everything ever stored (digests computed like the engine's)
                    digests = block_digests(prompt, prefix.block_size, prefix.extra)
                    n = next((i for i, d in enumerate(digests) if d not in ever_blocks), len(digests))
                    ideal = hit_length(len(prompt), prefix.block_size, prefix.ring_rows, n,
                                       lambda p, dg=digests: dg[p // prefix.block_size - 1] in ever_swa).length
                out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
                history[s] = prompt + out.outputs[0].token_ids
                rows.append({"turn": t, "session": s, "prompt": len(prompt), "hit": out.num_cached_tokens,
                             "ideal": ideal, "ttft": out.metrics.ttft, "tokens": out.outputs[0].token_ids,
                             "prompt_ids": prompt})
    finally:
        sched.prefix = prefix
        if cached:
            del prefix.pool.register, prefix.snapshots.put
    return rows


ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=128, block_size=64, max_model_len=2048, chunking="tokens",
              use_tqdm=False)


def restarted(model, store: str, prompts_file: str) -> None:
    """In a fresh process: an engine on the same store directory, the prompts, their hits as JSON."""
    llm = LLM(model, **ENGINE, block_store=store, encoder_replay=True)
    prompts = json.loads(Path(prompts_file).read_text())
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1), use_tqdm=False)
    print(json.dumps([o.num_cached_tokens for o in outs]))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--restarted":
        return restarted(None if sys.argv[2] == "-" else sys.argv[2], sys.argv[3], sys.argv[4])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--new", type=int, default=64, help="new tokens per turn")
    ap.add_argument("--out", type=int, default=16, help="generated tokens per turn")
    ap.add_argument("--yoco-lengths", default="1024,4096,16384", help="prompt lengths for decoder replay ('' = skip)")
    args = ap.parse_args()
    max_len = ENGINE["max_model_len"]
    store = tempfile.mkdtemp(prefix="deepinfer-store-")
    llm = LLM(args.model, **ENGINE, block_store=store)
    need = 600 + args.turns * (args.new + args.out) + 1
    if need > max_len:
        raise SystemExit(f"--turns/--new/--out make prompts of up to {need} tokens > max_model_len {max_len}")
    llm.generate({"prompt_token_ids": [0, 5, 6]}, SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    hit = run_trace(llm, args.sessions, args.turns, args.new, args.out, seed=1, cached=True)
    cold = run_trace(llm, args.sessions, args.turns, args.new, args.out, seed=1, cached=False)
    later = [r for r in hit if r["turn"] > 0]
    later_cold = [r for r in cold if r["turn"] > 0]
    tot_hit, tot_ideal, tot_prompt = (sum(r[k] for r in later) for k in ("hit", "ideal", "prompt"))
    print(f"\n{'turn':>4} {'prompt':>7} {'hit':>6} {'ideal':>6} {'TTFT hit ms':>12} {'TTFT cold ms':>13}")
    for t in range(args.turns):
        h = [r for r in hit if r["turn"] == t]
        c = [r for r in cold if r["turn"] == t]
        print(f"{t:4d} {np.mean([r['prompt'] for r in h]):7.0f} {np.mean([r['hit'] for r in h]):6.0f} "
              f"{np.mean([r['ideal'] for r in h]):6.0f} {1e3 * np.mean([r['ttft'] for r in h]):12.1f} "
              f"{1e3 * np.mean([r['ttft'] for r in c]):13.1f}")
    ttft_hit = float(np.mean([r["ttft"] for r in later]))
    ttft_cold = float(np.mean([r["ttft"] for r in later_cold]))
    same = sum(a["tokens"] == b["tokens"] for a, b in zip(hit, cold))
    print(f"\noutputs identical with and without the cache: {same} of {len(hit)} requests")
    print(f"turns >= 2: {tot_hit} of {tot_prompt} prompt tokens hit ({100 * tot_hit / tot_prompt:.1f}%); "
          f"ideal given what was stored {tot_ideal} -> {100 * tot_hit / max(tot_ideal, 1):.1f}% of ideal")
    llm.flush()
    finals = {}
    for r in hit:  # each session's last prompt (what a restarted engine would be sent again)
        finals[r["session"]] = r
    prompts_file = Path(store) / "prompts.json"
    prompts_file.write_text(json.dumps([r["prompt_ids"] for r in finals.values()]))
    proc = subprocess.run([sys.executable, __file__, "--restarted", args.model or "-", store, str(prompts_file)],
                          capture_output=True, text=True, check=True)
    restart_hits = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"restart: a new process on the same store hit {restart_hits} tokens of final prompts "
          f"{[r['prompt'] for r in finals.values()]} (encoder bounded replay for the windows)")
    yoco = []
    if args.yoco_lengths:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import yoco_prefill

        yoco = yoco_prefill.run(args.model, tuple(int(x) for x in args.yoco_lengths.split(",")), repeats=1)
        yoco_prefill.print_rows(yoco)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix_cache.json").write_text(json.dumps({"hit": hit, "cold": cold, "restart_hits": restart_hits,
                                                       "decoder_replay": yoco}, indent=1))
    print(f"cold/hit TTFT ratio (turns >= 2): {ttft_cold / ttft_hit:.2f}x")


if __name__ == "__main__":
    main()
