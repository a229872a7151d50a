"""Memory plan: bytes per device of a model under a sharding preset, from shapes alone (host, no jax).

``plan_memory(cfg, layout)`` adds up, for one device:

- **weights by kind** (``checkpoint.names.TensorKind``) in the residency chosen (``weights``): under
  ``"quantized"`` the storage bytes (FP8 values + one UE8M0 byte per 32x32 block; packed FP4 experts,
  half a byte per value + one scale byte per 32; FP8 Engram rows; BF16 embed/head; float32 for the
  rest, as ``checkpoint.residency`` keeps them), under ``"float32"`` / ``"bfloat16"`` the decoded
  bytes. Routed experts are split over the ``ep`` ranks, each rank also holding its EPLB redundant
  slots; the Engram tables are split over the instance's devices (``engram="sharded"``: the layout the
  design needs, not yet the rules table's, which replicates them) or replicated. Everything else is
  replicated: every device is an attention DP rank in the design presets (no tensor parallelism).
  ``storage`` (optional, name -> (dtype, shape) of each stored tensor: a checkpoint's headers)
  overrides the released formats of model.md §7, e.g. the shipped checkpoint's FP8 ``embed``.
- **KV blocks** for ``kv_tokens`` tokens (``CacheConfig.global_bytes_per_block``), **SWA rings** and
  **compressor state** per request slot (``CacheConfig``), for ``max_requests`` slots.
- **activations of the largest bucket** (``bucket_tokens`` tokens): an estimate of one layer's live
  float32 set: the mHC streams (in, out, mixed), queries and outputs of every head, the gathered
  window + top-k keys of the reference attention, the routed and shared expert rows, and the logits of
  up to ``logit_rows`` rows.
- what is left of ``device_bytes``, and the concurrent requests that fit at ``context`` tokens each.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from deepinfer_jax.checkpoint import names as N
from deepinfer_jax.checkpoint.residency import BF16_RESIDENT, WeightsError
from deepinfer_jax.config import CacheConfig, ModelConfig
from deepinfer_jax.config.shipped import shipped

PRESET_DIR = shipped("sharding")
#: The single-machine offline example of engine.md §4: one 8-GPU machine, EP8 x DP8, no redundant slots.
OFFLINE_8 = "offline-8"
DESIGN_PRESETS = ("prefill-ep8-dp8", "decode-ep64-dp64", "decode-ep128-dp128", OFFLINE_8)
H200_BYTES = 141 * 10**9
_FP32 = 4


class PlanError(ValueError):
    """A bad plan input; ``field`` names it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class Layout:
    """What the plan needs of a sharding preset: devices, DP and EP sizes, redundant expert slots."""

    name: str
    devices: int
    dp_size: int
    ep_size: int
    redundant_slots: int = 0

    @classmethod
    def from_preset(cls, preset: str | Path) -> Layout:
        """A preset name (``sharding/*.toml``), a ``.toml`` path, or ``offline-8``."""
        if str(preset) == OFFLINE_8:
            return cls(OFFLINE_8, 8, 8, 8, 0)
        path = Path(preset)
        if not path.suffix:
            path = PRESET_DIR / f"{preset}.toml"
        if not path.is_file():
            known = sorted(p.stem for p in PRESET_DIR.glob("*.toml")) + [OFFLINE_8]
            raise PlanError("sharding", f"no preset {preset!r} (known: {', '.join(known)})")
        raw = tomllib.loads(path.read_text())
        shape = raw.get("mesh", {}).get("shape", [1])
        par = raw.get("parallel", {})
        return cls(raw.get("name", path.stem), math.prod(shape), int(par.get("dp_size", 1)),
                   int(par.get("ep_size", 1)), int(raw.get("eplb", {}).get("redundant_slots_per_rank", 0)))


