"""Content digests of KV blocks (engine.md §1.1): chained, canonical, identical across processes.

A full block's digest is ``sha256(TAG || parent digest || extra || token ids as little-endian
uint32)``; the first block's parent is 32 zero bytes. ``extra`` binds the digest to what else
decides the block's contents: the model fingerprint (config + weights) and an optional cache
salt, each length-prefixed. Never Python's ``hash`` (randomised per process).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np

__all__ = ["ROOT_DIGEST", "block_digests", "extra_keys", "model_fingerprint"]

ROOT_DIGEST = bytes(32)
_TAG = b"deepinfer-jax/block/v1"


def _lp(b: bytes) -> bytes:
    return len(b).to_bytes(8, "little") + b


def model_fingerprint(config_dict: dict, leaves: Sequence[tuple[str, np.ndarray]] = ()) -> bytes:
    """sha256 over the canonical JSON of the model config and, in name order, every weight's name,
    dtype, shape and bytes. Two engines share cache blocks only when this matches."""
    h = hashlib.sha256(b"deepinfer-jax/model/v1")
    h.update(_lp(json.dumps(config_dict, sort_keys=True, separators=(",", ":"), default=str).encode()))
    for name, arr in sorted(leaves, key=lambda kv: kv[0]):
        a = np.ascontiguousarray(arr)
        h.update(_lp(name.encode()) + _lp(str(a.dtype).encode()) + _lp(repr(a.shape).encode()))
        h.update(a.nbytes.to_bytes(8, "little"))  # = _lp(a.tobytes()), without copying the weight twice
        h.update(a.reshape(-1).view(np.uint8))
    return h.digest()


def extra_keys(fingerprint: bytes, cache_salt: str | None = None) -> bytes:
    """The ``extra`` bytes of every digest: model fingerprint + salt, each length-prefixed."""
    return _lp(fingerprint) + _lp((cache_salt or "").encode())


def block_digests(token_ids: Sequence[int], block_size: int, extra: bytes, parent: bytes = ROOT_DIGEST,
                  start_block: int = 0) -> list[bytes]:
    """Digests of the full blocks of ``token_ids`` from block ``start_block`` on, chained from
    ``parent`` (the digest of block ``start_block - 1``, or ``ROOT_DIGEST``)."""
    ids = np.asarray(token_ids, dtype="<u4")
    out = []
    for k in range(start_block, len(ids) // block_size):
        parent = hashlib.sha256(_TAG + parent + extra + ids[k * block_size : (k + 1) * block_size].tobytes()).digest()
        out.append(parent)
    return out
