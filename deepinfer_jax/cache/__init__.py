"""Host-side cache bookkeeping (engine.md §1): the block pool and per-request block tables."""

from deepinfer_jax.cache.block_pool import BlockPool, OutOfBlocks, RequestBlocks

__all__ = ["BlockPool", "OutOfBlocks", "RequestBlocks"]
