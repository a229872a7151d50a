"""Checkpoint tensor names of the DeepSeek-V4.1 backbone and their parameter-tree paths.

Names are DeepSeek-native (model.md §7): ``embed.weight``, ``layers.L.attn.wq_a.weight``,
``layers.L.ffn.experts.E.w1.weight``, ... Each name maps to a path in the nested parameter
dict (integer parts as Python ints); routed experts map to one stacked leaf
``layers.L.ffn.experts.wN`` of shape ``[E, out, in]`` plus the expert index.

A 2-D ``X.weight`` may carry a UE8M0 scale partner ``X.scale``; the storage kind records how
the released checkpoint stores each tensor (and how the writer encodes it).
"""

from __future__ import annotations

import enum
import re

from deepinfer_jax.config import LayerRole, ModelConfig

SCALE_SUFFIX = ".scale"
WEIGHT_SUFFIX = ".weight"

_SKIP_RE = re.compile(r"^(?:vision\.|aligner\.|mtp\.|image_(?:start|end|newline|pad)(?:$|\.))")
_EXPERT_RE = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")


class TensorKind(enum.Enum):
    """How a backbone tensor is stored in the released checkpoint."""

    PLAIN = "plain"  # BF16, unquantised; decoded to the tree dtype
    FP32 = "fp32"  # FP32 (mHC mixers, sinks, router biases); kept float32 in the tree
    FP8_BLOCK = "fp8_block"  # FP8 E4M3 + UE8M0 scale per 32x32 block
    FP4_EXPERT = "fp4_expert"  # packed FP4 E2M1 (2 per byte) + UE8M0 scale per row per 32 columns
    FP8_ROW = "fp8_row"  # FP8 E4M3 + UE8M0 scale per row per 32 columns (Engram tables)


def is_skipped(name: str) -> bool:
    """True for tensors outside the text backbone: ``vision.*``, ``aligner.*``, ``mtp.*``
    (the DSpark drafter, loaded separately: ``expected_drafter_tensors``) and the
    ``image_{start,end,newline,pad}`` embeddings."""
    return _SKIP_RE.match(name) is not None


def scale_partner(name: str) -> str | None:
    """``X.scale`` for ``X.weight`` (e.g. ``layers.0.attn.wq_a.scale``), else ``None``."""
    if name.endswith(WEIGHT_SUFFIX):
        return name[: -len(WEIGHT_SUFFIX)] + SCALE_SUFFIX
    return None


def weight_of_scale(name: str) -> str | None:
    """``X.weight`` for a scale name ``X.scale``, else ``None``."""
    if name.endswith(SCALE_SUFFIX):
        return name[: -len(SCALE_SUFFIX)] + WEIGHT_SUFFIX
    return None


def _part(p: str) -> int | str:
    return int(p) if p.isdigit() else p


def native_to_path(name: str) -> tuple[tuple[int | str, ...], int | None]:
    """Tree path of a checkpoint name and its expert index (``None`` unless a routed expert).

    ``layers.3.attn.wq_a.weight`` -> ``(("layers", 3, "attn", "wq_a", "weight"), None)``;
    ``layers.3.ffn.experts.5.w1.weight`` -> ``(("layers", 3, "ffn", "experts", "w1"), 5)``.
    """
    m = _EXPERT_RE.match(name)
    if m:
        prefix, expert, proj = m.groups()
        return tuple(_part(p) for p in prefix.split(".")) + (proj,), int(expert)
    return tuple(_part(p) for p in name.split(".")), None


def path_to_native(path: tuple[int | str, ...], expert: int | None = None) -> str:
    """Inverse of :func:`native_to_path`."""
    if expert is None:
        return ".".join(str(p) for p in path)
    *prefix, proj = path
    return ".".join(str(p) for p in prefix) + f".{expert}.{proj}.weight"


def _num_engram_hash_heads(cfg: ModelConfig) -> int:
    n = cfg.num_engram_hash_heads
    return int(n() if callable(n) else n)


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], TensorKind]]:
    """Every checkpoint tensor the backbone needs: ``{name: (decoded_shape, kind)}``.

    Routed experts are listed per expert (``layers.L.ffn.experts.E.w1.weight``). Scale
    partners, ``mtp.*`` and vision tensors are not listed.
    """
    P, F8, F8R = TensorKind.PLAIN, TensorKind.FP8_BLOCK, TensorKind.FP8_ROW
    d, hc = cfg.hidden_size, cfg.hc_mult
    D, ql = cfg.head_dim, cfg.q_lora_rank
    E = cfg.n_routed_experts
    ih, idim = cfg.index_n_heads, cfg.index_head_dim
    engram_rows = dict(zip(cfg.engram_layer_ids, cfg.engram_num_embeddings))

    out: dict[str, tuple[tuple[int, ...], TensorKind]] = {"embed.weight": ((cfg.vocab_size, d), P)}
    for L in range(cfg.num_hidden_layers):
        p = f"layers.{L}."
        t = _block_head_tensors(cfg)
        role = cfg.layer_role(L)
        if role == LayerRole.FULL:
            t["attn.compressor.wkv.weight"] = ((D, d), P)
            t["attn.compressor.norm.weight"] = ((D,), P)
            if cfg.compress_ratio(L) > 1:
                t["attn.compressor.wgate.weight"] = ((D, d), P)
            t["attn.indexer.wk.weight"] = ((idim, D), P)
            t["attn.indexer.k_norm.weight"] = ((idim,), P)
        if role in (LayerRole.FULL, LayerRole.REINDEX):
            t["attn.indexer.wq_b.weight"] = ((ih * idim, ql), F8)
            t["attn.indexer.weights_proj.weight"] = ((ih, d), P)
        t.update(_ffn_tensors(cfg, E))
        if L in engram_rows:
            ehd = cfg.engram_head_dim
            t["engram.embed.weight"] = ((int(engram_rows[L]), ehd), F8R)
            t["engram.wkv.weight"] = (((hc + 1) * d, _num_engram_hash_heads(cfg) * ehd), F8)
            t["engram.q_weight"] = ((hc, d), P)
            t["engram.k_weight"] = ((hc, d), P)
        out.update({p + k: v for k, v in t.items()})
    out["norm.weight"] = ((d,), P)
    out["head.weight"] = ((cfg.vocab_size, d), P)
    return out


