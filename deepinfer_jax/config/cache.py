"""KV-cache geometry and byte accounting (engine.md §1, model.md §4.8 and §5).

``CacheConfig`` sizes the two kinds of per-request cache state:

- **block KV** (paged, prefix-cacheable): blocks of ``block_size`` tokens, each holding, for every
  active KV-source layer, ``block_size // ratio`` compressed main entries plus as many index keys;
- **per-request state** (one slot per running request, ``max_requests`` slots): the SWA ring of
  every backbone layer (``sliding_window + spec_slack`` rows), the fp32 compressor partial state of
  each ratio > 1 KV source, and the Engram n-gram look-back token ids.

Plain Python (host side); the byte arithmetic takes a ``ModelConfig`` argument rather than
holding one, so one ``CacheConfig`` can be checked against several models.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from deepinfer_jax.config.model import ModelConfig

__all__ = ["CACHE_STORAGES", "CacheConfig"]

#: Storage formats: the QAT formats of model.md §4.8, or float32 values (4 bytes per channel).
CACHE_STORAGES = ("quantized", "dequantized")

_FP32_BYTES = 4
_TOKEN_ID_BYTES = 4  # int32 token ids (Engram look-back)


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value!r}")
    return int(value)


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """Paged block KV and per-request cache slots; frozen and hashable (a static jit argument).

    Fields:
        block_size: tokens per block (128 in production; a multiple of every compress ratio).
        num_blocks: blocks in the device pool, shared by all requests.
        max_requests: per-request slots (SWA rings, compressor state, Engram look-back).
        max_blocks_per_request: width of one request's block table.
        spec_slack: extra SWA ring rows absorbing speculative-decoding rollback (engine.md §1.2).
        storage: ``"quantized"`` (NVFP4 global KV, MXFP4 index keys, FP8 SWA rows, model.md §4.8)
            or ``"dequantized"`` (float32 values, 4 bytes per channel everywhere).
    """

    block_size: int = 128
    num_blocks: int
    max_requests: int
    max_blocks_per_request: int
    spec_slack: int = 6
    storage: str = "quantized"

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_requests", "max_blocks_per_request"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        slack = self.spec_slack
        if not isinstance(slack, numbers.Integral) or isinstance(slack, bool) or slack < 0:
            raise ValueError(f"spec_slack must be an integer >= 0, got {slack!r}")
        object.__setattr__(self, "spec_slack", int(slack))
        if self.storage not in CACHE_STORAGES:
            raise ValueError(f"storage must be one of {CACHE_STORAGES}, got {self.storage!r}")

    # ---- compatibility with a model ----

    def validate_for(self, cfg: ModelConfig) -> None:
        """Raise ValueError (naming ``block_size``) unless every block holds whole compressed
        entries: ``block_size`` must be a multiple of each nonzero backbone compress ratio."""
        ratios = sorted({cfg.compress_ratio(i) for i in range(cfg.num_hidden_layers)} - {0})
        bad = [r for r in ratios if self.block_size % r]
        if bad:
            raise ValueError(f"block_size must be a multiple of every compress ratio {ratios}, "
                             f"got {self.block_size} (not a multiple of {bad})")

    # ---- derived sizes ----

    @property
    def quantized(self) -> bool:
        """True for the QAT storage formats."""
        return self.storage == "quantized"

    def tokens_capacity(self) -> int:
        """Longest request the block table can hold: ``max_blocks_per_request * block_size``."""
        return self.max_blocks_per_request * self.block_size

    def ring_capacity(self, cfg: ModelConfig) -> int:
        """Rows of one SWA ring: the window plus the speculative slack (134 for V4.1)."""
        return cfg.sliding_window + self.spec_slack

    def comp_capacity(self, ratio: int) -> int:
        """Rows of one compressor state ring (a ratio > 1 KV source): the ``ratio`` tokens of the
        current group plus the speculative slack, indexed by position, so a rollback of up to
        ``spec_slack`` positions finds the group's earlier tokens intact."""
        return ratio + self.spec_slack

    def engram_capacity(self, cfg: ModelConfig) -> int:
        """Token ids of one Engram look-back ring: ``engram_max_ngram_size - 1`` plus the slack."""
        return cfg.engram_max_ngram_size - 1 + self.spec_slack

    def entries_per_block(self, cfg: ModelConfig, layer: int) -> int:
        """Compressed global entries one block holds for ``layer`` (a compressed layer)."""
        ratio = cfg.compress_ratio(layer)
        if ratio == 0:
            raise ValueError(f"layer {layer} has compress ratio 0 (SWA only) and no global entries")
        return self.block_size // ratio

    def main_entry_bytes(self, cfg: ModelConfig) -> int:
        """One global main KV entry: NVFP4 codes + E4M3 scale per 16 channels (288 B for V4.1)."""
        d = cfg.head_dim
        return d // 2 + d // 16 if self.quantized else _FP32_BYTES * d

    def index_key_bytes(self, cfg: ModelConfig) -> int:
        """One index key: MXFP4 codes + UE8M0 scale per 32 channels (68 B for V4.1)."""
        d = cfg.index_head_dim
        return d // 2 + d // 32 if self.quantized else _FP32_BYTES * d

    def swa_row_bytes(self, cfg: ModelConfig) -> int:
        """One SWA ring row: FP8 values + UE8M0 scale per 32 channels (528 B for V4.1)."""
        d = cfg.head_dim
        return d + d // 32 if self.quantized else _FP32_BYTES * d

    def kv_source_layers(self, cfg: ModelConfig) -> tuple[int, ...]:
        """The KV sources that own global storage: those inside the backbone."""
        return tuple(s for s in cfg.kv_source_layer_ids if s < cfg.num_hidden_layers)

    def global_bytes_per_block(self, cfg: ModelConfig) -> int:
        """Bytes of one block: per active KV source, its entries x (main entry + index key).

        V4.1, 128-token blocks, quantized: (64 + 64 + 64 + 128) x 356 = 113,920 = 128 x 890.
        """
        entry = self.main_entry_bytes(cfg) + self.index_key_bytes(cfg)
        return sum(self.entries_per_block(cfg, s) * entry for s in self.kv_source_layers(cfg))

    def swa_bytes_per_request(self, cfg: ModelConfig) -> int:
        """SWA rings of every backbone layer for one request."""
        return cfg.num_hidden_layers * self.ring_capacity(cfg) * self.swa_row_bytes(cfg)

    def compressor_state_bytes_per_request(self, cfg: ModelConfig) -> int:
        """fp32 partial groups of the ratio > 1 KV sources: a ring of ``comp_capacity(r)`` tokens
        (r + spec_slack: at most r - 1 are pending, the rest absorb speculative rollback) x (values +
        gate scores) x head_dim x 4 bytes each."""
        ratios = (cfg.compress_ratio(s) for s in self.kv_source_layers(cfg))
        return sum(self.comp_capacity(r) * 2 * cfg.head_dim * _FP32_BYTES for r in ratios if r > 1)

    def engram_state_bytes_per_request(self, cfg: ModelConfig) -> int:
        """Engram n-gram look-back: a ring of ``engram_capacity`` token ids (int32; the last
        ``engram_max_ngram_size - 1`` plus the rollback slack), when the backbone has an Engram layer."""
        if not any(i < cfg.num_hidden_layers for i in cfg.engram_layer_ids):
            return 0
        return self.engram_capacity(cfg) * _TOKEN_ID_BYTES

    def bytes_per_request(self, cfg: ModelConfig) -> int:
        """Per-request slot bytes: SWA rings + compressor partial state + Engram look-back."""
        return (self.swa_bytes_per_request(cfg) + self.compressor_state_bytes_per_request(cfg)
                + self.engram_state_bytes_per_request(cfg))

    def total_bytes(self, cfg: ModelConfig) -> int:
        """Device bytes of the whole cache: the block pool plus every request slot."""
        blocks = self.num_blocks * self.global_bytes_per_block(cfg)
        return blocks + self.max_requests * self.bytes_per_request(cfg)

    # ---- sizing from memory ----

    @classmethod
    def from_memory_budget(
        cls,
        cfg: ModelConfig,
        budget_bytes: int,
        *,
        max_requests: int,
        block_size: int = 128,
        max_model_len: int,
        spec_slack: int = 6,
        storage: str = "quantized",
    ) -> CacheConfig:
        """The largest pool that fits ``budget_bytes`` after ``max_requests`` request slots.

        ``max_blocks_per_request = ceil(max_model_len / block_size)``;
        ``num_blocks = (budget_bytes - max_requests * bytes_per_request) // global_bytes_per_block``.
        Raises ValueError naming ``budget_bytes`` when that is fewer blocks than one
        ``max_model_len`` request needs. A model without backbone KV sources has free blocks
        (0 bytes each); it gets ``max_requests * max_blocks_per_request`` of them.
        """
        budget_bytes = _positive_int("budget_bytes", budget_bytes)
        max_model_len = _positive_int("max_model_len", max_model_len)
        block_size = _positive_int("block_size", block_size)
        per_request = math.ceil(max_model_len / block_size)
        probe = cls(block_size=block_size, num_blocks=1, max_requests=max_requests,
                    max_blocks_per_request=per_request, spec_slack=spec_slack, storage=storage)
        probe.validate_for(cfg)
        slots = probe.max_requests * probe.bytes_per_request(cfg)
        block_bytes = probe.global_bytes_per_block(cfg)
        if block_bytes == 0:
            num_blocks = probe.max_requests * per_request
            if slots > budget_bytes:
                raise ValueError(f"budget_bytes must cover {slots} bytes of request slots, "
                                 f"got {budget_bytes}")
        else:
            num_blocks = max(budget_bytes - slots, 0) // block_bytes
            if num_blocks < per_request:
                need = slots + per_request * block_bytes
                raise ValueError(
                    f"budget_bytes must be >= {need} ({max_requests} request slots of "
                    f"{probe.bytes_per_request(cfg)} B + {per_request} blocks of {block_bytes} B for one "
                    f"{max_model_len}-token request), got {budget_bytes}")
        return cls(block_size=block_size, num_blocks=num_blocks, max_requests=max_requests,
                   max_blocks_per_request=per_request, spec_slack=spec_slack, storage=storage)
