"""One mixed prefill/decode step over the paged cache: a flat ragged batch in, logits out.

``paged_step(params, cfg, cache_cfg, cache, inputs)`` runs every layer on ``N`` flat tokens that
belong to up to ``R`` requests (each request's tokens contiguous, at consecutive positions starting
at the request's ``ctx_len``), reads the window rows, compressed entries, compressor state and
Engram look-back that earlier steps left in the cache, writes the new ones, and returns the logits
of the ``logit_rows`` tokens. Per token it computes exactly what ``forward_full`` computes at that
position (same ops, same row shapes), so any chunking reproduces the full forward.

Bounded reads: per token the step reads its window rows, the index keys of its request's block table
(the indexer's linear scan, as wide as the step's block bucket) and its top-k main entries, gathered
in storage format and decoded alone (``model.selected_entries``); nothing it computes is as large as
the block pool (the cache writes aside).

Bounded replay (engine.md §1.4): a request row may set ``window_floor`` (its tokens' windows see no
position below it: attention truncated to the replayed segment) and ``global_write_from`` (its
tokens below it write no block KV: the cached blocks are reused as they are, never overwritten).

Decoder bounded replay (YOCO prefill, engine.md §1.4): with ``decoder_rows`` only those tokens (a
contiguous tail of each request's tokens) run the layers after ``cfg.decoder_start``; the others stop
after the decoder's KV-source layer, which has already written the decoder's block KV for every
token from the encoder output. Decoder windows then see no position below ``decoder_floor``, and
``logit_rows`` index into ``decoder_rows``.

Rollback (speculative decoding): every per-request ring (SWA rows, compressor tokens, Engram
look-back) keeps ``spec_slack`` positions to spare, so a step may write positions that a later step
starts before again (rejected drafts); block KV entries at such positions are invisible until the
positions are recomputed and written again.

With ``capture`` (layer ids) the step also returns the DSpark target features of its tokens
(``Captured``: the stream means entering those layers' attention sites, as ``forward_full(...,
capture=...)`` computes them).

Padding: tokens with ``token_valid = False`` and request rows whose ``req_slot`` is out of range
write nothing (scatters drop out-of-range indices). Validation of positions, block tables and
bucket sizes happens on the host, before this function is called (``deepinfer_jax.runner``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from deepinfer_jax.config import LayerRole
from deepinfer_jax.model import kv_cache as kc
from deepinfer_jax.model import mhc
from deepinfer_jax.model.attention import attend_step
from deepinfer_jax.model.deepseek_v41 import _graphdef
from deepinfer_jax.model.engram_consts import hash_constants
from deepinfer_jax.model.engram_hash import ngram_hash_ids
from deepinfer_jax.model.index_tiles import select_tokens
from deepinfer_jax.model.layers import matmul_t
from deepinfer_jax.model.moe_strategy import MoEStrategy, check_tables, layer_tables
from deepinfer_jax.model.quant import fake_quant_fp8, fake_quant_mxfp4, fake_quant_nvfp4
from deepinfer_jax.model.selected_entries import compact_selection


_AUTO = MoEStrategy()


class StepInputs(NamedTuple):
    """Device inputs of one step (all int32 unless noted; N tokens, R request rows, MB blocks, M logit rows)."""

    token_ids: jax.Array  # [N]
    positions: jax.Array  # [N]
    token_req: jax.Array  # [N] row of the token's request in the per-request arrays
    token_valid: jax.Array  # [N] bool; False = padding
    block_tables: jax.Array  # [R, MB] block ids, -1 = none
    req_slot: jax.Array  # [R] ring/state slot; >= max_requests for padding rows
    req_start: jax.Array  # [R] flat index of the request's first token in this step
    ctx_len: jax.Array  # [R] tokens already cached before this step
    new_len: jax.Array  # [R] ctx_len + this step's tokens of the request
    logit_rows: jax.Array  # [M] flat token indices whose logits are returned
    window_floor: jax.Array | None = None  # [R] first position a window may see (bounded replay; None = 0)
    global_write_from: jax.Array | None = None  # [R] positions below it write no block KV (reused; None = 0)
    decoder_rows: jax.Array | None = None  # [D] flat tokens that run the decoder (YOCO prefill; None = all)
    decoder_valid: jax.Array | None = None  # [D] bool; False = padding of decoder_rows
    decoder_floor: jax.Array | None = None  # [R] first position a decoder layer's window may see


class _Step(NamedTuple):
    """Per-token metadata derived once per step."""

    inp: StepInputs
    pos: jax.Array
    idx: jax.Array  # [N] flat index
    ctx: jax.Array  # [N] ctx_len of the token's request
    new: jax.Array  # [N]
    slot: jax.Array  # [N] slot for reads (clipped)
    valid: jax.Array  # [N]
    quantized: bool
    cache_cfg: object
    floor: jax.Array  # [N] first position the token's window may see
    write_from: jax.Array  # [N] the token writes block KV only at or past this position


class _Shared(NamedTuple):
    """Cross-layer CSA2 state within a step: the current KV source's entries and the selection."""

    source: int = -1
    pool_kv: object = None  # main entries of the whole block pool [P, block_size // ratio, ...] (storage, not decoded)
    index_RED: jax.Array | None = None  # index keys of every request row [R, E, hd] (decoded)
    topk: jax.Array | None = None  # [N, k]
    candidates: jax.Array | None = None  # [N, E]


