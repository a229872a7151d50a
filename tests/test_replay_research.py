"""The bounded-replay research tool (encoder and decoder replay): replaying the whole prefix is exact;
shorter replays drift, less the longer they are."""

from __future__ import annotations

import numpy as np
import pytest
from test_paged_step import CFG, robust_params

from deepinfer_jax.research.replay import replay_study


def test_replay_study_measures_the_approximation():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, CFG.vocab_size, 90).tolist() for _ in range(2)]
    res = replay_study(robust_params(), CFG, seqs, hit=48, replay_lengths=[8, 16, 48])
    by_w = {r.replay_tokens: r for r in res}
    exact = by_w[48]  # replay from position 0 with the blocks reused: the exact computation
    assert exact.kl.max() < 1e-9 and exact.swa_rel_err.max() < 1e-6 and exact.top1_agree.min() == 1.0
    assert by_w[8].kl.mean() > 1e-7 and by_w[8].swa_rel_err.max() > 1e-3  # the truncation is real
    assert by_w[8].kl.mean() > by_w[16].kl.mean() > exact.kl.mean()
    assert by_w[8].swa_rel_err.shape == (CFG.num_hidden_layers, 90 - 48 - 1)
    dec = {r.replay_tokens: r for r in replay_study(robust_params(), CFG, seqs, hit=48, replay_lengths=[8, 48],
                                                      mode="decoder")}
    assert dec[48].kl.max() == 0 and dec[48].swa_rel_err.max() == 0  # the whole prompt runs the decoder: exact
    assert dec[8].kl.mean() > 0 and dec[8].swa_rel_err[: CFG.decoder_start].max() == 0  # encoder windows exact
    assert dec[8].swa_rel_err[CFG.decoder_start + 1 :].max() > 1e-4
    with pytest.raises(ValueError, match="mode"):
        replay_study(robust_params(), CFG, seqs, hit=48, replay_lengths=[8], mode="both")
    with pytest.raises(ValueError, match="replay_lengths"):
        replay_study(robust_params(), CFG, seqs, hit=48, replay_lengths=[64])
