"""``python -m deepinfer_jax.serve``: serve a model over HTTP (see ``deepinfer_jax.serve``).

    python -m deepinfer_jax.serve                       # the shipped checkpoint, 127.0.0.1:8000
    python -m deepinfer_jax.serve --model DIR --port 8000 --api-key secret
    python -m deepinfer_jax.serve --model tiny --engine max_num_seqs=8 --engine chunking='"tokens"'

``--engine KEY=VALUE`` sets any ``EngineConfig`` field (VALUE as JSON, else a string). Before it
listens, the server runs one short chat request (``--no-warmup`` skips it), so the step programs
the first requests need are compiled (or loaded from the compilation cache) by then.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

_T0 = time.perf_counter()


def _settings(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine takes KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m deepinfer_jax.serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint directory or preset name (default: the shipped model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer / x-api-key)")
    p.add_argument("--served-model-name", default=None, help="accept this model name too (as DeepSeek-V4.1-Flash)")
    p.add_argument("--max-queued", type=int, default=256,
                   help="requests admitted at once; one more gets 503 overloaded (default 256)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-thinking", action="store_true", help="thinking off for requests that do not say")
    p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE", help="an EngineConfig setting")
    p.add_argument("--no-warmup", action="store_true", help="do not run a warm-up request before listening")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("deepinfer_jax.serve")

    import uvicorn

    from deepinfer_jax import LLM
    from deepinfer_jax.serve import build_app

    settings = _settings(args.engine)
    if args.max_num_seqs is not None:
        settings["max_num_seqs"] = args.max_num_seqs
    if args.max_model_len is not None:
        settings["max_model_len"] = args.max_model_len
    if args.no_thinking:
        settings["default_thinking_mode"] = False
    llm = LLM(args.model, use_tqdm=False, **settings)
    t_loaded = time.perf_counter()
    app = build_app(llm, api_key=args.api_key, max_queued=args.max_queued, served_model_name=args.served_model_name)
    if not args.no_warmup:
        llm.chat({"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                  "thinking": {"type": "disabled"}})
    t_ready = time.perf_counter()
    log.info("model loaded in %.1f s, warm-up %.1f s; serving on http://%s:%d", t_loaded - _T0, t_ready - t_loaded,
             args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