def _store(x, fmt, fq, m: _Step, fake_quant: bool):
    """(storage rows, the values the model uses): the values always equal ``fq(x)`` bit for bit."""
    if m.quantized:
        stored = kc.encode(x, fmt, True)
        return stored, kc.decode(stored, fmt, True)
    vals = fq(x) if fake_quant else x
    return vals, vals


def _engram_rows(model, cache, m: _Step):
    """Engram table rows [1, N, L, h] from each token's own look-back (this step or the cached ring)."""
    cfg = model.cfg
    n = cfg.engram_max_ngram_size
    ring = cache["engram"]  # [slots, cap] token ids by position % cap
    cols, mask = [], []
    for k in range(n - 1, -1, -1):  # chronological: look-back k = n-1 .. 0
        pk = m.pos - k
        from_step = pk >= m.ctx
        h = ring[m.slot, jnp.mod(pk, ring.shape[1])]
        tok = jnp.where(from_step, m.inp.token_ids[jnp.clip(m.idx - k, 0)], h)
        cols.append(jnp.maximum(tok, 0))
        mask.append((pk >= 0) & (from_step | (h >= 0)))
    mini, mini_mask = jnp.stack(cols, 1), jnp.stack(mask, 1)
    rows = ngram_hash_ids(mini, model.engram_token_map[...], hash_constants(cfg), max_ngram=n,
                          pad_token_id=cfg.engram_pad_token_id, token_mask=mini_mask)
    return rows[:, -1][None]


def _engram_history(cache, m: _Step):
    """This step's token ids -> the Engram look-back ring (the last ``cap`` positions of each request)."""
    ring = cache["engram"]
    cap = ring.shape[1]
    keep = m.valid & (m.pos >= m.new - cap)
    at = (jnp.where(keep, m.inp.req_slot[m.inp.token_req], ring.shape[0]), jnp.mod(m.pos, cap))
    return ring.at[at].set(m.inp.token_ids, mode="drop")


def _window_keys(attn, layer, kv_new, cache, m: _Step):
    """Each token's ``window`` SWA rows [N, w, D] (this step's rows or the ring) and their validity."""
    w = attn.window
    cap = m.cache_cfg.ring_capacity_rows
    pk = m.pos[:, None] - (w - 1) + jnp.arange(w)  # [N, w]
    in_step = pk >= m.ctx[:, None]
    src = jnp.clip(m.idx[:, None] - (m.pos[:, None] - pk), 0, kv_new.shape[0] - 1)
    ring = kc.decode(kc.gather(cache["swa"], (layer, m.slot[:, None], jnp.mod(pk, cap))), "fp8", m.quantized)
    keys = jnp.where(in_step[..., None], kv_new[src], ring)
    return keys, (pk >= m.floor[:, None]) & m.valid[:, None]