@dataclass
class MemoryPlan:
    """Per-device bytes (see the module docstring); ``weights`` by kind name."""

    layout: Layout
    weights_mode: str
    weights: dict[str, int] = field(default_factory=dict)
    kv_blocks: int = 0
    swa_rings: int = 0
    compressor_state: int = 0
    engram_state: int = 0
    activations: int = 0
    device_bytes: int = H200_BYTES
    kv_tokens: int = 0
    context: int = 0
    block_bytes: int = 0
    request_bytes: int = 0
    block_tokens: int = 128

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def cache_bytes(self) -> int:
        return self.kv_blocks + self.swa_rings + self.compressor_state + self.engram_state

    @property
    def total(self) -> int:
        return self.weight_bytes + self.cache_bytes + self.activations

    @property
    def free(self) -> int:
        return self.device_bytes - self.total

    @property
    def fits(self) -> bool:
        return self.free >= 0

    def requests_at_context(self, context: int | None = None) -> int:
        """Concurrent requests of ``context`` tokens (blocks + one request slot each) in the memory left
        after weights and activations."""
        context = context or self.context
        left = self.device_bytes - self.weight_bytes - self.activations
        per = math.ceil(context / max(self.block_tokens, 1)) * self.block_bytes + self.request_bytes
        return max(left, 0) // per if per else 0


def _stored_bytes(kind: N.TensorKind, shape: tuple[int, ...], mode: str, name: str,
                  storage: Mapping[str, tuple] | None) -> int:
    """Resident bytes of one tensor (one expert for routed experts): from the checkpoint's headers when
    ``storage`` is given, else from the released formats of model.md §7."""
    n = math.prod(shape)
    if kind is N.TensorKind.FP32:
        return n * _FP32
    if mode in ("float32", "bfloat16"):
        return n * (_FP32 if mode == "float32" else 2)
    if storage is not None and name in storage:
        dtype, stored = np.dtype(storage[name][0]), storage[name][1]
        partner = storage.get(N.scale_partner(name))
        if partner is not None:  # kept in its storage format: values + one UE8M0 byte per block
            return math.prod(stored) * dtype.itemsize + math.prod(partner[1])
        bf16 = dtype == np.dtype(ml_dtypes.bfloat16)
        return n * (2 if name in BF16_RESIDENT and bf16 else _FP32)
    r, c = shape if len(shape) == 2 else (1, shape[0])
    if kind is N.TensorKind.FP8_BLOCK:
        return n + math.ceil(r / 32) * math.ceil(c / 32)
    if kind is N.TensorKind.FP8_ROW:
        return n + r * math.ceil(c / 32)
    if kind is N.TensorKind.FP4_EXPERT:
        return n // 2 + r * math.ceil(c / 32)
    return n * (2 if name in BF16_RESIDENT else _FP32)


def _expert_index(name: str) -> bool:
    return N.native_to_path(name)[1] is not None


def plan_memory(cfg: ModelConfig, layout: Layout, *, weights: str = "quantized", kv_tokens: int = 65536,
                context: int = 65536, max_requests: int = 64, bucket_tokens: int = 8192, logit_rows: int = 256,
                block_size: int = 128, spec_slack: int = 6, device_bytes: int = H200_BYTES,
                engram: str = "sharded", storage: Mapping[str, tuple] | None = None,
                kv_storage: str = "quantized") -> MemoryPlan:
    """The per-device :class:`MemoryPlan` of ``cfg`` under ``layout`` (see the module docstring)."""
    if weights not in ("quantized", "float32", "bfloat16"):
        raise WeightsError(f"the plan takes 'quantized', 'float32' or 'bfloat16', got {weights!r}")
    if engram not in ("sharded", "replicated"):
        raise PlanError("engram", f"must be 'sharded' or 'replicated', got {engram!r}")
    if cfg.n_routed_experts % layout.ep_size:
        raise PlanError("sharding", f"ep_size {layout.ep_size} does not divide {cfg.n_routed_experts} experts")
    plan = MemoryPlan(layout, weights, device_bytes=device_bytes, kv_tokens=kv_tokens, context=context)
    slots = cfg.n_routed_experts // layout.ep_size + layout.redundant_slots
    expert_share = slots / cfg.n_routed_experts
    for name, (shape, kind) in N.expected_tensors(cfg).items():
        b = _stored_bytes(kind, shape, weights, name, storage)
        if _expert_index(name):
            b = b * expert_share
            key = "routed experts"
        elif name.endswith("engram.embed.weight"):
            b = b / (layout.devices if engram == "sharded" else 1)
            key = "engram tables"
        else:
            key = {N.TensorKind.FP8_BLOCK: "dense fp8", N.TensorKind.FP8_ROW: "engram tables",
                   N.TensorKind.FP4_EXPERT: "routed experts", N.TensorKind.FP32: "fp32 (mHC, sinks, biases)",
                   N.TensorKind.PLAIN: "plain"}[kind]
            if name in BF16_RESIDENT:
                key = "embed + head"
        plan.weights[key] = plan.weights.get(key, 0) + b
    plan.weights = {k: math.ceil(v) for k, v in plan.weights.items()}
    cache = CacheConfig(block_size=block_size, num_blocks=max(1, math.ceil(kv_tokens / block_size)),
                        max_requests=max_requests, max_blocks_per_request=max(1, math.ceil(context / block_size)),
                        spec_slack=spec_slack, storage=kv_storage)
    cache.validate_for(cfg)
    plan.block_tokens = block_size
    plan.block_bytes = cache.global_bytes_per_block(cfg)
    plan.request_bytes = cache.bytes_per_request(cfg)
    plan.kv_blocks = cache.num_blocks * plan.block_bytes
    plan.swa_rings = max_requests * cache.swa_bytes_per_request(cfg)
    plan.compressor_state = max_requests * cache.compressor_state_bytes_per_request(cfg)
    plan.engram_state = max_requests * cache.engram_state_bytes_per_request(cfg)
    plan.activations = activation_bytes(cfg, bucket_tokens, logit_rows)
    return plan


