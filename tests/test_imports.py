"""The two worlds stay apart (docs/architecture.md §4): device code never imports host packages, and host
code never imports jax.numpy. Checked statically on the source, so it cannot be fooled by lazy imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "deepinfer_jax"
HOST_PACKAGES = ("deepinfer_jax.checkpoint", "deepinfer_jax.engram_vocab", "deepinfer_jax.tokenizer", "tokenizers",
                 "deepinfer_jax.engine", "deepinfer_jax.cache", "deepinfer_jax.recipe", "torch", "nemo_automodel")
HOST_MODULES = ["engram_vocab.py", "tokenizer.py", "chat_grammar.py", "parallel/eplb.py", "parallel/eplb_policy.py",
                *[str(p.relative_to(PKG)) for d in ("checkpoint", "cache", "config", "engine", "recipe", "serve")
                  for p in sorted((PKG / d).rglob("*.py"))]]
DEVICE_MODULES = [f"model/{p.name}" for p in (PKG / "model").glob("*.py")] + [
    "parallel/ep_moe.py", "parallel/ep_model.py", "parallel/weight_moves.py", "parallel/mesh.py"] + [
    str(p.relative_to(PKG)) for p in sorted((PKG / "ops").rglob("*.py")) if "ascend" not in p.parts]


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, top_level) for every import in the file."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, id(node) in top))
    return out


@pytest.mark.parametrize("rel", DEVICE_MODULES)
def test_device_code_imports_no_host_package(rel):
    bad = [m for m, _ in _imports(PKG / rel) if m.startswith(HOST_PACKAGES)]
    assert not bad, f"{rel} imports host code: {bad}"


@pytest.mark.parametrize("rel", HOST_MODULES)
def test_host_code_never_imports_jax_numpy_at_module_level(rel):
    bad = [m for m, top in _imports(PKG / rel) if top and (m == "jax" or m.startswith(("jax.", "flax")))]
    assert not bad, f"{rel} imports {bad} at module level"