def _compress(attn, x_1Nd, cache, layer, m: _Step):
    """Latent [N, D] of the entry each token completes (garbage where it completes none), new comp state."""
    comp = attn.compressor
    r = attn.ratio
    if r == 1:
        return comp(x_1Nd)[0], cache["comp"]
    xf = x_1Nd.astype(jnp.float32)
    v, g = comp.wkv(xf)[0], comp.wgate(xf)[0]  # [N, D]
    state = cache["comp"][layer]
    cap = state["v"].shape[1]  # a ring of ratio + spec_slack positions
    vs, gs = [], []
    for k in range(r):
        pk = m.pos - (r - 1) + k
        in_step = (pk >= m.ctx)[:, None]
        src = jnp.clip(m.idx - (r - 1 - k), 0)
        vs.append(jnp.where(in_step, v[src], state["v"][m.slot, jnp.mod(pk, cap)]))
        gs.append(jnp.where(in_step, g[src], state["g"][m.slot, jnp.mod(pk, cap)]))
    values, gates = jnp.stack(vs, 1), jax.nn.softmax(jnp.stack(gs, 1), axis=1)
    latent = comp.norm(jnp.sum(values * gates, axis=1).astype(x_1Nd.dtype))
    keep = m.valid & (m.pos >= m.new - cap)
    at = (jnp.where(keep, m.inp.req_slot[m.inp.token_req], m.cache_cfg.max_requests), jnp.mod(m.pos, cap))
    new_state = {"v": state["v"].at[at].set(v, mode="drop"), "g": state["g"].at[at].set(g, mode="drop")}
    return latent, {**cache["comp"], layer: new_state}


