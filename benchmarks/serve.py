"""Serving load check: the HTTP server under N concurrent streaming clients vs the offline engine.

    python benchmarks/serve.py [--requests 32] [--concurrency 8] [--max-tokens 32] [--cold]

Loopback only, bounded: ``--requests`` chat requests (``max_tokens`` each, seeded sampling, thinking
off), at most ``--concurrency`` in flight, the whole run cut at ``--deadline`` seconds.

1. Start-up: ``python -m deepinfer_jax.serve`` in a fresh process (the shipped model, the engine
   settings below, its warm-up request), timed from the process start to the first ``/health``
   200, with the compilation cache as it is ("warm"); with ``--cold`` first once more with empty
   compilation- and profile-cache directories ("cold"). Then the first request's time to first token.
2. Load: after one untimed round of ``--concurrency`` requests (the step buckets the load reaches are
   compiled lazily, or loaded from the compilation cache, by it), the clients stream ``/v1/chat/completions`` (SSE read by hand with ``httpx``, so the
   client library's own cost stays out); per request TTFT (request sent -> first SSE event, which
   the server sends with the first token) and TPOT ((last - first event) / (tokens - 1), tokens from
   the usage chunk); throughput = completion tokens / wall time.
3. Offline: the same requests (``chat.prepare``) through ``LLM.generate`` in this process, all at
   once; the ratio server / offline of throughput is the serving overhead (1.0 = none).

Prints one table; results also go to ``benchmarks/results/serve.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, block_size=32, max_model_len=512, chunking="tokens")
PROMPTS = ["Say hi.", "Write a haiku about the sea.", "What is 2 + 2?", "Name three colors.",
           "Explain recursion briefly.", "Write a Python function that adds two numbers."]


def _body(i: int, max_tokens: int) -> dict:
    return {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": max_tokens, "temperature": 1.0, "seed": i}


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_server(port: int, env: dict, extra: list[str], timeout: float) -> tuple[subprocess.Popen, float]:
    """The server process and its seconds from start to the first /health 200."""
    cmd = [sys.executable, "-m", "deepinfer_jax.serve", "--port", str(port), "--no-thinking", "--log-level", "warning",
           *[f"--engine={k}={json.dumps(v)}" for k, v in ENGINE.items()], *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise TimeoutError("the server did not become healthy in time")


async def one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            first = first or now
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk.get("choices"):
                last = now
    return {"ttft": first - t0, "tpot": (last - first) / (tokens - 1) if tokens > 1 else None, "tokens": tokens,
            "e2e": time.perf_counter() - t0}


async def load(port: int, n: int, concurrency: int, max_tokens: int, deadline: float) -> tuple[list[dict], float]:
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=deadline, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def gated(i):
            async with gate:
                return await one(client, url, _body(i, max_tokens))

        t0 = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*[gated(i) for i in range(n)]), deadline)
        return results, time.perf_counter() - t0


def offline(n: int, max_tokens: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from deepinfer_jax import LLM
    from deepinfer_jax.chat import prepare

    llm = LLM(**ENGINE, use_tqdm=False, default_thinking_mode=False)
    prepared = [prepare(llm, _body(i, max_tokens), "chat") for i in range(n)]
    llm.generate([{"prompt_token_ids": p.ids} for p in prepared[:2]], [p.params for p in prepared[:2]],
                 use_tqdm=False)  # compiled / loaded from the cache before timing
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p.ids} for p in prepared], [p.params for p in prepared],
                        use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    tpot = [1 / o.metrics.decode_tokens_per_s for o in outs if o.metrics.decode_tokens_per_s]
    return {"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall, "tpot_p50": float(np.median(tpot)),
            "tpot_p99": float(np.percentile(tpot, 99))}


def _pct(values, q):
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds for the load phase at most")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--cold", action="store_true", help="also time a start with empty caches")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    startup = {}
    if args.cold:
        with tempfile.TemporaryDirectory() as tmp:
            cold_env = {**env, "DEEPINFER_COMPILATION_CACHE": str(Path(tmp) / "xla")}
            proc, startup["cold"] = start_server(_free_port(), cold_env, [f"--engine=cost_model_dir={json.dumps(tmp)}"],
                                                 args.startup_timeout)
            proc.terminate()
            proc.wait(30)
    port = _free_port()
    proc, startup["warm"] = start_server(port, env, [], args.startup_timeout)
    try:
        t0 = time.perf_counter()
        first = asyncio.run(load(port, 1, 1, 4, args.deadline))[0][0]
        first_request_s = time.perf_counter() - t0
        # untimed: the step buckets this load reaches compile (or load from the cache) lazily, once
        asyncio.run(load(port, args.concurrency, args.concurrency, args.max_tokens, args.deadline))
        results, wall = asyncio.run(load(port, args.requests, args.concurrency, args.max_tokens, args.deadline))
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        proc.terminate()
        proc.wait(30)
    tokens = sum(r["tokens"] for r in results)
    server = {"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall,
              "ttft_p50": _pct([r["ttft"] for r in results], 50), "ttft_p99": _pct([r["ttft"] for r in results], 99),
              "tpot_p50": _pct([r["tpot"] for r in results], 50), "tpot_p99": _pct([r["tpot"] for r in results], 99)}
    off = offline(args.requests, args.max_tokens)
    ratio = server["tok_per_s"] / off["tok_per_s"]
    print(f"serve load: {args.requests} requests, {args.concurrency} concurrent clients, max_tokens {args.max_tokens}, "
          f"engine {ENGINE}")
    print("start-up (process start -> /health 200): " + ", ".join(f"{k} {v:.1f} s" for k, v in startup.items())
          + f"; first request after it: {first_request_s * 1e3:.0f} ms (TTFT {first['ttft'] * 1e3:.0f} ms)")
    print(f"{'':10} {'wall s':>8} {'tokens':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
          f"{'TPOT p99':>9}")
    ms = lambda v: f"{v * 1e3:7.1f}ms"
    print(f"{'server':10} {wall:8.2f} {tokens:7d} {server['tok_per_s']:8.1f} {ms(server['ttft_p50'])} "
          f"{ms(server['ttft_p99'])} {ms(server['tpot_p50'])} {ms(server['tpot_p99'])}")
    print(f"{'offline':10} {off['wall_s']:8.2f} {off['tokens']:7d} {off['tok_per_s']:8.1f} {'-':>9} {'-':>9} "
          f"{ms(off['tpot_p50'])} {ms(off['tpot_p99'])}")
    print(f"server / offline throughput: {ratio:.2f}")
    out = ROOT / "benchmarks" / "results" / "serve.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "engine": ENGINE, "startup_s": startup,
                               "first_request_s": first_request_s, "server": server, "offline": off, "ratio": ratio,
                               "metrics": metrics}, indent=1))


if __name__ == "__main__":
    main()
