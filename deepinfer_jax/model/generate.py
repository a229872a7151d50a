"""``generate``: the notebook entry point, a pure function that ``jax.jit`` compiles as a whole.

    gen = jax.jit(generate, static_argnames=("cfg", "max_new_tokens", "storage", "stop_at_eos"))
    tokens = gen(params, cfg, prompt_token_ids, jax.random.key(0), max_new_tokens=32,
                 prompt_lengths=lengths)   # ragged rows: row b's prompt is prompt_token_ids[b, :lengths[b]]

or, with ragged prompts as lists and one compiled program for every sampling setting:

    tokens = generate_ragged(params, cfg, [[0, 5, 7], [0, 9]], max_new_tokens=32, temperature=0.7)

It builds a per-batch paged cache (one slot and a fixed run of blocks per row), prefills all rows
in one flat step (the padding after a row's prompt is marked invalid: it writes nothing and no
real token sees it), samples, and runs the decode steps in a ``lax.while_loop``, each row at its
own positions; every step is the engine's ``paged_step`` and sampler, so greedy results equal the
engine's for each prompt alone. After a row emits the end-of-sequence token its later tokens are
``cfg.eos_token_id`` too (``stop_at_eos``).

The number of steps may be an array (``new_tokens``): one compiled program then serves every count up
to its static ``max_new_tokens``. ``generate_ragged`` uses that: it compiles for a width of 64, 128,
256, ... tokens and passes the count, so asking for 16 tokens and then for 40 runs the same program.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax import compile_cache
from deepinfer_jax.config import CacheConfig
from deepinfer_jax.model.kv_cache import init_cache
from deepinfer_jax.model.paged import StepInputs, paged_step
from deepinfer_jax.model.sampler import sample_tokens

__all__ = ["generate", "generate_ragged", "new_tokens_width", "pad_prompts"]


def _cache_config(cfg, batch: int, total: int, storage: str) -> CacheConfig:
    ratios = {cfg.compress_ratio(i) for i in range(cfg.num_hidden_layers)} - {0}
    bs = math.lcm(*ratios) if ratios else 1
    bs *= max(1, 16 // bs)  # blocks of at least 16 tokens
    per_row = math.ceil(total / bs)
    return CacheConfig(block_size=bs, num_blocks=batch * per_row, max_requests=batch, max_blocks_per_request=per_row,
                       storage=storage)


def generate(params, cfg, prompt_token_ids: jax.Array, key: jax.Array, max_new_tokens: int,
             temperature: float | jax.Array = 0.0, top_p: float | jax.Array = 1.0, top_k: int | jax.Array = 0,
             min_p: float | jax.Array = 0.0, *, prompt_lengths: jax.Array | None = None,
             new_tokens: int | jax.Array | None = None, storage: str = "quantized",
             stop_at_eos: bool = True) -> jax.Array:
    """Generate ``max_new_tokens`` tokens after each row of ``prompt_token_ids`` [B, T] (int).

    ``prompt_lengths`` [B] (int, 1..T): row b's prompt is its first ``prompt_lengths[b]`` ids, the rest
    is padding the model never sees (None = every row is T long). ``key``: a ``jax.random.key``; row
    b's token i uses ``fold_in(fold_in(key, b), i)``. Sampling settings are scalars or [B] arrays
    (temperature 0 = greedy). ``new_tokens`` (an int or an int array, 1..max_new_tokens; None = all):
    generate only that many, a run-time count, so one compiled program serves every count; the
    columns from ``new_tokens`` on hold -1. Returns int32 [B, max_new_tokens]. ``cfg``,
    ``max_new_tokens``, ``storage`` and ``stop_at_eos`` are static; a traced ``new_tokens`` is
    clipped to 1..max_new_tokens.
    """
    compile_cache.enable()  # runs while jit traces, before it compiles: the program lands in the disk cache
    ids = jnp.asarray(prompt_token_ids, jnp.int32)
    batch, t = ids.shape
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if isinstance(new_tokens, (int, np.integer)) and not 1 <= new_tokens <= max_new_tokens:
        raise ValueError(f"new_tokens must lie in [1, max_new_tokens={max_new_tokens}], got {new_tokens}")
    count = max_new_tokens if new_tokens is None else jnp.clip(jnp.asarray(new_tokens, jnp.int32), 1, max_new_tokens)
    cc = _cache_config(cfg, batch, t + max_new_tokens, storage)
    per_row = cc.max_blocks_per_request
    tables = jnp.arange(batch * per_row, dtype=jnp.int32).reshape(batch, per_row)
    rows = jnp.arange(batch, dtype=jnp.int32)
    vec = lambda v, dtype: jnp.broadcast_to(jnp.asarray(v, dtype), (batch,))
    lens = jnp.full(batch, t, jnp.int32) if prompt_lengths is None else jnp.clip(vec(prompt_lengths, jnp.int32), 1, t)
    temp, tp, tk, mp = vec(temperature, jnp.float32), vec(top_p, jnp.float32), vec(top_k, jnp.int32), vec(
        min_p, jnp.float32)
    row_keys = jax.vmap(lambda b: jax.random.fold_in(key, b))(rows)

    def pick(logits, i):
        keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(row_keys)
        return sample_tokens(logits, keys, temp, tk, tp, mp)

    positions = jnp.tile(jnp.arange(t, dtype=jnp.int32), batch)
    token_req = jnp.repeat(rows, t)
    prefill = StepInputs(token_ids=ids.reshape(-1), positions=positions, token_req=token_req,
                         token_valid=positions < lens[token_req], block_tables=tables,
                         req_slot=rows, req_start=rows * t, ctx_len=jnp.zeros(batch, jnp.int32),
                         new_len=lens, logit_rows=rows * t + lens - 1,
                         window_floor=jnp.zeros(batch, jnp.int32), global_write_from=jnp.zeros(batch, jnp.int32))
    logits, cache = paged_step(params, cfg, cc, init_cache(cfg, cc), prefill)
    first = pick(logits, 0)
    out = jnp.full((batch, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)

    def body(carry):
        i, cache, out, done = carry
        last = out[:, i - 1]
        pos = lens + i - 1
        step = StepInputs(token_ids=last, positions=pos, token_req=rows, token_valid=jnp.ones(batch, bool),
                          block_tables=tables, req_slot=rows, req_start=rows, ctx_len=pos, new_len=pos + 1,
                          logit_rows=rows, window_floor=jnp.zeros(batch, jnp.int32),
                          global_write_from=jnp.zeros(batch, jnp.int32))
        logits, cache = paged_step(params, cfg, cc, cache, step)
        tok = pick(logits, i)
        done = done | (stop_at_eos & (last == cfg.eos_token_id))
        tok = jnp.where(done, cfg.eos_token_id, tok)
        return i + 1, cache, out.at[:, i].set(tok), done

    start = (jnp.int32(1), cache, out, jnp.zeros(batch, bool))
    _, _, out, _ = jax.lax.while_loop(lambda carry: carry[0] < count, body, start)
    return out


#: Prompt lengths are padded up to a multiple of this (and batches to a power of two), so that
#: prompts of nearby lengths share one compiled program.
PAD_MULTIPLE = 16

#: ``generate_ragged`` compiles for this many new tokens at least, and for the next power of two above it
#: when asked for more; the count itself is a run-time argument (``generate(..., new_tokens=...)``).
MIN_NEW_TOKENS_WIDTH = 64


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def new_tokens_width(max_new_tokens: int) -> int:
    """The output width ``generate_ragged`` compiles for ``max_new_tokens``: 64, 128, 256, ..."""
    return max(MIN_NEW_TOKENS_WIDTH, _pow2_at_least(max_new_tokens))


_STATIC = ("cfg", "max_new_tokens", "storage", "stop_at_eos")
_jitted = jax.jit(generate, static_argnames=_STATIC)


@functools.cache
def _ragged_program():
    """``_jitted`` with its programs kept in the program store (``runner.program_store.StoredLowering``), made at
    ``generate_ragged``'s first call: a warm process loads the compiled ``generate`` instead of tracing it; a
    user's ``jax.jit(generate)`` with the same arguments still finds the program in the compilation cache."""
    from deepinfer_jax.runner.program_store import StoredLowering

    return StoredLowering(_jitted, generate, "generate_ragged", _STATIC)


