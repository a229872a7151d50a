"""The host and file-system block tiers: round trips, damaged files are misses, concurrent writers."""

from __future__ import annotations

import logging
import threading

import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.cache.block_store import FileBlockStore, HostBlockStore, StoreError

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
    assert FileBlockStore(tmp_path, bytes(32)).get(d) is None  # another model: a miss
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
