"""Training (``deepinfer_jax.research``): the shipped trained checkpoint beats its card's unigram baseline on a
checked-in held-out sample; a few steps on a 5-layer cut of the tiny config (``tests/cut_model.py``) reduce the
loss; a run resumed from its orbax checkpoint continues bit for bit; the pieces the trainer relies on (weight
fake-quant = the export encoders, the tied-vocabulary head = the full softmax) are exact.

The fixture ``tests/fixtures/stdlib_heldout_sample.py.txt`` is an excerpt of ``string.py`` from CPython 3.11's
standard library (PSF License), a file of the training run's held-out split.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("optax")

import jax
import jax.numpy as jnp
from cut_model import tiny_cut

from deepinfer_jax.checkpoint import quant_formats as Q
from deepinfer_jax.research import train as T
from deepinfer_jax.research.corpus import batch_for_step, is_heldout
from deepinfer_jax.research.qat import fake_quant_tree, quantize_leaf

REPO = Path(__file__).resolve().parent.parent
TRAINED = REPO / "checkpoints" / "small-trained"
FIXTURE = REPO / "tests" / "fixtures" / "stdlib_heldout_sample.py.txt"

CFG = tiny_cut()  # the 5-layer cut (every layer role), passed to ``T.train``: the point here is the trainer
# qat off and no held-out evaluation while training: one small compilation shared by the tests below
TINY = T.TrainConfig(preset="tiny", steps=10, batch_size=4, seq_len=32, lr=1e-2, warmup_steps=2, qat=False,
                     eval_windows=0, ckpt_every=5)


def _tiny_data() -> T.TrainData:
    rng = np.random.default_rng(0)
    pattern = rng.integers(2, 300, 40).astype(np.int32)  # a learnable stream; ids >= 300 never occur
    return T.TrainData(np.tile(pattern, 100), np.tile(pattern, 5))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return T.train(TINY, tmp_path_factory.mktemp("run"), _tiny_data(), CFG, progress=False)


def test_shipped_checkpoint_beats_the_cards_unigram_baseline():
    from deepinfer_jax.checkpoint import load_hf_checkpoint
    from deepinfer_jax.model.deepseek_v41 import forward_full
    from deepinfer_jax.tokenizer import load_tokenizer

    card = json.loads((TRAINED / "metrics.json").read_text())
    cfg, params = load_hf_checkpoint(TRAINED, progress=False)
    assert cfg.fake_quant  # the engine's default numerics
    ids = load_tokenizer().encode(FIXTURE.read_text(encoding="utf-8"), add_special_tokens=False).ids
    n = card["fixture"]["tokens"]
    win = np.asarray([[cfg.bos_token_id, *ids[:n]]], np.int32)
    logits = jax.jit(forward_full, static_argnums=1)(params, cfg, win[:, :-1])
    nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, win[:, 1:, None], -1)[..., 0]
    loss = float(nll.mean())
    assert loss < card["fixture"]["unigram_loss"] - 1.0
    assert loss < card["unigram"]["loss"] - 1.0  # the held-out split's stated baseline too
    assert abs(loss - card["fixture"]["loss"]) < 0.02  # the card's number reproduces
    assert card["trained"]["loss"] < card["unigram"]["loss"] < card["random_init"]["loss"]


def test_fixture_is_from_the_heldout_split():
    assert is_heldout("string.py", 20)


def test_a_few_tiny_steps_reduce_the_loss(tiny_run):
    losses = [r["loss"] for r in tiny_run[1]["metrics"]]
    assert len(losses) == TINY.steps and np.all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.5


def test_resume_continues_bit_identically(tiny_run, tmp_path):
    data, cfg = _tiny_data(), CFG
    T.train(TINY, tmp_path, data, cfg, progress=False, stop_after=5)  # "interrupted" after step 5
    assert T.latest_checkpoint(tmp_path / T.CKPT_DIR).name == "step_0000005"
    resumed, info = T.train(TINY, tmp_path, data, cfg, progress=False)
    full, full_info = tiny_run
    assert int(resumed.step) == TINY.steps
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [r["loss"] for r in info["metrics"]] == [r["loss"] for r in full_info["metrics"]]
    with pytest.raises(ValueError, match="different configuration"):
        T.train(dataclasses.replace(TINY, seed=1), tmp_path, data, cfg, progress=False)


def test_tied_vocabulary_head_is_the_full_softmax(tiny_run):
    """The trainer scores the seen tokens plus one tail column; the exported model scores all 512."""
    from deepinfer_jax.model.deepseek_v41 import forward_full
    from deepinfer_jax.params import params_from_tree

    state, info = tiny_run
    tie, cfg = info["tie"], T.train_forward_config(CFG)
    assert tie.n_unseen > 0
    windows = batch_for_step(_tiny_data().train, 7, 0, 2, 16, 0)
    windows[:, 5] = 450  # an unseen token as a target (and as an input)
    consts = {**tie.consts(), "token_map": jnp.asarray(info["token_map"])}
    got = T.make_eval_fn(CFG, TINY, tie.n_unseen)(state.params, consts, jnp.asarray(windows))
    exported = params_from_tree(cfg, T.export_tree(state.params, tie), token_map=info["token_map"])
    logits = jax.jit(forward_full, static_argnums=1)(exported, cfg, windows[:, :-1])
    want = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, windows[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt, shape", [("fp8_block", (70, 45)), ("fp8_row", (9, 40)), ("fp4", (3, 20, 64)),
                                        ("bf16", (5, 7))])
def test_weight_fake_quant_matches_the_export_encoders(fmt, shape):
    rng = np.random.default_rng(1)
    w = (rng.standard_normal(shape) * rng.choice([1e-3, 0.02, 3.0], size=shape[:-1] + (1,))).astype(np.float32)
    got = np.asarray(quantize_leaf(jnp.asarray(w), fmt))
    mats = w.reshape(-1, shape[-2], shape[-1]) if w.ndim == 3 else w[None]
    if fmt == "fp8_block":
        want = [Q.decode_fp8_blockwise(*Q.encode_fp8_blockwise(m, (32, 32)), block=(32, 32)) for m in mats]
    elif fmt == "fp8_row":
        want = [Q.decode_fp8_rowwise(*Q.encode_fp8_rowwise(m, 32), group=32) for m in mats]
    elif fmt == "fp4":
        want = [Q.decode_fp4_packed(*Q.encode_fp4_packed(m, 32), group=32) for m in mats]
    else:
        want = [m.astype(jnp.bfloat16).astype(np.float32) for m in mats]
    np.testing.assert_array_equal(got, np.stack(want).reshape(shape))
    assert not np.array_equal(got, w)  # the rounding is real


def test_weight_fake_quant_passes_gradients_straight_through():
    tree = {"a": {"weight": jnp.linspace(-1.0, 1.0, 64).reshape(2, 32)}, "b": jnp.ones(3)}
    formats = {("a", "weight"): "fp4", ("b",): "fp32"}
    grads = jax.grad(lambda t: sum(jnp.sum(x * 3.0) for x in jax.tree.leaves(fake_quant_tree(t, formats))))(tree)
    np.testing.assert_array_equal(np.asarray(grads["a"]["weight"]), 3.0)
    with pytest.raises(KeyError, match="no storage format"):
        fake_quant_tree({"c": jnp.ones(2)}, formats)
