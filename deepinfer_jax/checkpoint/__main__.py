"""Command line: convert a Hugging Face checkpoint to orbax, or inspect one.

    python -m deepinfer_jax.checkpoint convert HF_DIR OUT_DIR [--dtype float32|bfloat16]
    python -m deepinfer_jax.checkpoint inspect HF_DIR
    python -m deepinfer_jax.checkpoint plan --config CONFIG.json --sharding PRESET [--kv-tokens N] ...

``convert`` reads tensors lazily one at a time (with a progress bar), decodes FP8/FP4, stacks
experts and writes ``OUT_DIR/config.json`` + ``OUT_DIR/params`` (orbax). ``inspect`` prints the
config summary and what the loader would do with every tensor; it exits 1 when the
checkpoint does not match its config. ``plan`` prints the per-device memory plan of a config under a
sharding preset (``checkpoint.memory_plan``; ``--sharding design`` prints every design preset), from
shapes alone. Independent of the model code (tree functions only).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from deepinfer_jax.checkpoint.loader import (
    CheckpointError,
    load_hf_checkpoint_tree,
    plan_checkpoint,
    read_hf_config,
)
from deepinfer_jax.checkpoint.orbax_io import PARAMS_DIR, save_tree
from deepinfer_jax.checkpoint.safetensors_io import open_checkpoint


def _convert(args: argparse.Namespace) -> int:
    params = Path(args.out_dir) / PARAMS_DIR
    if params.exists() and not args.overwrite:
        print(f"{params} already exists; pass --overwrite to replace it", file=sys.stderr)
        return 1
    try:
        cfg, tree = load_hf_checkpoint_tree(args.hf_dir, dtype=args.dtype, progress=not args.quiet)
    except CheckpointError as e:
        print(e, file=sys.stderr)
        return 1
    out = save_tree(args.out_dir, tree, cfg, overwrite=args.overwrite)
    print(f"wrote {out} ({cfg.num_hidden_layers} layers, dtype {args.dtype})")
    return 0


def _skip_group(name: str) -> str:
    head = name.split(".", 1)[0]
    return "layers (past num_hidden_layers)" if head == "layers" else head


def _inspect(args: argparse.Namespace) -> int:
    cfg = read_hf_config(args.hf_dir)
    roles = Counter(cfg.layer_role(i).name for i in range(cfg.num_hidden_layers))
    print(f"config: {args.hf_dir}/config.json")
    print(f"  layers {cfg.num_hidden_layers}, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
          f"heads {cfg.num_attention_heads}x{cfg.head_dim}, q_lora {cfg.q_lora_rank}, "
          f"o_lora {cfg.o_groups}x{cfg.o_lora_rank}")
    print(f"  experts {cfg.n_routed_experts} (top-{cfg.num_experts_per_tok}) + "
          f"{cfg.n_shared_experts} shared, inter {cfg.moe_intermediate_size}; hc_mult {cfg.hc_mult}")
    print(f"  roles {dict(sorted(roles.items()))}; engram layers {list(cfg.engram_layer_ids)}")
    print(f"  quantization: weight_block_size {cfg.weight_block_size}, expert_dtype {cfg.expert_dtype}")
    with open_checkpoint(args.hf_dir) as reader:
        plan = plan_checkpoint(cfg, reader)
        dtypes = Counter(str(reader.info(n).dtype) for n in reader)
        nbytes = sum(reader.info(n).nbytes for n in reader)
        quantized = sum(1 for partner in plan.load.values() if partner is not None)
        print(f"tensors: {len(reader)} ({nbytes / 2**30:.3f} GiB)")
        print(f"  backbone: {len(plan.load)} of {len(plan.expected)} expected loadable "
              f"({quantized} quantized with {len(plan.scales)} scales)")
        skipped = Counter(_skip_group(n) for n in plan.skipped)
        print(f"  skipped: {len(plan.skipped)} {dict(sorted(skipped.items()))}")
        print(f"  dtypes: {dict(sorted(dtypes.items()))}")
        if not plan.ok:
            print(plan.error(str(args.hf_dir)))
            return 1
    print("ok")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deepinfer_jax.checkpoint", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="Hugging Face safetensors -> orbax parameter tree")
    conv.add_argument("hf_dir", help="directory with config.json and *.safetensors")
    conv.add_argument("out_dir", help="output directory (config.json + params/)")
    conv.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                      help="leaf dtype (mHC mixers, sinks and router biases stay float32)")
    conv.add_argument("--overwrite", action="store_true", help="replace an existing OUT_DIR/params")
    conv.add_argument("--quiet", action="store_true", help="no progress bar")
    conv.set_defaults(func=_convert)
    insp = sub.add_parser("inspect", help="print the config summary and tensor counts")
    insp.add_argument("hf_dir", help="directory with config.json and *.safetensors")
    insp.set_defaults(func=_inspect)
    plan = sub.add_parser("plan", help="per-device memory plan of a config under a sharding preset")
    plan.add_argument("--config", required=True, help="config.json (HF) or a checkpoint directory")
    plan.add_argument("--sharding", required=True,
                      help="a preset name or .toml, 'offline-8' (one 8-GPU machine), or 'design' (all design presets)")
    plan.add_argument("--kv-tokens", type=int, default=65536, help="KV tokens per device (default 65,536)")
    plan.add_argument("--context", type=int, default=65536, help="context per request for the concurrency count")
    plan.add_argument("--max-requests", type=int, default=64, help="request slots per device (SWA rings)")
    plan.add_argument("--bucket-tokens", type=int, default=8192, help="tokens of the largest step bucket")
    plan.add_argument("--weights", choices=("quantized", "float32", "bfloat16"), default="quantized")
    plan.add_argument("--engram", choices=("sharded", "replicated"), default="sharded",
                      help="Engram tables split over the instance's devices (default) or replicated")
    plan.add_argument("--device-gb", type=float, default=141.0, help="device memory in GB (10^9 bytes)")
    plan.add_argument("--checkpoint", help="read stored dtypes from this checkpoint's headers (no data)")
    plan.set_defaults(func=_plan)
    args = parser.parse_args(argv)
    return args.func(args)


def _plan(args: argparse.Namespace) -> int:
    import json

    from deepinfer_jax.checkpoint import memory_plan as M
    from deepinfer_jax.config import ModelConfig

    src = Path(args.config)
    try:
        cfg = read_hf_config(src) if src.is_dir() else ModelConfig.from_hf_config(json.loads(src.read_text()))
        storage = M.checkpoint_storage(args.checkpoint) if args.checkpoint else None
        presets = M.DESIGN_PRESETS if args.sharding == "design" else (args.sharding,)
        for i, name in enumerate(presets):
            p = M.plan_memory(cfg, M.Layout.from_preset(name), weights=args.weights, kv_tokens=args.kv_tokens,
                              context=args.context, max_requests=args.max_requests, bucket_tokens=args.bucket_tokens,
                              device_bytes=int(args.device_gb * 1e9), engram=args.engram, storage=storage)
            print(("\n" if i else "") + M.format_plan(p, cfg))
    except (OSError, ValueError) as e:
        print(f"plan: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
