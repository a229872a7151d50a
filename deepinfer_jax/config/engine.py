"""Engine settings (host side): scheduling, chunking, sampling limits, buckets.

``LLM(model, **settings)`` maps its keyword arguments 1:1 onto ``EngineConfig`` fields.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["CHUNKING_MODES", "PRECOMPILE_MODES", "SPECULATION_MODES", "EngineConfig", "yoco_keep_tokens"]

#: The seeds' knob for decoder bounded replay (engine.md §1.4): prompt tokens that run the decoder.
YOCO_ENV = "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS"


def yoco_keep_tokens(value: int | None = None) -> int:
    """``value`` if given, else ``$DEEPINFER_YOCO_PREFILL_KEEP_TOKENS``, else 140 (the only place it is read)."""
    if value is not None:
        return value
    raw = os.environ.get(YOCO_ENV, "140")
    try:
        keep = int(raw)
    except ValueError:
        raise ValueError(f"{YOCO_ENV} must be an integer >= 1, got {raw!r}") from None
    if keep < 1:
        raise ValueError(f"{YOCO_ENV} must be an integer >= 1, got {raw!r}")
    return keep

#: Speculative decoding (engine.md §2.3): "auto" = "dspark" when the model has a DSpark drafter and no
#: sharding, else "none"; "fixed": every decoding request verifies ``num_speculative_tokens`` drafts per
#: step; "dspark": the confidence-driven budget (``engine.spec_policy``), which decodes plainly while
#: verifying would not pay.
SPECULATION_MODES = ("auto", "none", "fixed", "dspark")

#: "cost": chunk sizes from the fitted step-time model and ``step_budget_ns``; "tokens": a fixed
#: token budget per step (``max_num_batched_tokens``, vLLM's setting).
CHUNKING_MODES = ("cost", "tokens")

#: "lazy": ``LLM()`` compiles nothing up front; each step bucket compiles on its first use (from the
#: persistent compilation cache when an earlier process compiled it) and start-up profiling is
#: replaced by the disk caches or online fits; "all": every bucket compiles and every start-up
#: profile runs inside ``LLM()``, so no request ever waits on a compilation.
PRECOMPILE_MODES = ("lazy", "all")


def _pos(name: str, value: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _sizes(name: str, value: Any) -> None:
    if value is None:
        return
    if (not isinstance(value, tuple) or not value or any(not isinstance(v, int) or v < 1 for v in value)
            or list(value) != sorted(set(value))):
        raise ValueError(f"{name} must be a non-empty strictly increasing tuple of positive ints, got {value!r}")


def _is_preset(value: Any) -> bool:
    from deepinfer_jax.sharding import ShardingPreset  # imports jax: only reached for a non-path value

    return isinstance(value, ShardingPreset)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Fields:
        max_num_seqs: requests running at once (cache slots).
        max_model_len: most tokens (prompt + output) per request; None = the model's limit capped
            by ``max_blocks_per_request * block_size``.
        block_size: tokens per KV block. num_blocks: device blocks (None = enough for every slot at
            max_model_len). max_blocks_per_request: None = enough for max_model_len.
        kv_storage: "quantized" or "dequantized" (``CacheConfig.storage``).
        chunking: "cost" or "tokens" (``CHUNKING_MODES``).
        max_num_batched_tokens: tokens per step (the budget in "tokens" mode, a cap in both).
        step_budget_ns: the per-step time budget of "cost" mode, in nanoseconds.
        profile_steps: run the start-up profiling pass in "cost" mode (else start from the disk
            cache or a token-proportional guess). cost_model_dir: where fitted models are cached
            (None = ``~/.cache/deepinfer_jax/cost_model``).
        async_scheduling: overlap scheduling of step N+1 with the device running step N.
        structured_output_overlap: compute structured-output token masks while the device runs the
            step (False = before dispatching it, the baseline; ``engine.structured``).
        seed: the engine seed for requests without their own.
        max_logprobs: most top logprobs a request may ask for.
        token_buckets / request_buckets: the step shapes (None = derived).
        block_buckets: the step's block-table widths (None = ``runner.buckets.block_buckets``: the
            widest, ``max_blocks_per_request``, and narrower ones about 4x apart down to 512 tokens,
            so a short batch's indexer scan does not cover ``max_model_len``); the last must be
            ``max_blocks_per_request``.
        precompile: "lazy" (the default) or "all" (``PRECOMPILE_MODES``): whether ``LLM()`` compiles
            every step bucket and runs the start-up profiling (cost model, speculation step times)
            before returning, or leaves each bucket to its first use and takes the profiles from
            their disk caches, else fits them online from the real steps (and saves them).
        compilation_cache: the persistent XLA compilation cache directory; None = the
            ``DEEPINFER_COMPILATION_CACHE`` environment variable, else ``~/.cache/deepinfer_jax/xla``;
            False or "off" = no cache (``deepinfer_jax.compile_cache``).
        enable_prefix_caching: reuse the KV blocks and SWA windows of earlier requests (engine.md §1).
        cache_salt: mixed into every block digest (separates tenants sharing a store).
        swa_snapshot_entries: SWA window snapshots kept in host memory (LRU).
        encoder_replay: when a hit's window is missing, rebuild it approximately by bounded replay of
            the hit's last ``replay_tokens`` tokens (None = the sliding window) instead of hitting less
            (engine.md §1.4); what such a request computes is never cached.
        decoder_replay: decoder bounded replay (YOCO prefill, engine.md §1.4): only the last
            ``yoco_keep_tokens`` prompt tokens (None = ``$DEEPINFER_YOCO_PREFILL_KEEP_TOKENS``, default
            140) run the decoder layers; approximate for longer prompts, and then no SWA windows
            are saved for the prefix cache (block KV stays exact and cached).
        host_store_bytes: host-memory tier of cached blocks (bytes; 0 = none, and no file store).
        block_store: a directory for the file-system block store shared by engines and restarts
            (local disk or a shared mount); None = none. block_store_fallback: when that directory
            is not usable, log and run without it instead of failing at start-up.
        default_thinking_mode: ``LLM.chat``'s thinking mode for requests that say nothing about it
            (the recipe's ``ConversionOptions.default_thinking_mode``; True, the official default:
            the model reasons before answering, and ``tool_choice`` "required" or a named tool is
            then a 400). A request's ``thinking`` / ``reasoning_effort`` (Chat), ``reasoning.effort``
            (Responses) or ``thinking`` / ``output_config.effort`` (Messages) overrides it.
        sharding: run over a device mesh with attention data parallel and expert parallel
            (engine.md §4): a preset name (``deepinfer_jax/config/sharding/*.toml``, e.g.
            ``"cpu-dp2-ep4"``), a path to a preset ``.toml``, or a ``sharding.ShardingPreset``; None =
            one device. Each DP rank is then its own scheduling domain: ``max_num_seqs``,
            ``num_blocks`` and ``max_num_batched_tokens`` are per rank (``step_budget_ns`` too: every
            rank's chunks fit it, with one shared cost model). Needs ``enable_prefix_caching=False``
            and refuses ``decoder_replay`` and speculation (not supported with DP yet).
        speculation: speculative decoding with the model's DSpark drafter (``SPECULATION_MODES``):
            "auto" (the default: "dspark" when the checkpoint has a drafter and the engine is not
            sharded, else "none"), "none", "fixed" or "dspark". Lossless: greedy outputs are those of
            "none", sampled ones follow the same distribution. The dynamic budget skips drafting (and
            the scheduler then reserves one token per decoding request) while its profiled step times
            say plain decoding is faster, e.g. for large batches on CPU. Requests with a
            structured-output constraint verify no drafts.
        num_speculative_tokens: drafts per step in "fixed" mode, and the fixed count of requests with
            their own seed in "dspark" mode (their tokens then do not depend on the batch, engine.md
            §2.5); at most the drafter's block size. None = 3, except under "auto", where seeded
            requests then verify none (they decode exactly as without speculation).
        draft_vocab_size: the drafter proposes only the first this many tokens of the checkpoint's
            frequency-ranked ``draft_vocab.json`` (cheaper drafting, still lossless); None = the file's
            default size, or the whole vocabulary when the checkpoint ships no such file.
    """

    max_num_seqs: int = 8
    max_model_len: int | None = None
    block_size: int = 64
    num_blocks: int | None = None
    max_blocks_per_request: int | None = None
    kv_storage: str = "quantized"
    chunking: str = "cost"
    max_num_batched_tokens: int = 256
    step_budget_ns: int = 200_000_000
    profile_steps: bool = True
    cost_model_dir: str | None = None
    async_scheduling: bool = True
    structured_output_overlap: bool = True
    seed: int = 0
    max_logprobs: int = 5
    token_buckets: tuple[int, ...] | None = None
    request_buckets: tuple[int, ...] | None = None
    block_buckets: tuple[int, ...] | None = None
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
    default_thinking_mode: bool = True
    sharding: Any = None
    speculation: str = "auto"
    num_speculative_tokens: int | None = None
    draft_vocab_size: int | None = None
    precompile: str = "lazy"
    compilation_cache: Any = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "block_size", "max_num_batched_tokens", "step_budget_ns", "max_logprobs"):
            _pos(name, getattr(self, name))
        for name in ("max_model_len", "num_blocks", "max_blocks_per_request"):
            _pos(name, getattr(self, name), optional=True)
        if self.chunking not in CHUNKING_MODES:
            raise ValueError(f"chunking must be one of {CHUNKING_MODES}, got {self.chunking!r}")
        if self.kv_storage not in ("quantized", "dequantized"):
            raise ValueError(f"kv_storage must be 'quantized' or 'dequantized', got {self.kv_storage!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {self.cache_salt!r}")
        if not isinstance(self.swa_snapshot_entries, int) or self.swa_snapshot_entries < 0:
            raise ValueError(f"swa_snapshot_entries must be an integer >= 0, got {self.swa_snapshot_entries!r}")
        _pos("replay_tokens", self.replay_tokens, optional=True)
        if self.precompile not in PRECOMPILE_MODES:
            raise ValueError(f"precompile must be one of {PRECOMPILE_MODES}, got {self.precompile!r}")
        if not (self.compilation_cache is None or isinstance(self.compilation_cache, (bool, str, os.PathLike))):
            raise ValueError(f"compilation_cache must be a directory path, False, 'off' or None, "
                             f"got {self.compilation_cache!r}")
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation must be one of {SPECULATION_MODES}, got {self.speculation!r}")
        _pos("num_speculative_tokens", self.num_speculative_tokens, optional=True)
        _pos("draft_vocab_size", self.draft_vocab_size, optional=True)
        _pos("yoco_keep_tokens", self.yoco_keep_tokens, optional=True)
        if not isinstance(self.host_store_bytes, int) or self.host_store_bytes < 0:
            raise ValueError(f"host_store_bytes must be an integer >= 0, got {self.host_store_bytes!r}")
        if self.block_store is not None and not isinstance(self.block_store, (str, os.PathLike)):
            raise ValueError(f"block_store must be a directory path or None, got {self.block_store!r}")
        if self.block_store is not None and not self.host_store_bytes:
            raise ValueError("block_store needs host_store_bytes > 0 (blocks pass through host memory)")
        for name in ("async_scheduling", "structured_output_overlap", "profile_steps", "enable_prefix_caching", "encoder_replay",
                     "block_store_fallback", "decoder_replay", "default_thinking_mode"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")
        _sizes("token_buckets", self.token_buckets)
        _sizes("request_buckets", self.request_buckets)
        _sizes("block_buckets", self.block_buckets)
        if self.token_buckets and self.token_buckets[-1] < self.max_num_batched_tokens:
            raise ValueError(f"token_buckets must reach max_num_batched_tokens ({self.max_num_batched_tokens})")
        if self.request_buckets and self.request_buckets[-1] < self.max_num_seqs:
            raise ValueError(f"request_buckets must reach max_num_seqs ({self.max_num_seqs})")
        self._check_sharding()
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one decode token per running request)")

    def _check_sharding(self) -> None:
        if self.sharding is None:
            return
        if not (isinstance(self.sharding, (str, os.PathLike)) or _is_preset(self.sharding)):
            raise ValueError(f"sharding must be a preset name, a .toml path, a ShardingPreset or None, "
                             f"got {self.sharding!r}")
        for name, bad, want in (("enable_prefix_caching", self.enable_prefix_caching, "False"),
                                ("decoder_replay", self.decoder_replay, "False"),
                                ("speculation", self.speculation not in ("auto", "none"), "'auto' or 'none'")):
            if bad:
                raise ValueError(f"{name} must be {want} with sharding (not supported with attention data "
                                 f"parallel yet), got {getattr(self, name)!r}")

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(cls.__dataclass_fields__)
