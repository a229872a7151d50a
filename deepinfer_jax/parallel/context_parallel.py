"""Context-parallel (CP) prefill of one long chunk: its tokens split by position over a ``cp`` mesh axis.

``cp_prefill(params, cfg, cache_cfg, cache, inputs, lay, mesh=..., axis="cp")`` computes what
``paged_step`` computes for a one-request chunk (``inputs``: its flat ``StepInputs``), but each rank runs
only the tokens that ``parallel.cp_layout`` gave it (a head and a tail piece, ``lay``) inside one
``shard_map`` over ``axis``. Per token the numbers are the paged step's: the same ops on the same rows;
what a token needs from other ranks' tokens arrives through all-gathers:

- sliding window (every layer): the last ``tail_rows`` SWA rows of every piece (storage format) are
  gathered per layer; a token's window reads its own piece's rows locally, the earlier pieces' rows from
  that table (the halo: at most ``window - 1`` rows back) and positions before the chunk from the cache
  ring, exactly like the paged step. The same table holds the rows that end in the SWA ring.
- compressor (FULL layers, ratio > 1): piece boundaries are multiples of every ratio, so every entry is
  pooled from one piece; only the chunk's first piece reads the cached compressor state (as an ordinary
  step). The values and gate scores that end in the compressor ring come from the gathered tails too.
- compressed global KV and index keys (FULL layers): each rank keeps the entries its tokens complete
  (``pos % ratio == ratio - 1``), the ranks all-gather them (``~length / ratio`` entries in all) and every
  rank writes all of them into its copy of the block pool, so the indexer scores and the attention read
  the same pool as the unsharded step.
- Engram look-back: the n-gram rows are hashed from the whole chunk's token ids before the split
  (each rank needs ``max_ngram - 1`` ids across a piece boundary; hashing ids is cheap).

The cache is replicated over ``axis``; every rank applies the same writes (the same values at the same
places as the unsharded step), so the cache that comes out is the paged step's, and block payloads
written by a CP prefill equal the unsharded ones (docs/context_parallel.md states the one measured
caveat: XLA:CPU may round a row differently when a matmul has another row count).

``comm_log``: the shapes of the collectives are recorded at trace time (``CommRecord``); the
benchmark compares them with the analytical figure (``analytic_bytes``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from deepinfer_jax.config import LayerRole
from deepinfer_jax.model import kv_cache as kc
from deepinfer_jax.model import mhc
from deepinfer_jax.model.attention import attend_step
from deepinfer_jax.model.deepseek_v41 import _graphdef
from deepinfer_jax.model.layers import matmul_t
from deepinfer_jax.model.paged import (StepInputs, _engram_history, _engram_rows, _Shared, _Step, _store, select_entries,
                                       source_entries, step_meta)
from deepinfer_jax.model.quant import fake_quant_fp8, fake_quant_mxfp4, fake_quant_nvfp4
from deepinfer_jax.model.selected_entries import compact_selection
from deepinfer_jax.parallel.cp_layout import CPLayout

__all__ = ["CPInputs", "CommRecord", "analytic_bytes", "cp_inputs", "cp_prefill", "tail_rows_for"]


class CPInputs(NamedTuple):
    """Device arrays of a ``CPLayout`` (int32 unless noted; cp ranks, L = 2 * piece_len local slots, H tail rows)."""

    positions: jax.Array  # [cp, L]
    valid: jax.Array  # [cp, L] bool
    flat: jax.Array  # [cp, L] offset of the slot's token in the chunk
    tail_at: jax.Array  # [cp, 2, H]
    piece_start: jax.Array  # [2cp]
    piece_end: jax.Array  # [2cp]
    last_slot: jax.Array  # [] local slot of the chunk's last token (on its rank)
    last_rank: jax.Array  # []


class CommRecord(NamedTuple):
    """One collective of a traced CP step: layer, what it carries, bytes one rank receives."""

    layer: int
    what: str
    bytes_received: int


def tail_rows_for(cfg, cache_cfg) -> int:
    """Rows of every piece the ranks exchange: the window halo (``window - 1``) and every ring's capacity."""
    caps = [cfg.sliding_window - 1, cache_cfg.ring_capacity(cfg)]
    caps += [cache_cfg.comp_capacity(cfg.compress_ratio(i)) for i in range(cfg.num_hidden_layers)
             if cfg.layer_role(i) is LayerRole.FULL and cfg.compress_ratio(i) > 1]
    return max(caps)


