"""Start-up time: how long until the engine (or the jitted ``generate``) produces tokens.

    python benchmarks/startup.py [--skip-nemo] [--skip-baseline] [--baseline-rev 97d1407]

Every measurement runs in a fresh Python process (``--child``), timed from the moment the parent
starts it (the child reads the parent's clock when its tokens exist; the interpreter's teardown after
that is not counted, the process's exit time is in the JSON as ``wall_s``), so imports and loading
count. "cold" processes get empty compilation-cache and profile-cache directories; "warm" ones reuse
what the cold run left. Rows:

- ``LLM()`` ready: the demo's engine settings on the shipped checkpoint (``DEMO``: float32-resident
  weights, no speculation), ``precompile="lazy"`` (the default) and ``"all"``; then the demo's 5 prompts
  x 24 greedy tokens through ``LLM.generate``. The same with the engine's default weights and speculation
  (``DEFAULTS``: quantized-resident, ``auto``), in its own caches, beside it.
- NeMo eager: NeMo AutoModel's DeepSeek-V4.1 port (torch, CPU, fp32, eager; the peer a notebook user
  would pick) on the same checkpoint's decoded weights, the same 5 prompts, 24 greedy tokens each by
  recomputing the full forward per token (the port has no KV cache); it reports how many of its
  tokens equal ours.
- ``generate_ragged``: the jitted notebook entry point, the same prompts as ragged rows; first call
  (compile, or in a warm process load from the program store, + run), a second call with other sampling
  settings and a third asking for twice the tokens (neither recompiles: the settings are arrays, the token
  count a run-time argument); its first call again without the program store (``DEEPINFER_PROGRAM_STORE=off``,
  caches of its own: a warm process traces and reads the compilation cache).
- Per bucket: trace, compile time and optimized-HLO size of one plain step bucket (64 tokens, 4
  requests) and one speculative step bucket, for this tree and for ``--baseline-rev`` (the commit
  before the start-up work: Sinkhorn rounds unrolled, every bucket compiled up front), checked out
  into a temporary git worktree and run the same way.

Prints one table; results also go to ``benchmarks/results/startup.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["import os\n", "def fibonacci(n):", "class Queue:\n", "    for i in range(", 'if __name__ == "__main__":\n']
MAX_TOKENS = 24
SPAWN_CLOCK = "STARTUP_BENCH_SPAWNED_AT"  # the parent's time.time() when it started the child
#: ``make demo``'s engine settings (examples/offline_inference.py): float32-resident weights and no speculation
#: (docs/startup.md §8); ``DEFAULTS`` the same with the engine's defaults for those two, measured beside it.
DEMO = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=32, max_model_len=256,
            step_budget_ns=150_000_000, weights="float32", speculation="none")
DEFAULTS = {**DEMO, "weights": "auto", "speculation": "auto"}


# --- children: each prints one JSON line -------------------------------------------------------


def _since_spawn() -> float:
    """Seconds since the parent started this process (``run_child`` passes its clock): "process start -> tokens"
    stops when the tokens exist, not when the interpreter has finished tearing down."""
    return time.time() - float(os.environ[SPAWN_CLOCK])


def child_engine(precompile: str, profile_dir: str, settings: str = "demo") -> dict:
    from deepinfer_jax import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(None, use_tqdm=False, precompile=precompile, cost_model_dir=profile_dir,
              **(DEMO if settings == "demo" else DEFAULTS))
    ready = time.perf_counter() - t0
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return {"ready_in_process_s": ready, "tokens_at_s": _since_spawn(),
            "tokens": [o.outputs[0].token_ids for o in outs],
            "speculation": llm.speculation, "weights": llm.weights_resident}


def child_nemo() -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from forward import nemo_model  # NeMo's port built with this checkpoint's decoded weights

    from deepinfer_jax.checkpoint import load_hf_checkpoint
    from deepinfer_jax.llm import DEFAULT_CHECKPOINT
    from deepinfer_jax.tokenizer import load_tokenizer

    cfg, params = load_hf_checkpoint(DEFAULT_CHECKPOINT, progress=False)
    model = nemo_model(cfg, params)
    ours_tok = load_tokenizer(DEFAULT_CHECKPOINT)
    tokens = []
    with torch.no_grad():
        for p in PROMPTS:
            seq = [cfg.bos_token_id, *ours_tok.encode(p, add_special_tokens=False).ids]
            new = []
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([seq]), logits_to_keep=1).logits[0, -1]
                nxt = int(torch.argmax(logits))
                seq.append(nxt)
                new.append(nxt)
                if nxt == cfg.eos_token_id:
                    break
            tokens.append(new)
    return {"tokens_at_s": _since_spawn(), "tokens": tokens}


def child_generate() -> dict:
    import jax

    import deepinfer_jax as di
    from deepinfer_jax.llm import DEFAULT_CHECKPOINT
    from deepinfer_jax.tokenizer import load_tokenizer

    cfg, params = di.load_hf_checkpoint(DEFAULT_CHECKPOINT, progress=False)
    tok = load_tokenizer(DEFAULT_CHECKPOINT)
    prompts = [[cfg.bos_token_id, *tok.encode(p, add_special_tokens=False).ids] for p in PROMPTS]
    t0 = time.perf_counter()
    first = di.generate_ragged(params, cfg, prompts, MAX_TOKENS)
    t1 = time.perf_counter()
    di.generate_ragged(params, cfg, prompts, MAX_TOKENS, key=jax.random.key(1), temperature=0.8, top_p=0.95)
    t2 = time.perf_counter()
    longer = di.generate_ragged(params, cfg, prompts, 2 * MAX_TOKENS)
    t3 = time.perf_counter()
    assert [row[:MAX_TOKENS] for row in longer] == first, "the longer greedy run does not start with the shorter"
    return {"first_call_s": t1 - t0, "second_call_s": t2 - t1, "longer_call_s": t3 - t2, "tokens": first}


def child_bucket() -> dict:
    """Trace/lower, compile and optimized-HLO size of one plain and one speculative step bucket
    (this process's deepinfer_jax: the tree or the baseline worktree on PYTHONPATH)."""
    import jax

    from deepinfer_jax.checkpoint import load_hf_checkpoint, load_hf_drafter
    from deepinfer_jax.config import CacheConfig
    from deepinfer_jax.llm import DEFAULT_CHECKPOINT
    from deepinfer_jax.runner import Buckets, ModelRunner
    from deepinfer_jax.runner.step_batch import logit_rows, sampling_batch

    jax.config.update("jax_enable_compilation_cache", False)
    cfg, params = load_hf_checkpoint(DEFAULT_CHECKPOINT, progress=False)
    cc = CacheConfig(block_size=32, num_blocks=32, max_requests=4, max_blocks_per_request=8, storage="quantized")
    buckets = Buckets(tokens=(64,), requests=(4,), blocks=(8,))
    out = {}
    runner = ModelRunner(cfg, params, cc, buckets)
    inputs = runner._inputs([], 64, 4, 8)
    rows = logit_rows([], inputs, 4)
    feed, _, _ = sampling_batch([], inputs, 64, 4, 4)
    t0 = time.perf_counter()
    lowered = runner._forward_fn.lower(runner._ptree, runner._pleaves, cfg, cc, runner.cache, runner.last_ids, feed,
                                       inputs._replace(logit_rows=rows))
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    out["plain"] = {"trace_s": t1 - t0, "compile_s": t2 - t1, "hlo_mb": len(compiled.as_text()) / 1e6}
    drafter = load_hf_drafter(DEFAULT_CHECKPOINT, cfg)
    try:  # a baseline tree from before the step components: the speculative runner was a subclass
        from deepinfer_jax.runner.spec_runner import SpecRunner

        spec = SpecRunner(cfg, params, drafter, cc, buckets)
        dispatch = (lambda: spec._dispatch([], 0, True, 64, 4, 8))  # one rank: no per-rank lists yet
    except ImportError:
        spec = ModelRunner(cfg, params, cc, buckets, drafter=drafter).speculation
        dispatch = (lambda: spec._dispatch([[]], [0], [True], 64, 4, 8))
    t0 = time.perf_counter()
    spec.sample(dispatch()).result()  # both speculative programs, traced and compiled
    out["spec"] = {"first_step_s": time.perf_counter() - t0}
    return out


CHILDREN = {"engine": child_engine, "nemo": child_nemo, "generate": child_generate, "bucket": child_bucket}


# --- the parent ---------------------------------------------------------------------------------


def run_child(kind: str, *args: str, env: dict | None = None, pythonpath: str | None = None) -> dict:
    e = {**os.environ, **(env or {})}
    if pythonpath:
        e["PYTHONPATH"] = pythonpath
    t0 = time.perf_counter()
    e[SPAWN_CLOCK] = repr(time.time())
    proc = subprocess.run([sys.executable, __file__, "--child", kind, *args], env=e, capture_output=True, text=True,
                          cwd=pythonpath or ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"child {kind} {args} failed:\n{proc.stderr[-4000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    return {"wall_s": wall, **json.loads(line)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", choices=sorted(CHILDREN))
    parser.add_argument("--skip-nemo", action="store_true")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--baseline-rev", default="97d1407")
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child](*args.rest)), flush=True)
        return

    rows: list[tuple[str, str, float, str]] = []
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("lazy", "all"):
            xla, prof = Path(tmp, f"xla-{mode}"), Path(tmp, f"prof-{mode}")
            env = {"DEEPINFER_COMPILATION_CACHE": str(xla)}
            for temp in ("cold", "warm"):
                r = run_child("engine", mode, str(prof), env=env)
                results[f"engine_{mode}_{temp}"] = r
                rows.append((f"LLM(precompile={mode!r}) ready", temp, r["ready_in_process_s"], "in process"))
                rows.append((f"process start -> demo's 5 x {MAX_TOKENS} tokens", temp, r["tokens_at_s"],
                             f"precompile={mode}, weights {r['weights']}, speculation {r['speculation']}"))
                print(f"  engine {mode} {temp}: ready {r['ready_in_process_s']:.1f} s, tokens at "
                      f"{r['tokens_at_s']:.1f} s (process exited at {r['wall_s']:.1f} s)", flush=True)
        # the baseline without the program store (runner.program_store, on by default), in its own caches
        store = {"DEEPINFER_COMPILATION_CACHE": str(Path(tmp, "xla-nostore")), "DEEPINFER_PROGRAM_STORE": "off"}
        for temp in ("cold", "warm"):
            r = run_child("engine", "lazy", str(Path(tmp, "prof-nostore")), env=store)
            results[f"engine_lazy_{temp}_nostore"] = r
            rows.append((f"process start -> demo's 5 x {MAX_TOKENS} tokens", f"{temp}, no store", r["tokens_at_s"],
                         "precompile=lazy, DEEPINFER_PROGRAM_STORE=off"))
            print(f"  engine lazy {temp} without the program store: tokens at {r['tokens_at_s']:.1f} s", flush=True)
        # the engine's defaults for weights and speculation (quantized-resident, auto), in their own caches
        defaults = {"DEEPINFER_COMPILATION_CACHE": str(Path(tmp, "xla-defaults"))}
        for temp in ("cold", "warm"):
            r = run_child("engine", "lazy", str(Path(tmp, "prof-defaults")), "defaults", env=defaults)
            results[f"engine_lazy_{temp}_defaults"] = r
            same = sum(a == b for a, b in zip(r["tokens"], results["engine_lazy_cold"]["tokens"]))
            rows.append((f"process start -> demo's 5 x {MAX_TOKENS} tokens", f"{temp}, defaults", r["tokens_at_s"],
                         f"weights auto ({r['weights']}), speculation auto ({r['speculation']}); "
                         f"{same}/5 outputs equal the demo settings'"))
            print(f"  engine lazy {temp} with the engine's default weights and speculation: tokens at "
                  f"{r['tokens_at_s']:.1f} s", flush=True)
        ours = results["engine_lazy_cold"]["tokens"]
        if not args.skip_nemo:
            r = run_child("nemo")
            results["nemo"] = r
            same = sum(a == b for a, b in zip(r["tokens"], ours))
            rows.append((f"process start -> demo's 5 x {MAX_TOKENS} tokens", "-", r["tokens_at_s"],
                         f"NeMo eager (torch CPU); {same}/5 outputs equal ours"))
            print(f"  nemo: tokens at {r['tokens_at_s']:.1f} s", flush=True)
        # generate_ragged, and beside it without the program store (the warm process traces and reads the cache)
        for suffix, label, gen_env in (
                ("", "", {"DEEPINFER_COMPILATION_CACHE": str(Path(tmp, "xla-generate"))}),
                ("_nostore", ", no store", {"DEEPINFER_COMPILATION_CACHE": str(Path(tmp, "xla-generate-nostore")),
                                            "DEEPINFER_PROGRAM_STORE": "off"})):
            for temp in ("cold", "warm"):
                r = run_child("generate", env=gen_env)
                results[f"generate_{temp}{suffix}"] = r
                same = sum(a == b for a, b in zip(r["tokens"], ours))
                rows.append(("generate_ragged first call (compile or load + run)", temp + label, r["first_call_s"],
                             f"{same}/5 outputs equal the engine's"))
                print(f"  generate {temp}{label}: first call {r['first_call_s']:.1f} s", flush=True)
                if label:
                    continue
                rows.append(("generate_ragged, other sampling settings", temp, r["second_call_s"], "no recompile"))
                rows.append((f"generate_ragged, {2 * MAX_TOKENS} tokens instead of {MAX_TOKENS}", temp,
                             r["longer_call_s"], "no recompile"))
        trees = [("this tree", None)]
        if not args.skip_baseline:
            wt = Path(tmp, "baseline")
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(wt), args.baseline_rev],
                           check=True, capture_output=True)
            trees.append((f"baseline {args.baseline_rev}", str(wt)))
        try:
            for name, path in trees:
                r = run_child("bucket", pythonpath=path)
                results[f"bucket_{name}"] = r
                p = r["plain"]
                rows.append(("plain bucket (64 tok x 4 req): trace + lower", name, p["trace_s"], ""))
                rows.append(("plain bucket: XLA compile", name, p["compile_s"], f"optimized HLO {p['hlo_mb']:.1f} MB"))
                rows.append(("speculative bucket: first step (both programs)", name, r["spec"]["first_step_s"], ""))
                print(f"  bucket {name}: compile {p['compile_s']:.1f} s", flush=True)
        finally:
            if not args.skip_baseline:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(trees[-1][1])],
                               capture_output=True)
    print()
    print(f"{'measurement':52} {'cache':>16} {'seconds':>8}  notes")
    for what, temp, secs, note in rows:
        print(f"{what:52} {temp:>16} {secs:8.1f}  {note}")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "startup.json").write_text(json.dumps({"rows": rows, "raw": results}, indent=1))


if __name__ == "__main__":
    main()
