"""Host arrays onto the device without compiling a program: ``to_device`` and ``filled``.

Outside a trace, ``jnp.asarray(numpy_array)`` lifts the value through a small ``jit(stage)``
program that XLA compiles once per shape and dtype (and ``jnp.asarray(x, dtype)`` compiles a
``convert_element_type`` program as well). An engine's start-up moves about a hundred differently
shaped arrays (weights in their storage formats, cache buffers, speculation state), which made a
warm start compile and load that many small programs. ``jax.device_put`` of a numpy array copies it
and compiles nothing, so start-up code converts the dtype on the host (numpy and ``ml_dtypes``,
round-to-nearest-even like XLA's convert, float64 through float32 as JAX canonicalizes it) and
then puts the result on the device: the same bits as ``jnp.asarray`` (tested).
"""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["filled", "to_device"]


def to_device(x, dtype=None) -> jax.Array:
    """``jnp.asarray(x, dtype)`` for a host value, bit for bit, without compiling anything; a device
    array is returned as it is (cast by a device op only when its dtype differs)."""
    target = None if dtype is None else jax.dtypes.canonicalize_dtype(dtype)
    if isinstance(x, jax.Array):
        return x if target is None or x.dtype == target else x.astype(target)
    a = np.asarray(x)
    if target is not None and a.dtype != target:
        if a.dtype == np.float64:  # JAX without x64 makes float64 float32 first
            a = a.astype(np.float32)
        a = a.astype(target)
    return jax.device_put(a)


def filled(shape: tuple[int, ...], dtype, value=0) -> jax.Array:
    """A device array of ``value`` made on the host: unlike ``jnp.zeros``/``jnp.full``, compiles no
    program (an engine's start-up allocates dozens of differently shaped buffers)."""
    return jax.device_put(np.full(shape, value, jax.dtypes.canonicalize_dtype(dtype)))