def activation_bytes(cfg: ModelConfig, tokens: int, logit_rows: int = 256) -> int:
    """Estimated live float32 bytes of one layer on ``tokens`` tokens (module docstring), plus the logits."""
    d, n = cfg.hidden_size, cfg.hc_mult
    hd = cfg.num_attention_heads * cfg.head_dim
    keys = (cfg.sliding_window + cfg.index_topk) * cfg.head_dim
    experts = (cfg.num_experts_per_tok + cfg.n_shared_experts) * (2 * cfg.moe_intermediate_size + d)
    per_token = 3 * n * d + 2 * hd + keys + experts
    return _FP32 * (tokens * per_token + min(tokens, logit_rows) * cfg.vocab_size)


def checkpoint_storage(path: str | Path) -> dict[str, tuple]:
    """name -> (dtype, shape) of every tensor of a checkpoint directory (headers only, no data)."""
    from deepinfer_jax.checkpoint.safetensors_io import open_checkpoint

    with open_checkpoint(path) as reader:
        return {n: (reader.info(n).dtype, tuple(reader.info(n).shape)) for n in reader}


def _gb(b: int) -> str:
    return f"{b / 1e9:,.2f}"


def format_plan(plan: MemoryPlan, cfg: ModelConfig) -> str:
    """The plan as a markdown table (GB = 10^9 bytes) with its headline numbers."""
    lay = plan.layout
    title = (f"memory plan: {lay.name} ({lay.devices} devices, dp {lay.dp_size}, ep {lay.ep_size}, "
             f"{lay.redundant_slots} redundant expert slots per rank), weights={plan.weights_mode}, "
             f"{plan.device_bytes / 1e9:.0f} GB per device")
    lines = [title, "", "| per device | GB |", "|---|---:|"]
    for key in sorted(plan.weights, key=lambda k: -plan.weights[k]):
        lines.append(f"| weights: {key} | {_gb(plan.weights[key])} |")
    lines.append(f"| **weights** | **{_gb(plan.weight_bytes)}** |")
    lines.append(f"| KV blocks ({plan.kv_tokens:,} tokens) | {_gb(plan.kv_blocks)} |")
    lines.append(f"| SWA rings | {_gb(plan.swa_rings)} |")
    lines.append(f"| compressor state | {_gb(plan.compressor_state)} |")
    if plan.engram_state:
        lines.append(f"| Engram look-back | {_gb(plan.engram_state)} |")
    lines.append(f"| activations (largest bucket) | {_gb(plan.activations)} |")
    lines.append(f"| **total** | **{_gb(plan.total)}** |")
    lines.append(f"| free | {_gb(plan.free)} |")
    lines.append("")
    lines.append(f"fits: {'yes' if plan.fits else 'NO'}; concurrent requests at {plan.context:,} tokens of context: "
                 f"{plan.requests_at_context():,}; KV tokens that fit beside the weights and activations: "
                 f"{max(plan.device_bytes - plan.weight_bytes - plan.activations, 0) * plan.block_tokens // max(plan.block_bytes, 1):,}")
    return "\n".join(lines)
