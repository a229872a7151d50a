"""XLA compile options of the engine's own programs.

On the CPU backend the engine compiles its programs (the step programs, the speculative ones, the mesh and
context-parallel ones and the small cache-copy programs) at LLVM optimisation level 1
(``xla_backend_optimization_level``) instead of XLA's default 2. Measured on the shipped model on this project's
2-core machine (docs/startup.md §7), alternating runs: the demo's plain step bucket compiles in 6.2-6.5 s instead
of 7.1-8.0 s, its first ``generate`` (which compiles) takes ~8% less time and a warm one ~5% less; level 0 compiles
faster still but runs several times slower.

``DEEPINFER_XLA_CPU_OPT_LEVEL`` picks another level (``0``-``3``) or ``default`` (XLA's own); a level already given
in ``XLA_FLAGS`` wins over both. Other backends keep XLA's defaults. The level is part of every key that could
reuse a program: JAX's compilation cache hashes the compile options, the program store every ``DEEPINFER_*``
variable. A program built at another level may differ in the last bits of a float (vectorised reductions), so
everything the engine runs uses one level; the notebook's ``generate``/``generate_ragged`` and the user's own
``jax.jit`` keep XLA's default.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax

__all__ = ["DEFAULT_CPU_LEVEL", "ENV", "compiler_options", "jit"]

ENV = "DEEPINFER_XLA_CPU_OPT_LEVEL"
DEFAULT_CPU_LEVEL = 1
_FLAG = "xla_backend_optimization_level"


def compiler_options(backend: str | None = None) -> dict[str, int] | None:
    """The ``compiler_options`` for ``jax.jit`` on ``backend`` (default: JAX's default backend), or None for
    XLA's defaults. ``ValueError`` naming ``DEEPINFER_XLA_CPU_OPT_LEVEL`` for a value other than 0-3 or
    ``default``."""
    raw = os.environ.get(ENV, "").strip().lower()
    if raw in ("", "default"):
        level = DEFAULT_CPU_LEVEL if raw == "" else None
    elif raw in ("0", "1", "2", "3"):
        level = int(raw)
    else:
        raise ValueError(f"{ENV} must be 0, 1, 2, 3 or 'default', got {raw!r}")
    if level is None or _FLAG in os.environ.get("XLA_FLAGS", ""):
        return None
    if (backend or jax.default_backend()) != "cpu":
        return None
    return {_FLAG: level}


def jit(fn: Callable, **kwargs) -> Callable:
    """``jax.jit(fn, **kwargs)`` with the engine's compile options (``compiler_options()``)."""
    return jax.jit(fn, compiler_options=compiler_options(), **kwargs)
