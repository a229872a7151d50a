"""The paged step's indexer scoring and top-k, in token tiles for long steps (memory-bounded selection).

Scoring a flat step of ``N`` tokens against ``E`` entries builds, per FULL / REINDEX layer, the scores
[N, E] and the selection's masks [N, E]; the reference scoring (``ops/indexer_topk/reference``) also
gathers each token's request keys, [N, E, hd]. For one long prefill chunk ``E`` grows with ``N`` (a
ratio-1 layer has ``E = N``), so these intermediates grow as ``N^2``: at 8K tokens the gathered keys
of the 5-layer test model are 8.6 GB per ratio-1 layer, and moving them, not the FLOPs, is the cost.

Above a per-tile budget the step therefore scores and selects ``tile`` tokens at a time
(``jax.lax.map`` over the padded token axis): nothing larger than [tile, E, hd] exists, and the [N, E]
arrays that remain are the boolean candidate pool the candidate source hands to later REINDEX layers
(part of the step's cross-layer state). On the reference path a tile whose tokens all belong to one
request (all of a long chunk's tiles but the one or two at its ends) is scored by one matmul against
that request's keys, [tile * nh, hd] x [hd, E], instead of gathering each token's copy of them; only a
tile that straddles requests gathers ([tile, E, hd]). The kernel paths take the keys as they are.

Why tiles rather than one matmul per request over the whole step: a step may mix any number of
requests, and the matmul against one request's keys is only valid for that request's tokens; tiles make
the common case (a long chunk) a matmul while the mixed tiles keep the per-token contract of
``indexer_scores``. Every op in the tile body is row-wise in the token (its scores, ``top_k``, the
candidate blocks), so each token's row is computed from the same values as in the untiled path; the
matmul branch forms each (token, head, entry) dot over the same ``hd`` products as the gathered batched
dot, and XLA:CPU rounds the two alike. That last point is measured, not promised by XLA:
tests/test_index_tiles.py forces tiles of 8 tokens (mixed and single-request) and compares top-k ids,
candidate pools, logits and every cache leaf with the untiled step byte for byte.

The tile is a static function of ``E`` and the key width: the largest ``tile`` with
``tile * E * hd <= TILE_BUDGET`` (at least ``MIN_TILE``). Steps of at most one tile (decode, short
prefill) run the untiled code and compile exactly as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.ops import dispatch
from deepinfer_jax.ops.indexer_topk import indexer_scores
from deepinfer_jax.ops.indexer_topk.reference import combine

TILE_BUDGET = 1 << 26  # tile * E * hd: a straddling tile's gathered fp32 keys [tile, E, hd] (256 MiB)
MIN_TILE = 8


def tile_for(n_entries: int, head_dim: int, budget: int | None = None) -> int:
    """Tokens per tile (static): the largest with ``tile * E * hd <= budget``, at least ``MIN_TILE``."""
    budget = TILE_BUDGET if budget is None else budget
    return max(MIN_TILE, budget // max(1, n_entries * head_dim))


def select_tokens(attn, q_lat, x_1Nd, angles, index_RED, token_req, n_visible, candidates,
                  budget: int | None = None):
    """(top-k ids [N, k], candidate pool [N, E] or ``candidates`` passed through) of the flat step's tokens.

    index_RED [R, E, hd]: every request row's decoded index keys; token_req [N]; n_visible [N] (entries
    ``e < n_visible`` are visible); candidates [N, E] bool or None (the source layer's pool).
    """
    n, e = x_1Nd.shape[1], index_RED.shape[1]
    tile = tile_for(e, index_RED.shape[2], budget)
    if n <= tile:  # the untiled path, op for op
        visible = jnp.arange(e) < n_visible[:, None]
        scores = attn.indexer.scores_per_token(x_1Nd, q_lat, angles, index_RED[token_req], visible)
        return attn.select(scores, n_visible, visible, candidates)
    q, w = attn.indexer.query(x_1Nd, q_lat, angles)

    def one(q_t, w_t, req_t, nv_t, cand_t):
        visible = jnp.arange(e) < nv_t[:, None]
        scores = _tile_scores(q_t, w_t, index_RED, req_t, visible)
        return attn.select(scores, nv_t, visible, cand_t)

    pad = -n % tile

    def tiles(a):
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(-1, tile, *a.shape[1:])

    # padding rows: request 0, nothing visible (all scores -inf, top-k all -1), no candidates; sliced off below
    xs = (tiles(q[0]), tiles(w[0]), tiles(token_req), tiles(n_visible),
          None if candidates is None else tiles(candidates))
    topk, cand = jax.lax.map(lambda a: one(*a), xs)
    untile = lambda a: a.reshape(-1, *a.shape[2:])[:n]  # noqa: E731
    return untile(topk), None if cand is None else untile(cand)


def _tile_scores(q_THK, w_TH, keys_REK, req_T, visible_TE):
    """One tile's scores [T, E]. On the reference path a tile whose tokens all belong to one request
    (every tile of a long chunk but those at its ends) is one matmul against that request's keys; a tile
    that straddles requests gathers each token's keys ([T, E, hd]). The kernels take the keys as they are."""
    if not dispatch.uses_reference():
        return indexer_scores(q_THK, w_TH, keys_REK, req_T, visible_TE)

    def one_request():
        dots = jnp.einsum("nhk,ek->nhe", q_THK.astype(jnp.float32), keys_REK[req_T[0]].astype(jnp.float32))
        return combine(dots, w_TH.astype(jnp.float32), visible_TE)

    return jax.lax.cond(jnp.all(req_T == req_T[0]), one_request,
                        lambda: indexer_scores(q_THK, w_TH, keys_REK, req_T, visible_TE))