def pad_prompts(prompts, vocab_size: int | None = None, multiple: int = PAD_MULTIPLE,
                batch_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Ragged prompts (a sequence of token-id sequences) -> (ids [B', T] int32, lengths [B'] int32),
    T a multiple of ``multiple``; with ``batch_to`` the batch is padded with one-token rows up to it.
    ``ValueError`` naming ``prompts[i]`` for an empty row, a non-integer id or one outside the vocabulary."""
    rows = []
    for i, p in enumerate(prompts):
        arr = np.asarray(p)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"prompts[{i}] must be a non-empty list of token ids, got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompts[{i}] must hold integer token ids, got dtype {arr.dtype}")
        if arr.min() < 0 or (vocab_size is not None and arr.max() >= vocab_size):
            raise ValueError(f"prompts[{i}] has ids outside [0, {vocab_size}): min {arr.min()}, max {arr.max()}")
        rows.append(arr.astype(np.int32))
    if not rows:
        raise ValueError("prompts must hold at least one prompt")
    t = -(-max(len(r) for r in rows) // multiple) * multiple
    b = max(len(rows), batch_to or 0)
    ids = np.zeros((b, t), np.int32)
    lens = np.ones(b, np.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r)], lens[i] = r, len(r)
    return ids, lens


def generate_ragged(params, cfg, prompts, max_new_tokens: int, *, key: jax.Array | None = None,
                    temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, storage: str = "quantized",
                    stop_at_eos: bool = True) -> list[list[int]]:
    """``generate`` for ragged prompts, compiled once per (padded shape, output width, ``storage``,
    ``stop_at_eos``): the sampling settings (scalars or one per prompt) always enter as [B] arrays and
    ``max_new_tokens`` as the run-time count of a program 64, 128, 256, ... tokens wide
    (``new_tokens_width``), so changing either never recompiles within a width. Prompts are padded
    (``pad_prompts``: lengths to a multiple of 16, the batch to a power of two) and the padding never
    reaches the model. Returns each prompt's ``max_new_tokens`` new token ids (after an end-of-sequence
    token: ``cfg.eos_token_id``, as ``generate``). ``ValueError`` naming ``max_new_tokens`` unless it is
    an int >= 1 that fits the model's context with the longest prompt (``cfg.max_position_embeddings``); the
    width never reaches past that context."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    n = len(prompts)
    ids, lens = pad_prompts(prompts, cfg.vocab_size, batch_to=_pow2_at_least(n))
    b = ids.shape[0]
    context, longest = cfg.max_position_embeddings, int(lens.max())
    if longest + max_new_tokens > context:
        raise ValueError(f"max_new_tokens must fit the model's context: the longest prompt has {longest} tokens, "
                         f"so at most {context - longest} new ones (max_position_embeddings {context}), "
                         f"got {max_new_tokens}")
    width = max(int(max_new_tokens), min(new_tokens_width(max_new_tokens), context - ids.shape[1]))

    def per_row(value, name, dtype):
        arr = np.asarray(value, dtype)
        if arr.ndim == 0:
            return np.full(b, arr, dtype)
        if arr.shape != (n,):
            raise ValueError(f"{name} must be a scalar or one value per prompt ({n}), got shape {arr.shape}")
        return np.concatenate([arr, np.full(b - n, arr[0] if n else 0, dtype)])

    settings = (per_row(temperature, "temperature", np.float32), per_row(top_p, "top_p", np.float32),
                per_row(top_k, "top_k", np.int32), per_row(min_p, "min_p", np.float32))
    key = jax.random.key(0) if key is None else key
    compile_cache.enable()
    out = _ragged_program()(params, cfg, ids, key, width, *settings, prompt_lengths=lens,
                            new_tokens=int(max_new_tokens), storage=storage, stop_at_eos=stop_at_eos)
    return np.asarray(out)[:n, :max_new_tokens].tolist()
