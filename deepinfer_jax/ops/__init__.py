"""Kernel entry points: one folder per kernel (``reference.py`` jnp, ``pallas.py`` Pallas) and one
dispatch table by platform (``dispatch``). ``use_kernels`` selects implementations for tracing."""

from deepinfer_jax.ops.dispatch import use_kernels

__all__ = ["use_kernels"]
