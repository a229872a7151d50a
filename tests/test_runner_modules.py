"""One runner (issue 22 item 1): the runner modules share their programs through public names only, and the
one ``ModelRunner`` is the single-device runner and the mesh runner (the mesh equality tests are in
``tests/test_dp_engine.py``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parent.parent / "deepinfer_jax" / "runner"


def test_no_runner_module_imports_a_private_name_of_another():
    bad = []
    for path in sorted(RUNNER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deepinfer_jax"):
                bad += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not bad, bad


def test_there_is_one_runner_class_for_one_device_and_a_mesh():
    from deepinfer_jax import runner

    assert not (RUNNER / "dp_runner.py").exists()
    assert {"mesh", "preset"} <= set(runner.ModelRunner.__init__.__code__.co_varnames)


def test_a_mesh_without_a_preset_is_refused_naming_both():
    from deepinfer_jax import ModelConfig
    from deepinfer_jax.config import CacheConfig
    from deepinfer_jax.runner import Buckets, ModelRunner

    bk = Buckets(tokens=(8,), requests=(2,), blocks=(2,))
    cc = CacheConfig(block_size=16, num_blocks=4, max_requests=2, max_blocks_per_request=2)
    with pytest.raises(ValueError, match="mesh and preset"):
        ModelRunner(ModelConfig.tiny(), None, cc, bk, mesh=object())
    with pytest.raises(ValueError, match="mesh and preset"):  # decoder_replay runs over a mesh (issue 22)
        ModelRunner(ModelConfig.tiny(), None, cc, bk, decoder_replay=True, mesh=object())


def test_the_prefix_cache_copies_name_a_rank_of_the_runner():
    """The block and window copies take the DP rank they touch (over a mesh: its slice of the stacked cache; the
    copies' equality with one device is in ``tests/test_dp_engine.py``); one device has rank 0 only."""
    from deepinfer_jax import ModelConfig
    from deepinfer_jax.config import CacheConfig
    from deepinfer_jax.runner import Buckets, ModelRunner

    bk = Buckets(tokens=(8,), requests=(2,), blocks=(2,))
    cc = CacheConfig(block_size=16, num_blocks=4, max_requests=2, max_blocks_per_request=2)
    runner = ModelRunner(ModelConfig.tiny(), None, cc, bk)
    for copy in (lambda: runner.snapshot_swa(0, rank=1), lambda: runner.read_blocks([0], rank=-1),
                 lambda: runner.restore_swa(0, None, [], 0, rank=2), lambda: runner.write_blocks([0], [{}], rank=1)):
        with pytest.raises(ValueError, match=r"rank must lie in \[0, 1\)"):
            copy()
    assert runner.block_payloads(runner.read_blocks([1], rank=0))[0].keys() == set(runner._global_names)
