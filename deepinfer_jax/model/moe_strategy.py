"""How the MoE layers run their routed experts: a static argument of the model step (model.md §4.6).

``MoEStrategy`` is frozen and hashable: ``forward_full`` and ``paged_step`` take it as a static
argument (``moe=``), so it is part of every jit key that traces them, and pass it down the layer
loop to each ``MoE`` layer. Kinds:

* ``"auto"`` (the default): the routed experts on this device, the dense reference when the kernel
  selection (``ops.dispatch``, itself part of the jit key) resolves to the jnp references, else the
  grouped-matmul kernel on expert-sorted rows;
* ``"dense"``: the dense reference (every expert on every token, unselected ones zero-weighted);
* ``"grouped"``: the grouped-matmul path (``ops.grouped_matmul``, the selected implementation);
* ``"ep"``: expert parallelism over a mesh, through ``ep``, an ``ExpertParallel`` object.

The model defines the interface and the parallel layer implements it: ``ExpertParallel`` is a
protocol (a hashable callable), ``parallel.ep_model`` provides ``MeshEP`` (its own ``shard_map``
over a whole mesh: ``sharding.sharded_forward_full``) and ``StepEP`` (inside a ``shard_map`` already
manual over the mesh: the engine's DP step, ``runner.mesh_step``), and the code that builds a step
(``sharding``, ``runner``) puts one into the strategy. So the model imports nothing from
``deepinfer_jax.parallel`` and nothing is read from module state while tracing.

An ``"ep"`` step also takes ``moe_tables``: every layer's EPLB routing tables stacked ``[L, ...]``
(int32 arrays, the keys of ``parallel.ep_moe.TABLES``; layer ``l`` of the model reads row ``l``). They
are jit arguments, never captured constants: a new placement is new argument values, not a retrace.
The step then also returns every layer's pair count per physical slot, ``[L, P]`` int32.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import jax

__all__ = ["KINDS", "ExpertParallel", "MoEStrategy", "check_tables", "layer_tables"]

KINDS = ("auto", "dense", "grouped", "ep")


class ExpertParallel(Protocol):
    """An expert-parallel implementation of the routed experts (hashable: it is part of the jit key)."""

    def __call__(self, moe, x_Nd: jax.Array, tables: Mapping[str, jax.Array], valid: jax.Array | None
                 ) -> tuple[jax.Array, jax.Array]:
        """(routed output [N, d] fp32, pairs routed to each physical slot [P] int32) of the ``model.moe.MoE``
        layer ``moe`` for tokens ``x_Nd``, with the layer's ``tables`` and the tokens' validity ``valid`` [N]
        (None: all real)."""
        ...


@dataclass(frozen=True)
class MoEStrategy:
    """``kind`` (one of ``KINDS``) and, for ``"ep"`` only, the ``ExpertParallel`` implementation ``ep``."""

    kind: str = "auto"
    ep: ExpertParallel | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"MoEStrategy.kind must be one of {KINDS}, got {self.kind!r}")
        if (self.kind == "ep") != (self.ep is not None):
            raise ValueError("MoEStrategy: ep (an ExpertParallel implementation) is given with kind 'ep' and only then")

    @property
    def counts(self) -> bool:
        """Whether the step returns per-slot pair counts (the ``"ep"`` kind)."""
        return self.kind == "ep"


def check_tables(moe: MoEStrategy, tables: Mapping[str, jax.Array] | None, n_layers: int) -> None:
    """ValueError unless ``tables`` fits ``moe``: every layer's tables [L, ...] for ``"ep"``, None otherwise."""
    if not moe.counts:
        if tables is not None:
            raise ValueError(f"moe_tables are for the 'ep' strategy, the step runs {moe.kind!r}")
        return
    if tables is None:
        raise ValueError("the 'ep' MoE strategy needs moe_tables (every layer's routing tables [L, ...])")
    bad = {k: tuple(v.shape) for k, v in tables.items() if v.ndim < 1 or v.shape[0] != n_layers}
    if bad:
        raise ValueError(f"moe_tables must hold {n_layers} layers along axis 0, got {bad}")


def layer_tables(tables: Mapping[str, jax.Array] | None, layer: int) -> dict | None:
    """Layer ``layer``'s row of every table (None stays None)."""
    return None if tables is None else {k: v[layer] for k, v in tables.items()}
