"""The public API end to end: init, forward, state-dict loading, orbax round trip, the shipped checkpoint."""

from __future__ import annotations

import filecmp
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import deepinfer_jax
from deepinfer_jax import CheckpointError, ModelConfig, forward_full, init_params, params_from_state_dict
from deepinfer_jax.checkpoint import load_params, save_params
from deepinfer_jax.checkpoint.hf_export import tree_to_hf_tensors

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "checkpoints" / "small-random"
fwd = jax.jit(forward_full, static_argnums=1)


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.tiny()
    return cfg, init_params(cfg, seed=3)


def _native(cfg, params) -> dict[str, np.ndarray]:
    tree = nnx.to_pure_dict(params)
    tree.pop("engram_token_map")
    return tree_to_hf_tensors(cfg, tree, quantize=False, plain_dtype=np.float32)


def test_public_names():
    for name in ("ModelConfig", "load_hf_checkpoint", "params_from_state_dict", "init_params", "forward_full"):
        assert callable(getattr(deepinfer_jax, name))


def test_forward_rejects_bad_token_ids(tiny):
    cfg, params = tiny
    for bad in (np.asarray([[1, 2, cfg.vocab_size]]), np.asarray([[-1, 2]]), np.asarray([1, 2, 3]),
                np.asarray([[0.5, 1.0]]), np.zeros((1, 0), np.int32)):
        with pytest.raises(ValueError, match="token_ids"):
            forward_full(params, cfg, bad)


def test_state_dict_round_trip_gives_identical_logits(tiny):
    cfg, params = tiny
    again = params_from_state_dict(cfg, _native(cfg, params))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 21))
    np.testing.assert_array_equal(np.asarray(fwd(params, cfg, ids)), np.asarray(fwd(again, cfg, ids)))


def test_state_dict_errors_list_every_problem(tiny):
    cfg, params = tiny
    tensors = _native(cfg, params)
    del tensors["layers.3.attn.wq_a.weight"], tensors["norm.weight"]
    tensors["layers.0.attn.wkv.weight"] = tensors["layers.0.attn.wkv.weight"][:, :-1]
    tensors["layers.0.attn.bogus.weight"] = np.zeros((2, 2), np.float32)
    with pytest.raises(CheckpointError) as err:
        params_from_state_dict(cfg, tensors)
    e = err.value
    assert set(e.missing) == {"layers.3.attn.wq_a.weight", "norm.weight"}
    assert e.misshaped == ["layers.0.attn.wkv.weight"] and e.unknown == ["layers.0.attn.bogus.weight"]
    for name in ("layers.3.attn.wq_a.weight", "norm.weight", "layers.0.attn.wkv.weight", "layers.0.attn.bogus.weight"):
        assert name in str(e)


def test_orbax_round_trip(tiny, tmp_path):
    cfg, params = tiny
    save_params(tmp_path / "ckpt", cfg, params)
    cfg2, params2 = load_params(tmp_path / "ckpt")
    assert cfg2 == cfg
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 21))  # the shape above: one compiled program
    np.testing.assert_array_equal(np.asarray(fwd(params, cfg, ids)), np.asarray(fwd(params2, cfg, ids)))


def test_token_map_validation():
    cfg = ModelConfig.tiny()
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        init_params(cfg, token_map=np.full(cfg.vocab_size, cfg.vocab_size))


def test_small_uses_the_tokenizer_derived_engram_map():
    cfg = ModelConfig.small()
    from deepinfer_jax.params import engram_token_map

    m = engram_token_map(cfg)
    assert m.shape == (cfg.vocab_size,) and m.max() == cfg.engram_compressed_vocab_size - 1


def test_shipped_checkpoint_is_reproduced_by_its_script(tmp_path):
    from deepinfer_jax.checkpoint.make_random import write_random_checkpoint

    files = write_random_checkpoint(tmp_path / "again", preset="small", seed=0)
    for f in files:
        assert filecmp.cmp(f, SHIPPED / f.name, shallow=False), f.name
    assert sorted(p.name for p in SHIPPED.iterdir()) == sorted(f.name for f in files)


def test_shipped_checkpoint_loads_and_runs():
    cfg, params = deepinfer_jax.load_hf_checkpoint(SHIPPED, progress=False)
    assert cfg == ModelConfig.small()
    ids = np.asarray([[0, 671, 6102, 294, 8760, 344]])
    logits = np.asarray(fwd(params, cfg, ids))
    assert logits.shape == (1, 6, cfg.vocab_size) and np.isfinite(logits).all()
