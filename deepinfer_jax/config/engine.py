"""Engine settings (host side): ``EngineConfig``, composed of its sections (``config.sections``).

``LLM(model, **settings)`` maps its keyword arguments 1:1 onto the flat ``EngineConfig`` settings: each
is a field of one section (``scheduler``, ``cache``, ``spec``, ``parallel``) or of ``EngineConfig``
itself (seed, logprobs, chat default, start-up), and reads back flat (``ec.max_num_seqs`` is
``ec.scheduler.max_num_seqs``). Plain Python, no JAX.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from deepinfer_jax.config.sections import (
    CHUNKING_MODES,
    SPECULATION_MODES,
    CacheSettings,
    ParallelConfig,
    SchedulerConfig,
    SpeculationConfig,
    check_bools,
    check_pos,
)

__all__ = ["CHUNKING_MODES", "PRECOMPILE_MODES", "SECTIONS", "SPECULATION_MODES", "EngineConfig", "yoco_keep_tokens"]

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

#: "lazy": ``LLM()`` compiles nothing up front; each step bucket compiles on its first use (from the
#: persistent compilation cache when an earlier process compiled it) and start-up profiling is
#: replaced by the disk caches or online fits; "all": every bucket compiles and every start-up
#: profile runs inside ``LLM()``, so no request ever waits on a compilation.
PRECOMPILE_MODES = ("lazy", "all")

#: The sections of ``EngineConfig``: attribute name -> section class.
SECTIONS: dict[str, type] = {"scheduler": SchedulerConfig, "cache": CacheSettings, "spec": SpeculationConfig,
                             "parallel": ParallelConfig}
#: Flat setting -> the section holding it.
_SECTION_OF = {f.name: name for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True, init=False)
class EngineConfig:
    """The engine's settings: four sections plus the settings of the engine as a whole; frozen and hashable.

    ``EngineConfig(max_num_seqs=4, speculation="none")`` takes every setting flat (routed to its
    section); ``EngineConfig(scheduler=SchedulerConfig(...), cache=..., spec=..., parallel=...)`` takes
    whole sections, and flat settings given with a section override its fields. Every flat setting
    reads back as an attribute; ``settings()`` returns them as a dict, ``replace(**flat)`` a copy
    with some changed, ``fields()`` their names, ``flat_fields()`` their dataclass fields.

    Sections: ``scheduler`` (``SchedulerConfig``: max_num_seqs, max_model_len, chunking,
    max_num_batched_tokens, step_budget_ns, profile_steps, cost_model_dir, async_scheduling,
    structured_output_overlap, token_buckets, request_buckets, block_buckets), ``cache`` (``CacheSettings``: block_size,
    num_blocks, max_blocks_per_request, kv_storage, enable_prefix_caching, cache_salt,
    swa_snapshot_entries, encoder_replay, replay_tokens, decoder_replay, yoco_keep_tokens,
    host_store_bytes, block_store, block_store_fallback), ``spec`` (``SpeculationConfig``: speculation,
    num_speculative_tokens, draft_vocab_size), ``parallel`` (``ParallelConfig``: sharding, cp_threshold,
    dp_match_floor_ns). Its own:
    seed, max_logprobs, default_thinking_mode, precompile, compilation_cache.

    Settings:
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
        enable_prefix_caching: reuse the KV blocks and SWA windows of earlier requests (docs/engine.md §1).
        cache_salt: mixed into every block digest (separates tenants sharing a store).
        swa_snapshot_entries: SWA window snapshots kept in host memory (LRU).
        encoder_replay: when a hit's window is missing, rebuild it approximately by bounded replay of
            the hit's last ``replay_tokens`` tokens (None = the sliding window) instead of hitting less
            (docs/engine.md §1.4); what such a request computes is never cached.
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
            (docs/engine.md §4): a preset name (``sharding/*.toml``, e.g.
            ``"cpu-dp2-ep4"``), a path to a preset ``.toml``, or a ``config.ShardingPreset``; None =
            one device. Each DP rank is then its own scheduling domain: ``max_num_seqs``,
            ``num_blocks`` and ``max_num_batched_tokens`` are per rank (``step_budget_ns`` too: every
            rank's chunks fit it, with one shared cost model). Prefix caching runs per rank (each
            rank's block pool; the host and file tiers and the window store are shared, so a prefix
            computed on one rank hits on another) and ``decoder_replay`` on every rank; an explicit
            ``speculation`` ("fixed", "dspark") runs per rank too (each rank plans its own verification
            budget), while "auto" stays plain when sharded. A preset with a ``cp`` axis (``cpu-cp4``,
            ``prefill-cp8``) runs one scheduling domain and prefills long prompts by context parallelism
            (without speculation: refused there).
        cp_threshold: with a context-parallel preset, a prompt with at least this many tokens still to
            compute prefills alone, as one chunk split by position over the ``cp`` ranks
            (docs/context_parallel.md); shorter ones run as ordinary chunks. None = the preset's
            ``[parallel] cp_threshold``, or ``2 * max_num_batched_tokens`` when that is 0; 0 = never.
        dp_match_floor_ns: with DP ranks (``sharding``) and ``chunking="cost"``, in a step where two or more
            ranks have prompt work, every rank chunks to the predicted cost of the smallest such rank's work,
            not below this many ns, so short prompts are not padded to a long chunk's end (layer 4 of the
            prefill balancer, docs/cluster.md; ``engine.ranks.matched_budget_ns``). None (the default) = off:
            every rank fills ``step_budget_ns``. No effect on one rank; needs ``chunking="cost"``.
        speculation: speculative decoding with the model's DSpark drafter (``SPECULATION_MODES``):
            "auto" (the default: "dspark" when the checkpoint has a drafter and the engine is not
            sharded, else "none"), "none", "fixed" or "dspark". Lossless: greedy outputs are those of
            "none", sampled ones follow the same distribution. The dynamic budget skips drafting (and
            the scheduler then reserves one token per decoding request) while its profiled step times
            say plain decoding is faster, e.g. for large batches on CPU. Requests with a
            structured-output constraint verify no drafts.
        num_speculative_tokens: drafts per step in "fixed" mode, and the fixed count of requests with
            their own seed in "dspark" mode (their tokens then do not depend on the batch, docs/engine.md
            §2.5); at most the drafter's block size. None = 3, except under "auto", where seeded
            requests then verify none (they decode exactly as without speculation).
        draft_vocab_size: the drafter proposes only the first this many tokens of the checkpoint's
            frequency-ranked ``draft_vocab.json`` (cheaper drafting, still lossless); None = the file's
            default size, or the whole vocabulary when the checkpoint ships no such file.
    """

    scheduler: SchedulerConfig
    cache: CacheSettings
    spec: SpeculationConfig
    parallel: ParallelConfig
    seed: int = 0
    max_logprobs: int = 5
    default_thinking_mode: bool = True
    precompile: str = "lazy"
    compilation_cache: Any = None

    def __init__(self, *, scheduler: SchedulerConfig | None = None, cache: CacheSettings | None = None,
                 spec: SpeculationConfig | None = None, parallel: ParallelConfig | None = None,
                 **settings: Any) -> None:
        own = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name not in SECTIONS}
        for key in settings:
            if key not in own and key not in _SECTION_OF:
                raise TypeError(f"EngineConfig.__init__() got an unexpected keyword argument {key!r}")
        given = {"scheduler": scheduler, "cache": cache, "spec": spec, "parallel": parallel}
        for name, cls in SECTIONS.items():
            flat = {k: v for k, v in settings.items() if _SECTION_OF.get(k) == name}
            section = given[name]
            if section is not None and not isinstance(section, cls):
                raise ValueError(f"{name} must be a {cls.__name__}, got {section!r}")
            object.__setattr__(self, name, cls(**flat) if section is None else dataclasses.replace(section, **flat))
        for key, default in own.items():
            object.__setattr__(self, key, settings.get(key, default))
        self._validate()

    def _validate(self) -> None:
        check_pos("max_logprobs", self.max_logprobs)
        if self.precompile not in PRECOMPILE_MODES:
            raise ValueError(f"precompile must be one of {PRECOMPILE_MODES}, got {self.precompile!r}")
        if not (self.compilation_cache is None or isinstance(self.compilation_cache, (bool, str, os.PathLike))):
            raise ValueError(f"compilation_cache must be a directory path, False, 'off' or None, "
                             f"got {self.compilation_cache!r}")
        check_bools(self, ("default_thinking_mode",))
        if self.parallel.dp_match_floor_ns is not None and self.scheduler.chunking != "cost":
            raise ValueError("dp_match_floor_ns: matching the DP ranks' chunks needs chunking='cost', "
                             f"got chunking={self.scheduler.chunking!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {self.seed!r}")

    # ---- the flat view ----

    @classmethod
    def flat_fields(cls) -> tuple[dataclasses.Field, ...]:
        """The dataclass fields of every flat setting (the sections', then ``EngineConfig``'s own)."""
        own = tuple(f for f in dataclasses.fields(cls) if f.name not in SECTIONS)
        return tuple(f for section in SECTIONS.values() for f in dataclasses.fields(section)) + own

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The names of every flat setting (what ``LLM(**settings)`` accepts)."""
        return tuple(f.name for f in cls.flat_fields())

    def settings(self) -> dict[str, Any]:
        """Every flat setting and its value."""
        return {name: getattr(self, name) for name in self.fields()}

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with some flat settings (or whole sections) changed, validated again."""
        sections = {k: changes.pop(k) for k in list(changes) if k in SECTIONS}
        base = {k: v for k, v in self.settings().items() if _SECTION_OF.get(k) not in sections}
        return EngineConfig(**sections, **{**base, **changes})


def _flat(section: str, name: str) -> property:
    return property(lambda self: getattr(getattr(self, section), name),
                    doc=f"``{section}.{name}`` (a flat setting)")


for _name, _section in _SECTION_OF.items():
    setattr(EngineConfig, _name, _flat(_section, _name))
del _name, _section
