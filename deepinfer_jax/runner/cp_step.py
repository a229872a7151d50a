"""The context-parallel step: the ``ModelRunner`` component that prefills a long prompt over ``cp``.

See docs/context_parallel.md.

A runner built for a preset with a ``cp`` mesh axis (``cpu-cp4``, ``prefill-cp8``) holds one
``ContextParallelStep`` as ``runner.context_parallel``. Every ordinary step runs as on one device (the mesh's
first device holds the cache and the one-device programs); a chunk marked ``ChunkSpec.context_parallel`` (the
scheduler marks a prompt of at least ``cp_threshold`` tokens still to compute; it runs alone in its step) runs
``parallel.context_parallel.cp_prefill`` over the ``cp`` ranks: the cache goes to every rank (replicated), each
rank computes its head and tail pieces, and the updated cache, equal to what the one-device step would have
written, comes back to the first device. The logits of the chunk's last token then sample exactly like an
ordinary step's (``ModelRunner.sample``).

Shapes: the flat chunk pads to a multiple of ``2 * cp * pad_to`` tokens and each piece to a multiple of
``pad_to``, so prompts of nearby lengths share one compiled CP program.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from deepinfer_jax import compile_options
from deepinfer_jax.parallel.context_parallel import cp_inputs, cp_prefill, tail_rows_for
from deepinfer_jax.parallel.cp_layout import cp_align, cp_layout
from deepinfer_jax.runner.buckets import Buckets
from deepinfer_jax.runner.step_batch import ChunkSpec, StepInputError, build_inputs, check_chunks

__all__ = ["ContextParallelStep"]


def check_cp_mesh(mesh, preset) -> None:
    """ValueError unless ``preset`` has ``cp_size > 1`` and ``mesh`` is its one ``cp`` axis."""
    if not preset.context_parallel:
        raise ValueError(f"context parallelism needs a preset with cp_size > 1, got {preset.name!r}")
    if dict(mesh.shape) != {"cp": preset.cp_size}:
        raise ValueError(f"context parallelism needs a mesh with one axis 'cp' of size {preset.cp_size}, "
                         f"got {dict(mesh.shape)}")


class ContextParallelStep:
    """``context_parallel`` chunks of ``runner`` (whose one cache is on the mesh's first device) over the ``cp``
    axis of ``mesh``. ``preset``: a ``ShardingPreset`` with ``cp_size > 1`` (nothing else split). ``pad_to``:
    piece padding."""

    def __init__(self, runner, params, mesh, preset, pad_to: int = 64):
        check_cp_mesh(mesh, preset)
        self.runner = runner
        self.mesh, self.preset, self.cp_size = mesh, preset, preset.cp_size
        self._home = mesh.devices.flat[0]
        self._repl = NamedSharding(mesh, PartitionSpec())
        self._shard = NamedSharding(mesh, PartitionSpec("cp"))
        self._params = jax.device_put(params, self._repl)
        self._fn = compile_options.jit(cp_prefill, static_argnums=(1, 2), static_argnames=("mesh", "axis", "comm_log"),
                                       donate_argnums=(3,))
        self.align, self.pad_to = cp_align(runner.cfg), pad_to
        self.tail_rows = tail_rows_for(runner.cfg, runner.cache_cfg)
        self.steps = 0  # CP chunks run so far

    def chunk(self, chunks: Sequence[ChunkSpec]) -> ChunkSpec | None:
        """The step's context-parallel chunk (validated), or None when no chunk is marked; ``StepInputError`` for a
        marked chunk that does not run alone or is not a plain prefill."""
        chunks = list(chunks)
        marked = [c for c in chunks if isinstance(c, ChunkSpec) and c.context_parallel]
        if not marked:
            return None
        if len(chunks) != 1:
            raise StepInputError("a context-parallel chunk runs alone in its step")
        c, rn = chunks[0], self.runner
        check_chunks([c], rn.cfg, rn.cache_cfg)
        if c.verify or c.feed_last or c.window_floor or c.global_write_from or c.decoder_from > c.ctx_len:
            raise StepInputError("chunk 0: a context-parallel chunk is a plain prefill (no verify, feed_last, "
                                 "bounded replay or decoder replay)")
        return c

    def run(self, c: ChunkSpec):
        """(logits [1, vocab] on the first device, flat inputs) of the CP prefill of chunk ``c``; the runner's cache
        is updated as the one-device step would have."""
        rn = self.runner
        n = len(c.token_ids)
        lay = cp_layout(c.ctx_len, n, self.cp_size, align=self.align, tail_rows=self.tail_rows, multiple=self.pad_to)
        whole = 2 * self.cp_size * self.pad_to
        b = Buckets.pick(rn.buckets.blocks, len(c.block_table), "block_table length")
        inp = build_inputs([c], -(-n // whole) * whole, 1, b, rn.cache_cfg.max_requests)
        inp = inp._replace(logit_rows=np.array([n - 1], np.int32))
        lin = cp_inputs(lay)
        lin = lin._replace(**{k: jax.device_put(getattr(lin, k), self._shard)
                              for k in ("positions", "valid", "flat", "tail_at")})
        cache = jax.device_put(rn.cache, self._repl)
        rn.cache = None
        logits, cache = self._fn(self._params, rn.cfg, rn.cache_cfg, cache, jax.device_put(inp, self._repl), lin,
                                 mesh=self.mesh)
        rn.cache = jax.device_put(cache, self._home)
        self.steps += 1
        return jax.device_put(logits, self._home), inp
