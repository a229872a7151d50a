"""Where each token of a context-parallel (CP) prefill chunk runs: a pure host-side position layout.

A chunk of ``length`` tokens at positions ``start .. start + length - 1`` is cut into ``2 * cp`` pieces
of about equal length; rank ``r`` runs piece ``r`` (its *head*) and piece ``2 * cp - 1 - r`` (its *tail*).
Under causal attention a token's work grows with its position, so pairing an early piece with a late
one gives every rank about the same number of (query, visible key) pairs (the zig-zag pairing).

Every boundary between two pieces is a multiple of ``align`` (absolute position): with ``align`` the
least common multiple of the model's compression ratios, no compressor group straddles two pieces, so
each entry is pooled from one rank's rows alone. Only the first piece may start mid-group (a chunk after
a prefix hit); it reads the cached compressor state exactly as an ordinary step does.

Each rank's two pieces are padded to one length ``piece_len`` (the longest piece), so rank ``r`` holds
``2 * piece_len`` local token slots: ``[head piece, padding, tail piece, padding]``. ``tail_rows`` is how
many of the last rows of every piece the ranks exchange per layer: the sliding-window halo
(``window - 1`` rows) and the rows that end in the per-request rings (SWA rows, compressor state), which
only the pieces that hold the chunk's last positions contribute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["CPLayout", "cp_align", "cp_layout"]


def cp_align(cfg) -> int:
    """The piece alignment of a model: the lcm of its compression ratios above 1 (1 if none)."""
    ratios = [cfg.compress_ratio(i) for i in range(cfg.num_hidden_layers)]
    return math.lcm(1, *[r for r in ratios if r > 1])


@dataclass(frozen=True)
class CPLayout:
    """The layout of one chunk over ``cp`` ranks (numpy, host only).

    piece_start / piece_end [2cp]: absolute positions of every piece (end exclusive; empty pieces allowed);
    rank_pieces [cp, 2]: (head, tail) piece of each rank; positions / valid / flat [cp, 2 * piece_len]:
    each local slot's position, whether it holds a token, and its offset in the chunk (0 for padding);
    tail_at [cp, 2, tail_rows]: the local slots of the last ``tail_rows`` rows of each of a rank's pieces
    (clipped into the piece's slots; rows before the piece start are never read).
    """

    cp: int
    start: int
    length: int
    align: int
    piece_len: int
    tail_rows: int
    piece_start: np.ndarray
    piece_end: np.ndarray
    rank_pieces: np.ndarray
    positions: np.ndarray
    valid: np.ndarray
    flat: np.ndarray
    tail_at: np.ndarray

    @property
    def local_len(self) -> int:
        return 2 * self.piece_len

    def owner(self, piece: int) -> tuple[int, int]:
        """(rank, local piece 0 = head / 1 = tail) of a piece."""
        return (piece, 0) if piece < self.cp else (2 * self.cp - 1 - piece, 1)

    def last_slot(self) -> tuple[int, int]:
        """(rank, local slot) of the chunk's last token (its logits are the step's)."""
        pos = self.start + self.length - 1
        hit = np.argwhere(self.valid & (self.positions == pos))
        return int(hit[0, 0]), int(hit[0, 1])

    def tokens_per_rank(self) -> np.ndarray:
        return self.valid.sum(axis=1)

    def attention_pairs_per_rank(self, window: int | None = None) -> np.ndarray:
        """Per rank, the sum over its tokens of the keys each sees within the chunk (causal; ``window``: at
        most that many): the load the zig-zag pairing balances."""
        seen = self.positions - self.start + 1
        if window is not None:
            seen = np.minimum(seen, window)
        return np.where(self.valid, seen, 0).sum(axis=1)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def cp_layout(start: int, length: int, cp: int, align: int = 1, tail_rows: int = 1, multiple: int = 1) -> CPLayout:
    """The zig-zag layout of ``length`` tokens from position ``start`` over ``cp`` ranks (see the module).

    ``multiple``: ``piece_len`` is rounded up to a multiple of it (fewer distinct compiled shapes);
    ``tail_rows``: rows exchanged per piece, clipped to ``piece_len``.
    """
    for name, v, low in (("start", start, 0), ("length", length, 1), ("cp", cp, 1), ("align", align, 1),
                         ("tail_rows", tail_rows, 1), ("multiple", multiple, 1)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < low:
            raise ValueError(f"cp_layout: {name} must be an int >= {low}, got {v!r}")
    n = 2 * cp
    end = start + length
    bounds = [start]
    for k in range(1, n):
        b = _round_up(start + (k * length) // n, align)
        bounds.append(min(max(b, bounds[-1]), end))
    bounds.append(end)
    ps, pe = np.array(bounds[:-1], np.int64), np.array(bounds[1:], np.int64)
    piece_len = _round_up(max(1, int((pe - ps).max())), multiple)
    h = min(tail_rows, piece_len)
    rank_pieces = np.array([[r, n - 1 - r] for r in range(cp)], np.int32)
    positions = np.zeros((cp, 2 * piece_len), np.int32)
    valid = np.zeros((cp, 2 * piece_len), bool)
    flat = np.zeros((cp, 2 * piece_len), np.int32)
    tail_at = np.zeros((cp, 2, h), np.int32)
    for r in range(cp):
        for s, p in enumerate(rank_pieces[r]):
            k = int(pe[p] - ps[p])
            lo = s * piece_len
            positions[r, lo : lo + k] = np.arange(ps[p], pe[p])
            positions[r, lo + k : lo + piece_len] = pe[p]  # padding: past the piece, never a real position
            valid[r, lo : lo + k] = True
            flat[r, lo : lo + k] = np.arange(ps[p], pe[p]) - start
            tail_at[r, s] = np.clip(lo + k - h + np.arange(h), lo, lo + piece_len - 1)
    return CPLayout(cp=cp, start=start, length=length, align=align, piece_len=piece_len, tail_rows=h,
                    piece_start=ps.astype(np.int32), piece_end=pe.astype(np.int32), rank_pieces=rank_pieces,
                    positions=positions, valid=valid, flat=flat, tail_at=tail_at)
