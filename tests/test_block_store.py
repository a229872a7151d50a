"""The host and file-system block tiers: round trips, damaged files are misses, concurrent writers."""

from __future__ import annotations

import logging
import threading

import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.cache.block_store import FileBlockStore, HostBlockStore, StoreError
from deepinfer_jax.engine.request import CacheState

FP = bytes(range(32))


def payload(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"[0]['kv']['values']": rng.normal(size=(8, 16)).astype(ml_dtypes.float8_e4m3fn),
            "[0]['kv']['scales']": rng.integers(0, 255, (8, 1)).astype(np.uint8),
            "[1]['index']": rng.normal(size=(8, 4)).astype(np.float32)}


def same(a, b):
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k].view(np.uint8),
                                                                                   b[k].view(np.uint8)) for k in a)


def test_file_round_trip_and_misses(tmp_path, caplog):
    store = FileBlockStore(tmp_path, FP)
    d = bytes([7]) * 32
    assert store.get(d) is None and d not in store
    store.put(d, payload(0))
    assert d in store and same(store.get(d), payload(0))
    assert same(FileBlockStore(tmp_path, FP).get(d), payload(0))  # another engine / a restart
    assert FileBlockStore(tmp_path, bytes(32)).get(d) is None  # another model: a miss (and quarantined)
    assert d not in store
    store.put(d, payload(0))
    path = store._path(d)
    data = path.read_bytes()
    for damaged in (data[: len(data) // 2], data[:-1] + bytes([data[-1] ^ 1]),
                    data[:40] + bytes([data[40] ^ 0xFF]) + data[41:], b""):
        path.write_bytes(damaged)
        with caplog.at_level(logging.WARNING):
            assert store.get(d) is None
    assert store.misses_corrupt == 4 and "treated as a miss" in caplog.text
    assert not list(tmp_path.rglob(".tmp-*"))


def test_concurrent_writers_never_corrupt(tmp_path):
    stores = [FileBlockStore(tmp_path, FP) for _ in range(4)]
    digests = [bytes([i]) * 32 for i in range(12)]

    def work(s):
        for i, d in enumerate(digests):
            s.put(d, payload(i))

    threads = [threading.Thread(target=work, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(same(stores[0].get(d), payload(i)) for i, d in enumerate(digests))
    assert not list(tmp_path.rglob(".tmp-*"))


def test_unusable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match="not writable"):
        FileBlockStore(blocker / "store", FP)


def test_host_tier_is_lru_bounded_by_bytes():
    size = sum(a.nbytes for a in payload(0).values())
    host = HostBlockStore(max_bytes=2 * size)
    for i in range(3):
        host.put(bytes([i]) * 32, payload(i))
    assert len(host) == 2 and bytes([0]) * 32 not in host and host.nbytes == 2 * size
    assert same(host.get(bytes([2]) * 32), payload(2))


def test_a_block_that_failed_verification_is_quarantined_and_rewritten(tmp_path):
    store = FileBlockStore(tmp_path, FP)
    digests = [bytes([i]) * 32 for i in range(20)]
    for i, d in enumerate(digests):
        store.put(d, payload(i))
        path = store._path(d)
        data = path.read_bytes()
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # a flipped checksum bit
    assert all(store.get(d) is None for d in digests)  # misses ...
    assert store.misses_corrupt == 20 and store.quarantined == 20
    assert len(list((store.root / "quarantine").iterdir())) == 20
    for i, d in enumerate(digests):  # ... recomputed and written back: the store heals
        store.put(d, payload(i))
    assert all(same(store.get(d), payload(i)) for i, d in enumerate(digests))
    assert store.misses_corrupt == 20


class _Req:
    """The fields of ``engine.Request`` that ``PrefixCache.match`` reads."""

    def __init__(self, ids):
        self.prompt_ids, self.output_ids, self.cache = list(ids), [], CacheState()

    @property
    def num_tokens(self):
        return len(self.prompt_ids)

    def known_tokens(self, start, stop):
        return self.prompt_ids[start:stop]


def _prefix(tmp_path, host=True, files=True):
    from deepinfer_jax.cache import BlockPool
    from deepinfer_jax.engine.prefix_cache import PrefixCache

    return PrefixCache(BlockPool(16), 4, 4, b"extra", host=HostBlockStore() if host else None,
                       files=FileBlockStore(tmp_path, FP) if files else None, encoder_replay=True)


def test_prefix_stats_count_tier_hits_and_miss_reasons(tmp_path):
    ids = list(range(100, 120))  # 5 blocks of 4; at most 4 reusable (ring rows 4)
    pc = _prefix(tmp_path)
    r = _Req(ids)
    pc.match(r)
    pc.record_admitted()
    assert pc.stats()["miss_reasons"]["no_cached_blocks"] == 1 and pc.stats()["hits"] == 0
    d = pc.digests(r)
    blocks = pc.pool.allocate(1)
    pc.pool.register(blocks[0], d[0])  # block 0 on the device
    pc.host.put(d[1], payload(1))  # block 1 in host memory
    pc.files.put(d[2], payload(2))  # blocks 2 and 3 on disk
    pc.files.put(d[3], payload(3))
    pc.prefetch(d[:3])  # the background prefetch brings block 2 into host memory: still a file hit
    decision, cached, uploads = pc.match(_Req(ids))
    pc.record_admitted()
    assert decision.length == 16 and len(cached) == 1 and len(uploads) == 3
    s = pc.stats()
    assert s["tier_hits"] == {"device": 1, "host": 1, "file": 2} and s["hits"] == 1 and s["hit_tokens"] == 16
    pc.match(_Req(ids[:5]))  # one full block before the window: nothing usable
    pc.record_admitted()
    assert pc.stats()["miss_reasons"]["prompt_too_short"] == 1


def test_prefix_miss_reasons_corrupt_block_and_missing_window(tmp_path):
    ids = list(range(200, 220))
    pc = _prefix(tmp_path)
    d = pc.digests(_Req(ids))
    pc.files.put(d[0], payload(0))
    path = pc.files._path(d[0])
    path.write_bytes(path.read_bytes()[:-3])
    pc.prefetch(d)  # the background prefetch meets the damaged file first
    pc.match(_Req(ids))
    pc.record_admitted()
    assert pc.stats()["miss_reasons"]["corrupt_block"] == 1 and pc.stats()["quarantined_files"] == 1
    pc.encoder_replay = False  # a restarted engine: blocks on disk, windows gone
    pc.files.put(d[0], payload(0))
    pc.match(_Req(ids))
    pc.record_admitted()
    assert pc.stats()["miss_reasons"]["no_swa_window"] == 1 and pc.stats()["tier_hits"]["file"] == 0
