"""No import circles among deepinfer_jax's configuration, model, parallel and sharding code.

The layers, bottom first: ``config`` (plain Python) < ``model`` (the model and its kernels, ``ops``, and the
store of compiled programs, ``runner.program_store``, which ``generate_ragged`` uses) < ``parallel`` <
``sharding`` (the module ``deepinfer_jax.sharding``). A module may import its own
layer and the layers below, never one above, so no chain of imports can come back to where it
started. Checked statically on the source (imports at module level and inside functions alike),
so a lazy import cannot hide an upward edge. A module that imports nothing from ``deepinfer_jax``
(``LEAVES``) may be imported from any layer: it cannot close a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "deepinfer_jax"
#: Layer of each module prefix, bottom first.
LAYERS = {"deepinfer_jax.config": 0, "deepinfer_jax.model": 1, "deepinfer_jax.ops": 1,
          "deepinfer_jax.runner.program_store": 1, "deepinfer_jax.parallel": 2, "deepinfer_jax.sharding": 3}
LAYER_NAMES = ("config", "model", "parallel", "sharding")
#: Modules that any layer may import: they import nothing from deepinfer_jax.
LEAVES = ("deepinfer_jax.model.engram_consts", "deepinfer_jax.model.routing", "deepinfer_jax.compile_cache",
          "deepinfer_jax.compile_options")
#: Upward edges still present, each with the work that removes it (the test fails once it is gone, so
#: the entry is removed with it).
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imported(path: Path) -> set[str]:
    """Every deepinfer_jax module the file imports (``from pkg import name`` counts as ``pkg.name`` when that is
    a module or package, else as ``pkg``)."""
    tree = ast.parse(path.read_text())
    here = _module_name(path).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                rel = Path(*full.split("."))
                is_module = (PKG.parent / rel).with_suffix(".py").is_file() or (PKG.parent / rel).is_dir()
                out.add(full if is_module else base)
    return {m for m in out if m == "deepinfer_jax" or m.startswith("deepinfer_jax.")}


def _layer(module: str) -> int | None:
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


SOURCES = sorted(p for p in PKG.rglob("*.py") if _layer(_module_name(p)) is not None)
EDGES = {(_module_name(p), m) for p in SOURCES for m in _imported(p)}


def test_the_layers_are_found():
    names = {_module_name(p) for p in SOURCES}
    assert {"deepinfer_jax.config.sharding", "deepinfer_jax.model.deepseek_v41", "deepinfer_jax.parallel.ep_moe",
            "deepinfer_jax.sharding", "deepinfer_jax.ops.dispatch"} <= names
    assert ("deepinfer_jax.sharding", "deepinfer_jax.config.sharding") in EDGES  # the parser sees imports


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaves_import_nothing_from_the_package(leaf):
    assert not _imported(PKG.parent / (leaf.replace(".", "/") + ".py"))


def test_no_module_imports_a_layer_above_its_own():
    bad = []
    for src, dst in sorted(EDGES):
        if dst in LEAVES or (src, dst) in KNOWN_UPWARD:
            continue
        low, high = _layer(src), _layer(dst)
        if high is None:
            bad.append(f"{src} -> {dst} (outside the layers: {', '.join(LAYER_NAMES)})")
        elif high > low:
            bad.append(f"{src} ({LAYER_NAMES[low]}) -> {dst} ({LAYER_NAMES[high]})")
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_known_upward_edges_still_exist():
    """Each exception is real; remove the entry when its work lands."""
    gone = [f"{s} -> {d} ({why})" for (s, d), why in KNOWN_UPWARD.items() if (s, d) not in EDGES]
    assert not gone, "remove from KNOWN_UPWARD:\n" + "\n".join(gone)


def test_no_private_jax_api():
    """``jax._src`` is JAX's private tree: nothing in the package reaches into it."""
    bad = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py") if "jax._src" in p.read_text()]
    assert not bad, f"jax._src used in {bad}"
