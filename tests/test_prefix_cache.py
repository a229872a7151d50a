"""Prefix cache, host side: block digests (golden vectors), the pool's content index, the hit rule."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from deepinfer_jax.cache import BlockPool, OutOfBlocks
from deepinfer_jax.cache.block_hash import ROOT_DIGEST, block_digests, extra_keys, model_fingerprint
from deepinfer_jax.cache.swa_snapshots import SwaSnapshotStore, hit_length, prefill_snapshot_position

FP = model_fingerprint({"a": 1, "b": [2, 3]}, [("w", np.arange(6, dtype=np.float32).reshape(2, 3))])


def test_golden_digests():
    assert FP.hex() == "73b262f13c94ccde72d605503d684b1b9b5545ee1fef2ef465e449e6011ffb52"
    assert [d.hex() for d in block_digests(list(range(10)), 4, extra_keys(FP, "salt"))] == [
        "9e0591eb4c2836fba22e49ead9934413ef382437fd58a9f74bc8b7436dfb954c",
        "3831495a621b2fe53e164dbe293ef87b5a0f7b885a186c3b5678c11744f07346"]
    assert [d.hex() for d in block_digests(list(range(10)), 4, extra_keys(FP))] == [
        "36481489684a56d15c9168bb7e06debcb351b526d7bca73420f8f69f4c75afd2",
        "ed2bda47784c881710b5622f1534a04ec5a2a8923764ed1d22cd936ef47757bb"]


def test_digests_chain_and_bind_the_model_and_salt():
    e = extra_keys(FP)
    ids = list(range(3, 40))
    full = block_digests(ids, 8, e)
    assert len(full) == 4 and len(set(full)) == 4
    assert block_digests(ids, 8, e, parent=full[1], start_block=2) == full[2:]  # incremental = whole
    changed = ids.copy()
    changed[2] += 1  # a change in block 0 changes every later digest (chained)
    assert all(a != b for a, b in zip(full, block_digests(changed, 8, e)))
    other = model_fingerprint({"a": 1, "b": [2, 3]}, [("w", np.arange(6, dtype=np.float32).reshape(2, 3) + 1)])
    assert block_digests(ids, 8, extra_keys(other))[0] != full[0]
    assert block_digests(ids, 8, extra_keys(FP, "tenant"))[0] != full[0]
    assert ROOT_DIGEST == bytes(32)


def test_digests_are_identical_in_another_process():
    code = ("from deepinfer_jax.cache.block_hash import *; import numpy as np; "
            "fp = model_fingerprint({'a': 1, 'b': [2, 3]}, [('w', np.arange(6, dtype=np.float32).reshape(2, 3))]); "
            "print(block_digests(list(range(10)), 4, extra_keys(fp, 'salt'))[1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.strip()
    assert out == block_digests(list(range(10)), 4, extra_keys(FP, "salt"))[1].hex()


def test_pool_index_evicts_only_unreferenced_blocks_lru():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.register(a[0], b"d0")
    pool.register(a[1], b"d1")
    assert not pool.register(a[1], b"d1x") and not pool.register(a[0], b"d1")
    assert pool.lookup([b"d0", b"d1", b"d2"]) == a and pool.lookup([b"d1"]) == [a[1]] and pool.lookup([b"x"]) == []
    pool.decref([a[1]])  # free but still indexed
    assert pool.num_cached == 2 and pool.free_count == 3
    new = pool.allocate(2)  # never-used blocks first (freed longer ago), the cached one survives
    assert a[1] not in new and pool.lookup([b"d0", b"d1"]) == a
    pool.acquire([a[1]])  # revived from the free list
    assert pool.refcount(a[1]) == 1 and pool.free_count == 0
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)  # a[0] and a[1] are in use: never evicted
    pool.decref([a[1]])
    pool.decref([a[0]])
    pool.decref(new)
    got = pool.allocate(3)  # LRU over free blocks: the first freed goes first, cached or not
    assert got == [a[1], a[0], new[0]] and pool.evictions == 2 and pool.lookup([b"d0"]) == []
    with pytest.raises(ValueError, match="not indexed"):
        pool.acquire([new[0]])


def test_prefill_snapshot_position():
    assert [prefill_snapshot_position(n, 128) for n in (1, 128, 129, 256, 257, 8500)] == [0, 0, 128, 128, 256, 8448]


@pytest.mark.parametrize("length, cached, swa, replay, want", [
    (100, 5, {128}, False, (0, False)),  # short prompt: no block can be hit
    (134 + 128, 9, {128}, False, (128, False)),  # L1 = 128 exactly at the limit L - 134
    (134 + 127, 9, {128}, False, (0, False)),  # one token short of it
    (8500, 100, {8320}, False, (8320, False)),  # SWA present at L1
    (8500, 100, {8192}, False, (8192, False)),  # SWA missing at L1: the last block is recomputed
    (8500, 100, set(), True, (8320, True)),  # ... or bounded replay
    (8500, 100, {4096}, False, (4096, False)),  # nothing near: the nearest exact state below
    (8500, 3, {384, 8320}, False, (384, False)),  # a missing middle block caps L1 at the cached prefix
    (8500, 3, set(), False, (0, False)),  # ... and no exact window anywhere: nothing to reuse
    (8500, 3, {256}, False, (256, False)),  # L1 - 128 with its window
])
def test_hit_rule_edges(length, cached, swa, replay, want):
    d = hit_length(length, 128, 134, cached, lambda p: p in swa, encoder_replay=replay)
    assert (d.length, d.approximate) == want


def test_snapshot_store_is_lru_bounded():
    s = SwaSnapshotStore(2)
    s.put(b"a", 1)
    s.put(b"b", 2)
    assert s.get(b"a") == 1
    s.put(b"c", 3)
    assert b"b" not in s and b"a" in s and b"c" in s and s.evicted == 1
    with pytest.raises(ValueError):
        SwaSnapshotStore(-1)
