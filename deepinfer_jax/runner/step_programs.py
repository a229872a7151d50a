"""The runner's traced step programs and their trace counter (one definition for every runner layout).

``logits_step`` (the logits of chosen rows; ``ModelRunner.execute``), ``forward_step`` (the engine's
model step: tokens marked ``feed`` come from the slots' last sampled ids on the device) and
``sample_rows`` (seeded sampling of one row per request, ``model.sampler``) are what the runner
jits, on one device as they are and over a mesh once per attention data-parallel rank
(``runner.mesh_step``). Each increments ``TRACES`` while it is traced, so ``ModelRunner.traces``
counts the programs a process built (a program loaded from the program store counts through
``count_trace``); tests assert that a long mixed run never recompiles.

``spec_forward_step`` / ``spec_sample_step`` are the speculative engine's pair (``runner.spec_step``): the model
step whose verify rows the device builds from the slots' drafts (with the DSpark feature capture), then acceptance
and the next drafts. Like the plain pair they run as they are on one device and once per DP rank over a mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deepinfer_jax.model import speculative as spec_ops
from deepinfer_jax.model.moe_strategy import MoEStrategy
from deepinfer_jax.model.paged import paged_step
from deepinfer_jax.model.sampler import sample

__all__ = ["TRACES", "count_trace", "forward_step", "forward_step_flat", "logits_step", "logits_step_flat",
           "sample_rows", "spec_forward_step", "spec_sample_step"]

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


def spec_forward_step(params, drafter, cfg, cache_cfg, cache, spec, last_ids, inputs, rows, moe: MoEStrategy = _AUTO,
                      moe_tables=None):
    """The speculative model step of one rank: the verify rows' tokens built from ``spec`` (the slots' anchors and
    drafts, ``model.speculative.verify_inputs``), ``paged_step`` capturing the DSpark target layers, the captured
    features written into the slots' rings. Returns (logits, cache, spec, layout, the rows' slots), plus the slot
    counts [L, P] under the ``"ep"`` MoE strategy ``moe``."""
    TRACES[0] += 1
    full, layout = spec_ops.verify_inputs(inputs, rows, spec, last_ids)
    out = paged_step(params, cfg, cache_cfg, cache, full, capture=tuple(cfg.dspark_target_layer_ids), moe=moe,
                     moe_tables=moe_tables)
    logits, cache, captured = out[:3]
    spec = spec_ops.write_features(spec, drafter, cfg, captured)
    layout = layout._replace(counts=jnp.where(rows.is_verify, layout.counts, 0))
    return (logits, cache, spec, layout, full.req_slot, *out[3:])


def spec_sample_step(num_top, cfg, params, drafter, heads, logits, mask, has_mask, sampling, layout, rows, spec,
                     last_ids, slot_R, draft, want_logprobs, drafting: bool = True):
    """Acceptance of one rank's verify rows (lossless), the anchors taken into the slots and, where ``draft``, the
    drafter's next blocks. ``drafting=False`` (static): the *accept-only* program, without the drafter (``draft``
    is then ignored). Returns (accepted, drafts verified per row, anchors, next confidences, spec, last_ids)."""
    TRACES[0] += 1
    out = spec_ops.accept(logits, layout, rows, sampling, spec, slot_R, num_top, heads.ids, mask, has_mask,
                          want_logprobs, verifies=drafting)  # no drafter, no drafts: nothing to verify
    spec, last_ids = spec_ops.draft_next(spec, last_ids, drafter, params, cfg, heads, out, layout, rows, sampling,
                                         slot_R, draft, drafting)
    conf = spec.conf[jnp.clip(slot_R, 0, spec.conf.shape[0] - 1)]
    return out, layout.counts, layout.anchor, conf, spec, last_ids
