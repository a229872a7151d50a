"""Sharding presets, the rules table, the sharded forward on 8 fake devices and across two processes.

Preset loading, validation and the rules run here (one device). The sharded forward runs in
subprocesses (``tests/sharded/shard_*.py``) with fake CPU devices, so this process keeps its one
device; the 8-device run and the two-process run start together (module fixture) and each test
waits for its own, every subprocess bounded by a timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from deepinfer_jax import ModelConfig
from deepinfer_jax import sharding as sh
from deepinfer_jax.config import CacheConfig
from deepinfer_jax.model.deepseek_v41 import abstract_params
from deepinfer_jax.model.kv_cache import init_cache

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "sharded"
TIMEOUT_S = 240
TOLERANCE = 1e-5
EIGHT_DEVICE_PRESETS = ("cpu-dp2-ep4", "cpu-dp1-ep8", "cpu-dp8-ep1", "prefill-ep8-dp8", "cpu-dp2-ep2-tp2")


def _preset(**changes) -> dict:
    raw = {"name": "t", "mesh": {"axes": ["dp", "ep"], "shape": [2, 4]}, "parallel": {"dp_size": 2, "ep_size": 4},
           "eplb": {"redundant_slots_per_rank": 1, "window_steps": 8, "rebalance_period": 16, "dispatch": "all_to_all"}}
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            raw[section] = {**raw.get(section, {}), field: value}
        else:
            raw[section] = value
    return raw


# ---- presets --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, shape, dp, ep, redundant, window, period, dispatch", [
    ("prefill-ep8-dp8", (1, 8), 8, 8, 4, 100, 1000, "ragged_all_to_all"),
    ("decode-ep64-dp64", (1, 64), 64, 64, 1, 1000, 10000, "ragged_all_to_all"),
    ("decode-ep128-dp128", (1, 128), 128, 128, 1, 1000, 10000, "ragged_all_to_all"),
    ("cpu-dp2-ep4", (2, 4), 2, 4, 1, 8, 16, "all_to_all"),
    ("cpu-dp1-ep8", (1, 8), 1, 8, 1, 8, 16, "all_to_all"),
    ("cpu-dp8-ep1", (8, 1), 8, 1, 1, 8, 16, "all_to_all"),
    ("single", (1, 1), 1, 1, 0, 100, 1000, "all_to_all"),
])
def test_shipped_presets(name, shape, dp, ep, redundant, window, period, dispatch):
    p = sh.resolve_preset(name)
    assert (p.name, p.axes, p.shape, p.dp_size, p.ep_size) == (name, ("dp", "ep"), shape, dp, ep)
    assert (p.eplb.redundant_slots_per_rank, p.eplb.window_steps, p.eplb.rebalance_period, p.eplb.dispatch) == (
        redundant, window, period, dispatch)
    assert p.ep_axes == ("ep",)
    assert p.dp_axes == (("dp", "ep") if name.startswith(("prefill", "decode")) else ("dp",))
    assert p.mesh_axes("cache_slots") == p.mesh_axes("cache_blocks") == p.dp_axes  # caches follow the batch
    assert p.num_devices == shape[0] * shape[1]
    assert hash(p) == hash(sh.resolve_preset(name))  # hashable, a static jit argument


def test_available_presets_and_paths(tmp_path):
    assert set(EIGHT_DEVICE_PRESETS) | {"single", "decode-ep64-dp64", "decode-ep128-dp128"} <= set(
        sh.available_presets())
    path = tmp_path / "mine.toml"
    path.write_text((sh.PRESET_DIR / "cpu-dp2-ep4.toml").read_text().replace('name = "cpu-dp2-ep4"\n', ""))
    p = sh.resolve_preset(path)
    assert p.name == "mine" and p.shape == (2, 4)
    assert sh.resolve_preset(p) is p
    assert p.experts_per_rank(ModelConfig.tiny()) == 8 // 4 + 1


@pytest.mark.parametrize("changes, field", [
    ({"mesh__axes": ["dp", "xp"]}, "mesh.axes[1]"),
    ({"mesh__axes": ["dp", "dp"]}, "mesh.axes"),
    ({"mesh__shape": "2x4"}, "mesh.shape"),
    ({"mesh__shape": [2]}, "mesh.shape"),
    ({"mesh__shape": ["2", 4]}, "mesh.shape[0]"),
    ({"mesh__shape": [0, 4]}, "mesh.shape[0]"),
    ({"mesh": {"axes": ["dp", "ep"]}}, "mesh.shape"),
    ({"parallel__dp_size": 4}, "parallel.dp_size"),
    ({"parallel__ep_size": 8}, "parallel.ep_size"),
    ({"parallel": {"dp_size": 2}}, "parallel.ep_size"),
    ({"parallel__ep_size": 4.0}, "parallel.ep_size"),
    ({"parallel__pp_size": 2}, "parallel.pp_size"),
    ({"rules__sequence": "dp"}, "rules.sequence"),
    ({"rules__batch": ["dp", "zz"]}, "rules.batch"),
    ({"rules__batch": 3}, "rules.batch"),
    ({"eplb__dispatch": "nccl"}, "eplb.dispatch"),
    ({"eplb__redundant_slots_per_rank": -1}, "eplb.redundant_slots_per_rank"),
    ({"eplb__window_steps": "100"}, "eplb.window_steps"),
    ({"eplb__rebalance_period": True}, "eplb.rebalance_period"),
    ({"eplb__enabled": 1}, "eplb.enabled"),
    ({"eplb__slots": 1}, "eplb.slots"),
    ({"extra": 1}, "extra"),
])
def test_bad_presets_name_the_field(changes, field):
    with pytest.raises(sh.ShardingError) as err:
        sh.ShardingPreset.from_dict(_preset(**changes))
    assert err.value.field == field
    assert str(err.value).startswith(field)
    assert isinstance(err.value, ValueError)


def test_rules_override_and_tp_axis():
    p = sh.ShardingPreset.from_dict(_preset(mesh={"axes": ["dp", "ep"], "shape": [1, 8]},
                                            parallel={"dp_size": 8, "ep_size": 8}, rules={"batch": ["dp", "ep"]}))
    assert p.dp_axes == ("dp", "ep") and p.mesh_axes("cache_blocks") == ("dp", "ep")
    assert p.mesh_axes("vocab") == ()  # tp is not in this mesh: replicated
    tp = sh.resolve_preset("cpu-dp2-ep2-tp2")
    assert tp.mesh_axes("vocab") == tp.mesh_axes("heads") == ("tp",)
    assert sh.logical_spec(("vocab", "embed"), (512, 64), tp) == PartitionSpec("tp")


def test_unknown_preset_and_bad_files(tmp_path):
    with pytest.raises(sh.ShardingError, match="unknown preset 'ep3'") as err:
        sh.resolve_preset("ep3")
    assert err.value.field == "sharding"
    with pytest.raises(sh.ShardingError) as err:
        sh.resolve_preset(3)
    assert err.value.field == "sharding"
    bad = tmp_path / "bad.toml"
    bad.write_text("[mesh\n")
    with pytest.raises(sh.ShardingError, match="not valid TOML") as err:
        sh.resolve_preset(bad)
    assert err.value.field == "preset"
    with pytest.raises(sh.ShardingError, match="cannot read"):
        sh.resolve_preset(tmp_path / "missing.toml")


def test_mesh_larger_than_devices_and_experts_not_divisible():
    with pytest.raises(sh.ShardingError, match=f"needs 64 devices .* only {jax.device_count()} available") as err:
        sh.make_mesh("decode-ep64-dp64")
    assert err.value.field == "mesh.shape"
    with pytest.raises(sh.ShardingError, match="needs 8 devices .* only 2 available"):
        sh.make_mesh("cpu-dp2-ep4", devices=jax.devices()[:1] * 2)
    with pytest.raises(sh.ShardingError, match="does not divide the model's n_routed_experts 8") as err:
        sh.resolve_preset("decode-ep64-dp64").validate_for(ModelConfig.tiny())
    assert err.value.field == "parallel.ep_size"
    mesh = sh.make_mesh("single")
    assert dict(mesh.shape) == {"dp": 1, "ep": 1}
    if hasattr(mesh, "axis_types"):
        assert all("Auto" in str(t) for t in mesh.axis_types)


# ---- the rules on parameters and caches -------------------------------------------------------------


def _paths(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _paths(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


@pytest.mark.parametrize("cfg", [ModelConfig.tiny(), ModelConfig.small()], ids=["tiny", "small"])
def test_every_parameter_has_logical_axes(cfg):
    from flax import nnx

    preset = sh.resolve_preset("cpu-dp2-ep2-tp2")
    specs = {}
    for path, leaf in _paths(nnx.to_pure_dict(abstract_params(cfg))):
        axes = sh.param_logical_axes(path)
        assert len(axes) == len(leaf.shape), path
        specs[path] = sh.logical_spec(axes, leaf.shape, preset, path)
    assert specs["layers.0.ffn.experts.w1"] == PartitionSpec("ep", "tp")
    assert specs["layers.0.ffn.experts.w2"] == PartitionSpec("ep", None, "tp")
    assert specs["layers.0.ffn.gate.weight"] == PartitionSpec()  # every token scores every expert
    assert specs["head.weight"] == specs["embed.weight"] == PartitionSpec("tp")
    assert specs["layers.0.attn.wq_b.weight"] == PartitionSpec("tp")
    with pytest.raises(sh.ShardingError, match="no entry in sharding.PARAM_AXES") as err:
        sh.param_logical_axes("layers.3.attn.wq_c.weight")
    assert err.value.field == "layers.3.attn.wq_c.weight"


def test_drafter_parameters_have_logical_axes():
    from flax import nnx

    from deepinfer_jax.model.dspark import DSparkDrafter

    cfg = ModelConfig.tiny()
    preset = sh.resolve_preset("cpu-dp2-ep2-tp2")
    state = nnx.split(nnx.eval_shape(lambda: DSparkDrafter(cfg, rngs=nnx.Rngs(0))))[1]
    specs = {p: sh.logical_spec(sh.param_logical_axes(p), leaf.shape, preset, p)
             for p, leaf in _paths(nnx.to_pure_dict(state))}
    assert specs["mtp.0.ffn.experts.w1"] == PartitionSpec("ep", "tp")
    assert specs["mtp.2.markov_head.head.weight"] == PartitionSpec("tp")
    assert specs["mtp.0.main_proj.weight"] == PartitionSpec()


def test_param_shardings_tree_matches_the_state():
    state = abstract_params(ModelConfig.tiny())
    shardings = sh.param_shardings(state, sh.make_mesh("single"))
    assert jax.tree.structure(shardings) == jax.tree.structure(state)
    assert all(isinstance(s, jax.sharding.NamedSharding) for s in jax.tree.leaves(shardings))


def test_cache_logical_axes_and_divisibility():
    cfg = ModelConfig.tiny()
    preset = sh.resolve_preset("cpu-dp2-ep4")
    for storage in ("quantized", "dequantized"):
        cc = CacheConfig(block_size=16, num_blocks=8, max_requests=4, max_blocks_per_request=4, storage=storage)
        cache = jax.eval_shape(lambda cc=cc: init_cache(cfg, cc))
        for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]:
            top = path[0].key
            spec = sh.logical_spec(sh.CACHE_AXES[top], leaf.shape, preset, top)
            assert spec == {"swa": PartitionSpec(None, "dp")}.get(top, PartitionSpec("dp")), (path, spec)
    cc = CacheConfig(block_size=16, num_blocks=8, max_requests=3, max_blocks_per_request=4)
    cache = jax.eval_shape(lambda: init_cache(cfg, cc))
    with pytest.raises(sh.ShardingError, match=r"dimension 1 \('cache_slots', size 3\) does not divide"):
        sh.logical_spec(sh.CACHE_AXES["swa"], cache["swa"]["q"].shape, preset, "cache.swa.q")
    with pytest.raises(sh.ShardingError, match="no entry in sharding.CACHE_AXES"):
        sh.cache_shardings({"ring": np.zeros(2)}, sh.make_mesh("single"))


def test_logical_spec_errors():
    preset = sh.resolve_preset("cpu-dp2-ep4")
    with pytest.raises(sh.ShardingError, match=r"experts.w1: dimension 0 \('experts', size 6\)") as err:
        sh.logical_spec(("experts", None, None), (6, 4, 4), preset, "experts.w1")
    assert err.value.field == "experts.w1"
    with pytest.raises(sh.ShardingError, match="two dimensions"):
        sh.logical_spec(("batch", "cache_slots"), (4, 4), preset, "x")
    with pytest.raises(sh.ShardingError, match="unknown logical axis 'rows'"):
        sh.logical_spec(("rows",), (4,), preset, "x")


# ---- multi-host settings ----------------------------------------------------------------------------


def test_init_distributed_settings():
    assert sh.init_distributed(environ={}) is False  # nothing set: single process, no-op
    cases = [
        ({"DEEPINFER_COORDINATOR": "127.0.0.1:1234"}, "num_processes (DEEPINFER_NUM_PROCESSES)"),
        ({"DEEPINFER_COORDINATOR": "localhost", "DEEPINFER_NUM_PROCESSES": "2", "DEEPINFER_PROCESS_ID": "0"},
         "coordinator_address (DEEPINFER_COORDINATOR)"),
        ({"DEEPINFER_COORDINATOR": "h:1", "DEEPINFER_NUM_PROCESSES": "two", "DEEPINFER_PROCESS_ID": "0"},
         "num_processes (DEEPINFER_NUM_PROCESSES)"),
        ({"DEEPINFER_COORDINATOR": "h:1", "DEEPINFER_NUM_PROCESSES": "2", "DEEPINFER_PROCESS_ID": "2"},
         "process_id (DEEPINFER_PROCESS_ID)"),
    ]
    for env, field in cases:
        with pytest.raises(sh.ShardingError) as err:
            sh.init_distributed(environ=env)
        assert err.value.field == field, env
    with pytest.raises(sh.ShardingError) as err:
        sh.init_distributed("h:1", 2, -1, environ={})
    assert err.value.field == "process_id (DEEPINFER_PROCESS_ID)"


# ---- subprocess runs: 8 fake devices, and two processes of 4 ------------------------------------------


def _env(devices: int, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(ROOT / ".jax_cache"))
    return {**env, **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _finish(runs: dict, key: str) -> list[tuple[int, str]]:
    """(exit code, output) of each process of ``runs[key]``, waiting within the timeout (once); kill all on overrun."""
    if key not in runs["done"]:
        procs = runs[key]
        try:
            outs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            outs = [p.communicate()[0] for p in procs]
            pytest.fail(f"{key}: subprocess timed out after {TIMEOUT_S} s; output tails: {[o[-2000:] for o in outs]}")
        runs["done"][key] = [(p.returncode, out) for p, out in zip(procs, outs)]
    return runs["done"][key]


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start the 8-device run and the two-process run together (they overlap on the two cores)."""
    tmp = tmp_path_factory.mktemp("sharded")
    port = _free_port()

    def start(args, env):
        return subprocess.Popen([sys.executable, *map(str, args)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    forward = start([SCRIPTS / "shard_forward.py", tmp / "ref.npz", *EIGHT_DEVICE_PRESETS], _env(8))
    multi = [start([SCRIPTS / "shard_multihost.py", "cpu-dp2-ep4", tmp / "multihost"],
                   _env(4, DEEPINFER_COORDINATOR=f"127.0.0.1:{port}", DEEPINFER_NUM_PROCESSES="2",
                        DEEPINFER_PROCESS_ID=str(i))) for i in range(2)]
    yield {"tmp": tmp, "forward": [forward], "multi": multi, "done": {}}
    for p in [forward, *multi]:  # a test that failed early leaves them running
        if p.poll() is None:
            p.kill()
            p.communicate()


def test_sharded_forward_matches_one_device(runs):
    [(code, out)] = _finish(runs, "forward")
    assert code == 0, out[-4000:]
    results = {r["preset"]: r for r in _json_lines(out) if "preset" in r}
    assert set(results) == set(EIGHT_DEVICE_PRESETS), out[-4000:]
    for name, r in results.items():
        preset = sh.resolve_preset(name)
        dp, ep, tp = (preset.axis_size(*preset.mesh_axes(a)) for a in ("batch", "experts", "vocab"))
        assert r["shape"] == [8, 16, 512]
        assert r["max_abs_err"] <= TOLERANCE, r
        assert r["logit_scale"] > 100 * TOLERANCE  # the comparison is not between zeros
        if r["max_abs_err_padded"] is not None:
            assert r["max_abs_err_padded"] <= TOLERANCE, r
        if name in ("cpu-dp2-ep4", "cpu-dp1-ep8"):  # also through the shard_map expert-parallel MoE
            assert r["max_abs_err_expert_parallel"] is not None and r["max_abs_err_expert_parallel"] <= TOLERANCE, r
        # the layout really is the preset's: batch over dp, experts over ep, vocab and heads over tp
        assert r["logits_shard"] == [8 // dp, 16, 512 // tp], r
        assert r["experts_w1_shard"] == [8 // ep, 32 // tp, 64], r
        assert r["gate_shard"] == [8, 64] and r["head_shard"] == [512 // tp, 64], r
        assert r["wq_b_shard"] == [128 // tp, 32], r
        assert r["swa_q_shard"] == [5, 8 // dp, 14, 32] and r["comp_v_shard"] == [8 // dp, 2 + 6, 32], r
        assert r["global_kv_q_shard"] == [16 // dp, 8, 16], r


def test_two_processes_match_one(runs):
    results = _finish(runs, "multi")
    for code, out in results:
        assert code == 0, out[-4000:]
    lines = [_json_lines(out)[-1] for _, out in results]
    assert [r["process"] for r in lines] == [0, 1]
    assert all(r["processes"] == 2 and r["devices"] == 8 and r["local_devices"] == 4 for r in lines), lines
    assert [r["addressable_rows"] for r in lines] == [[0], [4]]  # each process holds its DP rank's rows
    [(code, out)] = _finish(runs, "forward")
    assert code == 0, out[-4000:]
    want = np.load(runs["tmp"] / "ref.npz")["logits"]
    for i in range(2):
        got = np.load(runs["tmp"] / f"multihost{i}.npy")
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= TOLERANCE, (i, float(np.abs(got - want).max()))
