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

XLA:CPU also hands some operations to the YNNPACK library (``xla_cpu_experimental_ynn_fusion_type``; by default its
dots and its reductions). The engine's programs keep the dots there and leave the reductions to XLA's own code:
the reductions of these models are small (the mHC collapse sums 4 streams per token and channel), and a YNNPACK
reduction cost about 0.36 ms each where XLA's loop takes a few microseconds. Measured on the shipped model with
the demo's settings (docs/startup.md §7): the same 5 x 24 greedy tokens, a warm ``generate`` about 20% faster and
a warm process's first one about 0.35 s shorter (each YNNPACK fusion also sets itself up at its first run).
``DEEPINFER_XLA_CPU_YNN=default`` keeps XLA's list; a list given in ``XLA_FLAGS`` wins over both. The option is
XLA:CPU's as of jaxlib 0.10 (tested: ``tests/test_startup.py``); an XLA that lacks it refuses the compile with an
error naming ``xla_cpu_experimental_ynn_fusion_type``, which ``DEEPINFER_XLA_CPU_YNN=default`` avoids.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax

__all__ = ["DEFAULT_CPU_LEVEL", "ENV", "YNN_ENV", "compiler_options", "jit"]

ENV = "DEEPINFER_XLA_CPU_OPT_LEVEL"
YNN_ENV = "DEEPINFER_XLA_CPU_YNN"
DEFAULT_CPU_LEVEL = 1
_FLAG = "xla_backend_optimization_level"
_YNN_FLAG = "xla_cpu_experimental_ynn_fusion_type"
#: The YNNPACK fusions the engine's CPU programs keep: single dots (XLA's default list adds reductions).
_YNN_DOTS = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"


def compiler_options(backend: str | None = None) -> dict[str, int | str] | None:
    """The ``compiler_options`` for ``jax.jit`` on ``backend`` (default: JAX's default backend), or None for
    XLA's defaults. ``ValueError`` naming ``DEEPINFER_XLA_CPU_OPT_LEVEL`` for a value other than 0-3 or
    ``default``, or naming ``DEEPINFER_XLA_CPU_YNN`` for a value other than ``dots`` or ``default``."""
    raw = os.environ.get(ENV, "").strip().lower()
    if raw in ("", "default"):
        level = DEFAULT_CPU_LEVEL if raw == "" else None
    elif raw in ("0", "1", "2", "3"):
        level = int(raw)
    else:
        raise ValueError(f"{ENV} must be 0, 1, 2, 3 or 'default', got {raw!r}")
    ynn = os.environ.get(YNN_ENV, "").strip().lower()
    if ynn not in ("", "dots", "default"):
        raise ValueError(f"{YNN_ENV} must be 'dots' or 'default', got {ynn!r}")
    if (backend or jax.default_backend()) != "cpu":
        return None
    user = os.environ.get("XLA_FLAGS", "")
    options: dict[str, int | str] = {}
    if level is not None and _FLAG not in user:
        options[_FLAG] = level
    if ynn != "default" and _YNN_FLAG not in user:
        options[_YNN_FLAG] = _YNN_DOTS
    return options or None


def jit(fn: Callable, **kwargs) -> Callable:
    """``jax.jit(fn, **kwargs)`` with the engine's compile options (``compiler_options()``)."""
    return jax.jit(fn, compiler_options=compiler_options(), **kwargs)