def cp_inputs(lay: CPLayout) -> CPInputs:
    """The layout as numpy arrays in ``CPInputs`` order (put them on the device with the step's shardings)."""
    rank, slot = lay.last_slot()
    return CPInputs(lay.positions, lay.valid, lay.flat, lay.tail_at, lay.piece_start, lay.piece_end,
                    np.int32(slot), np.int32(rank))


def _nbytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


class _CP(NamedTuple):
    """Per-rank CP metadata inside the shard_map."""

    axis: str
    cp: int
    rank: jax.Array  # [] this rank
    tail_at: jax.Array  # [2, H] local slots of this rank's piece tails
    piece_start: jax.Array  # [2cp]
    piece_end: jax.Array  # [2cp]
    own_start: jax.Array  # [L] start position of each local slot's piece
    own_pieces: jax.Array  # [2] (head, tail) piece ids of this rank
    log: list | None

    def gather(self, tree, layer: int, what: str):
        """All-gather a per-rank pytree with a leading axis; returns [cp, ...]."""
        if self.log is not None:
            self.log.append(CommRecord(layer, what, (self.cp - 1) * _nbytes(tree)))
        return jax.tree.map(lambda a: jax.lax.all_gather(a, self.axis, axis=0, tiled=False), tree)

    def tails(self, rows, layer: int, what: str):
        """The last H rows of every piece (of per-token ``rows`` [L, ...]), gathered: [2cp, H, ...] by piece."""
        h = self.tail_at.shape[1]
        local = jax.tree.map(lambda a: a[self.tail_at.reshape(-1)].reshape(2, h, *a.shape[1:]), rows)
        got = self.gather(local, layer, what)  # [cp, 2, H, ...]
        cp = self.cp
        perm = np.array([p * 2 if p < cp else (2 * cp - 1 - p) * 2 + 1 for p in range(2 * cp)])  # piece -> rank*2+s
        return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:])[perm], got)

    def table_positions(self, h: int):
        """(positions [2cp, H] of the tail tables' rows, whether each row is a token of its piece)."""
        tpos = self.piece_end[:, None] - h + jnp.arange(h)
        return tpos, tpos >= self.piece_start[:, None]


def _window_keys(attn, layer, kv_new, table, cache, m: _Step, c: _CP):
    """As ``paged._window_keys``: own-piece rows locally, earlier pieces' rows from the gathered tails."""
    w = attn.window
    cap = m.cache_cfg.ring_capacity_rows
    h = c.tail_at.shape[1]
    pk = m.pos[:, None] - (w - 1) + jnp.arange(w)  # [L, w]
    in_step = pk >= m.ctx[:, None]
    own = pk >= c.own_start[:, None]
    src = jnp.clip(m.idx[:, None] - (m.pos[:, None] - pk), 0, kv_new.shape[0] - 1)
    piece = jnp.clip(jnp.sum(pk[..., None] >= c.piece_end, -1), 0, 2 * c.cp - 1)
    off = jnp.clip(h - (c.piece_end[piece] - pk), 0, h - 1)
    halo = kc.decode(kc.gather(table, (piece, off)), "fp8", m.quantized)
    ring = kc.decode(kc.gather(cache["swa"], (layer, m.slot[:, None], jnp.mod(pk, cap))), "fp8", m.quantized)
    keys = jnp.where(own[..., None], kv_new[src], jnp.where(in_step[..., None], halo, ring))
    return keys, (pk >= m.floor[:, None]) & m.valid[:, None]


