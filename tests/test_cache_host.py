"""Host cache bookkeeping: CacheConfig sizes (engine.md §1, model.md §4.8/§5), the block pool and
request block tables."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from deepinfer_jax.cache import BlockPool, OutOfBlocks, RequestBlocks
from deepinfer_jax.config import CacheConfig, ModelConfig

V41 = ModelConfig()
TINY = ModelConfig.tiny()


def _cache(**changes) -> CacheConfig:
    return CacheConfig(**{"num_blocks": 16, "max_requests": 2, "max_blocks_per_request": 4, **changes})


# ---- CacheConfig: validation ----------------------------------------------------------------


def test_defaults_and_hashable():
    c = _cache()
    assert (c.block_size, c.spec_slack, c.storage) == (128, 6, "quantized")
    assert hash(c) == hash(_cache()) and c == _cache()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_blocks = 3  # type: ignore[misc]


@pytest.mark.parametrize("field", ["block_size", "num_blocks", "max_requests", "max_blocks_per_request"])
@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "8", None])
def test_positive_int_fields(field, bad):
    with pytest.raises(ValueError, match=field):
        _cache(**{field: bad})


@pytest.mark.parametrize("bad", [-1, 1.5, False])
def test_spec_slack(bad):
    with pytest.raises(ValueError, match="spec_slack"):
        _cache(spec_slack=bad)
    assert _cache(spec_slack=0).ring_capacity(TINY) == TINY.sliding_window


@pytest.mark.parametrize("bad", ["fp8", "", None])
def test_storage(bad):
    with pytest.raises(ValueError, match="storage"):
        _cache(storage=bad)


def test_numpy_ints_accepted():
    c = _cache(num_blocks=np.int64(5))
    assert c.num_blocks == 5 and type(c.num_blocks) is int


def test_validate_for_compress_ratios():
    _cache(block_size=128).validate_for(V41)
    _cache(block_size=2).validate_for(TINY)  # tiny has ratios 2 and 1
    with pytest.raises(ValueError, match="block_size"):
        _cache(block_size=3).validate_for(TINY)
    four = TINY.replace(compress_ratios=(0, 0, 4, 4, 4, 4, 1, 1, 1, 1, 1, 1, 0, 0, 0))
    _cache(block_size=8).validate_for(four)
    with pytest.raises(ValueError, match="block_size"):
        _cache(block_size=6).validate_for(four)
    # ratios past the backbone (a truncated prefix) do not count
    _cache(block_size=3).validate_for(TINY.replace(num_hidden_layers=2, dspark_target_layer_ids=(1,)))


# ---- CacheConfig: V4.1 byte sizes -----------------------------------------------------------


def test_v41_global_block_bytes():
    c = _cache()
    assert c.main_entry_bytes(V41) == 288 and c.index_key_bytes(V41) == 68
    assert [c.entries_per_block(V41, s) for s in V41.kv_source_layer_ids] == [64, 64, 64, 128]
    assert c.global_bytes_per_block(V41) == 113_920 == 128 * 890
    assert c.global_bytes_per_block(V41) / c.block_size == 890 == V41.global_cache_bytes_per_token


def test_v41_per_request_bytes():
    c = _cache()
    assert c.swa_row_bytes(V41) == 528 == V41.swa_row_bytes
    assert c.ring_capacity(V41) == 134
    swa = 40 * 134 * 528
    compressor = 3 * (2 + 6) * 2 * 512 * 4  # layers 2, 8, 14 (ring of r + slack); layer 20 (ratio 1) keeps none
    engram = (3 + 6) * 4
    assert c.swa_bytes_per_request(V41) == swa
    assert c.compressor_state_bytes_per_request(V41) == compressor
    assert c.engram_state_bytes_per_request(V41) == engram
    assert c.bytes_per_request(V41) == swa + compressor + engram == 2_928_420


def test_v41_dequantized_bytes():
    c = _cache(storage="dequantized")
    assert c.global_bytes_per_block(V41) == (64 * 3 + 128) * 4 * (512 + 128)
    assert c.swa_row_bytes(V41) == 2048
    assert c.bytes_per_request(V41) == 40 * 134 * 2048 + 3 * 8 * 2 * 512 * 4 + 9 * 4


def test_entries_per_block_swa_layer_rejected():
    with pytest.raises(ValueError, match="layer 0"):
        _cache().entries_per_block(V41, 0)


def test_tiny_sizes_by_hand():
    c = _cache(block_size=16)
    # tiny: head_dim 32, index_head_dim 32; sources 2 (r2), 4 (r2), 6 (r1)
    entry = (16 + 2) + (16 + 1)
    assert c.global_bytes_per_block(TINY) == (8 + 8 + 16) * entry == 1120
    # 12 layers x (8 + 6) rows x 33 B + 2 sources x (2 + 6) x 2 x 32 x 4 + (3 - 1 + 6) x 4
    assert c.bytes_per_request(TINY) == 12 * 14 * 33 + 2 * 8 * 256 + 8 * 4 == 9672
    assert c.tokens_capacity() == 4 * 16


def test_sizes_without_engram_or_sources():
    no_engram = TINY.replace(engram_layer_ids=(), engram_num_embeddings=())
    assert _cache().engram_state_bytes_per_request(no_engram) == 0
    # a 2-layer prefix has no KV source inside the backbone: blocks cost nothing
    prefix = TINY.replace(num_hidden_layers=2, dspark_target_layer_ids=(1,))
    assert _cache().global_bytes_per_block(prefix) == 0
    assert _cache().compressor_state_bytes_per_request(prefix) == 0


# ---- CacheConfig.from_memory_budget ---------------------------------------------------------


def test_from_memory_budget_tiny_by_hand():
    # per request 9672 B, per 16-token block 1120 B; 3 slots = 29016 B
    c = CacheConfig.from_memory_budget(TINY, 29016 + 10 * 1120 + 1119, max_requests=3, block_size=16,
                                       max_model_len=100)
    assert c.max_blocks_per_request == 7  # ceil(100 / 16)
    assert c.num_blocks == 10
    assert (c.max_requests, c.block_size, c.spec_slack, c.storage) == (3, 16, 6, "quantized")
    assert c.total_bytes(TINY) <= 29016 + 10 * 1120 + 1119


def test_from_memory_budget_exactly_one_request():
    need = 2 * 9672 + 7 * 1120
    c = CacheConfig.from_memory_budget(TINY, need, max_requests=2, block_size=16, max_model_len=112)
    assert c.num_blocks == c.max_blocks_per_request == 7
    with pytest.raises(ValueError, match="budget_bytes"):
        CacheConfig.from_memory_budget(TINY, need - 1, max_requests=2, block_size=16, max_model_len=112)
    with pytest.raises(ValueError, match="budget_bytes"):  # not even the request slots fit
        CacheConfig.from_memory_budget(TINY, 100, max_requests=2, block_size=16, max_model_len=112)


def test_from_memory_budget_v41():
    c = CacheConfig.from_memory_budget(V41, 80 * 2**30, max_requests=64, max_model_len=1 << 20)
    assert c.max_blocks_per_request == 8192
    assert c.num_blocks == (80 * 2**30 - 64 * 2_928_420) // 113_920


def test_from_memory_budget_rejects_bad_arguments():
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig.from_memory_budget(TINY, 10**9, max_requests=1, block_size=3, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        CacheConfig.from_memory_budget(TINY, 10**9, max_requests=1, max_model_len=0)
    with pytest.raises(ValueError, match="budget_bytes"):
        CacheConfig.from_memory_budget(TINY, -5, max_requests=1, max_model_len=64)
    with pytest.raises(ValueError, match="max_requests"):
        CacheConfig.from_memory_budget(TINY, 10**9, max_requests=0, max_model_len=64)
    with pytest.raises(ValueError, match="storage"):
        CacheConfig.from_memory_budget(TINY, 10**9, max_requests=1, max_model_len=64, storage="x")


# ---- BlockPool ------------------------------------------------------------------------------


def test_pool_basics_fifo():
    pool = BlockPool(4)
    assert (pool.num_blocks, pool.free_count, pool.used_count) == (4, 4, 0)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.free_count == 1 and all(pool.refcount(b) == 1 for b in a)
    assert pool.allocate(0) == []
    assert pool.decref([1]) == [1]
    assert pool.allocate(2) == [3, 1]  # FIFO: the longest-free block first


def test_pool_out_of_blocks_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(OutOfBlocks) as err:
        pool.allocate(2)
    assert (err.value.requested, err.value.free) == (2, 1)
    assert isinstance(err.value, RuntimeError)
    assert pool.free_count == 1 and pool.allocate(1) == [2]


def test_pool_refcounts():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.incref([b, b])
    assert pool.refcount(b) == 3
    assert pool.decref([b, b]) == []
    assert pool.decref([b]) == [b] and pool.refcount(b) == 0 and pool.free_count == 3


def test_pool_bad_ids_change_nothing():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    with pytest.raises(ValueError, match="block"):
        pool.decref([a, 2])  # 2 is free
    with pytest.raises(ValueError, match="block"):
        pool.decref([a, a])  # only one holder
    for bad in (-1, 3, 1.0, True, "0"):
        with pytest.raises(ValueError, match="block_id"):
            pool.decref([a, bad])
        with pytest.raises(ValueError, match="block_id"):
            pool.incref([a, bad])
        with pytest.raises(ValueError, match="block_id"):
            pool.refcount(bad)
    with pytest.raises(ValueError, match="block"):
        pool.incref([a, 2])  # a free block is revived only by allocate
    assert [pool.refcount(i) for i in range(3)] == [1, 1, 0] and pool.free_count == 1
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    with pytest.raises(ValueError, match="n "):
        pool.allocate(-1)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/incref/decref/release sequences against a dict model of the refcounts."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(8)
        self.model: dict[int, int] = {}  # used block -> holders
        self.holders: list[list[int]] = []  # each allocation or incref is one holder of its blocks

    @rule(n=st.integers(0, 10))
    def allocate(self, n):
        before = (self.pool.free_count, [self.pool.refcount(i) for i in range(8)])
        if n > 8 - len(self.model):
            with pytest.raises(OutOfBlocks):
                self.pool.allocate(n)
            assert before == (self.pool.free_count, [self.pool.refcount(i) for i in range(8)])
            return
        got = self.pool.allocate(n)
        assert len(got) == len(set(got)) == n
        assert not set(got) & set(self.model), "a block handed out while still referenced"
        self.model.update(dict.fromkeys(got, 1))
        self.holders.append(got)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def incref(self, data):
        blocks = data.draw(st.sampled_from(self.holders))
        self.pool.incref(blocks)
        for b in blocks:
            self.model[b] += 1
        self.holders.append(list(blocks))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def release(self, data):
        blocks = self.holders.pop(data.draw(st.integers(0, len(self.holders) - 1)))
        freed = self.pool.decref(blocks)
        expect = []
        for b in blocks:
            self.model[b] -= 1
            if not self.model[b]:
                del self.model[b]
                expect.append(b)
        assert freed == expect

    @rule(b=st.integers(-2, 9), times=st.integers(1, 3))
    def bad_decref(self, b, times):
        if 0 <= b < 8 and self.model.get(b, 0) >= times:
            return
        before = [self.pool.refcount(i) for i in range(8)]
        with pytest.raises(ValueError):
            self.pool.decref([b] * times)
        assert before == [self.pool.refcount(i) for i in range(8)]

    @invariant()
    def consistent(self):
        assert self.pool.free_count + self.pool.used_count == 8
        assert self.pool.used_count == len(self.model)
        assert all(self.pool.refcount(i) == self.model.get(i, 0) for i in range(8))


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


# ---- RequestBlocks --------------------------------------------------------------------------


def test_request_growth_across_block_boundaries():
    pool = BlockPool(10)
    req = RequestBlocks(pool, max_blocks_per_request=4, block_size=4)
    assert req.ensure_capacity(0) == [] and req.num_tokens_capacity == 0
    assert req.ensure_capacity(1) == [0] and req.num_tokens_capacity == 4
    assert req.ensure_capacity(4) == []  # still inside block 0
    assert req.ensure_capacity(5) == [1]  # crosses into block 1
    assert req.ensure_capacity(3) == []  # never shrinks
    assert req.ensure_capacity(16) == [2, 3]
    assert req.block_ids == [0, 1, 2, 3] and req.num_tokens_capacity == 16 == req.max_tokens
    table = req.table(6)
    assert table.dtype == np.int32 and table.tolist() == [0, 1, 2, 3, -1, -1]
    with pytest.raises(ValueError, match="width"):
        req.table(3)
    with pytest.raises(ValueError, match="num_tokens"):
        req.ensure_capacity(17)
    with pytest.raises(ValueError, match="num_tokens"):
        req.ensure_capacity(-1)


def test_request_out_of_blocks_is_all_or_nothing():
    pool = BlockPool(3)
    other = RequestBlocks(pool, 8, 4)
    other.ensure_capacity(4)
    req = RequestBlocks(pool, 8, 4)
    req.ensure_capacity(4)
    with pytest.raises(OutOfBlocks) as err:
        req.ensure_capacity(12)  # needs 2 more, 1 free
    assert (err.value.requested, err.value.free) == (2, 1)
    assert req.block_ids == [1] and pool.free_count == 1


def test_request_release_idempotent_and_reuse():
    pool = BlockPool(4)
    a = RequestBlocks(pool, 4, 2)
    a.ensure_capacity(8)
    assert pool.free_count == 0
    b = RequestBlocks(pool, 4, 2)
    with pytest.raises(OutOfBlocks):
        b.ensure_capacity(1)
    assert sorted(a.release()) == [0, 1, 2, 3]
    assert a.release() == [] and a.block_ids == [] and pool.free_count == 4
    assert b.ensure_capacity(8) == [0, 1, 2, 3]  # the released blocks, in release order
    assert a.table(2).tolist() == [-1, -1]


def test_request_release_keeps_shared_blocks():
    pool = BlockPool(4)
    a = RequestBlocks(pool, 4, 2)
    a.ensure_capacity(4)
    pool.incref(a.block_ids)  # e.g. a prefix cache also holds them
    assert a.release() == [] and pool.used_count == 2
    assert pool.decref([0, 1]) == [0, 1] and pool.free_count == 4


@settings(max_examples=50, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40)), max_size=40))
def test_requests_never_share_blocks(steps):
    pool = BlockPool(12)
    reqs = [RequestBlocks(pool, 5, 8) for _ in range(4)]
    for i, tokens in steps:
        if tokens == 0:
            reqs[i].release()
            continue
        before = reqs[i].block_ids
        try:
            new = reqs[i].ensure_capacity(tokens)
        except OutOfBlocks:
            assert reqs[i].block_ids == before
        else:
            assert reqs[i].block_ids == before + new and reqs[i].num_tokens_capacity >= tokens
            assert reqs[i].num_tokens_capacity - tokens < 8 or not new  # grows by whole blocks only
        held = [b for r in reqs for b in r.block_ids]
        assert len(held) == len(set(held)) == pool.used_count
        assert pool.free_count + pool.used_count == 12