def _block_head_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], TensorKind]]:
    """A block's norms, mHC mixers and SWA attention projections (names relative to the block)."""
    P, F32, F8 = TensorKind.PLAIN, TensorKind.FP32, TensorKind.FP8_BLOCK
    d, hc = cfg.hidden_size, cfg.hc_mult
    H, D = cfg.num_attention_heads, cfg.head_dim
    ql, ol, G = cfg.q_lora_rank, cfg.o_lora_rank, cfg.o_groups
    mix = (2 + hc) * hc
    t = {"attn_norm.weight": ((d,), P), "ffn_norm.weight": ((d,), P)}
    for site in ("attn", "ffn"):
        t[f"hc_{site}_fn"] = ((mix, hc * d), F32)
        t[f"hc_{site}_base"] = ((mix,), F32)
        t[f"hc_{site}_scale"] = ((3,), F32)
    t.update({
        "attn.wq_a.weight": ((ql, d), F8),
        "attn.q_norm.weight": ((ql,), P),
        "attn.wq_b.weight": ((H * D, ql), F8),
        "attn.wkv.weight": ((D, d), F8),
        "attn.kv_norm.weight": ((D,), P),
        "attn.wo_a.weight": ((G * ol, H * D // G), F8),
        "attn.wo_b.weight": ((d, G * ol), F8),
        "attn.attn_sink": ((H,), F32),
    })
    return t


def _ffn_tensors(cfg: ModelConfig, n_experts: int) -> dict[str, tuple[tuple[int, ...], TensorKind]]:
    """A block's MoE: router, ``n_experts`` routed experts (FP4) and the shared expert (FP8)."""
    P, F32, F8, F4 = TensorKind.PLAIN, TensorKind.FP32, TensorKind.FP8_BLOCK, TensorKind.FP4_EXPERT
    d, inter = cfg.hidden_size, cfg.moe_intermediate_size
    t = {"ffn.gate.weight": ((n_experts, d), P), "ffn.gate.bias": ((n_experts,), F32),
         "ffn.gate.bias_vl": ((n_experts,), F32)}
    for e in range(n_experts):
        t[f"ffn.experts.{e}.w1.weight"] = ((inter, d), F4)
        t[f"ffn.experts.{e}.w3.weight"] = ((inter, d), F4)
        t[f"ffn.experts.{e}.w2.weight"] = ((d, inter), F4)
    t["ffn.shared_experts.w1.weight"] = ((inter, d), F8)
    t["ffn.shared_experts.w3.weight"] = ((inter, d), F8)
    t["ffn.shared_experts.w2.weight"] = ((d, inter), F8)
    return t


def is_drafter(name: str) -> bool:
    """True for the DSpark drafter's tensors (``mtp.*``)."""
    return name.startswith("mtp.")


def expected_drafter_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], TensorKind]]:
    """Every ``mtp.*`` tensor of the DSpark drafter (model.md §4.9): ``{name: (decoded_shape, kind)}``.

    ``num_nextn_predict_layers`` stages ``mtp.S``, each a ratio-0 (SWA-only) block with a MoE of
    ``dspark_n_routed_experts``; ``mtp.0`` adds ``main_proj`` [d, len(dspark_target_layer_ids) * d] and
    ``main_norm``; the last stage adds ``norm``, the Markov head (``markov_head.embed`` [V, r],
    ``markov_head.head`` [V, r], r = ``dspark_markov_rank``) and the FP32 confidence head
    ``confidence_head.proj`` [1, d + r]. Empty when the config has no DSpark stages. The drafter
    shares the backbone's ``embed`` and ``head``.
    """
    P, F32, F8 = TensorKind.PLAIN, TensorKind.FP32, TensorKind.FP8_BLOCK
    d, n, r, V = cfg.hidden_size, cfg.num_nextn_predict_layers, cfg.dspark_markov_rank, cfg.vocab_size
    out: dict[str, tuple[tuple[int, ...], TensorKind]] = {}
    for s in range(n):
        t = _block_head_tensors(cfg)
        t.update(_ffn_tensors(cfg, cfg.dspark_n_routed_experts))
        if s == 0:
            t["main_proj.weight"] = ((d, len(cfg.dspark_target_layer_ids) * d), F8)
            t["main_norm.weight"] = ((d,), P)
        if s == n - 1:
            t["norm.weight"] = ((d,), P)
            t["markov_head.embed.weight"] = ((V, r), P)
            t["markov_head.head.weight"] = ((V, r), P)
            t["confidence_head.proj.weight"] = ((1, d + r), F32)
        out.update({f"mtp.{s}.{k}": v for k, v in t.items()})
    return out
