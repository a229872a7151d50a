"""Checkpoint names, safetensors I/O, the HF -> parameter-tree loader, orbax round trip, CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from deepinfer_jax.checkpoint import names as N
from deepinfer_jax.checkpoint import quant_formats as Q
from deepinfer_jax.checkpoint import safetensors_io as S
from deepinfer_jax.checkpoint.__main__ import main as cli_main
from deepinfer_jax.checkpoint.hf_export import save_hf_checkpoint, tree_to_hf_tensors
from deepinfer_jax.checkpoint.loader import (
    CheckpointError,
    load_hf_checkpoint_tree,
    plan_checkpoint,
    tensors_to_tree,
)
from deepinfer_jax.checkpoint.orbax_io import restore_tree, save_tree
from deepinfer_jax.config import ModelConfig

REPO = Path(__file__).resolve().parents[1]
BF16 = np.dtype(ml_dtypes.bfloat16)

# tensors a released checkpoint carries that the backbone loader must skip
EXTRA = {
    "vision.blocks.0.attn.qkv.weight": np.ones((8, 4), BF16),
    "aligner.proj.weight": np.ones((4, 4), BF16),
    "image_newline": np.ones((64,), BF16),
    "image_pad": np.ones((64,), BF16),
    "mtp.0.attn.wq_a.weight": np.zeros((32, 64), ml_dtypes.float8_e4m3fn),
    "mtp.0.attn.wq_a.scale": np.zeros((1, 2), ml_dtypes.float8_e8m0fnu),
    "mtp.0.main_proj.weight": np.zeros((64, 192), ml_dtypes.float8_e4m3fn),
}


# --------------------------------------------------------------------------- fixtures


def _leaves(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, prefix + (k,))
    else:
        yield prefix, tree


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def _project(value: np.ndarray, kind: N.TensorKind) -> np.ndarray:
    """The value a released-format checkpoint can represent exactly (per tensor, no loader)."""
    if kind is N.TensorKind.FP32:
        return value
    if kind is N.TensorKind.FP8_BLOCK:
        return Q.decode_fp8_blockwise(*Q.encode_fp8_blockwise(value, (32, 32)))
    if kind is N.TensorKind.FP8_ROW:
        return Q.decode_fp8_rowwise(*Q.encode_fp8_rowwise(value, 32))
    if kind is N.TensorKind.FP4_EXPERT:
        return Q.decode_fp4_packed(*Q.encode_fp4_packed(value, 32))
    return value.astype(BF16).astype(np.float32)


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    return ModelConfig.tiny()


@pytest.fixture(scope="module")
def reference_tree(cfg):
    """A random tree in the contract layout whose values are exactly representable on disk."""
    rng = np.random.default_rng(0)
    tree: dict = {}
    for name, (shape, kind) in N.expected_tensors(cfg).items():
        value = _project((rng.standard_normal(shape) * 0.05).astype(np.float32), kind)
        path, expert = N.native_to_path(name)
        node = tree
        for p in path[:-1]:
            node = node.setdefault(p, {})
        if expert is None:
            node[path[-1]] = value
        else:
            node.setdefault(path[-1], np.zeros((cfg.n_routed_experts,) + shape, np.float32))[expert] = value
    return tree


@pytest.fixture(scope="module")
def hf_tensors(cfg, reference_tree):
    return tree_to_hf_tensors(cfg, reference_tree)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, cfg, reference_tree):
    d = tmp_path_factory.mktemp("hf")
    save_hf_checkpoint(d, cfg, reference_tree, max_shard_bytes=64 * 1024, extra_tensors=EXTRA)
    return d


@pytest.fixture(scope="module")
def loaded(hf_dir):
    return load_hf_checkpoint_tree(hf_dir, progress=False)


def assert_trees_equal(a, b):
    la, lb = dict(_leaves(a)), dict(_leaves(b))
    assert la.keys() == lb.keys()
    for path in la:
        assert la[path].dtype == lb[path].dtype, path
        np.testing.assert_array_equal(la[path], lb[path], err_msg=str(path))


# --------------------------------------------------------------------------- names


def test_native_to_path():
    assert N.native_to_path("layers.3.attn.wq_a.weight") == (("layers", 3, "attn", "wq_a", "weight"), None)
    expert_path = ("layers", 12, "ffn", "experts", "w2")
    assert N.native_to_path("layers.12.ffn.experts.5.w2.weight") == (expert_path, 5)
    assert N.native_to_path("layers.0.hc_attn_fn") == (("layers", 0, "hc_attn_fn"), None)
    assert N.native_to_path("embed.weight") == (("embed", "weight"), None)
    for name in ("layers.12.ffn.experts.5.w2.weight", "layers.1.engram.q_weight", "norm.weight"):
        assert N.path_to_native(*N.native_to_path(name)) == name


def test_skip_rules_and_scale_partners():
    skipped = ("vision.x.weight", "aligner.fc.weight", "mtp.2.norm.weight", "image_start", "image_pad.weight")
    for name in skipped:
        assert N.is_skipped(name)
    for name in ("layers.0.attn.wq_a.weight", "embed.weight", "image_token_embed", "norm.weight"):
        assert not N.is_skipped(name)
    assert N.scale_partner("layers.0.attn.wq_a.weight") == "layers.0.attn.wq_a.scale"
    assert N.scale_partner("layers.0.hc_attn_scale") is None
    assert N.weight_of_scale("layers.0.ffn.experts.3.w1.scale") == "layers.0.ffn.experts.3.w1.weight"


def test_expected_tensors_follow_layer_roles(cfg):
    exp = N.expected_tensors(cfg)
    has = lambda L, suffix: f"layers.{L}.{suffix}" in exp  # noqa: E731
    for L in range(cfg.num_hidden_layers):
        role = cfg.layer_role(L).name
        assert has(L, "attn.compressor.wkv.weight") == (role == "FULL")
        assert has(L, "attn.indexer.wk.weight") == (role == "FULL")
        assert has(L, "attn.compressor.wgate.weight") == (role == "FULL" and cfg.compress_ratio(L) > 1)
        assert has(L, "attn.indexer.wq_b.weight") == (role in ("FULL", "REINDEX"))
        assert has(L, "attn.indexer.weights_proj.weight") == (role in ("FULL", "REINDEX"))
        assert has(L, "engram.embed.weight") == (L in cfg.engram_layer_ids)
        assert has(L, f"ffn.experts.{cfg.n_routed_experts - 1}.w2.weight")
    assert [L for L in range(12) if has(L, "attn.compressor.wgate.weight")] == [2, 4]
    assert [L for L in range(12) if has(L, "attn.indexer.wq_b.weight")] == [2, 4, 6, 8, 10]


def test_full_model_shapes_match_published_headers():
    """model.md §7 on-disk dtypes and shapes (scales included) plan cleanly for the real config."""
    cfg = ModelConfig()
    exp = N.expected_tensors(cfg)
    E4, E8, I8, B, F = Q.E4M3, Q.E8M0, np.dtype(np.int8), BF16, np.dtype(np.float32)
    published = {
        "attn.wq_a": ((1280, 5120), (40, 160)),
        "attn.wq_b": ((32768, 1280), (1024, 40)),
        "attn.wkv": ((512, 5120), (16, 160)),
        "attn.wo_a": ((8192, 4096), (256, 128)),
        "attn.wo_b": ((5120, 8192), (160, 256)),
        "attn.indexer.wq_b": ((4096, 1280), (128, 40)),
        "ffn.shared_experts.w1": ((2304, 5120), (72, 160)),
        "ffn.shared_experts.w3": ((2304, 5120), (72, 160)),
        "ffn.shared_experts.w2": ((5120, 2304), (160, 72)),
        "engram.wkv": ((25600, 6144), (800, 192)),
    }
    infos: dict[str, S.TensorInfo] = {}
    for name, (shape, kind) in exp.items():
        stem = name.split(".", 2)[2].removesuffix(".weight") if name.startswith("layers.") else ""
        if kind is N.TensorKind.FP8_BLOCK:
            wshape, sshape = published[stem]
            assert wshape == shape, name
            infos[name] = S.TensorInfo(E4, wshape, 0, 0)
            infos[N.scale_partner(name)] = S.TensorInfo(E8, sshape, 0, 0)
        elif kind is N.TensorKind.FP4_EXPERT:
            infos[name] = S.TensorInfo(I8, (shape[0], shape[1] // 2), 0, 0)
            infos[N.scale_partner(name)] = S.TensorInfo(E8, (shape[0], shape[1] // 32), 0, 0)
        elif kind is N.TensorKind.FP8_ROW:
            assert shape in ((384006168, 256), (384016682, 256))
            infos[name] = S.TensorInfo(E4, shape, 0, 0)
            infos[N.scale_partner(name)] = S.TensorInfo(E8, (shape[0], 8), 0, 0)
        else:
            infos[name] = S.TensorInfo(F if kind is N.TensorKind.FP32 else B, shape, 0, 0)
    assert exp["layers.0.hc_attn_fn"][0] == (24, 20480)
    assert exp["layers.5.ffn.experts.383.w2.weight"][0] == (5120, 2304)
    assert exp["layers.20.attn.compressor.wkv.weight"][0] == (512, 5120)
    assert "layers.20.attn.compressor.wgate.weight" not in exp
    assert "layers.14.attn.compressor.wgate.weight" in exp
    assert "layers.24.attn.indexer.wq_b.weight" in exp and "layers.24.attn.indexer.wk.weight" not in exp

    class HeaderOnly(dict):
        def info(self, name):
            return self[name]

    plan = plan_checkpoint(cfg, HeaderOnly(infos))
    assert plan.ok, plan.error()
    assert len(plan.load) == len(exp) and len(plan.scales) == sum(p is not None for p in plan.load.values())


# --------------------------------------------------------------------------- safetensors


def test_safetensors_round_trip_all_dtypes(tmp_path):
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((5, 7)).astype(np.float32)
    tensors = {
        "f32": f32,
        "f16": f32.astype(np.float16),
        "bf16": f32.astype(BF16),
        "e4m3": f32.astype(ml_dtypes.float8_e4m3fn),
        "e8m0": np.arange(120, 130, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu),
        "i8": np.arange(-4, 4, dtype=np.int8),
        "u8": np.arange(8, dtype=np.uint8),
        "i32": np.arange(3, dtype=np.int32),
        "i64": np.arange(3, dtype=np.int64),
        "bool": np.array([True, False]),
        "empty": np.zeros((0, 3), np.float32),
    }
    S.save_file(tmp_path / "a.safetensors", tensors, metadata={"format": "np"})
    with S.open_checkpoint(tmp_path / "a.safetensors") as r:
        assert set(r) == set(tensors) and r.metadata == {"format": "np"}
        for k, v in tensors.items():
            assert r.info(k).dtype == v.dtype and r.info(k).shape == v.shape
            np.testing.assert_array_equal(r[k].view(np.uint8), v.view(np.uint8))

    # the official library reads what we write, and we read what it writes (FP8 included)
    import torch
    from safetensors.torch import load_file, save_file

    theirs = load_file(tmp_path / "a.safetensors")
    assert theirs["e4m3"].dtype == torch.float8_e4m3fn and theirs["e8m0"].dtype == torch.float8_e8m0fnu
    np.testing.assert_array_equal(theirs["bf16"].float().numpy(), tensors["bf16"].astype(np.float32))
    save_file({"w": theirs["e4m3"], "s": theirs["e8m0"], "b": theirs["bf16"]}, tmp_path / "model.safetensors")
    with S.open_checkpoint(tmp_path) as r:
        np.testing.assert_array_equal(r["w"].view(np.uint8), tensors["e4m3"].view(np.uint8))
        np.testing.assert_array_equal(r["s"].view(np.uint8), tensors["e8m0"].view(np.uint8))
        np.testing.assert_array_equal(r["b"], tensors["bf16"])


def test_safetensors_malformed_files_are_refused(tmp_path):
    bad = tmp_path / "bad.safetensors"
    header = json.dumps({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    with pytest.raises(S.SafetensorsError, match="bad.safetensors:x.*data_offsets"):
        S.open_checkpoint(bad)
    bad.write_bytes(b"\xff" * 16)
    with pytest.raises(S.SafetensorsError, match="header length"):
        S.open_checkpoint(bad)
    with pytest.raises(S.SafetensorsError, match="no model.safetensors"):
        S.open_checkpoint(tmp_path / "nothing")


def test_hf_dir_is_sharded_with_index(hf_dir):
    files = sorted(p.name for p in hf_dir.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= 2 and S.INDEX_FILE in files and "config.json" in files
    index = json.loads((hf_dir / S.INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert "layers.0.ffn.experts.0.w1.scale" in index["weight_map"]


# --------------------------------------------------------------------------- loader


def test_loaded_tree_equals_decoded_originals(cfg, loaded, reference_tree):
    got_cfg, tree = loaded
    assert got_cfg == cfg
    assert_trees_equal(tree, reference_tree)
    E, d, inter, hc = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hc_mult
    assert tree["layers"][0]["ffn"]["experts"]["w1"].shape == (E, inter, d)
    assert tree["layers"][0]["ffn"]["experts"]["w2"].shape == (E, d, inter)
    wkv_shape = ((hc + 1) * d, cfg.num_engram_hash_heads * cfg.engram_head_dim)
    assert tree["layers"][1]["engram"]["wkv"]["weight"].shape == wkv_shape
    assert tree["layers"][2]["attn"]["wo_a"]["weight"].shape == (2 * 16, 4 * 32 // 2)
    assert set(tree) == {"embed", "layers", "norm", "head"} and set(tree["layers"]) == set(range(12))
    assert "mtp" not in tree and "vision" not in tree


def test_in_memory_and_bfloat16(cfg, hf_tensors, reference_tree):
    assert_trees_equal(tensors_to_tree(cfg, hf_tensors), reference_tree)
    tree = tensors_to_tree(cfg, hf_tensors, dtype="bfloat16")
    for path, leaf in _leaves(tree):
        fp32_family = path[-1] in ("attn_sink", "bias", "bias_vl") or str(path[-1]).startswith("hc_")
        assert leaf.dtype == (np.float32 if fp32_family else BF16), path
        np.testing.assert_array_equal(leaf.astype(np.float32), _get(reference_tree, path), err_msg=str(path))


def test_unquantized_checkpoint_loads(cfg, reference_tree):
    plain = tree_to_hf_tensors(cfg, reference_tree, quantize=False)
    assert not any(k.endswith(".scale") for k in plain)
    assert_trees_equal(tensors_to_tree(cfg, plain), reference_tree)


def test_truncated_config_skips_deeper_layers(cfg, hf_tensors, reference_tree):
    short = cfg.replace(num_hidden_layers=6, dspark_target_layer_ids=(3, 4, 5))
    tree = tensors_to_tree(short, hf_tensors)
    assert set(tree["layers"]) == set(range(6))
    np.testing.assert_array_equal(tree["layers"][5]["attn"]["wkv"]["weight"],
                                  reference_tree["layers"][5]["attn"]["wkv"]["weight"])


def test_all_problems_in_one_error(cfg, hf_tensors):
    t = dict(hf_tensors)
    del t["layers.3.attn.wkv.weight"], t["layers.3.attn.wkv.scale"]
    del t["layers.0.ffn.experts.7.w2.weight"], t["layers.0.ffn.experts.7.w2.scale"]
    del t["layers.9.ffn.gate.bias_vl"]
    t["layers.2.attn.indexer.wk.weight"] = np.zeros((32, 31), BF16)  # plain, wrong shape
    t["layers.0.attn.wq_a.scale"] = np.zeros((3, 3), ml_dtypes.float8_e8m0fnu)  # no block fits
    t["layers.1.ffn.experts.0.w1.weight"] = np.zeros((32, 16), np.int8)  # packed: decodes to 32 cols
    del t["layers.4.attn.wo_b.scale"]  # FP8 without its scale
    t["layers.0.attn.bogus.weight"] = np.zeros(3, np.float32)
    t["model.embed_tokens.weight"] = np.zeros((4, 4), BF16)
    t["layers.5.attn.q_norm.scale"] = np.zeros((1, 1), np.uint8)  # scale partner of a 1-D weight
    with pytest.raises(CheckpointError) as info:
        tensors_to_tree(cfg, t)
    err = info.value
    assert isinstance(err, ValueError)
    assert sorted(err.missing) == [
        "layers.0.ffn.experts.7.w2.weight", "layers.3.attn.wkv.weight", "layers.9.ffn.gate.bias_vl"
    ]
    assert sorted(err.misshaped) == sorted([
        "layers.2.attn.indexer.wk.weight", "layers.0.attn.wq_a.weight", "layers.1.ffn.experts.0.w1.weight",
        "layers.4.attn.wo_b.weight", "layers.5.attn.q_norm.weight",
    ])
    assert sorted(err.unknown) == ["layers.0.attn.bogus.weight", "model.embed_tokens.weight"]
    msg = str(err)
    for name in err.missing + err.misshaped + err.unknown:
        assert name in msg
    assert "no block size" in err.reasons["layers.0.attn.wq_a.weight"]
    assert "expected (32, 64), got (32, 32)" in err.reasons["layers.1.ffn.experts.0.w1.weight"]
    assert "scale partner" in err.reasons["layers.4.attn.wo_b.weight"]


@pytest.mark.oracle
def test_quantized_leaves_match_nemo_decoding(hf_tensors, loaded):
    import torch
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import dequantize_checkpoint_weight

    def to_torch(a):
        a = np.ascontiguousarray(a)
        if a.dtype == np.int8:
            return torch.from_numpy(a.copy())
        tdt = torch.float8_e4m3fn if a.dtype == Q.E4M3 else torch.float8_e8m0fnu
        return torch.from_numpy(a.view(np.uint8).copy()).view(tdt)

    _, tree = loaded
    checked = 0
    for scale_name in (k for k in hf_tensors if k.endswith(".scale")):
        name = N.weight_of_scale(scale_name)
        ref = dequantize_checkpoint_weight(
            to_torch(hf_tensors[name]), to_torch(hf_tensors[scale_name]), dtype=torch.float32,
            rowwise=".engram.embed." in name,
        ).numpy()
        path, expert = N.native_to_path(name)
        leaf = _get(tree, path)
        np.testing.assert_array_equal(leaf if expert is None else leaf[expert], ref, err_msg=name)
        checked += 1
    assert checked > 300


# --------------------------------------------------------------------------- orbax and CLI


def test_orbax_round_trip(tmp_path, cfg, loaded):
    _, tree = loaded
    tree_bf16 = {**tree, "head": {"weight": tree["head"]["weight"].astype(BF16)}}
    save_tree(tmp_path / "ck", tree_bf16, cfg)
    got_cfg, got = restore_tree(tmp_path / "ck")
    assert got_cfg == cfg
    assert_trees_equal(got, tree_bf16)
    with pytest.raises(FileExistsError):
        save_tree(tmp_path / "ck", tree, cfg)


def test_cli_convert_and_inspect(tmp_path, hf_dir, loaded, capsys):
    out = tmp_path / "orbax"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-m", "deepinfer_jax.checkpoint", "convert", str(hf_dir), str(out),
         "--dtype", "bfloat16", "--quiet"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    cfg, tree = restore_tree(out)
    assert cfg == loaded[0]
    assert tree["layers"][0]["attn"]["wq_a"]["weight"].dtype == BF16
    assert tree["layers"][0]["hc_attn_fn"].dtype == np.float32
    np.testing.assert_array_equal(tree["layers"][0]["ffn"]["experts"]["w3"].astype(np.float32),
                                  loaded[1]["layers"][0]["ffn"]["experts"]["w3"])

    assert cli_main(["inspect", str(hf_dir)]) == 0
    report = capsys.readouterr().out
    assert "layers 12, hidden 64" in report and "skipped: 7" in report and report.strip().endswith("ok")
