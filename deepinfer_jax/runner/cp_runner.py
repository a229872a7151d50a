"""CPRunner: a ``ModelRunner`` whose long-prompt chunks prefill by context parallelism (docs/context_parallel.md).

Built for a preset with a ``cp`` mesh axis (``cpu-cp4``, ``prefill-cp8``): every ordinary step runs as on
one device (the mesh's first device holds the cache and the one-device programs), and a chunk marked
``ChunkSpec.context_parallel`` (the scheduler marks a prompt of at least ``cp_threshold`` tokens still to
compute; it runs alone in its step) runs ``parallel.context_parallel.cp_prefill`` over the ``cp`` ranks:
the cache goes to every rank (replicated), each rank computes its head and tail pieces, and the updated
cache, equal to what the one-device step would have written, comes back to the first device. The
logits of the chunk's last token then sample exactly like an ordinary step's (``ModelRunner.sample``).

Shapes: the flat chunk pads to a multiple of ``2 * cp * pad_to`` tokens and each piece to a multiple of
``pad_to``, so prompts of nearby lengths share one compiled CP program.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from deepinfer_jax.parallel.context_parallel import cp_inputs, cp_prefill, tail_rows_for
from deepinfer_jax.parallel.cp_layout import cp_align, cp_layout
from deepinfer_jax.runner.buckets import Buckets
from deepinfer_jax.runner.model_runner import Forward, ModelRunner
from deepinfer_jax.runner.step_batch import ChunkSpec, StepInputError, build_inputs, check_chunks, sampling_batch

__all__ = ["CPRunner"]


class CPRunner(ModelRunner):
    """One cache on the mesh's first device; ``context_parallel`` chunks run over the ``cp`` axis of ``mesh``.

    ``preset``: a ``ShardingPreset`` with ``cp_size > 1`` (nothing else split). ``pad_to``: piece padding.
    """

    def __init__(self, cfg, params, cache_cfg, buckets: Buckets | None = None, num_top_logprobs: int = 5,
                 decoder_replay: bool = False, *, mesh, preset, pad_to: int = 64):
        if not preset.context_parallel:
            raise ValueError(f"CPRunner needs a preset with cp_size > 1, got {preset.name!r}")
        if dict(mesh.shape) != {"cp": preset.cp_size}:
            raise ValueError(f"CPRunner needs a mesh with one axis 'cp' of size {preset.cp_size}, "
                             f"got {dict(mesh.shape)}")
        with jax.default_device(mesh.devices.flat[0]):
            super().__init__(cfg, params, cache_cfg, buckets, num_top_logprobs, decoder_replay)
        self.cp_mesh, self.cp_preset, self.cp_size = mesh, preset, preset.cp_size
        self._home = mesh.devices.flat[0]
        self._repl = NamedSharding(mesh, PartitionSpec())
        self._shard = NamedSharding(mesh, PartitionSpec("cp"))
        self._cp_params = jax.device_put(params, self._repl)
        self._cp_fn = jax.jit(cp_prefill, static_argnums=(1, 2), static_argnames=("mesh", "axis", "comm_log"),
                              donate_argnums=(3,))
        self.align, self.tail_rows, self.pad_to = cp_align(cfg), tail_rows_for(cfg, cache_cfg), pad_to
        self.cp_steps = 0  # CP chunks run so far

    # -- entry points --------------------------------------------------------------------------
    def forward(self, chunks) -> Forward:
        """As ``ModelRunner.forward``; a ``context_parallel`` chunk (alone in the step) runs over the cp ranks."""
        cp = self._cp_chunk(chunks)
        if cp is None:
            return super().forward(chunks)
        logits, inp = self._run_cp(cp)
        feed, sampling, sample_slot = sampling_batch([cp], inp, inp.token_ids.shape[0], 1, self.cache_cfg.max_requests)
        return Forward(logits, sampling, sample_slot, [cp], 1, [0])

    def execute(self, chunks: Sequence[ChunkSpec]) -> list[np.ndarray]:
        """As ``ModelRunner.execute``; a ``context_parallel`` chunk returns its last token's logits [1, vocab]."""
        cp = self._cp_chunk(chunks)
        if cp is None:
            return super().execute(chunks)
        if cp.offsets != (len(cp.token_ids) - 1,):
            raise StepInputError("a context-parallel chunk returns the logits of its last token only")
        return [np.asarray(self._run_cp(cp)[0])]

    # -- internals -----------------------------------------------------------------------------
    def _cp_chunk(self, chunks) -> ChunkSpec | None:
        chunks = list(chunks)
        marked = [c for c in chunks if isinstance(c, ChunkSpec) and c.context_parallel]
        if not marked:
            return None
        if len(chunks) != 1:
            raise StepInputError("a context-parallel chunk runs alone in its step")
        c = chunks[0]
        check_chunks([c], self.cfg, self.cache_cfg)
        if c.verify or c.feed_last or c.window_floor or c.global_write_from or c.decoder_from > c.ctx_len:
            raise StepInputError("chunk 0: a context-parallel chunk is a plain prefill (no verify, feed_last, "
                                 "bounded replay or decoder replay)")
        return c

    def _run_cp(self, c: ChunkSpec):
        """(logits [1, vocab] on the first device, flat inputs) of the CP prefill of chunk ``c``."""
        n = len(c.token_ids)
        lay = cp_layout(c.ctx_len, n, self.cp_size, align=self.align, tail_rows=self.tail_rows, multiple=self.pad_to)
        whole = 2 * self.cp_size * self.pad_to
        b = Buckets.pick(self.buckets.blocks, len(c.block_table), "block_table length")
        inp = build_inputs([c], -(-n // whole) * whole, 1, b, self.cache_cfg.max_requests)
        inp = inp._replace(logit_rows=np.array([n - 1], np.int32))
        lin = cp_inputs(lay)
        lin = lin._replace(**{k: jax.device_put(getattr(lin, k), self._shard)
                              for k in ("positions", "valid", "flat", "tail_at")})
        cache = jax.device_put(self.cache, self._repl)
        self.cache = None
        logits, cache = self._cp_fn(self._cp_params, self.cfg, self.cache_cfg, cache, jax.device_put(inp, self._repl),
                                    lin, mesh=self.cp_mesh)
        self.cache = jax.device_put(cache, self._home)
        self.cp_steps += 1
        return jax.device_put(logits, self._home), inp
