"""Which Pallas GPU backend the kernels target: Triton, chosen explicitly.

On CUDA, ``pl.pallas_call`` lowers through Mosaic GPU or Triton depending on JAX's default (it has
changed between versions). These kernels are written for Triton's model (one program per block,
dynamic scalar loads from whole-array operands), so on a GPU they pass Triton compiler parameters;
in interpret mode and on other backends they pass none.
"""

from __future__ import annotations

import jax

# Triton launch settings. Not measured (no GPU was available): 4 warps, 2 pipeline stages are
# Triton's usual defaults for small tiles; tune with benchmarks/kernels.py.
NUM_WARPS = 4
NUM_STAGES = 2


def compiler_params(interpret: bool):
    """Triton compiler parameters when compiling for a GPU, else None."""
    if interpret or jax.default_backend() != "gpu":
        return None
    from jax.experimental.pallas import triton as pl_triton

    return pl_triton.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES)