def _ring_write(ring, layer_at: tuple, table, c: _CP, m: _Step, cap: int):
    """Write the gathered tail rows that the unsharded step writes into a per-slot ring (the last ``cap``)."""
    tpos, ok = c.table_positions(c.tail_at.shape[1])
    new, slot = m.inp.new_len[0], m.inp.req_slot[0]
    keep = ok & (tpos >= new - cap)
    at = (*layer_at, jnp.where(keep, slot, m.cache_cfg.max_requests), jnp.mod(tpos, cap))
    return kc.scatter(ring, at, table)


def _compress(attn, x_1Nd, cache, layer, m: _Step):
    """``paged._compress`` without the state write: (latent [L, D], values, gate scores [L, D])."""
    comp = attn.compressor
    r = attn.ratio
    if r == 1:
        return comp(x_1Nd)[0], None, None
    xf = x_1Nd.astype(jnp.float32)
    v, g = comp.wkv(xf)[0], comp.wgate(xf)[0]
    state = cache["comp"][layer]
    cap = state["v"].shape[1]
    vs, gs = [], []
    for k in range(r):
        pk = m.pos - (r - 1) + k
        in_step = (pk >= m.ctx)[:, None]  # past the chunk start: the token's own piece (aligned pieces)
        src = jnp.clip(m.idx - (r - 1 - k), 0)
        vs.append(jnp.where(in_step, v[src], state["v"][m.slot, jnp.mod(pk, cap)]))
        gs.append(jnp.where(in_step, g[src], state["g"][m.slot, jnp.mod(pk, cap)]))
    values, gates = jnp.stack(vs, 1), jax.nn.softmax(jnp.stack(gs, 1), axis=1)
    return comp.norm(jnp.sum(values * gates, axis=1).astype(x_1Nd.dtype)), v, g


def _entries(c: _CP, r: int, piece_len: int):
    """Local slots [2E] of the tokens that complete an entry of ratio r, and whether each is one."""
    e = piece_len // r + 1
    ps, pe = c.piece_start[c.own_pieces], c.piece_end[c.own_pieces]  # [2]
    first = ps + jnp.mod(r - 1 - ps, r)
    pos = first[:, None] + r * jnp.arange(e)  # [2, E]
    ok = pos < pe[:, None]
    at = jnp.clip(jnp.arange(2)[:, None] * piece_len + pos - ps[:, None], 0, 2 * piece_len - 1)
    return at.reshape(-1), ok.reshape(-1)


