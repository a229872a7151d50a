"""JAX <-> torch hand-off through DLPack (zero copy on the host; torch is imported lazily).

``to_torch(x)`` views a JAX array as a torch tensor (``torch.from_dlpack``); ``to_jax(t)`` views a
contiguous torch tensor as a JAX array (``jnp.from_dlpack``). Shapes and dtypes (float32, bfloat16,
float16, int32, int64, bool, ...) are kept. Torch must treat the tensors from ``to_torch`` as
read-only: the JAX buffer behind them is immutable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def to_torch(x: jax.Array):
    """A torch tensor sharing ``x``'s buffer."""
    import torch

    if not isinstance(x, jax.Array):
        raise TypeError(f"expected a jax.Array, got {type(x).__name__}")
    return torch.from_dlpack(x)


def to_jax(t) -> jax.Array:
    """A JAX array of torch tensor ``t`` (made contiguous first; on the host, no copy if it already is)."""
    return jnp.from_dlpack(t.contiguous())