def source_entries(layer: int, glob: dict, tables, r: int, m: _Step, shared: _Shared) -> _Shared:
    """After KV-source ``layer`` wrote its compressed entries into ``glob`` (its ``cache["global"]`` part):
    the ``_Shared`` its readers use, i.e. the pool and every table entry's index keys, decoded [R, E, d]."""
    bs, n_blocks = m.cache_cfg.block_size, m.cache_cfg.num_blocks
    e = tables.shape[1] * bs // r
    jj = jnp.arange(e)
    where_e = (jnp.clip(tables[:, (jj * r) // bs], 0, n_blocks - 1),
               jnp.broadcast_to(jnp.mod(jj * r, bs) // r, (tables.shape[0], e)))
    return _Shared(source=layer, pool_kv=glob["kv"],
                   index_RED=kc.decode(kc.gather(glob["index"], where_e), "mxfp4", m.quantized),
                   candidates=shared.candidates)


def select_entries(attn, shared: _Shared, x_1Nd, q_lat, angles, r: int, m: _Step) -> _Shared:
    """The lightning indexer's top-k over the entries each token may see (a FULL or REINDEX layer); long
    steps score and select in token tiles (``model.index_tiles``)."""
    topk, candidates = select_tokens(attn, q_lat, x_1Nd, angles, shared.index_RED, m.inp.token_req, (m.pos + 1) // r,
                                     shared.candidates)
    return shared._replace(topk=topk, candidates=candidates)


def _attention_step(attn, layer, x_1Nd, shared: _Shared, cache, m: _Step, cfg):
    """One layer's CSA2 attention on the flat batch: write SWA rows / entries, select, attend."""
    angles = attn.angles(m.pos)[None]
    q_lat, q = attn.query(x_1Nd, angles)
    stored, kv_new = _store(attn.window_kv(x_1Nd, angles, raw=True)[0], "fp8", fake_quant_fp8, m, cfg.fake_quant)
    keys, valid = _window_keys(attn, layer, kv_new, cache, m)
    cap = m.cache_cfg.ring_capacity_rows
    keep = m.valid & (m.pos >= m.new - cap)
    ring_at = (layer, jnp.where(keep, m.inp.req_slot[m.inp.token_req], m.cache_cfg.max_requests), jnp.mod(m.pos, cap))
    cache = {**cache, "swa": kc.scatter(cache["swa"], ring_at, stored)}
    if attn.ratio:
        r, bs = attn.ratio, m.cache_cfg.block_size
        tables = m.inp.block_tables
        n_blocks = m.cache_cfg.num_blocks
        if attn.role is LayerRole.FULL:
            latent, comp = _compress(attn, x_1Nd, cache, layer, m)
            j = m.pos // r
            c_angles = attn.angles(j * r)
            g_stored, _ = _store(attn.global_kv(latent, c_angles, raw=True), "nvfp4", fake_quant_nvfp4, m,
                                 cfg.fake_quant)
            i_stored, _ = _store(attn.indexer.keys(latent, c_angles, raw=True), "mxfp4", fake_quant_mxfp4, m,
                                 cfg.fake_quant)
            blk = tables[m.inp.token_req, (j * r) // bs]
            done = m.valid & (jnp.mod(m.pos, r) == r - 1) & (blk >= 0) & (m.pos >= m.write_from)
            at = (jnp.where(done, blk, n_blocks), jnp.mod(j * r, bs) // r)
            glob = cache["global"][layer]
            glob = {"kv": kc.scatter(glob["kv"], at, g_stored), "index": kc.scatter(glob["index"], at, i_stored)}
            cache = {**cache, "comp": comp, "global": {**cache["global"], layer: glob}}
            shared = source_entries(layer, glob, tables, r, m, shared)
        if attn.role in (LayerRole.FULL, LayerRole.REINDEX):
            shared = select_entries(attn, shared, x_1Nd, q_lat, angles, r, m)
        # only the selected entries are decoded, never the whole pool (``model.selected_entries``)
        o = attend_step(q[0], keys, valid, attn.attn_sink[...],
                        *compact_selection(shared.pool_kv, "nvfp4", m.quantized, tables, m.inp.token_req,
                                           shared.topk, kv_new.dtype))
    else:
        o = attend_step(q[0], keys, valid, attn.attn_sink[...])
    return attn.output(o[None], angles), shared, cache


class Captured(NamedTuple):
    """DSpark target features of a step's tokens (``paged_step(..., capture=...)``): the rows that ran
    the capture layers (every token, or the decoder rows under decoder bounded replay)."""

    feats: jax.Array  # [N', len(capture) * d] stream means entering each capture layer's attention site
    positions: jax.Array  # [N']
    req_slot: jax.Array  # [N'] the token's slot (>= max_requests for padding rows)
    valid: jax.Array  # [N'] bool
    new_len: jax.Array  # [N'] new_len of the token's request


def paged_step(params: nnx.State, cfg, cache_cfg, cache: dict, inputs: StepInputs, capture: tuple[int, ...] = (),
               moe: MoEStrategy = _AUTO, moe_tables=None):
    """(logits [M, V] fp32, updated cache), plus ``Captured`` features when ``capture`` (backbone layer
    ids, e.g. ``cfg.dspark_target_layer_ids``) is given, plus the slot counts [L, P] (last) under the
    ``"ep"`` MoE strategy ``moe``, which takes every layer's routing tables ``moe_tables``
    (``model.moe_strategy``; padding tokens are neither sent nor counted). ``cfg``, ``cache_cfg``,
    ``capture`` and ``moe`` are static under jit; donate ``cache``."""
    check_tables(moe, moe_tables, cfg.num_hidden_layers)
    model = nnx.merge(_graphdef(cfg), params)
    inp = inputs
    n = inp.token_ids.shape[0]
    m = step_meta(cfg, cache_cfg, inp)
    x = model.embed(inp.token_ids)[None]
    streams = jnp.broadcast_to(x[:, :, None, :], (1, n, cfg.hc_mult, cfg.hidden_size))
    pre = jnp.zeros((1, n, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
    rows = _engram_rows(model, cache, m) if cfg.engram_layer_ids else None
    shared = _Shared()
    m_all = m
    taps: list = []  # (features [N, d], taken before the step narrowed to the decoder rows)
    counts = []
    for layer, block in enumerate(model.layers):
        if inp.decoder_rows is not None and layer == cfg.decoder_start + 1:
            m, streams, pre, shared = _to_decoder_rows(m, streams, pre, shared, inp)

        def attend(attn, x, carry, layer=layer, m=m):
            out, shared, cache = _attention_step(attn, layer, x, *carry, m, cfg)
            return out, (shared, cache)

        tap = (lambda s, m=m: taps.append((jnp.mean(s[0].astype(jnp.float32), axis=1).astype(s.dtype), m is m_all))
               if layer in capture else None)
        streams, pre, (shared, cache), c = block(streams, pre, (shared, cache), attend, engram_rows=rows, tap=tap,
                                                 moe=moe, moe_tables=layer_tables(moe_tables, layer), valid=m.valid)
        counts.append(c)
    if cfg.engram_layer_ids:
        cache = {**cache, "engram": _engram_history(cache, m_all)}
    h = model.norm(mhc.collapse(streams[:, inp.logit_rows], pre[:, inp.logit_rows]))[0]
    logits = matmul_t(h.astype(jnp.float32), model.head.weight[...].astype(jnp.float32))
    out = (logits, cache)
    if capture:
        narrowed = m is not m_all
        feats = jnp.concatenate([t[inp.decoder_rows] if narrowed and early else t for t, early in taps], axis=-1)
        out += (Captured(feats, m.pos, m.inp.req_slot[m.inp.token_req], m.valid, m.new),)
    if moe.counts:
        out += (jnp.stack(counts),)
    return out


def _to_decoder_rows(m: _Step, streams, pre, shared: _Shared, inp: StepInputs):
    """Narrow the step to the tokens that run the decoder (``inp.decoder_rows``)."""
    rows = inp.decoder_rows
    sub = inp._replace(token_ids=inp.token_ids[rows], positions=inp.positions[rows], token_req=inp.token_req[rows],
                       token_valid=inp.decoder_valid & inp.token_valid[rows])
    floor = m.floor[rows]
    if inp.decoder_floor is not None:
        floor = jnp.maximum(floor, inp.decoder_floor[sub.token_req])
    m = m._replace(inp=sub, pos=sub.positions, idx=jnp.arange(rows.shape[0]), ctx=m.ctx[rows], new=m.new[rows],
                   slot=m.slot[rows], valid=sub.token_valid, floor=floor, write_from=m.write_from[rows])
    shared = shared._replace(topk=None if shared.topk is None else shared.topk[rows],
                             candidates=None if shared.candidates is None else shared.candidates[rows])
    return m, streams[:, rows], pre[:, rows], shared


def step_meta(cfg, cache_cfg, inp: StepInputs) -> _Step:
    """The per-token metadata of a flat step (positions, contexts, slots, floors) from its inputs."""
    n = inp.token_ids.shape[0]
    zero = jnp.zeros(n, jnp.int32)
    slots = cache_cfg.max_requests
    return _Step(inp=inp, pos=inp.positions, idx=jnp.arange(n), ctx=inp.ctx_len[inp.token_req],
                 new=inp.new_len[inp.token_req], slot=jnp.clip(inp.req_slot[inp.token_req], 0, slots - 1),
                 valid=inp.token_valid, quantized=cache_cfg.storage == "quantized",
                 floor=zero if inp.window_floor is None else inp.window_floor[inp.token_req],
                 write_from=zero if inp.global_write_from is None else inp.global_write_from[inp.token_req],
                 cache_cfg=_CacheGeometry(cache_cfg.block_size, cache_cfg.num_blocks, cache_cfg.max_requests,
                                          cache_cfg.ring_capacity(cfg)))


class _CacheGeometry(NamedTuple):
    """The static numbers of a CacheConfig that the step needs."""

    block_size: int
    num_blocks: int
    max_requests: int
    ring_capacity_rows: int