def _attention_step(attn, layer, x_1Nd, shared: _Shared, cache, m: _Step, cfg, c: _CP):
    """``paged._attention_step`` on one rank's tokens, the cross-rank inputs gathered (see the module)."""
    angles = attn.angles(m.pos)[None]
    q_lat, q = attn.query(x_1Nd, angles)
    stored, kv_new = _store(attn.window_kv(x_1Nd, angles, raw=True)[0], "fp8", fake_quant_fp8, m, cfg.fake_quant)
    table = c.tails(stored, layer, "swa tails")
    keys, valid = _window_keys(attn, layer, kv_new, table, cache, m, c)
    cache = {**cache, "swa": _ring_write(cache["swa"], (layer,), table, c, m, m.cache_cfg.ring_capacity_rows)}
    if not attn.ratio:
        return attn.output(attend_step(q[0], keys, valid, attn.attn_sink[...])[None], angles), shared, cache
    r, bs = attn.ratio, m.cache_cfg.block_size
    tables, n_blocks = m.inp.block_tables, m.cache_cfg.num_blocks
    if attn.role is LayerRole.FULL:
        latent, v, g = _compress(attn, x_1Nd, cache, layer, m)
        if v is not None:
            vg = c.tails({"v": v, "g": g}, layer, "compressor tails")
            state = cache["comp"][layer]
            cap = state["v"].shape[1]
            state = {k: _ring_write(state[k], (), vg[k], c, m, cap) for k in ("v", "g")}
            cache = {**cache, "comp": {**cache["comp"], layer: state}}
        at, ok = _entries(c, r, m.idx.shape[0] // 2)
        j = m.pos[at] // r
        c_angles = attn.angles(j * r)
        g_stored, _ = _store(attn.global_kv(latent[at], c_angles, raw=True), "nvfp4", fake_quant_nvfp4, m,
                             cfg.fake_quant)
        i_stored, _ = _store(attn.indexer.keys(latent[at], c_angles, raw=True), "mxfp4", fake_quant_mxfp4, m,
                             cfg.fake_quant)
        got = c.gather({"kv": g_stored, "index": i_stored, "j": j, "ok": ok}, layer, "compressed entries")
        got = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), got)
        blk = tables[0, (got["j"] * r) // bs]
        done = got["ok"] & (blk >= 0) & (got["j"] * r + r - 1 >= m.write_from[0])
        where = (jnp.where(done, blk, n_blocks), jnp.mod(got["j"] * r, bs) // r)
        glob = cache["global"][layer]
        glob = {"kv": kc.scatter(glob["kv"], where, got["kv"]), "index": kc.scatter(glob["index"], where, got["index"])}
        cache = {**cache, "global": {**cache["global"], layer: glob}}
        shared = source_entries(layer, glob, tables, r, m, shared)
    if attn.role in (LayerRole.FULL, LayerRole.REINDEX):
        shared = select_entries(attn, shared, x_1Nd, q_lat, angles, r, m)
    o = attend_step(q[0], keys, valid, attn.attn_sink[...],
                    *compact_selection(shared.pool_kv, "nvfp4", m.quantized, tables, m.inp.token_req, shared.topk,
                                       kv_new.dtype))
    return attn.output(o[None], angles), shared, cache


def _rank_body(cfg, cache_cfg, axis, cp, log, params, cache, inp: StepInputs, token_ids, positions, valid, rows,
               tail_at, piece_start, piece_end, last_slot):
    """One rank: its 2 * piece_len tokens through every layer; (streams and pre of the last slot, cache)."""
    model = nnx.merge(_graphdef(cfg), params)
    token_ids, positions, valid, tail_at = token_ids[0], positions[0], valid[0], tail_at[0]
    n = token_ids.shape[0]
    rank = jax.lax.axis_index(axis)
    pieces = jnp.asarray(np.array([[r, 2 * cp - 1 - r] for r in range(cp)], np.int32))[rank]
    own_start = piece_start[pieces][jnp.arange(n) // (n // 2)]
    local = inp._replace(token_ids=token_ids, positions=positions, token_req=jnp.zeros(n, jnp.int32),
                         token_valid=valid, logit_rows=jnp.zeros(1, jnp.int32))
    m = step_meta(cfg, cache_cfg, local)
    c = _CP(axis=axis, cp=cp, rank=rank, tail_at=tail_at, piece_start=piece_start, piece_end=piece_end,
            own_start=own_start, own_pieces=pieces, log=log)
    x = model.embed(token_ids)[None]
    streams = jnp.broadcast_to(x[:, :, None, :], (1, n, cfg.hc_mult, cfg.hidden_size))
    pre = jnp.zeros((1, n, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
    shared = _Shared()
    for layer, block in enumerate(model.layers):
        def attend(attn, x, carry, layer=layer):
            out, shared, cache = _attention_step(attn, layer, x, *carry, m, cfg, c)
            return out, (shared, cache)

        streams, pre, (shared, cache), _ = block(streams, pre, (shared, cache), attend,
                                                 engram_rows=None if rows is None else rows, valid=m.valid)
    return streams[:, last_slot][:, None], pre[:, last_slot][:, None], cache


def cp_prefill(params, cfg, cache_cfg, cache, inputs: StepInputs, lay: CPInputs, *, mesh: Mesh, axis: str = "cp",
               comm_log: list | None = None):
    """(logits [1, V] of the chunk's last token, updated cache): ``paged_step`` of the one-request chunk
    ``inputs`` (flat, padded; row 0 is the request) computed over the ``axis`` ranks of ``mesh`` as laid out
    by ``lay``. ``cfg``, ``cache_cfg``, ``mesh``, ``axis`` are static under jit; donate ``cache``."""
    cp = mesh.shape[axis]
    model = nnx.merge(_graphdef(cfg), params)
    m_flat = step_meta(cfg, cache_cfg, inputs)
    flat = lay.flat.reshape(-1)
    token_ids = inputs.token_ids[flat].reshape(lay.flat.shape)
    rows = None
    if cfg.engram_layer_ids:  # hashed from the whole chunk's ids: the look-back crosses piece boundaries
        r_flat = _engram_rows(model, cache, m_flat)  # [1, N, ...]
        rows = r_flat[0][flat].reshape(*lay.flat.shape, *r_flat.shape[2:])
    shard, repl = PartitionSpec(axis), PartitionSpec()
    body = functools.partial(_rank_body, cfg, cache_cfg, axis, cp, comm_log)

    def wrapped(params, cache, inp, token_ids, positions, valid, rows, tail_at, piece_start, piece_end, last_slot):
        rows = None if rows is None else rows[0][None]
        return body(params, cache, inp, token_ids, positions, valid, rows, tail_at, piece_start, piece_end,
                    last_slot)

    run = jax.shard_map(wrapped, mesh=mesh,
                        in_specs=(repl, repl, repl, shard, shard, shard, None if rows is None else shard, shard, repl,
                                  repl, repl),
                        out_specs=(shard, shard, repl), axis_names={axis}, check_vma=False)
    streams, pre, cache = run(params, cache, inputs, token_ids, lay.positions, lay.valid, rows, lay.tail_at,
                              lay.piece_start, lay.piece_end, lay.last_slot)
    s, p = streams[lay.last_rank][None], pre[lay.last_rank][None]  # [1, 1, hc, d]
    h = model.norm(mhc.collapse(s, p))[0]
    logits = matmul_t(h.astype(jnp.float32), model.head.weight[...].astype(jnp.float32))
    if cfg.engram_layer_ids:
        cache = {**cache, "engram": _engram_history(cache, m_flat)}
    return logits, cache


def analytic_bytes(cfg, cache_cfg, lay: CPLayout) -> dict[str, int]:
    """The bytes one rank receives per step by kind, from the layout alone (the benchmark's reference figure):
    per layer ``(cp - 1) * 2 * H`` SWA rows; per FULL layer of ratio r > 1 also ``(cp - 1) * 2 * H`` compressor
    values and gate scores; per FULL layer ``(cp - 1) * 2 * (piece_len // r + 1)`` compressed entries."""
    qz = cache_cfg.storage == "quantized"
    d, hd, cp, h, p = cfg.head_dim, cfg.index_head_dim, lay.cp, lay.tail_rows, lay.piece_len

    def row(fmt, ch):
        if not qz:
            return 4 * ch
        group = {"fp8": 32, "nvfp4": 16, "mxfp4": 32}[fmt]
        return (ch if fmt == "fp8" else ch // 2) + ch // group

    out = {"swa tails": 0, "compressor tails": 0, "compressed entries": 0}
    for i in range(cfg.num_hidden_layers):
        out["swa tails"] += (cp - 1) * 2 * h * row("fp8", d)
        if cfg.layer_role(i) is LayerRole.FULL:
            r = cfg.compress_ratio(i)
            if r > 1:
                out["compressor tails"] += (cp - 1) * 2 * h * 2 * 4 * d
            out["compressed entries"] += (cp - 1) * 2 * (p // r + 1) * (row("nvfp4", d) + row("mxfp4", hd) + 4 + 1)
    return out
