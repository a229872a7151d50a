"""The sections of ``EngineConfig``: scheduling, the engine's cache, speculation, parallelism.

Each section is a frozen dataclass validated in ``__post_init__`` (a ``ValueError`` naming the field);
``EngineConfig`` composes them and accepts their fields flat (``LLM(max_num_seqs=4)``). Plain Python,
no JAX.

- ``SchedulerConfig``: which requests run in a step and how its tokens are chunked (docs/engine.md §2).
- ``CacheSettings``: the engine's KV cache: block pool size and storage, the prefix cache and its
  tiers, bounded replay (docs/prefix_cache.md). From it and the model the engine derives the device
  geometry ``config.CacheConfig``.
- ``SpeculationConfig``: speculative decoding with the model's DSpark drafter (docs/speculative.md).
- ``ParallelConfig``: the device mesh (a sharding preset, docs/sharding.md).
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from typing import Any

from deepinfer_jax.config.sharding import ShardingPreset

__all__ = ["CHUNKING_MODES", "SPECULATION_MODES", "CacheSettings", "ParallelConfig", "SchedulerConfig",
           "SpeculationConfig"]

#: "cost": chunk sizes from the fitted step-time model and ``step_budget_ns``; "tokens": a fixed
#: token budget per step (``max_num_batched_tokens``, vLLM's setting).
CHUNKING_MODES = ("cost", "tokens")

#: Speculative decoding (docs/engine.md §2.3): "auto" = "dspark" when the model has a DSpark drafter and no
#: sharding, else "none"; "fixed": every decoding request verifies ``num_speculative_tokens`` drafts per
#: step; "dspark": the confidence-driven budget (``engine.spec_policy``), which decodes plainly while
#: verifying would not pay.
SPECULATION_MODES = ("auto", "none", "fixed", "dspark")


def check_pos(name: str, value: Any, optional: bool = False) -> None:
    """ValueError naming ``name`` unless ``value`` is an int >= 1 (or None when ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_bools(section: Any, names: tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(getattr(section, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(section, name)!r}")


def _sizes(name: str, value: Any) -> None:
    if value is None:
        return
    if (not isinstance(value, tuple) or not value or any(not isinstance(v, int) or v < 1 for v in value)
            or list(value) != sorted(set(value))):
        raise ValueError(f"{name} must be a non-empty strictly increasing tuple of positive ints, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Fields (``EngineConfig`` documents each): max_num_seqs, max_model_len, chunking,
    max_num_batched_tokens, step_budget_ns, profile_steps, cost_model_dir, async_scheduling,
    structured_output_overlap, token_buckets, request_buckets, block_buckets."""

    max_num_seqs: int = 8
    max_model_len: int | None = None
    chunking: str = "cost"
    max_num_batched_tokens: int = 256
    step_budget_ns: int = 200_000_000
    profile_steps: bool = True
    cost_model_dir: str | None = None
    async_scheduling: bool = True
    structured_output_overlap: bool = True
    token_buckets: tuple[int, ...] | None = None
    request_buckets: tuple[int, ...] | None = None
    block_buckets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "step_budget_ns"):
            check_pos(name, getattr(self, name))
        check_pos("max_model_len", self.max_model_len, optional=True)
        if self.chunking not in CHUNKING_MODES:
            raise ValueError(f"chunking must be one of {CHUNKING_MODES}, got {self.chunking!r}")
        check_bools(self, ("async_scheduling", "structured_output_overlap", "profile_steps"))
        _sizes("token_buckets", self.token_buckets)
        _sizes("request_buckets", self.request_buckets)
        _sizes("block_buckets", self.block_buckets)
        if self.token_buckets and self.token_buckets[-1] < self.max_num_batched_tokens:
            raise ValueError(f"token_buckets must reach max_num_batched_tokens ({self.max_num_batched_tokens})")
        if self.request_buckets and self.request_buckets[-1] < self.max_num_seqs:
            raise ValueError(f"request_buckets must reach max_num_seqs ({self.max_num_seqs})")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token per running request)")


@dataclass(frozen=True, kw_only=True)
class CacheSettings:
    """Fields (``EngineConfig`` documents each): block_size, num_blocks, max_blocks_per_request, kv_storage,
    enable_prefix_caching, cache_salt, swa_snapshot_entries, encoder_replay, replay_tokens, decoder_replay,
    yoco_keep_tokens, host_store_bytes, block_store, block_store_fallback."""

    block_size: int = 64
    num_blocks: int | None = None
    max_blocks_per_request: int | None = None
    kv_storage: str = "quantized"
    enable_prefix_caching: bool = True
    cache_salt: str | None = None
    swa_snapshot_entries: int = 256
    encoder_replay: bool = False
    replay_tokens: int | None = None
    decoder_replay: bool = False
    yoco_keep_tokens: int | None = None
    host_store_bytes: int = 1 << 30
    block_store: str | None = None
    block_store_fallback: bool = False

    def __post_init__(self) -> None:
        check_pos("block_size", self.block_size)
        for name in ("num_blocks", "max_blocks_per_request", "replay_tokens", "yoco_keep_tokens"):
            check_pos(name, getattr(self, name), optional=True)
        if self.kv_storage not in ("quantized", "dequantized"):
            raise ValueError(f"kv_storage must be 'quantized' or 'dequantized', got {self.kv_storage!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {self.cache_salt!r}")
        if not isinstance(self.swa_snapshot_entries, int) or self.swa_snapshot_entries < 0:
            raise ValueError(f"swa_snapshot_entries must be an integer >= 0, got {self.swa_snapshot_entries!r}")
        if not isinstance(self.host_store_bytes, int) or self.host_store_bytes < 0:
            raise ValueError(f"host_store_bytes must be an integer >= 0, got {self.host_store_bytes!r}")
        if self.block_store is not None and not isinstance(self.block_store, (str, os.PathLike)):
            raise ValueError(f"block_store must be a directory path or None, got {self.block_store!r}")
        if self.block_store is not None and not self.host_store_bytes:
            raise ValueError("block_store needs host_store_bytes > 0 (blocks pass through host memory)")
        check_bools(self, ("enable_prefix_caching", "encoder_replay", "block_store_fallback", "decoder_replay"))


@dataclass(frozen=True, kw_only=True)
class SpeculationConfig:
    """Fields (``EngineConfig`` documents each): speculation (the mode, ``SPECULATION_MODES``),
    num_speculative_tokens, draft_vocab_size."""

    speculation: str = "auto"
    num_speculative_tokens: int | None = None
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {SPECULATION_MODES}, got {self.speculation!r}")
        check_pos("num_speculative_tokens", self.num_speculative_tokens, optional=True)
        check_pos("draft_vocab_size", self.draft_vocab_size, optional=True)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Fields (``EngineConfig`` documents them): sharding (a preset name, a ``.toml`` path, a
    ``ShardingPreset``, or None for one device), cp_threshold (context-parallel prefill above it),
    dp_match_floor_ns (DP ranks' prompt chunks matched, not below this; None = off)."""

    sharding: Any = None
    cp_threshold: int | None = None
    dp_match_floor_ns: int | None = None

    def __post_init__(self) -> None:
        t = self.cp_threshold
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t < 0):
            raise ValueError(f"cp_threshold must be an int >= 0 (0 = never) or None, got {self.cp_threshold!r}")
        f = self.dp_match_floor_ns
        if f is not None and (not isinstance(f, int) or isinstance(f, bool) or f < 0):
            raise ValueError(f"dp_match_floor_ns must be an int >= 0 (ns) or None (off), got {f!r}")
        if self.sharding is not None and not isinstance(self.sharding, (str, os.PathLike, ShardingPreset)):
            raise ValueError(f"sharding must be a preset name, a .toml path, a ShardingPreset or None, "
                             f"got {self.sharding!r}")

    @property
    def sharded(self) -> bool:
        return self.sharding is not None
