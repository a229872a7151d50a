"""Prompt logprobs (``SamplingParams.prompt_logprobs``, vLLM's field): the model's log-probability
of each prompt token given the ones before it, and the top alternatives at each position.

The engine's step does not produce these: it returns logits at one row per request, and with
decoder bounded replay (YOCO prefill, docs/engine.md §1.4) the decoder layers never run at most
prompt positions. So a
request that asks for them gets one extra pass of the full-sequence model (``forward_full``, the
function the oracle parity suites check against NeMo) over its prompt, right-padded to a power-of-two
length bucket: attention, compression and Engram look-ups are all causal, so the padding cannot
change an earlier position. One program per length bucket, compiled on first use (and kept by the
persistent compilation cache). Logprobs are those of the raw distribution ``log_softmax(logits)``,
as for generated tokens. They agree with the paged step's own logprobs within the paged-vs-full
tolerance (tested), not bit for bit.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.engine.outputs import TokenLogprobs
from deepinfer_jax.model.deepseek_v41 import forward_full

__all__ = ["PromptScorer"]

_MIN_BUCKET = 16


@partial(jax.jit, static_argnums=(0, 3))
def _scores(cfg, params, ids_1T, num_top: int):
    logits = forward_full(params, cfg, ids_1T)[0]  # [T, V]
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp[:-1], ids_1T[0, 1:, None], axis=-1)[:, 0]  # p(token t | tokens < t)
    top_lp, top_ids = jax.lax.top_k(logp[:-1], num_top)
    return chosen, top_ids, top_lp


class PromptScorer:
    """Scores prompts with the full model; ``num_top`` (the engine's ``max_logprobs``) is fixed so
    every ``k <= num_top`` shares a program."""

    def __init__(self, cfg, params, num_top: int) -> None:
        self.cfg, self.params, self.num_top = cfg, params, max(1, num_top)

    @staticmethod
    def bucket(n: int) -> int:
        return max(_MIN_BUCKET, 1 << (n - 1).bit_length())

    def __call__(self, ids: list[int], k: int) -> list[TokenLogprobs | None]:
        """vLLM's shape: ``None`` for the first token (nothing precedes it), then per position its
        token's logprob and the ``k`` most likely tokens there."""
        n = len(ids)
        padded = np.zeros((1, self.bucket(n)), np.int32)
        padded[0, :n] = ids
        chosen, top_ids, top_lp = jax.device_get(_scores(self.cfg, self.params, padded, self.num_top))
        out: list[TokenLogprobs | None] = [None]
        for t in range(1, n):
            top = {int(i): float(v) for i, v in zip(top_ids[t - 1, :k], top_lp[t - 1, :k])}
            out.append(TokenLogprobs(int(ids[t]), float(chosen[t - 1]), top))
        return out
