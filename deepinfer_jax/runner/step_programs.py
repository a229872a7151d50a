"""The runner's traced step programs and their trace counter (one definition for every runner layout).

``logits_step`` (the logits of chosen rows; ``ModelRunner.execute``), ``forward_step`` (the engine's
model step: tokens marked ``feed`` come from the slots' last sampled ids on the device) and
``sample_rows`` (seeded sampling of one row per request, ``model.sampler``) are what the runner
jits, on one device as they are and over a mesh once per attention data-parallel rank
(``runner.mesh_step``). Each increments ``TRACES`` while it is traced, so ``ModelRunner.traces``
counts the programs a process built (a program loaded from the program store counts through
``count_trace``); tests assert that a long mixed run never recompiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.model.moe_strategy import MoEStrategy
from deepinfer_jax.model.paged import paged_step
from deepinfer_jax.model.sampler import sample

__all__ = ["TRACES", "count_trace", "forward_step", "forward_step_flat", "logits_step", "logits_step_flat",
           "sample_rows"]

_AUTO = MoEStrategy()

#: How many step programs this process traced (or loaded from the program store).
TRACES = [0]


def count_trace() -> None:
    """A program loaded from the program store counts as built (as a tracing would)."""
    TRACES[0] += 1


def logits_step(params, cfg, cache_cfg, cache, inputs):
    """``paged_step``: the logits of ``inputs.logit_rows`` and the new cache."""
    TRACES[0] += 1  # runs only while tracing
    return paged_step(params, cfg, cache_cfg, cache, inputs)


def forward_step(params, cfg, cache_cfg, cache, last_ids, feed, inputs, moe: MoEStrategy = _AUTO, moe_tables=None):
    """The engine's model step: tokens marked ``feed`` come from ``last_ids`` [slots] (by slot);
    returns the logits of ``inputs.logit_rows`` (one row per request) and the new cache, plus the slot
    counts [L, P] under the ``"ep"`` MoE strategy ``moe`` (static; ``moe_tables``: ``paged_step``'s)."""
    TRACES[0] += 1
    slots = cache_cfg.max_requests
    token_slot = jnp.clip(inputs.req_slot[inputs.token_req], 0, slots - 1)
    inputs = inputs._replace(token_ids=jnp.where(feed, last_ids[token_slot], inputs.token_ids))
    return paged_step(params, cfg, cache_cfg, cache, inputs, moe=moe, moe_tables=moe_tables)


def logits_step_flat(ptree, pleaves, cfg, cache_cfg, cache, inputs):
    """``logits_step`` with the parameters as (treedef, leaves): jit flattens a list of arrays in C++, where an
    ``nnx.State`` costs a Python traversal of every variable on every call (milliseconds per step)."""
    return logits_step(jax.tree_util.tree_unflatten(ptree, pleaves), cfg, cache_cfg, cache, inputs)


def forward_step_flat(ptree, pleaves, cfg, cache_cfg, cache, last_ids, feed, inputs):
    """``forward_step`` with the parameters as (treedef, leaves) (see ``logits_step_flat``)."""
    return forward_step(jax.tree_util.tree_unflatten(ptree, pleaves), cfg, cache_cfg, cache, last_ids, feed, inputs)


def sample_rows(num_top, logits, mask, has_mask, sampling, last_ids, sample_slot):
    """Sample one token per row of ``logits`` [R, V] under the packed token ``mask`` [R, W] and store
    it in ``last_ids`` at ``sample_slot`` (out of range = none). A separate program from the model
    step so a structured-output mask can arrive while the step already runs on the device."""
    TRACES[0] += 1
    out = sample(logits, sampling, num_top, mask, has_mask)
    return out, last_ids.at[sample_slot].set(out.token_ids, mode="drop")
